"""What the tests share: keys, a supervisor with test timings, and process helpers."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from trio_supervisor import (
    Handle,
    Key,
    Load,
    SubprocessExecution,
    Supervisor,
    SupervisorError,
    open_supervisor,
)
from trio_supervisor._background import open_background_nursery
from trio_supervisor.abc import Store, SupervisorAPI
from trio_supervisor.client import RemoteSupervisor, connect
from trio_supervisor.executions._groups import read_stat
from trio_supervisor.service import create_app
from trio_supervisor.testing import FakeExecution

KEY = Key(identity="plugin", instance="a")
OTHER = Key(identity="plugin", instance="b")


# How the tests of the rules reach the supervisor: "embedded" (the object itself), or
# "remote" (a RemoteSupervisor through a real Hypercorn server on an ephemeral loopback
# port, in the test's own Trio run). Set per test by the ``wire`` fixture (conftest.py).
WIRE = ["embedded"]
TIMINGS: dict[str, Any] = {"lease": 10.0, "grace": 1.0, "confirmation_timeout": 1.0}
HOSTS_TOKEN = "hosts-token-for-tests"
OPERATOR_TOKEN = "operator-token-for-tests"


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


@contextlib.asynccontextmanager
async def supervise_served(
    store: Store, execution: Any, **settings: Any
) -> AsyncIterator[tuple[Supervisor, RemoteSupervisor]]:
    """A supervisor and a client of its server, which outlives the supervisor's block."""
    async with serving() as serve_it, open_supervisor(store, execution, **settings) as supervisor:
        yield supervisor, await serve_it(supervisor)


@contextlib.asynccontextmanager
async def served(supervisor: Supervisor) -> AsyncIterator[RemoteSupervisor]:
    """Serve ``supervisor`` on an ephemeral loopback port; yield a client connected to it."""
    async with serving() as serve_it:
        yield await serve_it(supervisor)


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[Callable[[Supervisor], Awaitable[RemoteSupervisor]]]:
    """A place for a server: yields what serves a supervisor there, and returns a client.

    The server runs until this block ends, so a supervisor served from within a block
    nested in it (``open_supervisor``) keeps its server through its own shutdown.
    """
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    stop = trio.Event()
    async with contextlib.AsyncExitStack() as stack, open_background_nursery() as nursery:

        async def serve_it(supervisor: Supervisor) -> RemoteSupervisor:
            app = create_app(supervisor, hosts_token=HOSTS_TOKEN, operator_token=OPERATOR_TOKEN)
            # The readiness handshake: serve reports its bound address once it listens.
            binds = await nursery.start(
                functools.partial(serve, app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
            )
            return await stack.enter_async_context(connect(binds[0], token=HOSTS_TOKEN))

        try:
            yield serve_it
        finally:
            # The server stops first and answers what is in flight (a dispose that
            # joined the shutdown, say); the client closes once it is done.
            stop.set()


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
