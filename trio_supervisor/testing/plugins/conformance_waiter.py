"""Waits until told to exit (a file named after its session), then exits with that code.

The file is in the child's working directory where it has one of its own (an isolated
child sees nothing else of the state directory), else in ``WAITER_MAILBOX``.

The subprocess harness uses it to make a child exit by itself. This directory is an entry
path of that harness: the bootstrap finds the file there without importing the package.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def _mail(context: Any) -> Path | None:
    name = f"{context.instance}-{context.generation}"
    for folder in (os.getcwd(), os.environ["WAITER_MAILBOX"]):
        if os.path.exists(os.path.join(folder, name)):
            return Path(folder, name)
    return None


def main(context: Any) -> int:
    while (mail := _mail(context)) is None:
        time.sleep(0.01)
    return int(mail.read_text() or 0)


async def asynchronous(context: Any) -> int:
    import trio

    # The mailbox is a file: polling it is the point.
    while (mail := _mail(context)) is None:  # noqa: ASYNC110
        await trio.sleep(0.01)
    return int(mail.read_text() or 0)
