"""A nursery for a library's own background tasks, behind an ``async with``.

Trio's nurseries wrap whatever leaves them in an ``ExceptionGroup``. When a library
keeps its background tasks in a nursery around its user's ``async with`` block, that
wrapping would hand users their own exception back in a group they did not ask for.
The tasks kept here never raise (they report failures in other ways), so whatever
leaves the nursery alone came from the block, and is re-raised as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import trio

__all__ = ["open_background_nursery", "when_idle"]


@contextlib.asynccontextmanager
async def open_background_nursery() -> AsyncIterator[trio.Nursery]:
    """Open a nursery whose tasks never raise; the block's own exception comes out unwrapped."""
    escaped: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1:
            raise
        escaped = group.exceptions[0]
    if escaped is not None:
        # Raised outside the handler, so the group does not become its __context__.
        raise escaped


# How long background work waits for the run to be idle, at most.
IDLE_BOUND = 0.05


async def when_idle(bound: float = IDLE_BOUND) -> None:
    """Wait until the run has nothing else to do, or ``bound`` seconds at most.

    For background work that nobody waits for (the next standby, removing what a gone
    child left): it runs while every other task waits, not between the steps of a
    request that someone does wait for. The bound keeps a loop that is never idle from
    putting the work off for ever.
    """
    from trio.testing import wait_all_tasks_blocked  # the one primitive that says "idle"

    with trio.move_on_after(bound):
        await wait_all_tasks_blocked()
