"""The rules' supervisor: keys, test timings, the one way a test opens a supervisor
(:func:`supervise`: embedded, or over the wire as the ``wire`` fixture says, conftest.py),
and what opens and ends its sessions."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio

from trio_supervisor import (
    Handle,
    Key,
    Load,
    Supervisor,
    SupervisorError,
    open_supervisor,
)
from trio_supervisor.abc import Store, SupervisorAPI
from trio_supervisor.testing import FakeExecution

from .service import supervise_served

KEY = Key(identity="plugin", instance="a")
OTHER = Key(identity="plugin", instance="b")

# How the tests of the rules reach the supervisor: "embedded" (the object itself), or
# "remote" (a RemoteSupervisor through a real Hypercorn server on an ephemeral loopback
# port, in the test's own Trio run). Set per test by the ``wire`` fixture (conftest.py).
WIRE = ["embedded"]
TIMINGS: dict[str, Any] = {"lease": 10.0, "grace": 1.0, "confirmation_timeout": 1.0}


@contextlib.asynccontextmanager
async def supervise(store: Store, execution: Any, **options: Any) -> AsyncIterator[SupervisorAPI]:
    """open_supervisor with the short timings the tests use unless they say otherwise.

    Yields the supervisor, or, when the test runs over the wire, a client of it: either
    way only the calls both offer (``SupervisorAPI``). The server outlives the
    supervisor's block, so calls made during its shutdown (Z1) and the errors of leaving
    it (Z3) reach the test as they would embedded.
    """
    settings = {**TIMINGS, **options}
    if WIRE[0] == "embedded":
        async with open_supervisor(store, execution, **settings) as supervisor:
            yield supervisor
        return
    async with supervise_served(store, execution, **settings) as (_, remote):
        yield remote


@contextlib.asynccontextmanager
async def supervise_embedded(
    store: Store, execution: Any, **options: Any
) -> AsyncIterator[Supervisor]:
    """open_supervisor with the tests' timings, never over the wire: for tests that look
    inside the supervisor (its poison, its records, its watchers)."""
    async with open_supervisor(store, execution, **{**TIMINGS, **options}) as supervisor:
        yield supervisor


def embedded() -> bool:
    """Whether this test reaches its supervisor directly (not over the wire)."""
    return WIRE[0] == "embedded"


async def poisoning(supervisor: SupervisorAPI) -> SupervisorError | None:
    """The error that poisoned the supervisor, or None; over the wire, as open sees it."""
    if isinstance(supervisor, Supervisor):
        return supervisor.poisoned
    try:
        # Poisoned, open refuses at once (O1) and changes nothing. Healthy, this opens a
        # probe session, which is why tests ask only when they expect the poison.
        await supervisor.open(Key(identity="probe", instance="poisoned?"), "probe")
    except SupervisorError as error:
        return error
    return None


async def opened(
    supervisor: SupervisorAPI, key: Key = KEY, request_id: str = "r1", **options: Any
) -> Handle:
    """Open a session of ``key`` at the next generation; return its handle."""
    expected = await supervisor.high_water(key)
    record = await supervisor.open(key, request_id, expected_generation=expected, **options)
    return record.handle


async def during_shutdown(
    store: Store,
    fake: FakeExecution,
    action: Callable[[SupervisorAPI, Handle], Awaitable[None]],
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
