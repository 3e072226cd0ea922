"""Ignores SIGTERM, so stopping it takes a kill after the grace."""

from __future__ import annotations

import signal
import time
from typing import Any


def main(context: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring SIGTERM from now on")
    while True:
        time.sleep(0.1)
