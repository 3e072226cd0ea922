"""Bounded waits: for what a test has nothing to wait on (/proc, a file, a runner over
HTTP), polled, and failing after a bound."""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar, overload

from trio_supervisor import Handle, StoppedRecord, SubprocessExecution, Supervisor, realtime

# Seconds a test waits for what a real child does (starts, writes, exits) before failing.
BOUND: Final = 20.0

T = TypeVar("T")


@overload
async def until(
    condition: Callable[[], Awaitable[T | None]],
    what: str,
    *,
    bound: float = ...,
    every: float = ...,
) -> T: ...
@overload
async def until(
    condition: Callable[[], T | None], what: str, *, bound: float = ..., every: float = ...
) -> T: ...
async def until(
    condition: Callable[[], Any], what: str, *, bound: float = 20.0, every: float = 0.02
) -> Any:
    """Poll ``condition()`` (awaited if it is async) until it is truthy; return that value.

    For what has nothing to wait on (/proc, a file, a runner over HTTP), asked every
    ``every`` seconds. Fails naming ``what`` after ``bound`` seconds. What it polls is
    outside the run, so the pauses and the bound are real time, also on a virtual clock.
    """
    with realtime.bounded(bound):
        while True:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            await realtime.sleep(every)
    raise AssertionError(f"{what}: not within {bound:g} s")


def settled(condition: Callable[[], T], bound: float, *, every: float = 0.02) -> T:
    """Poll ``condition()``, blocking, every ``every`` seconds until it is truthy or
    ``bound`` seconds passed; its last value (truthy if it held in time).

    For sync tests and fixtures; an async test uses :func:`until`.
    """
    deadline = time.monotonic() + bound
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(every)
    return value


async def until_logged(
    execution: SubprocessExecution, handle: Handle, text: str, *, bound: float = 20.0
) -> None:
    """Wait, bounded, until the child wrote ``text`` (its log is a file: we poll it)."""
    await until(lambda: text in execution.logs(handle), f"{text!r} in the log", bound=bound)


async def until_stopped(
    supervisor: Supervisor, handle: Handle, *, bound: float = 20.0
) -> StoppedRecord:
    """Poll a session until it is stopped (its child ended it, its lease expired)."""

    async def stopped() -> StoppedRecord | None:
        record = await supervisor.status(handle)
        return record if isinstance(record, StoppedRecord) else None

    return await until(stopped, f"{handle} stopped", bound=bound)
