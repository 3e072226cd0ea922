"""The minimal plugin of the child benchmarks: it says it is ready and waits."""

from __future__ import annotations

import time
from typing import Any


def main(context: Any) -> None:
    print("ready", flush=True)
    while True:
        time.sleep(60)
