"""Three ``trio-supervisor serve`` processes on one PostgreSQL database: a fleet.

Real runner processes, real children (the example plugins), the machine's real
PostgreSQL (a database of this module's own, tests/support/postgres.py). What is checked
is what the issue promises a fleet does (docs/design.md, "The fleet"):

* F3: racing opens of one key from three runners hand out each generation once;
* F6: an open that supersedes a session held by another runner returns only once that
  session's child is gone;
* F7: a runner killed with SIGKILL is taken over only after the margin, its child gone;
* F4: a runner frozen (SIGSTOP) past its takeover and then resumed writes nothing, and
  poisons itself;
* B2, B5: a runner cut off from the database (through a proxy of the test's) past its
  trust is fenced, reaps its children, and serves again by itself once the database
  answers, as a new epoch; nothing it acknowledged is lost;
* failover: a dead runner's sessions answer HolderLost until the takeover, and a chain of
  opens across it ends without a 500;
* drain: a fleet restarted runner by runner while hosts work;
* chaos: all of it at random while hosts work, with the database's server restarted,
  stopped past the runners' trust and failed over, checked from their history.

Waits are bounded polls (``until``); the one timing assertion is a lower bound that
says a takeover did not come early.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import psycopg
import pytest
import trio

from trio_supervisor import (
    Key,
    Load,
    LoadedRecord,
    RunnerDrainingError,
    RunnerLostError,
    RunnerRestartingError,
    RunnerUnreachableError,
    StaleSessionError,
    StoppedRecord,
    Superseded,
    SupervisorError,
)
from trio_supervisor.client import RemoteSupervisor, connect
from trio_supervisor.executions.trees._groups import read_stat

from ..support.clusters import own_clusters
from ..support.members import (
    CONFIRMATION,
    FLEET_HOSTS_TOKEN,
    FLEET_OPERATOR_TOKEN,
    GRACE,
    MARGIN,
    RUNNER_LEASE,
    SESSION_LEASE,
    child_of,
    hosts,
    member,
    stopped_on,
    stored,
)
from ..support.processes import SHUTDOWN, process_state, reap_orphans, running
from ..support.runners import Runner
from ..support.tcp_proxy import TcpProxy
from ..support.waits import until

KEY = Key(identity="fleet", instance="one")


@pytest.fixture
def database(database: str) -> str:
    """The module's database (conftest.py), empty: each test's fleet starts afresh."""
    with psycopg.connect(database, autocommit=True) as connection:
        connection.execute("DROP SCHEMA IF EXISTS trio_supervisor CASCADE")
    return database


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    yield
    # What a killed runner left comes back to the test process (a subreaper).
    reap_orphans()


@contextlib.contextmanager
def fleet(
    tmp_path: Path, tokens: tuple[Path, Path], store: str, count: int = 3
) -> Iterator[list[Runner]]:
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(member(tmp_path, tokens, store, f"r{number}"))
            for number in range(1, count + 1)
        ]


async def fleet_record(runner: Runner, generation: int) -> dict[str, Any] | None:
    """The record of KEY's ``generation`` as the fleet's listing shows it."""
    async with runner.http(FLEET_OPERATOR_TOKEN) as operator:
        answer = await operator.get("/v1/sessions", params={"limit": 1000})
    assert answer.status_code == 200, answer.text
    for record in answer.json()["sessions"]:
        handle = record["handle"]
        if handle["key"]["instance"] == KEY.instance and handle["generation"] == generation:
            return dict(record)
    return None


async def race(clients: list[RemoteSupervisor], round_: int) -> list[Any]:
    """Every client opens KEY at once, expecting the generation of round ``round_``."""
    outcomes: list[Any] = []

    async def open_on(host: RemoteSupervisor, number: int) -> None:
        try:
            record = await host.open(
                KEY, f"race-{round_}-{number}", expected_generation=round_ or None, lease=30.0
            )
        except SupervisorError as error:
            outcomes.append(error)
        else:
            outcomes.append(record)

    async with trio.open_nursery() as nursery:
        for number, host in enumerate(clients):
            nursery.start_soon(open_on, host, number)
    return outcomes


async def test_racing_opens_of_one_key_from_three_runners_hand_out_each_generation_once(
    tmp_path: Path, tokens: tuple[Path, Path], database: str
) -> None:
    """F3: three hosts, each on its own runner, open the same key at once, ten times."""
    with fleet(tmp_path, tokens, database) as runners:
        async with hosts(runners) as clients:
            for round_ in range(10):
                outcomes = await race(clients, round_)
                won = [outcome for outcome in outcomes if not isinstance(outcome, Exception)]
                lost = [outcome for outcome in outcomes if isinstance(outcome, Exception)]
                assert len(won) == 1, outcomes
                assert won[0].handle.generation == round_ + 1
                assert all(isinstance(error, StaleSessionError) for error in lost), lost
            assert await clients[2].high_water(KEY) == 10


async def test_an_open_that_supersedes_a_session_on_another_runner_returns_once_its_child_is_gone(
    tmp_path: Path, tokens: tuple[Path, Path], database: str
) -> None:
    """F6 (O5 across the fleet), with a real child on the first runner."""
    with fleet(tmp_path, tokens, database, count=2) as runners:
        async with hosts(runners) as (first, second):
            record = await first.open(KEY, "held", lease=30.0)
            await first.load(record.handle, Load(specifier="heartbeat:main"))
            pid = await child_of(first, record.handle)
            assert running(pid)
            newer = await second.open(KEY, "supersede", expected_generation=1, lease=30.0)
            # The open returned: the older generation's child is gone already.
            assert process_state(pid) in (None, "Z"), process_state(pid)
            older = await stopped_on(first, record.handle)
            assert isinstance(older.reason, Superseded)
            assert newer.handle.generation == 2
            # The second runner answers for it; the first sends the host there (421).
            assert (await second.status(newer.handle)).handle == newer.handle
            assert (await first.status(newer.handle)).handle == newer.handle


async def test_f7_a_killed_runner_is_taken_over_after_the_margin_with_its_children_gone(
    tmp_path: Path, tokens: tuple[Path, Path], database: str
) -> None:
    """F7: kill -9 of a runner holding a loaded session. Until the takeover, which comes
    only after the margin, its session's calls answer 503 HolderLost on the survivors.
    A chain of opens across it (generation 2 on r2 waiting for the takeover, generation
    3 on r3 waiting for generation 2) ends with both returned, no 500: r3 waits out the
    takeover's bound, not r2's stop bound alone (F6)."""
    with fleet(tmp_path, tokens, database) as (doomed, second_runner, third_runner):
        async with hosts([doomed, second_runner, third_runner]) as (first, second, third):
            record = await first.open(KEY, "held", lease=SESSION_LEASE)
            await first.load(record.handle, Load(specifier="heartbeat:main"))
            pid = await child_of(first, record.handle)
            doomed.process.kill()
            killed = time.monotonic()
            doomed.process.wait()
            opened: dict[str, Any] = {}

            async def open_on(name: str, host: RemoteSupervisor, expected: int) -> None:
                opened[name] = await host.open(
                    KEY, f"after-{name}", expected_generation=expected, lease=30.0
                )

            async def lost() -> dict[str, Any] | None:
                async with second_runner.http(FLEET_HOSTS_TOKEN) as bare:
                    answer = await bare.post("/v1/renew", json={"handle": handle_json(record)})
                if answer.status_code == 421:
                    return None  # r1's row has not expired yet
                assert answer.status_code == 503, answer.text
                return {"retry-after": answer.headers["retry-after"], **answer.json()}

            with trio.fail_after(MARGIN + RUNNER_LEASE + 30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(open_on, "r2", second, 1)

                    async def recorded() -> bool:
                        return await third.high_water(KEY) == 2

                    await until(recorded, "generation 2 recorded", every=0.005)
                    nursery.start_soon(open_on, "r3", third, 2)
                    problem = await until(lost, "the survivors tell r1 lost", bound=10)
                    assert (problem["code"], problem["owner"], problem["location"]) == (
                        "HolderLost",
                        "r1",
                        doomed.url,
                    )
                    assert problem["takeover_at"] > time.time() - 1
                    assert int(problem["retry-after"]) >= 1
                    async with connect(
                        third_runner.url, token=FLEET_HOSTS_TOKEN, retry_for=0.2
                    ) as impatient:
                        with pytest.raises(RunnerLostError, match="'r1' at http"):
                            await impatient.renew(record.handle)
            waited = time.monotonic() - killed
            assert opened["r2"].handle.generation == 2
            assert opened["r3"].handle.generation == 3
            # Not early: the row was valid up to a runner lease past the kill, and the
            # takeover waits a session lease, grace, confirmation and slack past that.
            assert waited >= SESSION_LEASE + GRACE + CONFIRMATION, waited
            assert process_state(pid) in (None, "Z"), "the dead runner's child outlived takeover"
            # Generation 1's Stopped record (Recovery, runner lost: tested in
            # test_postgres_store.py) is evicted by generation 2's (one kept per key).
            took = "is dead past its takeover margin; took over 1 of its sessions: fleet/one#1"
            assert any(took in runner.stderr() for runner in (second_runner, third_runner))

            # r3's open returned once generation 2's Stopped row was committed; r2 answers
            # from its own record once its store has told it so (a moment later).
            async def stopped_on_r2() -> StoppedRecord | None:
                found = await second.status(opened["r2"].handle)
                return found if isinstance(found, StoppedRecord) else None

            superseded = await until(stopped_on_r2, "generation 2 Stopped on r2", bound=10)
            assert isinstance(superseded, StoppedRecord)
            assert isinstance(superseded.reason, Superseded)
            # After the takeover nothing points at the dead runner: its session was
            # stopped, then evicted (404, not a 421 or a 503).
            with pytest.raises(StaleSessionError):
                await third.renew(record.handle)


def handle_json(record: Any) -> dict[str, Any]:
    handle = record.handle
    return {
        "key": {"identity": handle.key.identity, "instance": handle.key.instance},
        "token": handle.token,
        "generation": handle.generation,
    }


async def test_f4_a_runner_frozen_past_its_takeover_writes_nothing_once_it_resumes(
    tmp_path: Path, tokens: tuple[Path, Path], database: str
) -> None:
    """F4: SIGSTOP past the takeover, then SIGCONT: every write refused, and poisoned."""
    with fleet(tmp_path, tokens, database, count=2) as (frozen, other):
        async with hosts([frozen, other]) as (first, second):
            record = await first.open(KEY, "held", lease=SESSION_LEASE)
            await first.load(record.handle, Load(specifier="heartbeat:main"))
            pid = await child_of(first, record.handle)
            frozen.process.send_signal(signal.SIGSTOP)
            try:
                with trio.fail_after(MARGIN + RUNNER_LEASE + 30):
                    await second.open(KEY, "after", expected_generation=1, lease=30.0)
                assert process_state(pid) in (None, "Z"), "the frozen runner's child outlived it"
                before = {token: row for token, row in stored(database).items() if row[0] == "r1"}
            finally:
                frozen.process.send_signal(signal.SIGCONT)

            async def poisoned() -> bool:
                async with frozen.http(FLEET_OPERATOR_TOKEN) as client:
                    answer = await client.get("/readyz")
                return answer.status_code == 503

            await until(poisoned, "the resumed runner poisoned itself", bound=30)
            after = {token: row for token, row in stored(database).items() if row[0] == "r1"}
            assert after == before, "a runner taken over still wrote"


async def test_b5_a_runner_cut_off_past_its_trust_reaps_its_children_and_heals_itself(
    tmp_path: Path, tokens: tuple[Path, Path], database: str
) -> None:
    """B2, B5: the connection cut (resets, then refused) past the runner's trust, then
    restored through a proxy. The runner is fenced, answers RunnerRestarting while its
    children are reaped, and once the database answers serves again by itself, as a
    new epoch; its old sessions read as stopped, and nothing it acknowledged is lost."""
    with TcpProxy(("127.0.0.1", 5432)) as proxy:
        store = proxy.url(database)
        with member(tmp_path, tokens, store, "cut", "--store-wait", "0.5") as runner:
            async with hosts([runner]) as (host,):
                records = [
                    await host.open(
                        Key(identity="fleet", instance=f"cut-{n}"), f"c{n}", lease=SESSION_LEASE
                    )
                    for n in range(3)
                ]
                await host.load(records[0].handle, Load(specifier="heartbeat:main"))
                pid = await child_of(host, records[0].handle)
                acknowledged = {record.handle.token for record in records}
                [epoch] = {row[1] for row in stored(database).values()}
                proxy.cut()

                async def ready() -> tuple[int, str]:
                    async with runner.http(FLEET_OPERATOR_TOKEN) as client:
                        answer = await client.get("/readyz")
                    return answer.status_code, answer.json().get("code", "")

                async def restarting() -> bool:
                    return await ready() == (503, "RunnerRestarting")

                await until(restarting, "the cut-off runner fenced itself", bound=30)
                await until(lambda: process_state(pid) is None, "the child reaped", bound=30)
                async with connect(runner.url, token=FLEET_HOSTS_TOKEN, retry_for=0) as hurried:
                    with pytest.raises(RunnerRestartingError, match="fenced"):
                        await hurried.open(Key(identity="fleet", instance="late"), "late")
                proxy.restore()

                async def serving_again() -> bool:
                    return (await ready())[0] == 200

                await until(serving_again, "the runner serving again", bound=30)
                for record in records:
                    status = await host.status(record.handle)
                    assert isinstance(status, StoppedRecord), status
                late = await host.open(Key(identity="fleet", instance="late"), "late")
                assert late.handle.generation == 1
                epochs = {row[1] for token, row in stored(database).items()}
                assert max(epochs) > epoch, "no new incarnation registered"
            assert runner.stop() == 0
            assert "the supervisor was poisoned (fenced)" in runner.stderr()
        rows = stored(database)
        assert acknowledged <= set(rows), "an acknowledged Open record is gone"


async def test_b5_a_runner_past_its_restart_limit_reaps_its_children_and_exits_3(
    tmp_path: Path, tokens: tuple[Path, Path], database: str
) -> None:
    """B5: with ``--restart-limit 0/600`` the first poisoning is past the limit: the runner
    stops its sessions, reaps its children and exits 3, for its service manager."""
    with TcpProxy(("127.0.0.1", 5432)) as proxy:
        store = proxy.url(database)
        flags = ("--store-wait", "0.5", "--restart-limit", "0/600")
        with member(tmp_path, tokens, store, "limited", *flags) as runner:
            async with hosts([runner]) as (host,):
                record = await host.open(KEY, "held", lease=SESSION_LEASE)
                await host.load(record.handle, Load(specifier="heartbeat:main"))
                pid = await child_of(host, record.handle)
                proxy.cut()
                with trio.fail_after(30):
                    assert await runner.wait() == 3, runner.stderr()
            assert process_state(pid) is None, "the child outlived its runner"
            assert "the runner gives up and exits 3" in runner.stderr()


async def test_a_fleet_of_three_is_restarted_runner_by_runner_by_drain_while_hosts_work(
    tmp_path: Path, tokens: tuple[Path, Path], database: str
) -> None:
    """The README's rolling restart: each runner in turn is drained, exits 0 once its
    sessions ended, and is started again, while three hosts open, load, renew and
    dispose, each on a key of its own, calling whichever runner takes the open. No open
    is refused by the fleet as a whole, no renew finds its lease lost, and every
    generation is handed out once, in order."""
    names = ("r1", "r2", "r3")
    # Nothing here waits for a lease to run out: the runners' rows and the sessions get
    # leases that a busy machine keeps renewed (a row's is the default's).
    kept = 10.0
    flags = ("--runner-lease", str(kept))
    with contextlib.ExitStack() as stack:
        current = {
            name: stack.enter_context(member(tmp_path, tokens, database, name, *flags))
            for name in names
        }
        refused: list[str] = []
        lost: list[BaseException] = []
        opened: dict[str, list[tuple[int, str]]] = {}
        restarted = trio.Event()

        async def work(number: int) -> None:
            key = Key(identity="roll", instance=f"host-{number}")
            generation = 0
            cycle = 0
            while not restarted.is_set():
                cycle += 1
                done = False
                tried: list[str] = []
                # A runner of the fleet, then the others: as a balancer would choose.
                for offset in range(len(names)):
                    name = names[(number + cycle + offset) % len(names)]
                    url = current[name].url
                    async with connect(url, token=FLEET_HOSTS_TOKEN, connect_for=0.5) as host:
                        try:
                            record = await host.open(
                                key,
                                f"h{number}-{cycle}",
                                expected_generation=generation or None,
                                lease=kept,
                            )
                        except (RunnerDrainingError, RunnerUnreachableError) as error:
                            tried.append(f"{name}: {error.code}")
                            continue
                        done = True
                        generation = record.handle.generation
                        opened.setdefault(key.instance, []).append((generation, name))
                        try:
                            # Refused if it began to drain since the open: the session
                            # runs on all the same.
                            with contextlib.suppress(RunnerDrainingError):
                                await host.load(record.handle, Load(specifier="heartbeat:main"))
                            for _ in range(2):
                                await trio.sleep(SESSION_LEASE / 4)
                                await host.renew(record.handle)
                            await host.dispose(record.handle)
                        except SupervisorError as error:
                            lost.append(error)
                        break
                if not done:
                    refused.append(f"{key.instance} cycle {cycle}: {tried}")

        async def restart_each() -> None:
            for name in names:
                old = current[name]
                async with connect(old.url, token=FLEET_OPERATOR_TOKEN) as operator:
                    answer = await operator.drain(30.0)
                assert answer["draining"] is True
                with trio.fail_after(30):
                    assert await old.wait() == 0, old.stderr()
                assert "drained: no session is left" in old.stderr()
                # In a thread: waiting for its "listening on" line would stall the hosts.
                current[name] = await trio.to_thread.run_sync(
                    stack.enter_context, member(tmp_path, tokens, database, name, *flags)
                )
            restarted.set()

        async with trio.open_nursery() as nursery:
            for number in range(3):
                nursery.start_soon(work, number)
            nursery.start_soon(restart_each)
    assert not refused, refused
    assert not lost, lost
    for instance, generations in opened.items():
        numbers = [generation for generation, _ in generations]
        assert numbers == list(range(1, len(numbers) + 1)), (instance, generations)
    # Every runner took opens, before and after its restart.
    assert {name for generations in opened.values() for _, name in generations} == set(names)


# -- chaos ----------------------------------------------------------------------------------

CHAOS_VARIABLE = "TRIO_SUPERVISOR_CHAOS_SECONDS"  # the nox session "chaos" sets minutes


def chaos_seconds() -> float:
    raw = os.environ.get(CHAOS_VARIABLE, "").strip()
    return float(raw) if raw else 10.0


@attrs.define
class History:
    """Every reply a host acknowledged, and every answer a 5xx other than 503."""

    opens: list[tuple[float, Key, int, str, str]] = attrs.Factory(
        list
    )  # t, key, gen, token, runner
    sent: dict[str, float] = attrs.Factory(dict)  # when each acknowledged open was asked, by token
    children: dict[tuple[Key, int], tuple[int, int]] = attrs.Factory(dict)  # pid, start time
    violations: list[str] = attrs.Factory(list)

    def child_alive(self, key: Key, generation: int) -> bool:
        child = self.children.get((key, generation))
        if child is None:
            return False
        stat = read_stat(child[0])
        return stat is not None and stat.start_time == child[1] and stat.state != "Z"


class Statuses(httpx.AsyncBaseTransport):
    """The real transport; an answer 500 or above, other than 503, is a violation."""

    def __init__(self, history: History) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.history = history

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if response.status_code >= 500 and response.status_code != 503:
            await response.aread()
            self.history.violations.append(
                f"{request.method} {request.url} answered {response.status_code}: "
                f"{response.text[:300]}"
            )
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_fleet_under_chaos_keeps_every_promise(
    tmp_path: Path, tokens: tuple[Path, Path]
) -> None:
    """Three runners on a primary and its synchronous standby of the test's own (a
    multi-host URL); hosts open, load, renew and dispose over a handful of keys while a
    chaos loop kills runners (-9), freezes them past their takeover (SIGSTOP, then
    SIGCONT: fenced, they heal themselves, and are restarted), drains and restarts them,
    one at a time, and restarts the database's server, stops it past the runners' trust
    (each fenced, each healing by itself), or fails it over to the standby (once). From
    the history of every acknowledged reply: each (key,
    generation) handed out once; an open asked for once another was acknowledged gets a
    later generation of its key;
    at each open, no older generation of its key still running a child; every child gone
    within the takeover margin once the hosts stop; no 5xx other than 503; nothing
    acknowledged lost. ``TRIO_SUPERVISOR_CHAOS_SECONDS`` sets the length (10 s here;
    the nox session ``chaos`` runs it for minutes)."""
    seed = int(os.environ.get("TRIO_SUPERVISOR_CHAOS_SEED", "0")) or random.randrange(1 << 30)
    print(f"chaos seed {seed} (TRIO_SUPERVISOR_CHAOS_SEED replays its choices)")
    chance = random.Random(seed)
    names = ("r1", "r2", "r3")
    keys = [Key(identity="chaos", instance=f"k{number}") for number in range(3)]
    history = History()
    done = trio.Event()
    actions: list[str] = []
    with contextlib.ExitStack() as stack:
        made = stack.enter_context(own_clusters())
        servers = [made.primary("chaos")]
        servers.append(made.standby(servers[0], "chaos_standby", synchronous=True))
        database = (
            f"postgresql://postgres@127.0.0.1:{servers[0].port},127.0.0.1:{servers[1].port}"
            "/postgres?target_session_attrs=read-write"
        )
        flags = ("--store-wait", "1")
        current = {
            name: stack.enter_context(member(tmp_path, tokens, database, name, *flags))
            for name in names
        }

        async def start(name: str) -> None:
            current[name] = await trio.to_thread.run_sync(
                stack.enter_context, member(tmp_path, tokens, database, name, *flags)
            )

        async def host(number: int) -> None:
            statuses = Statuses(history)
            cycle = 0
            while not done.is_set():
                cycle += 1
                key = chance.choice(keys)
                name = names[(number + cycle) % len(names)]
                async with connect(
                    current[name].url, token=FLEET_HOSTS_TOKEN, connect_for=0.5, retry_for=2.0,
                    transport=statuses,
                ) as client:  # fmt: skip
                    sent = time.monotonic()
                    try:
                        high = await client.high_water(key)
                        record = await client.open(
                            key, f"h{number}-{cycle}", expected_generation=high, lease=SESSION_LEASE
                        )
                    except SupervisorError:
                        continue  # refused (stale, draining, lost, ...): nothing acknowledged
                    generation = record.handle.generation
                    history.opens.append(
                        (time.monotonic(), key, generation, record.handle.token, name)
                    )
                    history.sent[record.handle.token] = sent
                    for (older_key, older), _ in list(history.children.items()):
                        if (
                            older_key == key
                            and older < generation
                            and history.child_alive(key, older)
                        ):
                            history.violations.append(
                                f"{key.instance}#{generation} acknowledged while #{older}'s "
                                "child still runs"
                            )
                    try:
                        await client.load(record.handle, Load(specifier="heartbeat:main"))
                        loaded = await client.status(record.handle)
                        if isinstance(loaded, LoadedRecord) and loaded.child.pid is not None:
                            stat = read_stat(loaded.child.pid)
                            if stat is not None:
                                history.children[(key, generation)] = (
                                    loaded.child.pid,
                                    stat.start_time,
                                )
                        await trio.sleep(chance.uniform(0, SESSION_LEASE / 2))
                        await client.renew(record.handle)
                        await client.dispose(record.handle)
                    except SupervisorError:
                        pass  # superseded, expired, its runner lost: said, not lost

        async def chaos() -> None:
            end = trio.current_time() + chaos_seconds()
            while trio.current_time() < end:
                await trio.sleep(chance.uniform(0.5, 2.0))
                name = chance.choice(names)
                victim = current[name]
                action = chance.choice(
                    ["kill", "freeze", "drain", "restart", "outage"]
                    + (["failover"] if len(servers) > 1 else [])
                )
                if action in ("restart", "outage", "failover"):
                    actions.append(f"{action} the database")
                    primary = servers[0]
                    if action == "restart":
                        await trio.to_thread.run_sync(primary.restart)
                    elif action == "outage":
                        # Past every runner's trust: each is fenced and heals (B2, B5).
                        await trio.to_thread.run_sync(primary.stop)
                        await trio.sleep(2 * RUNNER_LEASE)
                        await trio.to_thread.run_sync(primary.start)
                    else:
                        await trio.to_thread.run_sync(primary.kill)
                        await trio.to_thread.run_sync(servers[1].promote)
                        del servers[0]
                    continue
                actions.append(f"{action} {name}")
                if action == "kill":
                    victim.process.kill()
                    await victim.wait()
                elif action == "freeze":
                    victim.process.send_signal(signal.SIGSTOP)
                    await trio.sleep(MARGIN + RUNNER_LEASE + 0.5)  # past its takeover
                    victim.process.send_signal(signal.SIGCONT)
                    victim.process.terminate()  # fenced: it poisoned itself, or will
                    with trio.fail_after(SHUTDOWN):
                        await victim.wait()
                else:
                    async with connect(victim.url, token=FLEET_OPERATOR_TOKEN) as operator:
                        await operator.drain(MARGIN)
                    with trio.fail_after(MARGIN + SHUTDOWN):
                        assert await victim.wait() == 0, victim.stderr()
                await start(name)
            done.set()

        async with trio.open_nursery() as nursery:
            for number in range(4):
                nursery.start_soon(host, number)
            nursery.start_soon(chaos)
        print(f"chaos: {len(history.opens)} opens; {', '.join(actions)}")

        # Every child is gone within the takeover margin, whatever became of its runner.
        async def all_gone() -> bool:
            return not any(history.child_alive(*which) for which in history.children)

        await until(all_gone, "every child gone", bound=MARGIN + RUNNER_LEASE + 10)
        async with connect(current["r1"].url, token=FLEET_HOSTS_TOKEN) as client:
            marks = {key: await client.high_water(key) or 0 for key in keys}
    assert not history.violations, history.violations
    handed: dict[tuple[Key, int], set[str]] = {}
    for _, key, generation, token, _ in history.opens:
        handed.setdefault((key, generation), set()).add(token)
    assert all(len(tokens) == 1 for tokens in handed.values()), handed
    for key in keys:
        acknowledged = [(t, g, token) for t, k, g, token, _ in history.opens if k == key]
        # An open asked for after another was acknowledged gets a later generation. (Two
        # hosts' opens in flight at once may be acknowledged in either order: a slow
        # answer for generation 8 can reach its host after generation 9 reached another.)
        for answered, earlier, _ in acknowledged:
            for _, later, token in acknowledged:
                if history.sent[token] > answered:
                    assert later > earlier, (key, earlier, later)
        # Nothing acknowledged is lost: the fleet's high-water holds every generation.
        top = max((g for _, g, _ in acknowledged), default=0)
        assert marks[key] >= top, (key, marks[key], top)
    assert len(history.opens) >= 3, "the hosts got nothing done"
