"""A plugin whose main thread cannot take SIGTERM itself (test_subprocess.py).

A helper thread takes it instead, so Python's handler is due while the main thread
sleeps in a call that does not look at signals: how an interrupt lands just before a
blocking call, held until the call returns, made certain.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any


def _helper(ready: threading.Event) -> None:
    # Every signal but SIGTERM held here: the kernel gives SIGTERM to this thread alone.
    signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGTERM})
    ready.set()
    while True:
        time.sleep(3600)


def main(context: Any) -> None:
    ready = threading.Event()
    threading.Thread(target=_helper, args=(ready,), daemon=True).start()
    ready.wait()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print("sleeping with SIGTERM held", flush=True)
    try:
        time.sleep(3600)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise
