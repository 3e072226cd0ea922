"""What the tests share: keys, a supervisor with test timings, and process helpers."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from trio_supervisor import Handle, Key, Load, SubprocessExecution, Supervisor, open_supervisor
from trio_supervisor.executions._groups import read_stat
from trio_supervisor.stores.base import Store
from trio_supervisor.testing import FakeExecution

KEY = Key(identity="plugin", instance="a")
OTHER = Key(identity="plugin", instance="b")


def supervise(
    store: Store, execution: Any, **options: Any
) -> contextlib.AbstractAsyncContextManager[Supervisor]:
    """open_supervisor with the short timings the tests use unless they say otherwise."""
    settings: dict[str, Any] = {"lease": 10.0, "grace": 1.0, "confirmation_timeout": 1.0}
    settings.update(options)
    return open_supervisor(store, execution, **settings)


async def opened(
    supervisor: Supervisor, key: Key = KEY, request_id: str = "r1", **options: Any
) -> Handle:
    """Open a session of ``key`` at the next generation; return its handle."""
    expected = await supervisor.high_water(key)
    record = await supervisor.open(key, request_id, expected_generation=expected, **options)
    return record.handle


async def during_shutdown(
    store: Store, fake: FakeExecution, action: Callable[[Supervisor, Handle], Awaitable[None]]
) -> Handle:
    """Run ``action`` half a second into a shutdown that waits for a slow child.

    The session's child takes 0.8 s to exit on interrupt, so at 0.5 s the supervisor is
    closing and the session is stopping. Needs a MockClock; returns the session's handle.
    """
    fake.behave("slow", exit_delay=0.8)
    async with trio.open_nursery() as callers, supervise(store, fake) as sup:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="slow"))

        async def late() -> None:
            await trio.sleep(0.5)
            await action(sup, handle)

        callers.start_soon(late)
    return handle


def process_state(pid: int) -> str | None:
    """The state letter of a process (``/proc/PID/stat``), or None when it is gone."""
    stat = read_stat(pid)
    return None if stat is None else stat.state


def running(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    return process_state(pid) not in (None, "Z")


async def until_logged(
    execution: SubprocessExecution, handle: Handle, text: str, *, bound: float = 20.0
) -> None:
    """Wait, bounded, until the child wrote ``text`` (its log is a file: we poll it)."""
    with trio.fail_after(bound):
        while text not in execution.logs(handle):  # noqa: ASYNC110
            await trio.sleep(0.02)


def report_in(log: str) -> dict[str, Any]:
    """The JSON report the ``inspector`` example plugin printed into its log."""
    report: dict[str, Any] = json.loads(log.split("REPORT ", 1)[1].splitlines()[0])
    return report
