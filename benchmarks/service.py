"""service.cycle: open + renew + dispose over HTTP, through the client, 50 clients at once.

Ours: a supervisor (MemoryStore, InProcessExecution; no load, so no child: the control
plane only) behind ``create_app``, served by Hypercorn's Trio server on an ephemeral
loopback port, driven by 50 concurrent :func:`trio_supervisor.client.connect` clients,
each with its own ``httpx.AsyncClient`` and so its own keep-alive connection.

Baseline: a bare Starlette app on the same Hypercorn configuration, with the same three
``POST`` paths, each reading its body and answering a constant JSON body of the shape
ours answers (taken from a real cycle once, before any round), with no token check and
no work. It is driven by the very same client code (``connect`` and RemoteSupervisor's
open, renew and dispose, which also parse its answers), the same 50 clients and the same
connection reuse. So the ratio is what the service's own work (the token check, reading
and checking the body, the supervisor's calls, writing the record) costs on top of HTTP
serving and the client, per cycle.

Each measurement is one ``trio.run`` holding the server and its clients: it starts the
server, connects the clients, runs one untimed cycle per client (the connections are
made and every code path is warm), then times ``cycles`` cycles per client and stops.

Why one process, on a 2-core machine: with the server in a child process, server and
clients run in parallel on the two cores and the rate is that of the slower side. The
clients are that side here (a profile puts httpx and httpcore at about twice Hypercorn
and Starlette per request), so the server's extra work mostly disappears from the rate:
a trial that way gave 0.96 where this one gives 0.84-0.92, and it would read near 1
whatever the service did until the service became the slower side, then jump. Two busy
processes also leave no core for the kernel's loopback work, and make the result depend
on how they get scheduled next to whatever else runs. In one run, every request costs
the client's share plus the server's share of one core, serially: the server's extra
work always shows, diluted by the same client share in both, so the ratio is the end to
end one a host sees. Both go through the kernel's loopback TCP, so the HTTP is real.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from trio_supervisor import (
    InProcessExecution,
    Key,
    MemoryStore,
    SessionRecord,
    open_supervisor,
)
from trio_supervisor.client import RemoteSupervisor, connect
from trio_supervisor.codec import converter
from trio_supervisor.service import create_app

from .measure import Result, compare
from .skeleton import LEASE

HOSTS_TOKEN = "bench-hosts-token"
OPERATOR_TOKEN = "bench-operator-token"
CLIENTS = 50


def _config() -> Config:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    # Hypercorn's own lines (``Running on ...``) stay out of the benchmark's output.
    config.errorlog = logging.getLogger("benchmarks.service.hypercorn")
    config.graceful_timeout = 1.0
    return config


@contextlib.asynccontextmanager
async def _serving(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` on an ephemeral loopback port until the block ends; yield its URL."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            functools.partial(serve, app, _config(), shutdown_trigger=stop.wait)
        )
        try:
            yield str(binds[0])
        finally:
            stop.set()


async def _client(
    remote: RemoteSupervisor, client: int, cycles: int, generations: list[int | None]
) -> None:
    """``cycles`` open + renew + dispose cycles of one client, on its own key."""
    key = Key(identity="bench", instance=str(client))
    generation = generations[client]
    for _ in range(cycles):
        record = await remote.open(key, f"{client}-{generation}", expected_generation=generation)
        handle = record.handle
        generation = handle.generation
        await remote.renew(handle)
        await remote.dispose(handle)
    generations[client] = generation


async def _drive(url: str, clients: int, cycles: int, *, tokens: list[str] | None = None) -> float:
    """Cycles per second of ``clients`` clients of ``url``, after one warm-up cycle each;
    each client's token is ``tokens``' (the hosts' by default)."""
    async with contextlib.AsyncExitStack() as stack:
        remotes = [
            await stack.enter_async_context(
                connect(url, token=tokens[client] if tokens else HOSTS_TOKEN, verify=False)
            )
            for client in range(clients)
        ]
        generations: list[int | None] = [None] * clients
        for rounds in (1, cycles):  # untimed warm-up, then the measured cycles
            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for client, remote in enumerate(remotes):
                    nursery.start_soon(_client, remote, client, rounds, generations)
            elapsed = time.perf_counter() - started
    return clients * cycles / elapsed


async def _stuck_reader(url: str) -> trio.SocketStream:
    """A connection that asks for ``/v1/events`` and then never reads a byte."""
    address = url.partition("://")[2]
    host, _, port = address.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    request = (
        f"GET /v1/events HTTP/1.1\r\nHost: {address}\r\n"
        f"Authorization: Bearer {OPERATOR_TOKEN}\r\n\r\n"
    )
    await stream.send_all(request.encode())
    return stream


def ours_rate(clients: int, cycles: int, *, stuck_reader: bool = False) -> float:
    async def main() -> float:
        async with (
            InProcessExecution() as execution,
            open_supervisor(MemoryStore(), execution, lease=LEASE) as supervisor,
        ):
            app = create_app(supervisor, hosts_token=HOSTS_TOKEN, operator_token=OPERATOR_TOKEN)
            async with _serving(app) as url:
                if not stuck_reader:
                    return await _drive(url, clients, cycles)
                # An operator's events stream that is never read: its buffer overflows,
                # and nothing of it may slow the sessions' calls.
                reader = await _stuck_reader(url)
                try:
                    return await _drive(url, clients, cycles)
                finally:
                    await reader.aclose()

    return trio.run(main)


@functools.cache
def _answers() -> dict[str, Any]:
    """What ours answers to open, renew and dispose: one real cycle, embedded."""

    async def main() -> dict[str, Any]:
        async with (
            InProcessExecution() as execution,
            open_supervisor(MemoryStore(), execution, lease=LEASE) as supervisor,
        ):
            key = Key(identity="bench", instance="0")
            record = await supervisor.open(key, "0-None", expected_generation=None)
            lease = await supervisor.renew(record.handle)
            termination = await supervisor.dispose(record.handle)
        return {
            "/v1/open": {"record": converter.unstructure(record, SessionRecord)},
            "/v1/renew": {"lease": lease},
            "/v1/dispose": {"termination": converter.unstructure(termination)},
        }

    return trio.run(main)


def bare_app() -> Starlette:
    """The baseline: the same three paths, each reading its body and answering a constant."""

    def answering(answer: Any) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            await request.body()
            return JSONResponse(answer)

        return endpoint

    return Starlette(
        routes=[
            Route(path, answering(answer), methods=["POST"]) for path, answer in _answers().items()
        ]
    )


def baseline_rate(clients: int, cycles: int) -> float:
    app = bare_app()

    async def main() -> float:
        async with _serving(app) as url:
            return await _drive(url, clients, cycles)

    return trio.run(main)


def run(quick: bool, rounds: int) -> list[Result]:
    clients = 10 if quick else CLIENTS
    cycles = 2 if quick else 8
    _answers()  # before the first round, so no round pays for it
    return [
        compare(
            "service.cycle",
            ours=lambda: ours_rate(clients, cycles),
            baseline=lambda: baseline_rate(clients, cycles),
            baseline_name="bare Starlette app, same server and clients",
            unit="cycles/s",
            better="higher",
            target=0.7,
            rounds=rounds,
            note=f"{clients} clients x {cycles} cycles over loopback HTTP (Hypercorn, Trio)",
        ),
        compare(
            "service.cycle.stuck_reader",
            ours=lambda: ours_rate(clients, cycles, stuck_reader=True),
            baseline=lambda: ours_rate(clients, cycles),
            baseline_name="service.cycle without the reader",
            unit="cycles/s",
            better="higher",
            target=0.9,
            rounds=rounds,
            note="the same cycles while a /v1/events reader never reads (within 10%)",
        ),
    ]
