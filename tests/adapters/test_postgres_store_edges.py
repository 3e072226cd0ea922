"""PostgresStore's edges: the settings it refuses and what it is before it opens, its
worker thread, what a call after closing says, and a close with no connection left; on
a real server, the calls a caller stops waiting for (a read is left, a save in its batch
answers), a fenced runner's writes, what an Open's save found for its wait, a schema a
newer library wrote, what registration warns of, and in a fleet what a lookup or an
Open after a failover says of the runners that did not check their writes yet (one, or
several), a listing of the fleet that waits for a live runner to answer its ask for
times, how often run_member checks, and a row of the inbox no key can hold."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

import psycopg
import pytest
import trio
import trio.testing

from trio_supervisor import (
    Disposed,
    ExitStatus,
    Handle,
    Key,
    Limits,
    OpenRecord,
    PostgresStore,
    Retention,
    RunnerFencedError,
    StateStorageError,
    StoppedRecord,
    StoreUnavailableError,
    Termination,
)
from trio_supervisor import _defaults as defaults
from trio_supervisor.model import FleetRecord
from trio_supervisor.stores._postgres_link import Memory
from trio_supervisor.stores._postgres_schema import SCHEMA_VERSION

from ..support.postgres import connect_in as connect
from ..support.postgres import query_in as run
from ..support.postgres import runner_row_locked
from ..support.tcp_proxy import TcpProxy
from ..support.waits import until

LOGGER = "trio_supervisor.stores.postgres"
NOWHERE = "postgresql://nowhere/x"  # a store made here never connects


class Member:
    """A supervisor as run_member sees it: its live keys, its sessions' times (which a
    test may change), and the supersedes it was told."""

    stop_bound = 0.5

    def __init__(self, live: Mapping[Key, int] | None = None) -> None:
        self.alive = dict(live or {})
        self.ages_and_leases: dict[str, tuple[float, float]] = {}
        self.calls: list[tuple[Key, int]] = []

    def live(self) -> Mapping[Key, int]:
        return dict(self.alive)

    def times(self) -> Mapping[str, tuple[float, float]]:
        return dict(self.ages_and_leases)

    def shortest_lease(self) -> float | None:
        return None

    def superseded(self, key: Key, high_water: int) -> None:
        self.calls.append((key, high_water))


def record(instance: str, generation: int = 1) -> OpenRecord:
    handle = Handle(
        key=Key(identity="p", instance=instance),
        token=f"{instance}-{generation}".rjust(32, "0"),
        generation=generation,
    )
    return OpenRecord(handle=handle, request_id=f"r{generation}", lease=5.0, limits=Limits())


# -- the settings, and the store before it opens -----------------------------------------

POSITIVE = "PostgresStore {} must be a positive number, got {!r}"
STORE_WAIT_NUMBER = "PostgresStore store_wait must be a number, got {!r}"
STORE_WAIT_RANGE = "PostgresStore store_wait must be 0 or more seconds, got {!r}"
WINDOW = "PostgresStore commit_window must be a number of seconds from 0 to 1, got {!r}"
RUNNER_ID = "PostgresStore runner_id must be a non-empty string, got {!r}"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("runner_lease", 0, POSITIVE),
        ("runner_lease", math.inf, POSITIVE),
        ("connect_timeout", -1.0, POSITIVE),
        ("connect_timeout", "5", POSITIVE),
        ("statement_timeout", 0.0, POSITIVE),
        ("statement_timeout", math.inf, POSITIVE),
        ("store_wait", True, STORE_WAIT_NUMBER),
        ("store_wait", "1", STORE_WAIT_NUMBER),
        ("store_wait", -0.5, STORE_WAIT_RANGE),
        ("store_wait", math.inf, STORE_WAIT_RANGE),
        ("commit_window", -0.1, WINDOW),
        ("runner_id", "", RUNNER_ID),
        ("runner_id", 5, RUNNER_ID),
    ],
)
def test_a_setting_out_of_range_is_refused_naming_it_and_its_value(
    name: str, value: Any, message: str
) -> None:
    said = message.format(*([name] if "{}" in message else []), value)
    with pytest.raises(ValueError, match=f"^{re.escape(said)}$"):
        PostgresStore(NOWHERE, **{"runner_id": "a", name: value})


def test_settings_at_their_edges_are_taken_and_a_store_not_open_is_at_zero() -> None:
    """Short timeouts and a lease under a second, no store_wait and the longest commit
    window are taken as given; before it opens, the store has no epoch, no commit and
    no lost write, the default retention, and a memory of no server."""
    store = PostgresStore(
        NOWHERE,
        runner_id="a",
        runner_lease=0.25,
        connect_timeout=0.25,
        statement_timeout=0.25,
        store_wait=0,
        commit_window=1.0,
    )
    assert (store.runner_lease, store.store_wait) == (0.25, 0.0)
    assert (store.epoch, store.commits, store.lost_writes) == (0, 0, 0)
    assert store.retention == Retention()
    assert store.memory.server is None
    assert store.schema == defaults.FLEET_SCHEMA
    kept = Retention(stopped_per_key=3)
    assert PostgresStore(NOWHERE, runner_id="a", retention=kept).retention is kept


async def test_the_worker_thread_is_named_and_a_call_after_closing_names_the_store(
    database: str, schema: str
) -> None:
    store = PostgresStore(database, runner_id="a", schema=schema)
    async with store:
        names = [thread.name for thread in threading.enumerate()]
        assert f"trio_supervisor postgres {store.dsn}" in names
    with pytest.raises(StateStorageError) as refused:
        await store.list()
    assert refused.value.detail == f"the store {store.dsn} is closed"
    # Closing marked its row expired: the fleet need not wait out its lease.
    expired = "SELECT lease_until <= clock_timestamp() FROM runners WHERE runner_id = 'a'"
    assert run(database, schema, expired) == [(True,)]


async def test_a_close_after_the_store_went_out_of_reach_talks_to_nobody(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The connection was lost (the network cut) and no call made another: closing
    leaves the row to its lease, and says nothing of it."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    with TcpProxy.to(database) as proxy:
        store = PostgresStore(proxy.url(database), runner_id="a", schema=schema, store_wait=0)
        await store.open()
        proxy.cut()
        with pytest.raises(StoreUnavailableError):
            await store.list()
        caplog.clear()
        await store.aclose()
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == []
    alive = "SELECT lease_until > clock_timestamp() FROM runners WHERE runner_id = 'a'"
    assert run(database, schema, alive) == [(True,)]


# -- the calls a caller stops waiting for -------------------------------------------------


def waits_for_a_lock(database: str) -> bool:
    """Whether a server session of runner a's store in the test's database waits for a
    lock."""
    return bool(
        query(
            database,
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'trio_supervisor a' AND wait_event_type = 'Lock'",
        )
    )


def query(database: str, statement: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(database, autocommit=True, connect_timeout=5) as connection:
        return connection.execute(statement).fetchall()


async def test_a_read_its_caller_stops_waiting_for_is_left_at_once(
    database: str, schema: str
) -> None:
    """A read writes nothing: cancelled while the server holds it (a lock), the call
    returns at once, not when the server answers."""
    returned = trio.Event()
    # A statement timeout that ends the held read soon, should the call wait for it.
    async with PostgresStore(database, runner_id="a", schema=schema, statement_timeout=2.0) as a:
        await a.save(record("k"))
        with connect(database, schema) as blocker:
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE records IN ACCESS EXCLUSIVE MODE")
            async with trio.open_nursery() as nursery:

                async def read(scope: trio.CancelScope) -> None:
                    with scope:
                        await a.list()
                    returned.set()

                scope = trio.CancelScope()
                nursery.start_soon(read, scope)
                await until(lambda: waits_for_a_lock(database), "the read held", bound=10)
                scope.cancel()
                with trio.fail_after(10):
                    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                assert returned.is_set()  # while the server still holds the read
            blocker.execute("ROLLBACK")
        assert await a.list() == [record("k")]


async def test_a_save_its_caller_stops_waiting_for_in_its_batch_still_answers(
    database: str, schema: str
) -> None:
    """A save may land once its batch is sent: cancelled while the server holds the
    batch (this runner's row locked), the call waits for the batch's outcome."""
    returned = trio.Event()
    async with PostgresStore(database, runner_id="a", schema=schema) as a:
        with runner_row_locked(database, schema) as blocker:
            async with trio.open_nursery() as nursery:

                async def save(scope: trio.CancelScope) -> None:
                    with scope:
                        await a.save(record("k"))
                    returned.set()

                scope = trio.CancelScope()
                nursery.start_soon(save, scope)
                await until(lambda: waits_for_a_lock(database), "the batch held", bound=10)
                scope.cancel()
                with trio.fail_after(10):
                    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                assert not returned.is_set()  # it waits for the batch
                blocker.execute("ROLLBACK")
                with trio.fail_after(10):
                    await returned.wait()
        assert await a.list() == [record("k")]  # and the batch landed


async def test_a_fenced_runner_s_writes_are_refused_at_once_and_its_reads_still_answer(
    database: str, schema: str
) -> None:
    """Once run_member fenced the runner (a renewal not answered within its trust), its
    saves and its drain are refused with that fence, without a word to the database,
    though its row still holds its epoch there; reads still answer."""
    async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.0) as a:
        await a.save(record("k"))
        with runner_row_locked(database, schema) as blocker:
            with trio.fail_after(10), pytest.raises(RunnerFencedError) as fenced:
                await a.run_member(Member())
            blocker.execute("ROLLBACK")
        commits = a.commits

        async def save() -> None:
            await a.save(record("j"))

        for write in (save, a.drain):
            with pytest.raises(RunnerFencedError) as refused:
                await write()
            assert refused.value.__cause__ is fenced.value
            assert str(refused.value) == str(fenced.value)
        assert a.commits == commits
        assert await a.list() == [record("k")]
        assert [(r.runner_id, r.draining) for r in await a.runners()] == [("a", False)]


# -- the older generations an Open's save found ------------------------------------------


async def test_an_open_s_wait_starts_from_what_its_save_found_for_the_latest_opens(
    database: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F6: the save of an Open says which older generations of its key other runners
    hold; the open's wait starts from that, with no look of its own (none here: the
    records are locked away and it returns at once). Only the latest Opens are kept
    (two here): an older one's wait looks, and the look fails at the statement timeout."""
    monkeypatch.setattr(defaults, "OLDER_KEPT", 2)
    first, second, third = record("1"), record("2"), record("3")
    async with PostgresStore(database, runner_id="a", schema=schema, statement_timeout=0.5) as a:
        for opened in (first, second, third):
            await a.save(opened)
        with connect(database, schema) as blocker:
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE records IN ACCESS EXCLUSIVE MODE")
            with trio.fail_after(10):
                await a.wait_older_stopped(third.handle)
                await a.wait_older_stopped(second.handle)
                with pytest.raises(StateStorageError, match="statement timeout"):
                    await a.wait_older_stopped(first.handle)
            blocker.execute("ROLLBACK")


async def test_an_open_s_wait_does_not_start_from_another_key_s_holder_in_its_batch(
    database: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two Opens saved together: the one of key j (generation 2) supersedes runner x's
    live generation 1, the one of key k (generation 1) supersedes nothing. k's wait
    returns at once, with no look of its own (the records are locked away), though
    another look would come only after OLDER_POLL (a minute here)."""
    monkeypatch.setattr(defaults, "OLDER_POLL", 60.0)
    held, newer, alone = record("j"), record("j", 2), record("k")
    async with (
        PostgresStore(database, runner_id="x", schema=schema) as x,
        PostgresStore(database, runner_id="a", schema=schema, statement_timeout=0.5) as a,
    ):
        await x.save(held)
        await a.save_many([newer, alone])
        with connect(database, schema) as blocker:
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE records IN ACCESS EXCLUSIVE MODE")
            with trio.fail_after(5):
                await a.wait_older_stopped(alone.handle)
            blocker.execute("ROLLBACK")


# -- the schema, and registration ---------------------------------------------------------


async def test_a_schema_a_newer_library_wrote_is_refused_naming_both_versions(
    database: str, schema: str
) -> None:
    async with PostgresStore(database, runner_id="a", schema=schema):
        pass
    newer = SCHEMA_VERSION + 1
    run(database, schema, "UPDATE schema_version SET version = %s", newer)
    store = PostgresStore(database, runner_id="a", schema=schema)
    with pytest.raises(StateStorageError) as refused:
        await store.open()
    await store.aclose()
    assert refused.value.detail == (
        f"{store.dsn}: the schema {schema} has version {newer}; this library knows version "
        f"{SCHEMA_VERSION} at most (a newer trio_supervisor wrote it)"
    )


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING
    ]


async def test_registration_warns_of_one_runner_with_its_url_and_of_no_other(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A runner that advertises the URL one other live runner advertises is warned of
    (in the singular); another URL, or none (""), is no one's twin."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with contextlib.AsyncExitStack() as stack:
        for runner, advertise in (("a", "http://h:1"), ("b", "http://h:2"), ("c", "")):
            await stack.enter_async_context(
                PostgresStore(database, runner_id=runner, schema=schema, advertise=advertise)
            )
        assert warnings(caplog) == []
        d = await stack.enter_async_context(
            PostgresStore(database, runner_id="d", schema=schema, advertise="http://h:1")
        )
        assert warnings(caplog) == [
            f"{d.dsn}: runner d advertises http://h:1, as a already does: hosts sent there "
            "reach only one of them; give each runner its own --advertise URL"
        ]
        caplog.clear()
        for runner, advertise in (("e", ""), ("f", "http://h:3")):
            await stack.enter_async_context(
                PostgresStore(database, runner_id=runner, schema=schema, advertise=advertise)
            )
        assert warnings(caplog) == []


async def test_a_restart_while_the_last_row_lives_warns_naming_both_epochs(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with PostgresStore(database, runner_id="a", schema=schema):
        pass  # epoch 1, its row expired as it closed
    assert warnings(caplog) == []
    async with (
        PostgresStore(database, runner_id="a", schema=schema),
        PostgresStore(database, runner_id="a", schema=schema) as again,
    ):
        assert again.epoch == 3
    assert warnings(caplog) == [
        f"{again.dsn}: runner a registered as epoch 3 while the row of its epoch 2 was still "
        "within its lease: another process may be running under this id"
    ]


# -- after a failover (B6) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("others", "named"), [(["b"], "runner b"), (["b", "c"], "runners b, c")], ids=["one", "two"]
)
async def test_a_lookup_after_a_failover_names_each_runner_that_did_not_check(
    database: str, schema: str, others: list[str], named: str
) -> None:
    """B6: the store meets another server than its last incarnation's, and a live runner
    of the fleet did not check its writes on this one: with no store_wait, the lookup
    gives up at once, naming that runner (in the singular) or those runners."""
    async with contextlib.AsyncExitStack() as stack:
        for runner in [*others, "z"]:
            await stack.enter_async_context(
                PostgresStore(database, runner_id=runner, schema=schema)
            )
        # z checked on this server as it registered; the others only elsewhere.
        run(
            database,
            schema,
            "UPDATE runners SET checked = 'elsewhere' WHERE runner_id = ANY(%s)",
            others,
        )
        memory = Memory()
        memory.server = "another server/00000001"
        async with PostgresStore(
            database, runner_id="a", schema=schema, memory=memory, store_wait=0
        ) as a:
            with trio.fail_after(10), pytest.raises(StoreUnavailableError) as waiting:
                await a.lookup(Key(identity="p", instance="k"), None)
    assert waiting.value.detail == (
        f"{a.dsn}: the database's server changed (a failover?), and {named} of the fleet "
        "did not check yet for writes it lost; no generation is handed out until each "
        "did, or its row expired"
    )


async def test_after_a_failover_only_an_open_waits_for_every_runner_to_check(
    database: str, schema: str
) -> None:
    """B6: after a failover, an Open hands out a generation only once every live runner
    checked its writes on the new server (with no store_wait, it gives up at once,
    writing nothing); a save of another record, which hands out none, does not wait."""
    earlier, later = record("k"), record("j")
    async with PostgresStore(database, runner_id="a", schema=schema) as first:
        await first.save(earlier)
    async with PostgresStore(database, runner_id="b", schema=schema):
        run(database, schema, "UPDATE runners SET checked = 'elsewhere' WHERE runner_id = 'b'")
        memory = Memory()
        memory.server = "another server/00000001"
        async with PostgresStore(
            database, runner_id="a", schema=schema, memory=memory, store_wait=0
        ) as a:
            done = StoppedRecord.of(
                earlier, Disposed(), Termination(kind="exited", exit=ExitStatus(code=0))
            )
            with trio.fail_after(10):
                await a.save(done)
                with pytest.raises(StoreUnavailableError) as waiting:
                    await a.save(later)
            assert "and runner b of the fleet did not check yet" in waiting.value.detail
            assert await a.list() == [done]
            # b checks on this server: the Open lands.
            run(
                database,
                schema,
                "UPDATE runners SET checked = %s WHERE runner_id = 'b'",
                memory.server,
            )
            with trio.fail_after(10):
                await a.save(later)
            assert await a.list() == [done, later]


# -- run_member: the times a listing asks for, the checks, the inbox ------------------


async def test_a_fleet_listing_waits_for_a_live_runner_to_publish_its_times(
    database: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing asks every runner for its sessions' times and waits until each live one
    that answers such asks published them since: while b's answer is held up at the
    server, the listing waits, and then shows what b published in answer, not what it
    published before the ask."""
    # The wait for an answer, long enough that only b's answer ends it.
    monkeypatch.setattr(defaults, "TIMES_WAIT", 60.0)
    live = record("k")
    member = Member()
    b_waits = (
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name = 'trio_supervisor b' AND wait_event_type = 'Lock'"
    )
    listed: list[FleetRecord] = []
    async with (
        PostgresStore(database, runner_id="a", schema=schema) as a,
        PostgresStore(database, runner_id="b", schema=schema) as b,
        trio.open_nursery() as nursery,
    ):
        await b.save(live)
        nursery.start_soon(b.run_member, member)
        # b publishes its times (none yet) as it begins to listen.
        await until(
            lambda: run(database, schema, "SELECT 1 FROM runner_times WHERE runner_id = 'b'"),
            "b listens",
            bound=10,
        )
        member.ages_and_leases[live.handle.token] = (2.0, 8.0)

        async def listing() -> None:
            listed.extend(await a.fleet_records())

        with connect(database, schema) as blocker:
            blocker.execute("BEGIN")
            blocker.execute("SELECT 1 FROM runner_times WHERE runner_id = 'b' FOR UPDATE")
            nursery.start_soon(listing)
            # b heard the ask and answers: its answer waits for the lock.
            await until(lambda: run(database, schema, b_waits), "b's answer held", bound=10)
            assert listed == []  # the listing still waits for it
            blocker.execute("ROLLBACK")
        await until(lambda: listed, "the listing", bound=10)
        nursery.cancel_scope.cancel()
    (found,) = listed
    assert found == FleetRecord(record=live, runner_id="b", epoch=b.epoch)
    assert found.age is not None
    assert found.lease_left is not None
    assert 2.0 <= found.age < 12.0, found
    assert 0 < found.lease_left <= 8.0, found


async def test_the_checks_come_every_third_of_a_runner_lease_shorter_than_the_fleet_s_check(
    database: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without sessions, run_member's checks (the inbox, dead runners) come every third
    of the runner lease (0.5 s of 1.5 s) when that is shorter than the fleet's check
    period (made 30 s here): never more often, and not at that period."""
    monkeypatch.setattr(defaults, "FLEET_CHECK", 30.0)
    asked: list[float] = []

    class Timed(Member):
        def live(self) -> Mapping[Key, int]:
            asked.append(time.monotonic())
            return super().live()

    async with (
        PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.5) as a,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(a.run_member, Timed({Key(identity="p", instance="k"): 1}))
        await until(lambda: len(asked) >= 3, "three checks", bound=6)
        nursery.cancel_scope.cancel()
    gaps = [later - earlier for earlier, later in itertools.pairwise(asked)]
    assert min(gaps[:2]) >= 0.5 - 0.01, gaps


async def test_an_inbox_row_no_key_can_hold_is_said_naming_the_store(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A row of this runner's inbox whose key is no key (an empty identity, written by
    hand): the check that reads it says so, naming the database; the row is read (and
    cleared) once, and no supersede is told."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    member = Member({Key(identity="p", instance="k"): 1})

    def said() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING and "malformed" in r.getMessage()
        ]

    async with (
        PostgresStore(database, runner_id="a", schema=schema) as a,
        trio.open_nursery() as nursery,
    ):
        a._check_period = 0.05
        run(database, schema, "INSERT INTO inbox VALUES ('a', '', 'k', 2)")
        nursery.start_soon(a.run_member, member)
        (warned,) = await until(said, "the inbox's row said", bound=10)
        # Cleared: the next checks find nothing and say nothing more.
        await until(
            lambda: not run(database, schema, "SELECT 1 FROM inbox"), "the inbox cleared", bound=5
        )
        nursery.cancel_scope.cancel()
    assert warned.startswith(f"{a.dsn}: a high-water row is malformed: "), warned
    assert said() == [warned]
    assert member.calls == []
