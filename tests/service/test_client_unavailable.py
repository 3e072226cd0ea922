"""The client waits out a runner that did not make the call: ``StoreUnavailable`` (its
store did not answer; nothing was written) and ``RunnerRestarting`` (it makes a new
incarnation of itself), within the call's retry window (docs/service.md section E).

A real Hypercorn server on an ephemeral loopback port serves a small Starlette app: the
runner's own app (a real embedded supervisor behind it) with a front that answers the
next calls from a script with the 503 problem a runner gives, ``Retry-After: 1``
included, and passes the others on. The client is the real one, its transport httpx's.
The clock is Trio's real one (a real server is involved); the waits are the runner's one
second ``Retry-After``, so each test takes a second or a few.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trio_supervisor import (
    Load,
    MemoryStore,
    OpenRecord,
    RunnerRestartingError,
    RunnerUnreachableError,
    StateStorageError,
    StoreUnavailableError,
)
from trio_supervisor.client import connect
from trio_supervisor.service import create_app
from trio_supervisor.testing import FakeExecution

from ..support.service import HOSTS_TOKEN, OPERATOR_TOKEN
from ..support.sessions import KEY, supervise_embedded
from ..support.waits import until

DETAILS = {
    "StoreUnavailable": "the store did not answer within 5 s (connection refused); "
    "nothing was written",
    "RunnerRestarting": "the supervisor was poisoned (the runner's row could not be "
    "renewed in time); restart 1 of 5 in 600 s",
}


class Script:
    """What the front answers: the next calls of ``path`` (any ``/v1/`` call when None)
    refused with a code's 503, and every ``/v1/`` call it was given.

    Attributes:
        refusals: The codes of the next refusals, in order.
        path: The calls refused ("/v1/renew"), or None: any.
        calls: Each ``/v1/`` call, as (path, JSON body), in the order they came.
        mended: Set once no refusal is left and a call (of ``path``) was passed on and
            answered.
        before_refusing: Awaited before each refusal is sent (a test's handshake).
    """

    def __init__(self) -> None:
        self.refusals: list[str] = []
        self.path: str | None = None
        self.calls: list[tuple[str, Any]] = []
        self.mended = trio.Event()
        self.before_refusing: Callable[[], Awaitable[None]] | None = None

    def refuse(self, code: str, times: int, *, path: str | None = None) -> None:
        """Refuse the next ``times`` calls (of ``path``) with ``code``."""
        self.refusals = [code] * times
        self.path = path
        self.mended = trio.Event()

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]


class Front:
    """ASGI middleware: answers the script's refusals, passes every other call on."""

    def __init__(self, app: ASGIApp, script: Script) -> None:
        self.app = app
        self.script = script

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        script = self.script
        script.calls.append((path, json.loads(body) if body else None))
        if script.refusals and script.path in (None, path):
            code = script.refusals.pop(0)
            if script.before_refusing is not None:
                await script.before_refusing()
            problem = {
                "type": f"urn:trio-supervisor:{code}",
                "title": "Service Unavailable",
                "status": 503,
                "detail": DETAILS[code],
                "code": code,
            }
            response = JSONResponse(
                problem,
                status_code=503,
                headers={"Retry-After": "1"},
                media_type="application/problem+json",
            )
            await response(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
        if not script.refusals and (script.path in (None, path)):
            script.mended.set()


class Served:
    """The fronted runner: its URL, and what stops its server."""

    def __init__(self, url: str, stop: trio.Event) -> None:
        self.url = url
        self.stop = stop

    @property
    def port(self) -> int:
        return int(self.url.rpartition(":")[2])


@contextlib.asynccontextmanager
async def fronted(script: Script) -> AsyncIterator[Served]:
    """A runner (a real embedded supervisor and its app) behind ``script``'s front, served
    by Hypercorn on an ephemeral loopback port until the block ends."""
    async with (
        supervise_embedded(MemoryStore(), FakeExecution()) as supervisor,
        trio.open_nursery() as nursery,
    ):
        runner = create_app(supervisor, operator_token=OPERATOR_TOKEN, hosts_token=HOSTS_TOKEN)
        app = Starlette(
            routes=[Mount("/", app=runner)], middleware=[Middleware(Front, script=script)]
        )
        config = Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        config.graceful_timeout = 1.0
        stop = trio.Event()
        # The readiness handshake: serve reports its bound address once it listens.
        binds = await nursery.start(
            functools.partial(serve, app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
        )
        try:
            yield Served(binds[0], stop)
        finally:
            stop.set()


async def test_an_open_waits_out_store_unavailable_and_opens_one_session_by_its_request_id() -> (
    None
):
    script = Script()
    async with fronted(script) as runner, connect(runner.url, token=HOSTS_TOKEN) as host:
        script.refuse("StoreUnavailable", 2)
        started = trio.current_time()
        record = await host.open(KEY, "r1", expected_generation=None)
        waited = trio.current_time() - started
        assert isinstance(record, OpenRecord)
        assert record.handle.generation == 1
        # Asked three times, the same open each time (its request id), a second apart.
        assert script.paths() == ["/v1/open"] * 3
        assert [body["request_id"] for _, body in script.calls] == ["r1"] * 3
        assert len({json.dumps(body, sort_keys=True) for _, body in script.calls}) == 1
        assert waited >= 2.0
        async with connect(runner.url, token=OPERATOR_TOKEN) as operator:
            sessions = await operator.sessions()
        assert [(s["handle"]["generation"], s["request_id"]) for s in sessions] == [(1, "r1")]
        assert await host.high_water(KEY) == 1


async def test_a_renew_and_a_load_wait_out_a_runner_restarting_and_its_store() -> None:
    script = Script()
    async with fronted(script) as runner, connect(runner.url, token=HOSTS_TOKEN) as host:
        record = await host.open(KEY, "r1")
        script.refuse("RunnerRestarting", 1)
        assert await host.renew(record.handle) == record.lease
        script.refuse("StoreUnavailable", 1)
        code = await host.load(record.handle, Load(specifier="plugin"))
        assert code.specifier == "plugin"
        assert (await host.status(record.handle)).phase.value == "Loaded"
        assert script.paths() == [
            "/v1/open",
            *["/v1/renew"] * 2,
            *["/v1/load"] * 2,  # the first load was not made: the same load again
            "/v1/status",
        ]


@pytest.mark.parametrize(
    ("code", "kind", "what"),
    [
        ("StoreUnavailable", StoreUnavailableError, "could not reach its store"),
        ("RunnerRestarting", RunnerRestartingError, "is restarting"),
    ],
)
async def test_a_window_that_ends_raises_the_runner_s_last_answer_naming_it_and_its_cause(
    code: str, kind: type[StoreUnavailableError | RunnerRestartingError], what: str
) -> None:
    script = Script()
    async with (
        fronted(script) as runner,
        connect(runner.url, token=HOSTS_TOKEN, retry_for=1.5) as host,
    ):
        script.refuse(code, 10)
        started = trio.current_time()
        with pytest.raises(kind) as raised:
            await host.high_water(KEY)
        waited = trio.current_time() - started
    # Asked at once and after its Retry-After; a second wait would end past the window.
    assert script.paths() == ["/v1/high-water"] * 2
    assert waited >= 1.0
    assert type(raised.value) is kind
    assert raised.value.code == code
    assert raised.value.retry_after == 1.0
    pattern = (
        rf"the runner at {re.escape(runner.url)} {what} \(waited \d+\.\d s of the call's "
        rf"1\.5 s window; the call changed nothing\): {re.escape(DETAILS[code])}"
    )
    assert re.fullmatch(pattern, raised.value.detail), raised.value.detail
    assert raised.value.__cause__ is None
    if kind is StoreUnavailableError:
        assert isinstance(raised.value, StateStorageError)


async def test_without_a_window_the_runner_s_answer_is_raised_at_once() -> None:
    script = Script()
    async with (
        fronted(script) as runner,
        connect(runner.url, token=HOSTS_TOKEN, retry_for=0) as host,
    ):
        script.refuse("StoreUnavailable", 1)
        started = trio.current_time()
        with pytest.raises(StoreUnavailableError) as raised:
            await host.open(KEY, "r1")
        assert trio.current_time() - started < 0.5
        assert script.paths() == ["/v1/open"]
        assert raised.value.detail == (
            f"the runner at {runner.url} could not reach its store (not waited: the call's "
            f"window is 0 s; the call changed nothing): {DETAILS['StoreUnavailable']}"
        )
        # It wrote nothing: the same open, asked again, opens the first generation.
        record = await host.open(KEY, "r1")
        assert record.handle.generation == 1


async def test_a_kept_session_renews_through_a_run_of_503s_shorter_than_its_lease() -> None:
    script = Script()
    async with fronted(script) as runner, connect(runner.url, token=HOSTS_TOKEN) as host:
        # Renewed every 1.5 s: the first renewal is refused twice, a second apart (a run
        # longer than a period), and asked a third time at 3.5 s, 1 s before the lease
        # ends; the keep-alive's own period would have asked again at 4.5 s, too late.
        script.refuse("StoreUnavailable", 2, path="/v1/renew")
        async with host.session(KEY, lease=4.5) as session:
            with trio.fail_after(10):
                await script.mended.wait()  # the third renewal was answered
            assert session.last_error is None  # the renewal itself waited them out
            assert isinstance(await session.status(), OpenRecord)
        assert session.termination is not None
        assert script.paths().count("/v1/renew") == 3


async def test_a_runner_that_stops_listening_while_restarting_is_unreachable() -> None:
    """A runner whose process is restarted by its service manager: it answered
    ``RunnerRestarting``, then takes no connection; that is one RunnerUnreachableError."""
    script = Script()
    async with fronted(script) as runner:

        async def refuses_connections() -> bool:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", runner.port)
            except OSError:
                return True
            await stream.aclose()
            return False

        async def stop_listening() -> None:
            # The handshake: the refusal is answered only once the port refuses.
            runner.stop.set()
            await until(refuses_connections, "the runner's port refused", bound=5)

        script.before_refusing = stop_listening
        script.refuse("RunnerRestarting", 1)
        async with connect(runner.url, token=HOSTS_TOKEN, retry_for=5, connect_for=0.2) as host:
            with pytest.raises(RunnerUnreachableError) as raised:
                await host.high_water(KEY)
    assert script.paths() == ["/v1/high-water"]
    assert raised.value.url == runner.url
    assert raised.value.detail.startswith(f"the runner at {runner.url} is not answering")
    assert getattr(raised.value, "__notes__", []) == [
        f"before, the runner at {runner.url} answered RunnerRestarting: "
        f"{DETAILS['RunnerRestarting']}"
    ]
