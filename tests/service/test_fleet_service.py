"""The service's side of a fleet (docs/service.md section C): routing, runners, flags.

Two supervisors in the test's own Trio run, each on a ``PostgresStore`` of one fleet (a
schema of the test's own in this module's database) and served by a real Hypercorn
server on an ephemeral loopback port: the HTTP layer of a fleet (421 bodies, the client
following one, ``/v1/runners``, ``/v1/sessions`` with each record's runner). As a fleet's
runner does (service/runner.py), each binds its socket before its store opens, so that
the store's row advertises the URL it is served at; a misconfigured fleet advertises
another. The fleet's own rules (fencing, takeover) are tested in tests/rules/test_fleet.py
and tests/adapters/test_postgres_store.py.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import httpx
import psycopg
import pytest
import trio
from click.testing import CliRunner
from hypercorn.config import Config
from hypercorn.trio import serve

from trio_supervisor import Handle, Key, Load, MemoryStore, PostgresStore, Supervisor, cli
from trio_supervisor._background import open_background_nursery
from trio_supervisor.abc import FleetStore
from trio_supervisor.cli import _serve as cli_serve
from trio_supervisor.client import RemoteSupervisor, connect
from trio_supervisor.errors import MisdirectedError, QuotaExceededError, RunnerLostError
from trio_supervisor.service.app import create_app
from trio_supervisor.service.fleet import Fleet
from trio_supervisor.service.openapi import document
from trio_supervisor.service.tenants import Quota, Tenant, Tenants, token_hash
from trio_supervisor.service.tenants_file import Roster
from trio_supervisor.testing import FakeExecution

from ..support import ROOT
from ..support.postgres import own_schema
from ..support.runners import serving
from ..support.service import HOSTS_TOKEN, OPERATOR_TOKEN, served
from ..support.sessions import supervise_embedded
from ..support.waits import until

HOSTS: Final = {"Authorization": f"Bearer {HOSTS_TOKEN}"}
OPERATORS: Final = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
KEY: Final = Key(identity="acme", instance="eu-1")
LOAD: Final = Load(specifier="fake:ok")


# -- a fleet of two, on PostgreSQL ----------------------------------------------------------


@pytest.fixture
def schema(database: str) -> Iterator[str]:
    """A schema no store used yet, for this test's fleet; dropped afterwards."""
    with own_schema(database) as name:
        yield name


@attrs.frozen
class Served:
    """A runner of the test's fleet: its supervisor, its URL, and a host's client."""

    name: str
    supervisor: Supervisor
    url: str
    host: RemoteSupervisor


def bound() -> tuple[socket.socket, str]:
    """A loopback socket on a free port, bound and not yet listening, and its URL."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
    except OSError:  # pragma: no cover - a loopback port 0 is always there
        listener.close()
        raise
    host, port = listener.getsockname()
    return listener, f"http://{host}:{port}"


@contextlib.asynccontextmanager
async def fleet_of_two(
    database: str,
    schema: str,
    *,
    advertised: Mapping[str, str] | None = None,
    tenants: Tenants | None = None,
    runner_lease: float = 10.0,
) -> AsyncIterator[tuple[Served, Served]]:
    """Runners ``a`` and ``b`` of one fleet, each on its own ``PostgresStore`` in
    ``schema`` and served on its own port.

    Args:
        advertised: Whose URL a runner's store advertises, by runner ("" for none; its
            own by default): a misconfigured fleet.
        tenants: The fleet's tenants (each runner is given the same); None: the hosts'
            token, whose client each Served holds.
        runner_lease: Each runner's row's lease (renewed every third of it).
    """
    names = ("a", "b")
    sockets: dict[str, socket.socket] = {}
    urls: dict[str, str] = {}
    stop = trio.Event()
    # The servers outlive the supervisors, which the stack holds (as server_slot does,
    # tests/support/service.py); a socket is closed by its server once served, else here.
    async with open_background_nursery() as nursery, contextlib.AsyncExitStack() as stack:
        for name in names:
            listener, urls[name] = bound()
            sockets[name] = stack.enter_context(listener)

        async def run(name: str) -> Served:
            whose = (advertised or {}).get(name, name)
            advertise = urls[whose] if whose else ""
            store = await stack.enter_async_context(
                PostgresStore(
                    database,
                    runner_id=name,
                    schema=schema,
                    advertise=advertise,
                    runner_lease=runner_lease,
                )
            )
            assert isinstance(store, FleetStore)
            supervisor = await stack.enter_async_context(supervise_embedded(store, FakeExecution()))
            fleet = Fleet(name, store=store, advertise=advertise)
            callers: dict[str, Any] = (
                {"hosts_token": HOSTS_TOKEN} if tenants is None else {"tenants": Roster(tenants)}
            )
            app = create_app(supervisor, operator_token=OPERATOR_TOKEN, fleet=fleet, **callers)
            config = Config()
            config.bind = [f"fd://{sockets[name].fileno()}"]
            config.accesslog = None
            config.graceful_timeout = 1.0
            binds = await nursery.start(
                functools.partial(serve, app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
            )
            sockets[name].detach()  # the server's socket holds it now, and closes it
            assert binds == [urls[name]]
            token = HOSTS_TOKEN if tenants is None else OPERATOR_TOKEN
            host = await stack.enter_async_context(connect(urls[name], token=token))
            return Served(name, supervisor, urls[name], host)

        try:
            yield await run("a"), await run("b")
        finally:
            stop.set()


def handle_json(handle: Handle) -> dict[str, Any]:
    return {
        "key": {"identity": handle.key.identity, "instance": handle.key.instance},
        "token": handle.token,
        "generation": handle.generation,
    }


# -- routing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/renew", "/v1/status", "/v1/dispose", "/v1/load"])
async def test_a_session_call_to_a_runner_not_holding_it_is_a_421_naming_its_owner(
    database: str, schema: str, path: str
) -> None:
    async with fleet_of_two(database, schema) as (a, b):
        record = await b.host.open(KEY, "req-1")
        body: dict[str, Any] = {"handle": handle_json(record.handle)}
        if path == "/v1/load":
            body["load"] = {"specifier": "fake:ok", "config": {}}
        async with httpx.AsyncClient(base_url=a.url, headers=HOSTS) as bare:
            answer = await bare.post(path, json=body)
        assert answer.status_code == 421, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        problem = answer.json()
        assert problem["owner"] == "b"
        assert problem["location"] == b.url
        assert (problem["status"], problem["code"], problem["title"]) == (
            421,
            "Misdirected",
            "Misdirected Request",
        )
        assert "'b'" in problem["detail"]
        # The session is untouched by the misdirected call.
        assert (await b.host.status(record.handle)).phase.value == "Open"


async def test_the_operators_calls_on_a_session_held_elsewhere_are_421_too(
    database: str, schema: str
) -> None:
    async with fleet_of_two(database, schema) as (a, b):
        record = await b.host.open(KEY, "req-1")
        where = {"identity": KEY.identity, "instance": KEY.instance}
        async with httpx.AsyncClient(base_url=a.url, headers=OPERATORS) as operator:
            logs = await operator.get("/v1/logs", params={**where, "generation": 1})
            disposed = await operator.post(
                "/v1/admin/dispose", json={"key": where, "generation": 1}
            )
        for answer in (logs, disposed):
            assert answer.status_code == 421, answer.text
            assert (answer.json()["owner"], answer.json()["location"]) == ("b", b.url)
        assert (await b.host.status(record.handle)).phase.value == "Open"


async def test_a_token_no_runner_holds_is_stale_and_open_and_high_water_need_no_routing(
    database: str, schema: str
) -> None:
    async with fleet_of_two(database, schema) as (a, b):
        record = await b.host.open(KEY, "req-1")
        forged = attrs.evolve(record.handle, token=str(uuid.uuid4()))
        async with httpx.AsyncClient(base_url=a.url, headers=HOSTS) as bare:
            stale = await bare.post("/v1/status", json={"handle": handle_json(forged)})
        assert stale.status_code == 404, stale.text
        assert "owner" not in stale.json()
        # Any runner answers open and high-water: the fleet's high-water is one.
        assert await a.host.high_water(KEY) == 1
        second = await a.host.open(KEY, "req-2", expected_generation=1)
        assert second.handle.generation == 2


async def test_the_client_follows_a_421_once_to_the_runner_holding_the_session(
    database: str, schema: str
) -> None:
    async with fleet_of_two(database, schema) as (a, b):
        record = await b.host.open(KEY, "req-1")
        # Every call through a; b holds the session and answers.
        assert await a.host.renew(record.handle) > 0
        assert await a.host.load(record.handle, LOAD) is not None
        assert (await a.host.status(record.handle)).phase.value == "Loaded"
        termination = await a.host.dispose(record.handle)
        assert (await b.host.status(record.handle)).phase.value == "Stopped"
        assert termination == await b.host.dispose(record.handle)  # D3
        async with connect(a.url, token=OPERATOR_TOKEN) as operator:
            assert await operator.logs(KEY, 1) == ""  # followed too (FakeExecution keeps none)


async def test_a_second_421_naming_the_same_runner_says_its_advertised_url_is_wrong(
    database: str, schema: str
) -> None:
    # Misconfigured: a advertises b's URL, so b sends a call for a's session back to b.
    async with fleet_of_two(database, schema, advertised={"a": "b"}) as (a, b):
        record = await a.host.open(KEY, "req-1")
        async with httpx.AsyncClient(base_url=b.url, headers=HOSTS) as bare:
            answer = await bare.post("/v1/status", json={"handle": handle_json(record.handle)})
        assert answer.status_code == 421, answer.text
        assert (answer.json()["owner"], answer.json()["location"]) == ("a", b.url)
        with pytest.raises(MisdirectedError) as misdirected:
            await b.host.status(record.handle)
        detail = misdirected.value.detail
        assert detail == (
            f"the runner at {b.url} and the one at {b.url} both say the runner 'a' holds the "
            f"session and is reached at {b.url}, which is not where 'a' answers: its "
            "--advertise URL is wrong"
        )
        # a, asked at its own URL, holds the session and answers it.
        assert (await a.host.status(record.handle)).phase.value == "Open"


async def test_a_421_without_a_location_is_an_error_naming_the_owner(
    database: str, schema: str
) -> None:
    # b never said where it is reached: its store advertises no URL.
    async with fleet_of_two(database, schema, advertised={"b": ""}) as (a, b):
        record = await b.host.open(KEY, "req-1")
        async with httpx.AsyncClient(base_url=a.url, headers=HOSTS) as bare:
            answer = await bare.post("/v1/renew", json={"handle": handle_json(record.handle)})
        assert answer.status_code == 421, answer.text
        assert (answer.json()["owner"], answer.json()["location"]) == ("b", "")
        assert "an address it did not advertise" in answer.json()["detail"]
        with pytest.raises(MisdirectedError, match="'b' holds the session, but not where"):
            await a.host.renew(record.handle)
        assert (await b.host.status(record.handle)).phase.value == "Open"


class Recording(httpx.AsyncBaseTransport):
    """The real transport, noting each request's URL."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.urls: list[str] = []
        self.changed = trio.Event()  # set, and made anew, at each request

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.urls.append(str(request.url))
        self.changed.set()
        self.changed = trio.Event()
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_the_client_remembers_the_holder_so_a_call_behind_a_balancer_is_one_round_trip(
    database: str, schema: str
) -> None:
    async with fleet_of_two(database, schema) as (a, b):
        record = await b.host.open(KEY, "req-1")
        recording = Recording()
        async with connect(a.url, token=HOSTS_TOKEN, transport=recording) as host:
            await host.renew(record.handle)
            assert recording.urls == [f"{a.url}/v1/renew", f"{b.url}/v1/renew"]
            recording.urls.clear()
            await host.renew(record.handle)
            await host.load(record.handle, LOAD)
            await host.status(record.handle)
            assert recording.urls == [
                f"{b.url}/v1/renew",
                f"{b.url}/v1/load",
                f"{b.url}/v1/status",
            ]


def expire(database: str, schema: str, runner: str, *, url: str | None = None) -> float:
    """Make ``runner``'s row read as expired a second ago (as a runner killed a runner
    lease ago leaves it), optionally advertising ``url``; its ``lease_until``."""
    with psycopg.connect(database, autocommit=True) as connection:
        row = connection.execute(
            f'UPDATE "{schema}".runners SET lease_until = clock_timestamp() - interval '
            "'1 second', advertise = coalesce(%s, advertise) WHERE runner_id = %s "
            "RETURNING extract(epoch FROM lease_until)::double precision, stop_bound",
            (url, runner),
        ).fetchone()
    assert row is not None
    return float(row[0])


async def test_a_call_for_a_session_whose_holder_is_lost_is_a_503_saying_when_the_takeover_is(
    database: str, schema: str
) -> None:
    # b renews its row every 100 s: the row expired here stays expired for the test.
    async with fleet_of_two(database, schema, runner_lease=300.0) as (a, b):
        record = await b.host.open(KEY, "req-1", lease=20.0)
        lease_until = expire(database, schema, "b")
        async with connect(a.url, token=OPERATOR_TOKEN) as operator:
            runners = {runner.runner_id: runner for runner in await operator.runners()}
        assert not runners["b"].alive
        stop_bound = runners["b"].stop_bound
        assert stop_bound > 0
        async with httpx.AsyncClient(base_url=a.url, headers=HOSTS) as bare:
            answer = await bare.post("/v1/renew", json={"handle": handle_json(record.handle)})
        assert answer.status_code == 503, answer.text
        problem = answer.json()
        assert (problem["code"], problem["owner"], problem["location"]) == (
            "HolderLost",
            "b",
            b.url,
        )
        assert problem["lease_until"] == pytest.approx(lease_until, abs=0.01)
        takeover_at = lease_until + 20.0 + stop_bound
        assert problem["takeover_at"] == pytest.approx(takeover_at, abs=0.01)
        assert 1 <= int(answer.headers["retry-after"]) <= takeover_at - time.time() + 1
        assert f"'b' at {b.url}, which stopped renewing its lease" in problem["detail"]
        # The client waits it out within its window, then says the same in one error.
        async with connect(a.url, token=HOSTS_TOKEN, retry_for=0.5) as host:
            with pytest.raises(RunnerLostError) as raised:
                await host.status(record.handle)
        lost = raised.value
        assert (lost.owner, lost.location) == ("b", b.url)
        assert lost.takeover_at == pytest.approx(takeover_at, abs=0.01)
        assert lost.retry_after is not None
        assert lost.retry_after >= 1


async def test_a_holder_that_does_not_take_the_connection_sends_the_client_back(
    database: str, schema: str
) -> None:
    # b's row names an address where nobody listens (a runner killed there): the client
    # follows the 421 there, is refused, and asks a again, until a answers HolderLost.
    nobody, dead = bound()
    nobody.close()
    async with fleet_of_two(database, schema, runner_lease=300.0) as (a, b):
        record = await b.host.open(KEY, "req-1", lease=20.0)
        with psycopg.connect(database, autocommit=True) as connection:
            connection.execute(
                f'UPDATE "{schema}".runners SET advertise = %s WHERE runner_id = %s', (dead, "b")
            )
        recording = Recording()

        async def lose_b_after_two_tries() -> None:
            while recording.urls.count(f"{dead}/v1/status") < 2:
                await recording.changed.wait()
            expire(database, schema, "b")

        async with (
            connect(
                a.url, token=HOSTS_TOKEN, transport=recording, retry_for=5.0, connect_for=0
            ) as host,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(lose_b_after_two_tries)
            with pytest.raises(RunnerLostError) as raised:
                await host.status(record.handle)
        assert raised.value.location == dead
        assert recording.urls[:4] == [
            f"{a.url}/v1/status",
            f"{dead}/v1/status",
            f"{a.url}/v1/status",
            f"{dead}/v1/status",
        ]
        assert f"{a.url}/v1/status" == recording.urls[-1]


# -- what operators see ---------------------------------------------------------------------


async def test_runners_lists_the_fleet_for_operators_only(database: str, schema: str) -> None:
    async with fleet_of_two(database, schema) as (a, b):
        await b.host.open(KEY, "req-1")
        async with httpx.AsyncClient(base_url=a.url) as bare:
            nobody = await bare.get("/v1/runners")
            hosts = await bare.get("/v1/runners", headers=HOSTS)
            operators = await bare.get("/v1/runners", headers=OPERATORS)
        assert (nobody.status_code, hosts.status_code, operators.status_code) == (401, 403, 200)
        assert nobody.headers["www-authenticate"] == "Bearer"
        listed = {one["runner_id"]: one for one in operators.json()["runners"]}
        assert set(listed) == {"a", "b"}
        assert set(listed["b"]) == {
            "runner_id",
            "epoch",
            "advertise",
            "started_at",
            "lease_until",
            "alive",
            "sessions",
            "children",
            "memory_allocated",
            "max_children",
            "allocatable",
            "stop_bound",
            "draining",
            "taken_over_at",
            "taken_over_by",
        }
        assert (listed["b"]["taken_over_at"], listed["b"]["taken_over_by"]) == (None, None)
        # This runner (a) knows its own capacity alone; b's is b's to say.
        assert listed["b"]["max_children"] is None
        assert (listed["b"]["children"], listed["b"]["memory_allocated"]) == (0, 0)
        assert (listed["b"]["advertise"], listed["b"]["alive"], listed["b"]["sessions"]) == (
            b.url,
            True,
            1,
        )
        assert listed["a"]["sessions"] == 0
        assert listed["b"]["lease_until"] > time.time()  # seconds since the Unix epoch
        async with connect(a.url, token=OPERATOR_TOKEN) as operator:
            infos = await operator.runners()
        assert {info.runner_id: info.advertise for info in infos} == {"a": a.url, "b": b.url}


async def test_sessions_on_any_runner_lists_the_fleet_s_sessions_each_with_its_runner(
    database: str, schema: str
) -> None:
    # Renewed every half second: each runner's sessions' times are published that often.
    async with fleet_of_two(database, schema, runner_lease=1.5) as (a, b):
        await a.host.open(KEY, "req-1")
        other = Key(identity="acme", instance="eu-2")
        record = await b.host.open(other, "req-2")
        await b.host.load(record.handle, LOAD)
        listings: dict[str, list[dict[str, Any]]] = {}
        for runner in (b, a):  # the holder first: a reads b's session's times after b
            async with connect(runner.url, token=OPERATOR_TOKEN) as operator:

                async def timed(operator: RemoteSupervisor = operator) -> Any:
                    listed = await operator.sessions()
                    return listed if all(one["age"] is not None for one in listed) else None

                listed = await until(timed, f"{runner.name} lists every age", bound=5)
            listings[runner.name] = listed
            assert [
                (one["handle"]["key"]["instance"], one["phase"], one["runner"]) for one in listed
            ] == [("eu-1", "Open", "a"), ("eu-2", "Loaded", "b")]
            assert all("token" not in one["handle"] for one in listed)
        # Every runner knows every running session's age and lease left: its own runner
        # from the session itself, the others as that runner last published them.
        held, seen = listings["b"][1], listings["a"][1]
        assert held["age"] - 0.1 <= seen["age"] <= held["age"] + 5, (held, seen)
        assert 0 < seen["lease_left"] <= held["lease_left"] + 0.1, (held, seen)


async def test_a_runner_of_its_own_lists_itself_and_its_sessions_as_its_own() -> None:
    async with (
        supervise_embedded(MemoryStore(), FakeExecution()) as supervisor,
        served(supervisor) as remote,
    ):
        url = str(remote._client.base_url).rstrip("/")
        await remote.open(KEY, "req-1")
        async with connect(url, token=OPERATOR_TOKEN) as operator:
            (info,) = await operator.runners()
            (listed,) = await operator.sessions()
        assert (info.alive, info.sessions, info.epoch) == (True, 1, 0)
        assert listed["runner"] == info.runner_id


def test_the_document_says_which_calls_may_answer_421() -> None:
    paths = document()["paths"]
    routed = {
        ("post", "/v1/renew"),
        ("post", "/v1/load"),
        ("post", "/v1/dispose"),
        ("post", "/v1/status"),
        ("get", "/v1/logs"),
        ("post", "/v1/admin/dispose"),
    }
    for path, operations in paths.items():
        for method, operation in operations.items():
            assert ("421" in operation["responses"]) == ((method, path) in routed), (method, path)
    assert (
        "runners"
        in paths["/v1/runners"]["get"]["responses"]["200"]["content"]["application/json"]["schema"][
            "properties"
        ]
    )


# -- serve's fleet flags ----------------------------------------------------------------------


def serve_flags(*flags: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli.main, ["serve", *flags])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ("--store", "mysql://root:secret@db/runs"),
            "--store must be a postgresql://... or postgres://... URL (the fleet's database); "
            "leave it out for SQLite in STATE/runner.db; got a mysql: URL",
        ),
        (("--store", "runner.db"), "got no URL scheme"),
        (
            ("--runner-lease", "0.5", "--store", "postgresql://db/fleet"),
            "--runner-lease must be a finite number of seconds >= 1 and <= 3600, got 0.5",
        ),
        (
            ("--runner-lease", "7200", "--store", "postgresql://db/fleet"),
            "--runner-lease must be a finite number of seconds >= 1 and <= 3600, got 7200.0",
        ),
        (("--runner-lease", "20"), "--runner-lease is for a fleet: it needs --store postgresql://"),
        (
            ("--advertise", "http://r1:8470"),
            "--advertise is for a fleet: it needs --store postgresql://",
        ),
        (
            ("--advertise", "r1:8470", "--store", "postgres://db/fleet"),
            "--advertise must be an http:// or https:// URL, got 'r1:8470'",
        ),
        (("--runner-id", ""), "--runner-id must not be empty"),
        (
            ("--listen", "0.0.0.0:8470", "--insecure-http", "--store", "postgresql://db/f"),
            "--listen 0.0.0.0:8470 is every address of this machine, which is no URL another "
            "runner or a host can reach: give --advertise URL",
        ),
    ],
)
def test_a_bad_fleet_flag_is_a_usage_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...], words: str
) -> None:
    async def never(config: Any) -> int:  # pragma: no cover - a usage error comes first
        raise AssertionError(config)

    monkeypatch.setattr(cli_serve, "run_runner", never)
    status, output = serve_flags(*flags)
    assert status == 2, output
    assert words in " ".join(output.split()), output
    assert "secret" not in output  # a --store URL's password is never repeated


def test_a_runner_serves_its_own_runners_list_under_its_runner_id(tmp_path: Path) -> None:
    with serving(
        tmp_path / "state", "--runner-id", "r-one", "--no-standby", "--no-fork-server"
    ) as runner:

        async def check() -> None:
            async with runner.http() as operator:
                answer = await operator.get("/v1/runners")
            assert answer.status_code == 200, answer.text
            (info,) = answer.json()["runners"]
            assert (info["runner_id"], info["advertise"], info["alive"]) == (
                "r-one",
                runner.url,
                True,
            )

        trio.run(check)
        result = CliRunner().invoke(
            cli.main,
            ["runners", "--url", runner.url, "--state", str(runner.state)],
        )
        assert result.exit_code == 0, result.output
        assert "r-one" in result.output
        assert "1 runner seen from" in result.output
        as_json = CliRunner().invoke(
            cli.main,
            ["runners", "--url", runner.url, "--state", str(runner.state), "--json"],
        )
        assert as_json.exit_code == 0, as_json.output
        assert '"runner_id": "r-one"' in as_json.output


def test_a_fleet_runner_binds_first_so_a_port_in_use_is_one_line_and_exit_status_1(
    tmp_path: Path,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        done = subprocess.run(
            [
                *(sys.executable, "-m", "trio_supervisor", "serve", "--state", tmp_path / "s"),
                *("--listen", address, "--store", "postgresql://postgres@127.0.0.1:1/never"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=False,
        )
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    assert errors == [
        f"Error: cannot listen on {address}: the address is already in use (another "
        "runner?); give --listen another HOST:PORT, or port 0 for a free one"
    ], done.stderr


# -- tenants' quotas across the fleet ----------------------------------------------------------

ACME_TOKEN: Final = "acme-token-for-the-fleet"


async def test_a_tenants_quota_holds_across_two_runners_racing_for_the_last_slots(
    database: str, schema: str
) -> None:
    acme = Tenant(
        name="acme",
        token_sha256=token_hash(ACME_TOKEN),
        identities=("acme",),
        quota=Quota(sessions=3, children=2),
    )
    async with (
        fleet_of_two(database, schema, tenants=Tenants({"acme": acme})) as (a, b),
        connect(a.url, token=ACME_TOKEN) as on_a,
        connect(b.url, token=ACME_TOKEN) as on_b,
    ):
        opened: list[Handle] = []
        refused: list[tuple[Key, QuotaExceededError]] = []

        async def open_one(number: int) -> None:
            key = Key(identity="acme", instance=f"{number}")
            try:
                opened.append((await (on_a, on_b)[number % 2].open(key, "r1")).handle)
            except QuotaExceededError as error:
                refused.append((key, error))

        async with trio.open_nursery() as nursery:
            for number in range(10):
                nursery.start_soon(open_one, number)
        assert (len(opened), len(refused)) == (3, 7)
        assert {(error.quota, error.hard) for _, error in refused} == {("sessions", 3)}
        for key, _ in refused:  # no generation consumed anywhere
            assert await on_a.high_water(key) is None

        loaded: list[Handle] = []
        left: list[tuple[Handle, QuotaExceededError]] = []

        async def load_one(index: int, handle: Handle) -> None:
            try:  # through either runner: the client follows a 421 to the owner
                await (on_a, on_b)[index % 2].load(handle, LOAD)
                loaded.append(handle)
            except QuotaExceededError as error:
                left.append((handle, error))

        async with trio.open_nursery() as nursery:
            for index, handle in enumerate(opened):
                nursery.start_soon(load_one, index, handle)
        assert (len(loaded), len(left)) == (2, 1)
        [(waiting, error)] = left
        assert (error.quota, error.hard) == ("children", 2)
        assert (await on_a.status(waiting)).phase.value == "Open"  # it may load later
