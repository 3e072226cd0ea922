"""Prints a heartbeat until it is stopped; on SIGTERM it says goodbye and exits."""

from __future__ import annotations

import time
from typing import Any


def main(context: Any) -> int:
    period = float(context.config.get("period", 0.2))
    beats = 0
    try:
        while True:
            beats += 1
            print(f"beat {beats} of {context.identity}/{context.instance} #{context.generation}")
            time.sleep(period)
    except KeyboardInterrupt:  # how the bootstrap delivers SIGTERM
        print(f"stopping after {beats} beats")
        return 0
