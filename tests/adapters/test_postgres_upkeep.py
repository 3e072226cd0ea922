"""PostgresStore's upkeep of its own runner row in a fleet (run_member): a renewal that
comes too late fences the store (what it says, and that it stays fenced), a renewal that
fails is tried again within the row's trust, and a row another runner took over is
noticed at the next renewal."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest
import trio

from trio_supervisor import (
    Key,
    Limits,
    OpenRecord,
    PostgresStore,
    RunnerFencedError,
    StateStorageError,
)
from trio_supervisor.model import Handle
from trio_supervisor.stores._jobs import Job
from trio_supervisor.stores._postgres_connection import Listener

from ..support.postgres import connect_in as connect
from ..support.postgres import runner_row_locked
from ..support.tcp_proxy import TcpProxy
from ..support.waits import until

LOGGER = "trio_supervisor.stores.postgres"


class Member:
    """A supervisor as run_member sees it: its live keys (and how often asked), its
    sessions' times, and the supersedes it was told."""

    stop_bound = 0.5

    def __init__(self, live: Mapping[Key, int] | None = None) -> None:
        self.alive = dict(live or {})
        self.checks = 0
        self.calls: list[tuple[Key, int]] = []

    def live(self) -> Mapping[Key, int]:
        self.checks += 1
        return dict(self.alive)

    def times(self) -> Mapping[str, tuple[float, float]]:
        return {}

    def shortest_lease(self) -> float | None:
        return None

    def superseded(self, key: Key, high_water: int) -> None:
        self.calls.append((key, high_water))


def record(instance: str) -> OpenRecord:
    handle = Handle(
        key=Key(identity="p", instance=instance),
        token=f"{instance}-1".rjust(32, "0"),
        generation=1,
    )
    return OpenRecord(handle=handle, request_id="r1", lease=5.0, limits=Limits())


def said(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name == LOGGER]


async def test_a_renewal_blocked_past_its_trust_fences_the_runner(
    database: str, schema: str
) -> None:
    """The row is trusted for its lease less a fifth (0.8 s of 1 s): a renewal not
    answered by then fences the store, which remembers it."""
    async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.0) as a:
        with runner_row_locked(database, schema) as blocker:
            began = time.monotonic()
            with trio.fail_after(10), pytest.raises(RunnerFencedError) as fenced:
                await a.run_member(Member())
            waited = time.monotonic() - began
            blocker.execute("ROLLBACK")
        assert str(fenced.value) == (
            f"{a.dsn}: runner a could not renew its row within 0.8 s of the last renewal "
            "sent; it may be taken over, so it stops serving"
        )
        assert fenced.value.__cause__ is None  # no try failed: the one try never ended
        assert 0.8 <= waited < 0.8 + 1.5
        assert a._fenced is fenced.value


async def test_a_renewal_that_keeps_failing_fences_with_its_last_failure(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each try ends at the server's statement timeout; they are tried again (a second
    after the last failed, or sooner where the trust ends sooner) until the trust ends,
    said once, and the fence names the last failure, before the row expires (B2)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with PostgresStore(
        database, runner_id="a", schema=schema, runner_lease=2.0, statement_timeout=0.2
    ) as a:
        with runner_row_locked(database, schema) as blocker:
            with trio.fail_after(10), pytest.raises(RunnerFencedError) as fenced:
                await a.run_member(Member())
            # Read in the blocking transaction: the row as registered.
            ((left,),) = blocker.execute(
                "SELECT extract(epoch FROM lease_until - clock_timestamp()) FROM runners "
                "WHERE runner_id = 'a'"
            ).fetchall()
            blocker.execute("ROLLBACK")
        failure = fenced.value.__cause__
        assert isinstance(failure, StateStorageError)
        assert str(fenced.value) == (
            f"{a.dsn}: runner a could not renew its row within 1.6 s of the last renewal "
            f"sent; it may be taken over, so it stops serving (last failure: {failure.detail})"
        )
        assert left > 0, left
        (warned,) = [m for m in said(caplog, logging.WARNING) if "trying again for" in m]
        assert warned.endswith(" s, until this runner's row is no longer trusted")
        assert warned.startswith(f"{failure}; trying again for ")
        assert a._fenced is fenced.value


async def test_a_renewal_that_failed_and_then_succeeds_keeps_the_runner(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with PostgresStore(
        database, runner_id="a", schema=schema, runner_lease=3.0, statement_timeout=0.2
    ) as a:
        with runner_row_locked(database, schema) as blocker:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.run_member, Member())
                await until(
                    lambda: [m for m in said(caplog, logging.WARNING) if "trying again" in m],
                    "a renewal failed",
                    bound=5,
                )
                blocker.execute("ROLLBACK")
                again = f"{a.dsn}: runner a renewed its row again"
                await until(lambda: again in said(caplog, logging.INFO), "renewed", bound=5)
                nursery.cancel_scope.cancel()
        tries = [m for m in said(caplog, logging.WARNING) if "trying again" in m]
        assert len(tries) == 1  # said once, however often tried
        assert said(caplog, logging.INFO).count(again) == 1
        assert a._fenced is None
        (info,) = await a.runners()
        assert info.alive


async def test_a_row_taken_over_fences_the_runner_at_its_next_renewal(
    database: str, schema: str
) -> None:
    async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.5) as a:
        epoch = a.epoch
        with connect(database, schema) as other:
            other.execute("UPDATE runners SET epoch = epoch + 1 WHERE runner_id = 'a'")
        with trio.fail_after(10), pytest.raises(RunnerFencedError) as fenced:
            await a.run_member(Member())
        assert str(fenced.value) == (
            f"{a.dsn}: runner a lost its row: its epoch {epoch} was taken over by another "
            "runner of the fleet"
        )
        assert a._fenced is fenced.value


async def test_a_runner_fences_itself_before_its_row_expires(database: str, schema: str) -> None:
    """B2: once renewals stop landing, the runner stops serving a fifth of its lease
    before the row it last renewed expires, counted from when that renewal was sent,
    not from the renewal that hangs."""
    async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.5) as a:
        with connect(database, schema) as blocker:
            async with trio.open_nursery() as nursery:

                async def member() -> None:
                    with pytest.raises(RunnerFencedError, match="could not renew"):
                        await a.run_member(Member())

                nursery.start_soon(member)
                # The first renewal writes the member's stop bound.
                await until(
                    lambda: blocker.execute(
                        "SELECT 1 FROM runners WHERE runner_id = 'a' AND stop_bound = 0.5"
                    ).fetchall(),
                    "the first renewal",
                    bound=5,
                )
                blocker.execute("BEGIN")
                blocker.execute("SELECT 1 FROM runners WHERE runner_id = 'a' FOR UPDATE")
                with trio.fail_after(10):
                    await until(lambda: a._fenced, "fenced", bound=5)
            # Read in the blocking transaction: the row as last renewed.
            ((left,),) = blocker.execute(
                "SELECT extract(epoch FROM lease_until - clock_timestamp()) FROM runners "
                "WHERE runner_id = 'a'"
            ).fetchall()
            blocker.execute("ROLLBACK")
        assert 0 < left <= 0.5, left


async def test_a_runner_renews_its_row_every_third_of_its_lease(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A lease of 3 s: renewed every second, and nothing said of renewals that went well."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    seen: set[tuple[Any, ...]] = set()
    with connect(database, schema) as reader:
        async with (
            PostgresStore(database, runner_id="a", schema=schema, runner_lease=3.0) as a,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(a.run_member, Member())

            def look() -> bool:
                seen.update(reader.execute("SELECT lease_until FROM runners WHERE runner_id = 'a'"))
                return len(seen) >= 2

            # Never more often than a third of the lease: in 1.5 s, as registered, then
            # renewals at 0 and 1 s (and at most one more on a slow look).
            with trio.move_on_after(1.5):
                while True:
                    look()
                    await trio.sleep(0.02)
            assert len(seen) <= 4, seen
            # And renewed at all, however busy the machine (a renewal may come late).
            await until(look, "a renewal", bound=10)
            nursery.cancel_scope.cancel()
    renewals = [
        m for m in said(caplog, logging.INFO) + said(caplog, logging.WARNING) if "renew" in m
    ]
    assert renewals == []


async def test_a_check_that_fails_is_said_once_until_one_succeeds(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The inbox check, locked out at the server's statement timeout, fails at each
    check: said once while it fails, and again after a check that succeeded."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    member = Member({Key(identity="p", instance="k"): 1})

    def failures() -> list[str]:
        return [m for m in said(caplog, logging.WARNING) if m.startswith(a.dsn)]

    with connect(database, schema) as blocker:
        async with (
            PostgresStore(
                database, runner_id="a", schema=schema, runner_lease=1.5, statement_timeout=0.1
            ) as a,
            trio.open_nursery() as nursery,
        ):
            a._check_period = 0.1
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE inbox IN ACCESS EXCLUSIVE MODE")
            nursery.start_soon(a.run_member, member)
            await until(lambda: member.checks >= 4, "four checks", bound=10)
            blocker.execute("ROLLBACK")
            (first,) = failures()
            # Back: the next check reads the inbox.
            blocker.execute("INSERT INTO inbox VALUES ('a', 'p', 'k', 2)")
            await until(lambda: member.calls, "the inbox read", bound=5)
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE inbox IN ACCESS EXCLUSIVE MODE")
            await until(lambda: len(failures()) == 2, "the next failure said", bound=5)
            blocker.execute("ROLLBACK")
            nursery.cancel_scope.cancel()
    assert member.calls == [(Key(identity="p", instance="k"), 2)]
    assert "statement timeout" in first, first


async def test_a_publish_of_times_that_fails_is_said(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with connect(database, schema) as blocker:
        async with (
            PostgresStore(
                database, runner_id="a", schema=schema, runner_lease=3.0, statement_timeout=0.1
            ) as a,
            trio.open_nursery() as nursery,
        ):
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE runner_times IN ACCESS EXCLUSIVE MODE")
            nursery.start_soon(a.run_member, Member())
            warned = await until(
                lambda: [m for m in said(caplog, logging.WARNING) if m.startswith(a.dsn)],
                "the publish failed",
                bound=5,
            )
            blocker.execute("ROLLBACK")
            nursery.cancel_scope.cancel()
    assert "statement timeout" in warned[0], warned


async def test_take_over_dead_counts_the_records_of_every_dead_runner(
    database: str, schema: str
) -> None:
    async with (
        PostgresStore(database, runner_id="a", schema=schema) as a,
        PostgresStore(database, runner_id="c", schema=schema) as c,
        PostgresStore(database, runner_id="b", schema=schema) as b,
    ):
        await a.save(record("x"))
        await c.save(record("y"))
        with connect(database, schema) as other:
            other.execute(
                "UPDATE runners SET lease_until = clock_timestamp() - interval '60 s' "
                "WHERE runner_id IN ('a', 'c')"
            )
        assert await b.take_over_dead() == 2
        assert await b.take_over_dead() == 0


class Timed(Member):
    """A member whose shortest session lease is ``shortest``, and which notes when each
    check asked for its live keys."""

    def __init__(self, shortest: float | None) -> None:
        super().__init__({Key(identity="p", instance="k"): 1})
        self.shortest = shortest
        self.asked: list[float] = []

    def live(self) -> Mapping[Key, int]:
        self.asked.append(time.monotonic())
        return super().live()

    def shortest_lease(self) -> float | None:
        return self.shortest


@pytest.mark.parametrize(
    ("shortest", "check_period", "spacing"),
    [
        pytest.param(0.3, 30.0, 0.1, id="a third of the shortest session lease"),
        pytest.param(None, 0.2, 0.2, id="the check period without sessions"),
    ],
)
async def test_the_inbox_is_checked_every_third_of_the_shortest_session_lease(
    database: str, schema: str, shortest: float | None, check_period: float, spacing: float
) -> None:
    """F5: with a session lease of 0.3 s, the inbox is read every 0.1 s, however long
    the store's own check period (never more often, and not at the check period); with
    no session, the store's own check period spaces the checks."""
    member = Timed(shortest=shortest)
    async with (
        PostgresStore(database, runner_id="a", schema=schema, runner_lease=30.0) as a,
        trio.open_nursery() as nursery,
    ):
        a._check_period = check_period
        nursery.start_soon(a.run_member, member)
        await until(lambda: len(member.asked) >= 6, "six checks", bound=3.5)
        nursery.cancel_scope.cancel()
    gaps = [later - earlier for earlier, later in itertools.pairwise(member.asked)]
    assert min(gaps[:5]) >= spacing, gaps


async def test_dead_runners_are_looked_for_every_third_of_the_runner_lease(
    database: str, schema: str
) -> None:
    """F7: a runner lease of 1.5 s: dead runners are looked for every 0.5 s, though the
    inbox is checked every 0.05 s."""
    looked: list[float] = []
    async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.5) as a:
        take_over_dead = a.take_over_dead

        async def counted() -> int:
            looked.append(time.monotonic())
            return await take_over_dead()

        a.take_over_dead = counted  # type: ignore[method-assign]
        a._check_period = 0.05
        member = Timed(shortest=None)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_member, member)
            await until(lambda: len(looked) >= 4, "four looks for dead runners", bound=6)
            nursery.cancel_scope.cancel()
    gaps = [later - earlier for earlier, later in itertools.pairwise(looked)]
    assert min(gaps[:3]) >= 0.5 - 0.01, gaps
    assert len(member.asked) > 2 * len(looked), (len(member.asked), len(looked))


async def test_only_a_notified_stop_wakes_the_waits_for_older_generations(
    database: str, schema: str
) -> None:
    """A stop notified sets the event the waits for older generations wait on (and a
    new one takes its place for the next); a supersede meant for another runner does
    not, nor does one meant for this runner (that one goes to its member)."""
    member = Member()
    with connect(database, schema) as other:

        def notify(**note: object) -> None:
            other.execute("SELECT pg_notify(%s, %s)", (schema, json.dumps(note)))

        async with (
            PostgresStore(database, runner_id="a", schema=schema, runner_lease=30.0) as a,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(a.run_member, member)
            await until(
                lambda: other.execute(
                    "SELECT 1 FROM runner_times WHERE runner_id = 'a'"
                ).fetchall(),
                "a listens",
                bound=10,
            )
            heard = a._heard = trio.Event()
            supersede = {"kind": "superseded", "identity": "p", "instance": "k", "generation": 2}
            notify(**supersede, runner="b")
            notify(**supersede, runner="a")
            # Notifications are acted on in order: once a's is, b's was.
            await until(lambda: member.calls, "a's supersede", bound=10)
            assert not heard.is_set()
            notify(kind="stopped", identity="p", instance="k", generation=1)
            await until(heard.is_set, "the stop heard", bound=10)
            assert a._heard is not heard
            nursery.cancel_scope.cancel()
    assert member.calls == [(Key(identity="p", instance="k"), 2)]


async def test_a_renewal_s_retries_end_with_the_row_s_trust(database: str, schema: str) -> None:
    """A renewal is retried while the store is out of reach only until the row's trust
    ends, not for the store's whole ``store_wait``: the fenced store closes at once,
    its worker not kept busy with a renewal no one waits for."""
    with TcpProxy.to(database) as proxy:
        through = proxy.through(database)
        store = PostgresStore(
            through, runner_id="a", schema=schema, runner_lease=1.5, store_wait=30.0
        )
        async with store:
            proxy.cut()
            with trio.fail_after(10), pytest.raises(RunnerFencedError, match="could not renew"):
                await store.run_member(Member())
            # The close is shielded: it waits for the worker, however long.
            began = time.monotonic()
            await store.aclose()
            assert time.monotonic() - began < 10


async def test_renewals_are_sent_a_third_of_the_lease_apart(database: str, schema: str) -> None:
    """A lease of 1.5 s: each renewal is sent 0.5 s after the one before was sent (a
    late one is not followed by one sooner), never more often."""
    sent: list[float] = []
    async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.5) as a:
        submit = a._submit

        async def noted(job: Job, *, abandonable: bool = False) -> Any:
            if job.kind == "renew":
                sent.append(time.monotonic())
            return await submit(job, abandonable=abandonable)

        a._submit = noted  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_member, Member())
            await until(lambda: len(sent) >= 4, "four renewals", bound=10)
            nursery.cancel_scope.cancel()
    gaps = [later - earlier for earlier, later in itertools.pairwise(sent)]
    assert min(gaps[:3]) >= 0.5 - 0.01, gaps


async def test_the_listener_s_thread_has_ended_when_run_member_returns(
    database: str, schema: str
) -> None:
    """Cancelled, run_member still waits for the thread that listens to stop (within
    its poll), so nothing of it outlives the call."""

    def listening() -> set[threading.Thread]:
        """The threads listening for this test's store (others may run beside it)."""
        return {t for t in threading.enumerate() if t.name == f"trio_supervisor listen {a.dsn}"}

    async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=30.0) as a:
        with connect(database, schema) as other:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.run_member, Member())
                await until(
                    lambda: other.execute("SELECT 1 FROM runner_times").fetchall(),
                    "a listens",
                    bound=10,
                )
                assert len(listening()) == 1
                nursery.cancel_scope.cancel()
            assert listening() == set()


async def test_notifications_that_come_as_run_member_ends_are_dropped(
    database: str, schema: str
) -> None:
    """Notifications keep coming while run_member is cancelled: those the listener
    hands on after it stopped reading them are dropped, and the call ends cleanly."""
    note = json.dumps(
        {"kind": "superseded", "identity": "p", "instance": "k", "generation": 2, "runner": "a"}
    )
    flooding = threading.Event()
    stop = threading.Event()

    def flood() -> None:
        with connect(database, schema) as other:
            while not stop.is_set():
                other.execute("SELECT pg_notify(%s, %s)", (schema, note))
                flooding.set()

    flooder = threading.Thread(target=flood, name="flood", daemon=True)
    flooder.start()
    try:
        async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=30.0) as a:
            for _ in range(3):
                member = Member()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(a.run_member, member)
                    await until(lambda: len(member.calls) >= 20, "notifications heard", bound=10)  # noqa: B023
                    nursery.cancel_scope.cancel()
    finally:
        stop.set()
        flooder.join(10)
    assert flooding.is_set()
    assert not flooder.is_alive()


async def test_run_member_does_not_wait_long_for_a_listener_that_hangs(
    database: str, schema: str
) -> None:
    """A listener stuck connecting (a network that stopped delivering) is left to its
    daemon thread once run_member has waited four of its polls for it, not until its
    connection attempt times out."""
    with TcpProxy.to(database) as proxy:
        through = proxy.through(database)
        async with PostgresStore(
            through, runner_id="a", schema=schema, runner_lease=30.0, connect_timeout=5
        ) as a:
            proxy.pause()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.run_member, Member())
                await until(
                    lambda: any(
                        t.name == f"trio_supervisor listen {a.dsn}" for t in threading.enumerate()
                    ),
                    "the listener started",
                    bound=10,
                )
                began = time.monotonic()
                nursery.cancel_scope.cancel()
            ended = time.monotonic() - began
            proxy.resume()
    assert 4 * Listener.POLL - 0.05 <= ended < 4, ended
