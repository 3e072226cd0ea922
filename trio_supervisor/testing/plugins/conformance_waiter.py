"""Waits until told to exit (a file named after its session), then exits with that code.

The subprocess harness uses it to make a child exit by itself. This directory is an entry
path of that harness: the bootstrap finds the file there without importing the package.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def main(context: Any) -> int:
    mailbox = Path(os.environ["WAITER_MAILBOX"]) / f"{context.instance}-{context.generation}"
    while not mailbox.exists():
        time.sleep(0.01)
    return int(mailbox.read_text() or 0)


async def asynchronous(context: Any) -> int:
    import trio

    mailbox = Path(os.environ["WAITER_MAILBOX"]) / f"{context.instance}-{context.generation}"
    # The mailbox is a file: polling it is the point.
    while not mailbox.exists():  # noqa: ASYNC110
        await trio.sleep(0.01)
    return int(mailbox.read_text() or 0)
