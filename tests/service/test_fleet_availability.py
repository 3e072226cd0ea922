"""A fleet through what its database goes through (docs/design.md, "Availability"):
real runner processes on a PostgreSQL cluster of the test's own (tests/support/clusters.py),
restarted and stopped under them while hosts hold sessions with live children and renew
them.

* B1, B2: a fast restart of the server costs nothing: no renew refused, no child
  stopped, no runner poisoned;
* B2: an outage as long as a Patroni failover's (about 35 s, in ``nox -s availability``;
  5 s in the suite) under runners whose lease outlasts it (``--runner-lease 60``) costs
  nothing either;
* B2, B5: an outage past the runners' trust fences both; their children are gone
  before any takeover could start, and both serve again by themselves once the server
  is back, each as a new epoch, their old sessions read as stopped.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
import trio

from trio_supervisor import Key, Load, StoppedRecord
from trio_supervisor.client import RemoteSupervisor, connect
from trio_supervisor.model import Handle

from ..support.clusters import Cluster, own_clusters
from ..support.members import (
    CONFIRMATION,
    FLEET_HOSTS_TOKEN,
    FLEET_OPERATOR_TOKEN,
    GRACE,
    child_of,
    member,
)
from ..support.processes import process_state
from ..support.runners import Runner
from ..support.waits import until

SESSION_LEASE = 3.0
RENEW_EVERY = 0.5
# How long B2's outage lasts: as long as a Patroni failover with its defaults (35 s) in
# the nox session ``availability``; a short pass of the same in the suite.
OUTAGE = float(os.environ.get("TRIO_SUPERVISOR_OUTAGE_SECONDS", "5"))


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A primary of the test's own, removed at the end."""
    with own_clusters() as made:
        yield made.primary("fleet")


@contextlib.contextmanager
def two_runners(
    tmp_path: Path, tokens: tuple[Path, Path], store: str, *flags: str
) -> Iterator[tuple[Runner, Runner]]:
    with (
        member(tmp_path, tokens, store, "r1", *flags) as r1,
        member(tmp_path, tokens, store, "r2", *flags) as r2,
    ):
        yield r1, r2


async def readiness(runner: Runner) -> tuple[int, str]:
    """The runner's /readyz: its status, and its problem's code if any."""
    async with runner.http(FLEET_OPERATOR_TOKEN) as client:
        answer = await client.get("/readyz")
    return answer.status_code, str(answer.json().get("code", ""))


async def each_answers(runners: tuple[Runner, ...], answer: tuple[int, str], what: str) -> None:
    """Wait, bounded, until each runner's /readyz gives ``answer``."""
    for runner in runners:

        async def answers(runner: Runner = runner) -> bool:
            return await readiness(runner) == answer

        await until(answers, f"{runner} {what}", bound=30)


def epochs(store: str) -> dict[str, int]:
    with psycopg.connect(store, autocommit=True, connect_timeout=5) as connection:
        rows = connection.execute("SELECT runner_id, epoch FROM trio_supervisor.runners")
        return dict(rows.fetchall())


class Renewing:
    """Hosts that hold one session with a live child on each runner and renew it every
    RENEW_EVERY seconds, noting each renew's outcome and the slowest one."""

    def __init__(self) -> None:
        self.handles: list[Handle] = []
        self.pids: list[int] = []
        self.failures: list[BaseException] = []
        self.renewed = 0
        self.slowest = 0.0

    async def hold(self, hosts: list[RemoteSupervisor], nursery: trio.Nursery) -> None:
        for number, host in enumerate(hosts):
            record = await host.open(
                Key(identity="avail", instance=f"held-{number}"), f"h{number}", lease=SESSION_LEASE
            )
            await host.load(record.handle, Load(specifier="heartbeat:main"))
            self.handles.append(record.handle)
            self.pids.append(await child_of(host, record.handle))
            nursery.start_soon(self._renew, host, record.handle)

    async def _renew(self, host: RemoteSupervisor, handle: Handle) -> None:
        while True:
            began = time.monotonic()
            try:
                await host.renew(handle)
            except Exception as error:
                self.failures.append(error)
                return
            self.renewed += 1
            self.slowest = max(self.slowest, time.monotonic() - began)
            await trio.sleep(RENEW_EVERY)

    def children_alive(self) -> bool:
        return all(process_state(pid) is not None for pid in self.pids)


@contextlib.asynccontextmanager
async def clients(runners: tuple[Runner, ...]) -> AsyncIterator[list[RemoteSupervisor]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                connect(runner.url, token=FLEET_HOSTS_TOKEN, retry_for=SESSION_LEASE)
            )
            for runner in runners
        ]


@pytest.mark.timeout(120)
async def test_b1_a_fast_restart_of_the_server_loses_no_session_and_poisons_no_runner(
    tmp_path: Path, tokens: tuple[Path, Path], cluster: Cluster
) -> None:
    store = cluster.dsn()
    with two_runners(tmp_path, tokens, store, "--runner-lease", "3") as runners:
        before = epochs(store)
        renewing = Renewing()
        async with clients(runners) as hosts, trio.open_nursery() as nursery:
            await renewing.hold(hosts, nursery)
            await trio.to_thread.run_sync(cluster.restart)
            # Work goes on after it: opens (which write) land on both runners.
            for number, host in enumerate(hosts):
                opened = await host.open(Key(identity="avail", instance=f"after-{number}"), "a")
                assert opened.handle.generation == 1
            ready = [await readiness(runner) for runner in runners]
            await trio.sleep(3 * RENEW_EVERY)  # renews keep coming, each answered
            nursery.cancel_scope.cancel()
        assert renewing.failures == []
        assert renewing.renewed > 0
        assert renewing.children_alive(), "a child was stopped by the restart"
        assert ready == [(200, ""), (200, "")]
        assert epochs(store) == before, "a runner made a new incarnation"
        for runner in runners:
            assert "poisoned" not in runner.stderr(), runner.stderr()


@pytest.mark.timeout(180)
async def test_b2_an_outage_as_long_as_a_failover_within_the_runner_lease_stops_nothing(
    tmp_path: Path, tokens: tuple[Path, Path], cluster: Cluster
) -> None:
    """Patroni's defaults (ttl 30 s) keep a failed primary's clients waiting about 35 s;
    runners started with ``--runner-lease 60`` trust their rows for 48 s. The outage
    lasts OUTAGE seconds (35 in ``nox -s availability``)."""
    store = cluster.dsn()
    with two_runners(tmp_path, tokens, store, "--runner-lease", "60") as runners:
        before = epochs(store)
        renewing = Renewing()
        async with clients(runners) as hosts, trio.open_nursery() as nursery:
            await renewing.hold(hosts, nursery)
            await trio.to_thread.run_sync(cluster.stop)
            down = time.monotonic()
            # Renew needs no store: every renew is answered while it is away.
            while time.monotonic() - down < OUTAGE:
                assert renewing.failures == []
                assert renewing.children_alive()
                await trio.sleep(1.0)
            await trio.to_thread.run_sync(cluster.start)
            for number, host in enumerate(hosts):
                opened = await host.open(Key(identity="avail", instance=f"after-{number}"), "a")
                assert opened.handle.generation == 1
            nursery.cancel_scope.cancel()
        assert renewing.failures == []
        assert renewing.children_alive(), "a child was stopped by the outage"
        assert epochs(store) == before, "a runner made a new incarnation"
        for runner in runners:
            assert await readiness(runner) == (200, "")
            assert "poisoned" not in runner.stderr(), runner.stderr()


@pytest.mark.timeout(180)
async def test_b5_an_outage_past_the_trust_fences_both_runners_which_heal_by_themselves(
    tmp_path: Path, tokens: tuple[Path, Path], cluster: Cluster
) -> None:
    store = cluster.dsn()
    runner_lease = 2.0
    with two_runners(
        tmp_path, tokens, store, "--runner-lease", str(runner_lease), "--store-wait", "1"
    ) as runners:
        before = epochs(store)
        renewing = Renewing()
        async with clients(runners) as hosts:
            async with trio.open_nursery() as nursery:
                await renewing.hold(hosts, nursery)
                await trio.to_thread.run_sync(cluster.stop)
                down = time.monotonic()
                # Fenced once its trust is over; every child stopped and reaped.
                await each_answers(runners, (503, "RunnerRestarting"), "restarting")
                await until(lambda: not any(map(process_state, renewing.pids)), "children gone")
                gone = time.monotonic() - down
                nursery.cancel_scope.cancel()
            # F7: a takeover may start once a row expired by the session's lease plus its
            # runner's stop bound (its grace, confirmation and the switch's slack); the
            # children were gone before that, the slack aside (a busy machine slows
            # this test's polls too: the rows' own expiry is too close a bound).
            assert gone < runner_lease + SESSION_LEASE + GRACE + CONFIRMATION, gone
            await trio.sleep(2.0)  # the server stays away a while longer
            await trio.to_thread.run_sync(cluster.start)
            back = time.monotonic()
            await each_answers(runners, (200, ""), "serving again")
            healed = time.monotonic() - back
            after = epochs(store)
            assert all(after[name] > before[name] for name in before), (before, after)
            for host, handle in zip(hosts, renewing.handles, strict=True):
                record = await host.status(handle)
                assert isinstance(record, StoppedRecord), record
            # And they serve: a new session on each.
            for number, host in enumerate(hosts):
                opened = await host.open(Key(identity="avail", instance=f"after-{number}"), "a")
                assert opened.handle.generation == 1
        for runner in runners:
            assert "the supervisor was poisoned (fenced)" in runner.stderr()
        print(f"children gone {gone:.2f} s after the stop; serving {healed:.2f} s after start")
