"""The runner service's wire: tokens, roles, capabilities, bad bodies, problems, documents.

A real Hypercorn server on an ephemeral loopback port serves a supervisor in the test's
own Trio run; the tests call it with httpx as any host would (docs/service.md section A).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from trio_supervisor import Handle, Key, Load, MemoryStore, StaleSessionError, Supervisor
from trio_supervisor.client import RunnerAccessError, SessionLostError, connect
from trio_supervisor.testing import FakeExecution

from ..support.service import HOSTS_TOKEN, OPERATOR_TOKEN, served, supervise_served
from ..support.sessions import KEY, opened, supervise_embedded

HOSTS = {"Authorization": f"Bearer {HOSTS_TOKEN}"}
OPERATORS = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


@contextlib.asynccontextmanager
async def runner(fake: FakeExecution) -> AsyncIterator[tuple[Supervisor, httpx.AsyncClient, str]]:
    """A served supervisor, and a bare httpx client (no token) pointed at it."""
    async with supervise_embedded(MemoryStore(), fake) as supervisor, served(supervisor) as remote:
        url = str(remote._client.base_url)
        async with httpx.AsyncClient(base_url=url) as client:
            yield supervisor, client, url


def problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """Check that ``response`` is the problem+json of ``status`` and ``code``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    assert body["code"] == code
    assert body["type"] == f"urn:trio-supervisor:{code}"
    assert body["title"]
    assert body["detail"]
    return body


def open_body(instance: str = "a", request_id: object = "r1", **more: Any) -> dict[str, Any]:
    return {"key": {"identity": "wire", "instance": instance}, "request_id": request_id, **more}


async def test_a_request_without_a_valid_token_is_401_and_changes_nothing(
    fake: FakeExecution,
) -> None:
    async with runner(fake) as (sup, client, _):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic x"}):
            answer = await client.post("/v1/open", json=open_body(), headers=headers)
            problem(answer, 401, "Unauthorized")
            assert answer.headers["www-authenticate"] == "Bearer"
        assert sup.records() == []
        # No token needed for these.
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        assert (await client.get("/readyz")).json() == {"status": "ready"}
        assert (await client.get("/openapi.json")).json()["openapi"] == "3.1.0"


async def test_the_hosts_token_is_refused_on_operator_calls_with_403(fake: FakeExecution) -> None:
    async with runner(fake) as (sup, client, _):
        handle = await opened(sup)
        key = {"identity": handle.key.identity, "instance": handle.key.instance}
        # The hosts' token is tenant "default": it may list, watch and read the logs of
        # its own keys (every key), and nothing else of the operators'.
        calls = [
            client.get("/v1/runners", headers=HOSTS),
            client.get("/metrics", headers=HOSTS),
            client.post("/v1/admin/dispose", json={"key": key, "generation": 1}, headers=HOSTS),
        ]
        for call in calls:
            problem(await call, 403, "Forbidden")
        listed = await client.get("/v1/sessions", headers=HOSTS)
        assert [one["handle"]["generation"] for one in listed.json()["sessions"]] == [1]
        assert (await sup.status(handle)).phase.value == "Open"  # the dispose did nothing
        # The operators' token may make every call, the hosts' ones included.
        listed = await client.get("/v1/sessions", headers=OPERATORS)
        assert listed.status_code == 200
        [session] = listed.json()["sessions"]
        assert "token" not in session["handle"]  # tokens left out
        assert session["handle"]["generation"] == 1
        water = await client.post("/v1/high-water", json={"key": key}, headers=OPERATORS)
        assert water.json() == {"generation": 1}
        disposed = await client.post(
            "/v1/admin/dispose", json={"key": key, "generation": 1}, headers=OPERATORS
        )
        assert disposed.json()["termination"]["kind"] == "none"  # it had no child
        assert (await sup.status(handle)).phase.value == "Stopped"


async def test_a_client_gone_mid_body_is_no_failure_of_the_runner(
    fake: FakeExecution, caplog: pytest.LogCaptureFixture
) -> None:
    """A host that gives up mid-request (or retries on a new connection) leaves half a
    body: the call is answered as malformed (to no one), logged as no runner failure."""
    async with runner(fake) as (_, client, url):
        host, port = httpx.URL(url).host, httpx.URL(url).port
        assert port is not None
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(
            b"POST /v1/renew HTTP/1.1\r\nHost: runner\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {HOSTS_TOKEN}\r\n".encode()
            + b'Content-Length: 200\r\n\r\n{"handle": '
        )
        await stream.aclose()
        counted = 'trio_supervisor_calls_total{call="renew",outcome="MalformedRequest"'

        async def answered() -> bool:
            return counted in (await client.get("/metrics", headers=OPERATORS)).text

        for _ in range(1000):  # 10 s at most
            if await answered():
                break
            await trio.sleep(0.01)
        assert await answered()
        assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
        assert (await client.get("/readyz")).status_code == 200


async def test_a_wrong_session_token_is_404_and_changes_nothing(fake: FakeExecution) -> None:
    async with runner(fake) as (sup, client, _):
        handle = await opened(sup)
        stolen = {
            "key": {"identity": handle.key.identity, "instance": handle.key.instance},
            "token": "0" * 36,
            "generation": handle.generation,
        }
        for path in ("/v1/renew", "/v1/status", "/v1/dispose"):
            answer = await client.post(path, json={"handle": stolen}, headers=HOSTS)
            problem(answer, 404, "StaleSession")
        load = {"handle": stolen, "load": {"specifier": "plugin:main"}}
        problem(await client.post("/v1/load", json=load, headers=HOSTS), 404, "StaleSession")
        record = await sup.status(handle)
        assert record.phase.value == "Open"
        assert fake.calls == []


async def test_bad_bodies_are_400_413_or_422_naming_the_field(fake: FakeExecution) -> None:
    async with runner(fake) as (sup, client, _):
        post = client.post
        problem(
            await post("/v1/open", content=b"{not json", headers=HOSTS), 400, "MalformedRequest"
        )
        huge = b'{"pad": "' + b"x" * (1 << 20) + b'"}'
        problem(await post("/v1/open", content=huge, headers=HOSTS), 413, "RequestTooLarge")
        cases = {
            "$.request_id": open_body(request_id=3),
            "$.key": open_body(instance=""),
            "extra fields found (colour)": open_body(colour="red"),
            "$.expected_generation": open_body(expected_generation="1"),
            "lease must be a finite number of seconds >= 0.1 and <= 1000000000, "
            "got -1.0 @ $.lease": open_body(lease=-1),
            "lease must be a finite number of seconds >= 0.1 and <= 1000000000, "
            "got 0.05 @ $.lease": open_body(lease=0.05),
            "identity must be at most 128 characters, got 129 @ $.key.identity": {
                "key": {"identity": "i" * 129, "instance": "a"},
                "request_id": "r1",
            },
            "required field missing @ $.request_id": {"key": {"identity": "a", "instance": "b"}},
            "memory_bytes must be None (no limit) or >= 0, got -1 "
            "@ $.limits.memory_bytes": open_body(limits={"memory_bytes": -1}),
        }
        for named, body in cases.items():
            detail = problem(
                await post("/v1/open", json=body, headers=HOSTS), 422, "InvalidRequest"
            )
            assert named in detail["detail"], detail
        assert sup.records() == []  # nothing was opened


async def test_errors_map_to_their_statuses(fake: FakeExecution) -> None:
    fake.behave("missing:main", spawn_error=__import__("trio_supervisor").PackageError("no such"))
    async with runner(fake) as (_, client, _url):
        opened_ = await client.post("/v1/open", json=open_body(), headers=HOSTS)
        handle = opened_.json()["record"]["handle"]
        stale = await client.post(
            "/v1/open", json=open_body(request_id="r2", expected_generation=5), headers=HOSTS
        )
        assert "expected generation 5" in problem(stale, 409, "StaleSession")["detail"]
        missing = {"handle": handle, "load": {"specifier": "missing:main"}}
        problem(await client.post("/v1/load", json=missing, headers=HOSTS), 422, "PackageError")
        # The failed load stopped the session: renew is now a 409.
        problem(
            await client.post("/v1/renew", json={"handle": handle}, headers=HOSTS),
            409,
            "SessionStopped",
        )


async def test_a_stale_expected_generation_is_409_a_stale_handle_404_both_stale_in_the_client(
    fake: FakeExecution,
) -> None:
    async with runner(fake) as (sup, client, url):
        first = await client.post("/v1/open", json=open_body(), headers=HOSTS)
        handle = first.json()["record"]["handle"]
        # Another open got in first: a conflict with the key's state, not a missing session.
        late = open_body(request_id="r2", expected_generation=None)
        body = problem(await client.post("/v1/open", json=late, headers=HOSTS), 409, "StaleSession")
        assert body["detail"] == (
            "wire/a: expected a key never opened, but its high-water generation is 1; "
            "pass expected_generation=1 to open the next one"
        )
        unknown = {**handle, "generation": 7}
        problem(
            await client.post("/v1/status", json={"handle": unknown}, headers=HOSTS),
            404,
            "StaleSession",
        )
        assert [record.handle.generation for record in sup.records()] == [1]  # nothing opened
        async with connect(url, token=HOSTS_TOKEN) as remote:
            key = Key(identity="wire", instance="a")
            with pytest.raises(StaleSessionError, match="high-water generation is 1"):
                await remote.open(key, "r3", expected_generation=None)
            with pytest.raises(StaleSessionError):
                await remote.status(Handle(key=key, token=handle["token"], generation=7))


async def test_every_documented_call_is_served_and_answers_a_documented_status(
    fake: FakeExecution,
) -> None:
    async with runner(fake) as (_, client, _):
        document = (await client.get("/openapi.json")).json()
        for path, operations in document["paths"].items():
            for method, operation in operations.items():
                # No token: a secured call refuses (401), an open one answers.
                answer = await client.request(method.upper(), path)
                assert str(answer.status_code) in operation["responses"], (path, answer.text)
                assert bool(operation["security"]) == (answer.status_code == 401), path
        problem(await client.get("/v1/nothing-here"), 404, "NotFound")


async def test_a_closing_runner_answers_503_with_retry_after(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("slow", exit_delay=0.8)
    answers: list[httpx.Response] = []
    settings = {"lease": 10.0, "grace": 1.0, "confirmation_timeout": 1.0}
    async with (
        trio.open_nursery() as nursery,
        supervise_served(MemoryStore(), fake, **settings) as (sup, remote),
    ):
        url = str(remote._client.base_url)
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="slow"))

        async def late() -> None:
            await trio.sleep(0.5)  # the shutdown waits 0.8 s for the child
            async with httpx.AsyncClient(base_url=url) as client:
                answers.append(await client.post("/v1/open", json=open_body(), headers=HOSTS))
                answers.append(await client.get("/readyz"))

        nursery.start_soon(late)
    # Leaving the block began the shutdown; late() called while it ran.
    assert len(answers) == 2
    body = problem(answers[0], 503, "RunnerClosing")
    assert answers[0].headers["retry-after"] == "5"
    assert body["detail"] == "the supervisor is shutting down"
    problem(answers[1], 503, "RunnerClosing")


async def test_the_client_keeps_a_session_alive_and_disposes_it(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    async with supervise_embedded(MemoryStore(), fake) as sup, served(sup) as remote:
        started = trio.current_time()
        async with remote.session(KEY, lease=2.0) as session:
            await session.load(Load(specifier="plugin:main"))
            await trio.sleep(10.0)  # five leases: renewed every 2/3 s in the background
            assert (await session.status()).phase.value == "Loaded"
        assert trio.current_time() - started == pytest.approx(10.0, abs=0.1)
        assert session.termination is not None
        assert (await sup.status(session.handle)).phase.value == "Stopped"
        renews = [call for call in fake.calls if call.name == "renew"]
        assert len(renews) >= 14  # one when the child registered, then about 15


async def test_a_lost_session_cancels_the_block_and_says_why(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    async with supervise_embedded(MemoryStore(), fake) as sup, served(sup) as remote:
        reached_the_end = False

        async def superseded_while_in_the_block() -> None:
            nonlocal reached_the_end
            async with remote.session(KEY, lease=3.0) as session:
                handles.append(session.handle)
                # Another host opens the next generation: this one is superseded.
                await sup.open(KEY, "usurper", expected_generation=1)
                await trio.sleep(30.0)
                reached_the_end = True

        handles: list[Handle] = []
        with pytest.raises(SessionLostError, match="Superseded") as lost:
            await superseded_while_in_the_block()
        assert not reached_the_end
        assert lost.value.cause is not None
        assert handles[0].generation == 1


async def test_a_wrong_token_is_a_runner_access_error_in_the_client(fake: FakeExecution) -> None:
    async with runner(fake) as (_, _client, url), connect(url, token="not it") as remote:
        with pytest.raises(RunnerAccessError):
            await remote.high_water(Key(identity="a", instance="b"))


async def test_the_openapi_document_describes_every_call(fake: FakeExecution) -> None:
    async with runner(fake) as (_, client, _):
        document = (await client.get("/openapi.json")).json()
    paths = document["paths"]
    for path in (
        "/v1/open",
        "/v1/renew",
        "/v1/load",
        "/v1/dispose",
        "/v1/status",
        "/v1/high-water",
        "/v1/sessions",
        "/v1/logs",
        "/v1/admin/dispose",
        "/healthz",
        "/readyz",
        "/openapi.json",
    ):
        assert path in paths, path
    schemas = document["components"]["schemas"]
    # The bounds are the checks' own: what the runner refuses is what the document says.
    assert schemas["Key"]["properties"]["identity"] == {
        "type": "string",
        "minLength": 1,
        "maxLength": 128,
        "pattern": "^[^\\x00]*$",
    }
    lease = schemas["OpenBody"]["properties"]["lease"]
    assert lease == {
        "anyOf": [{"type": "number", "minimum": 0.1, "maximum": 1e9}, {"type": "null"}]
    }
    # A stale expected_generation is a conflict; a handle that names no session, a 404.
    assert "409" in paths["/v1/open"]["post"]["responses"]
    assert "404" not in paths["/v1/open"]["post"]["responses"]
    assert "404" in paths["/v1/status"]["post"]["responses"]
    assert set(schemas["OpenBody"]["required"]) == {"key", "request_id"}
    assert schemas["Handle"]["properties"]["generation"]["minimum"] == 1
    assert schemas["ExitStatus"]["properties"]["cancelled"] == {"type": "boolean"}
    assert json.dumps(document)  # plain JSON throughout
