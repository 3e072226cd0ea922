"""A supervisor served in the test's own Trio run (a real Hypercorn server on an
ephemeral loopback port), the clients of it, and their tokens."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from trio_supervisor import Supervisor, open_supervisor
from trio_supervisor._background import open_background_nursery
from trio_supervisor.abc import Store
from trio_supervisor.client import RemoteSupervisor, connect
from trio_supervisor.service import create_app

HOSTS_TOKEN = "hosts-token-for-tests"
OPERATOR_TOKEN = "operator-token-for-tests"


@contextlib.asynccontextmanager
async def supervise_served(
    store: Store, execution: Any, **settings: Any
) -> AsyncIterator[tuple[Supervisor, RemoteSupervisor]]:
    """A supervisor and a client of its server, which outlives the supervisor's block."""
    async with (
        server_slot() as serve_it,
        open_supervisor(store, execution, **settings) as supervisor,
    ):
        yield supervisor, await serve_it(supervisor)


@contextlib.asynccontextmanager
async def served(supervisor: Supervisor, **app_options: Any) -> AsyncIterator[RemoteSupervisor]:
    """Serve ``supervisor`` on an ephemeral loopback port; yield a client connected to it
    (with the hosts' token; the operators' when ``app_options`` give tenants instead)."""
    async with server_slot(**app_options) as serve_it:
        yield await serve_it(supervisor)


@contextlib.asynccontextmanager
async def server_slot(
    **app_options: Any,
) -> AsyncIterator[Callable[[Supervisor], Awaitable[RemoteSupervisor]]]:
    """A place for a server: yields what serves a supervisor there, and returns a client.

    The server runs until this block ends, so a supervisor served from within a block
    nested in it (``open_supervisor``) keeps its server through its own shutdown.
    ``app_options`` go to ``create_app`` (tenants, admission); without tenants the app
    has the hosts' token :data:`HOSTS_TOKEN`.
    """
    if "tenants" not in app_options:
        app_options = {"hosts_token": HOSTS_TOKEN, **app_options}
    token = HOSTS_TOKEN if "hosts_token" in app_options else OPERATOR_TOKEN
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    stop = trio.Event()
    async with contextlib.AsyncExitStack() as stack, open_background_nursery() as nursery:

        async def serve_it(supervisor: Supervisor) -> RemoteSupervisor:
            app = create_app(supervisor, operator_token=OPERATOR_TOKEN, **app_options)
            # The readiness handshake: serve reports its bound address once it listens.
            binds = await nursery.start(
                functools.partial(serve, app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
            )
            return await stack.enter_async_context(connect(binds[0], token=token))

        try:
            yield serve_it
        finally:
            # The server stops first and answers what is in flight (a dispose that
            # joined the shutdown, say); the client closes once it is done.
            stop.set()
