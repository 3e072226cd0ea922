"""PostgresStore on a real server: the store's promises, global fencing of generations,
fenced writes, incarnations, takeover, membership of the fleet, and bad data."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import psycopg
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from trio_supervisor import (
    Disposed,
    ExitStatus,
    Handle,
    Key,
    Limits,
    Load,
    MemoryStore,
    OpenRecord,
    PostgresStore,
    RecordFormatError,
    Retention,
    SessionRecord,
    StaleSessionError,
    StateStorageError,
    StoppedRecord,
    StoppingRecord,
    StoreUnavailableError,
    Superseded,
    Termination,
    TerminationUnconfirmedError,
    codec,
)
from trio_supervisor import _defaults as defaults
from trio_supervisor.abc import BatchStore, FleetMember, FleetStore, Store
from trio_supervisor.codec import encode
from trio_supervisor.model import FleetRecord
from trio_supervisor.stores._jobs import Job
from trio_supervisor.stores._postgres_records import columns
from trio_supervisor.stores._postgres_schema import MIGRATIONS, SCHEMA_VERSION
from trio_supervisor.stores._postgres_sql import SAVE_BATCH
from trio_supervisor.testing import FakeExecution
from trio_supervisor.testing.contracts import StoreContract, StoreFactory

from ..support.postgres import fresh_schema
from ..support.sessions import KEY, supervise_embedded
from ..support.tcp_proxy import TcpProxy
from ..support.waits import until, until_stopped

DONE = Termination(kind="exited", exit=ExitStatus(code=0))


@pytest.fixture
def schema() -> str:
    """A schema no store used yet (the stores create it)."""
    return fresh_schema()


def connect(dsn: str) -> psycopg.Connection[Any]:
    """A plain connection, for a test to look at or tamper with the data."""
    return psycopg.connect(dsn, autocommit=True, connect_timeout=5)


def record(instance: str, generation: int, *, token: str | None = None) -> OpenRecord:
    handle = Handle(
        key=Key(identity="p", instance=instance),
        token=token or f"{instance}-{generation}".rjust(32, "0"),
        generation=generation,
    )
    return OpenRecord(handle=handle, request_id=f"r{generation}", lease=5.0, limits=Limits())


def stopped(opened: OpenRecord, reason: Any = None) -> StoppedRecord:
    return StoppedRecord.of(opened, reason or Disposed(), DONE)


def key(instance: str) -> Key:
    return Key(identity="p", instance=instance)


class Member:
    """A supervisor as run_member sees it: live keys, its sessions' times, and the
    supersedes it was told."""

    def __init__(
        self,
        live: Mapping[Key, int] | None = None,
        stop_bound: float = 0.5,
        times: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        self.stop_bound = stop_bound
        self.alive = dict(live or {})
        self.ages_and_leases = dict(times or {})
        self.calls: list[tuple[Key, int]] = []
        self.lease: float | None = None
        self.checks = 0  # how often the store asked for the live keys

    def live(self) -> Mapping[Key, int]:
        self.checks += 1
        return dict(self.alive)

    def times(self) -> Mapping[str, tuple[float, float]]:
        return dict(self.ages_and_leases)

    def shortest_lease(self) -> float | None:
        return self.lease

    def superseded(self, key: Key, high_water: int) -> None:
        self.calls.append((key, high_water))


def run(dsn: str, statement: str, *args: object) -> list[tuple[Any, ...]]:
    with connect(dsn) as connection:
        cursor = connection.execute(statement, args)
        return cursor.fetchall() if cursor.description else []


def in_schema(dsn: str, schema: str) -> str:
    """A DSN whose connections find the store's tables unqualified."""
    return make_conninfo(dsn, options=f"-c search_path={schema}")


@contextlib.asynccontextmanager
async def two_runners(
    database: str, schema: str, **options: Any
) -> AsyncIterator[tuple[PostgresStore, PostgresStore]]:
    """Stores of runners ``a`` and ``b`` of one fleet (the test's schema), open."""
    async with (
        PostgresStore(database, runner_id="a", schema=schema, **options) as a,
        PostgresStore(database, runner_id="b", schema=schema, **options) as b,
    ):
        yield a, b


# -- the contract kit, and the protocols -----------------------------------------------


class TestPostgresStore(StoreContract):
    @pytest.fixture
    def store_factory(self, database: str, schema: str) -> StoreFactory:
        def make(previous: Store | None, retention: Retention) -> Store:
            return PostgresStore(database, runner_id="kit", schema=schema, retention=retention)

        return make


async def test_it_is_a_store_a_batch_store_and_a_fleet_store(database: str, schema: str) -> None:
    store = PostgresStore(database, runner_id="a", schema=schema)
    as_fleet: FleetStore = store  # mypy checks the protocols here
    as_batch: BatchStore = store
    assert isinstance(as_fleet, FleetStore)
    assert isinstance(as_batch, BatchStore)
    assert store.member == "a"
    assert PostgresStore(database).member == socket.gethostname()
    await store.aclose()


def test_without_psycopg_the_import_names_the_extra() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["psycopg"] = None  # importing it fails
        try:
            from trio_supervisor import PostgresStore
        except ImportError as error:
            print(error)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'trio_supervisor[postgres]'" in done.stdout


# -- schema ----------------------------------------------------------------------------


async def test_stores_starting_at_once_on_an_empty_database_create_the_schema_once(
    database: str, schema: str
) -> None:
    stores = [PostgresStore(database, runner_id=f"r{n}", schema=schema) for n in range(6)]
    async with trio.open_nursery() as nursery:
        for store in stores:
            nursery.start_soon(store.open)
    assert run(
        database,
        sql.SQL("SELECT version FROM {}.schema_version").format(sql.Identifier(schema)).as_string(),
    ) == [(SCHEMA_VERSION,)]
    for store in stores:
        assert store.epoch == 1
        await store.aclose()


async def test_a_schema_of_a_newer_version_is_refused_naming_both(
    database: str, schema: str
) -> None:
    async with PostgresStore(database, runner_id="a", schema=schema):
        pass
    newer = SCHEMA_VERSION + 1
    run(in_schema(database, schema), f"UPDATE schema_version SET version = {newer}")
    with pytest.raises(
        StateStorageError, match=rf"version {newer}.*version {SCHEMA_VERSION}"
    ) as caught:
        async with PostgresStore(database, runner_id="a", schema=schema):
            pytest.fail(f"opened a schema of version {newer}")
    assert schema in caught.value.detail


# The call of write_batch as a runner of version 6 makes it (no stopped_for).
VERSION_6_CALL = SAVE_BATCH.replace(" %s::double precision,", "")


async def test_a_version_6_schema_is_migrated_and_its_runners_keep_saving(
    database: str, schema: str
) -> None:
    """Version 7 adds the stops' times and the takeovers' columns: a Stopped record of
    version 6 has no time and counts as stopped long ago; write_batch of version 6 stays,
    as a wrapper that keeps no record past the number per key."""
    old = stopped(record("k", 1))
    with connect(database) as connection:
        connection.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        connection.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        connection.execute("CREATE TABLE schema_version (version integer NOT NULL)")
        connection.execute("INSERT INTO schema_version VALUES (6)")
        for version in range(1, 7):
            for statement in MIGRATIONS[version]:
                connection.execute(statement)
        connection.execute(
            "INSERT INTO records (token, identity, instance, generation, request_id, "
            "runner_id, epoch, saved, stopped, lease, body, phase) VALUES (%s, 'p', 'k', 1, "
            "'r1', 'old', 1, 1, 1, 5, %s, 'Stopped')",
            (old.handle.token, encode(old)),
        )
        connection.execute("INSERT INTO high_water VALUES ('p', 'k', 1)")
        connection.execute("UPDATE stop_counts SET stopped = 1")
        connection.execute("SELECT setval('save_order', 1), setval('stop_order', 1)")
    retention = Retention(stopped_per_key=1, stopped_for=3600.0)
    async with two_runners(database, schema, retention=retention) as (a, b):
        assert await a.held(old.handle.token) is not None
        await a.save(stopped(record("k", 2)))
        # Generation 1 stopped before version 7: long ago, so it goes.
        assert [held.record.handle.generation for held in await a.fleet_records()] == [2]
        # A runner of version 6 still saves, and keeps nothing past the count per key.
        rows = [[(each, encode(each))] for each in (stopped(record("k", 3)),)]
        assert (
            run(
                in_schema(database, schema),
                VERSION_6_CALL,
                "b",
                b.epoch,
                1,
                1000,
                *columns(rows),
                None,
            )
            == []
        )
        assert [held.record.handle.generation for held in await a.fleet_records()] == [3]
    assert run(in_schema(database, schema), "SELECT version FROM schema_version") == [
        (SCHEMA_VERSION,)
    ]


async def test_a_young_stopped_record_outlives_the_count_per_key_by_the_database_s_clock(
    database: str, schema: str
) -> None:
    retention = Retention(stopped_per_key=1, stopped_total=4, stopped_for=3600.0)
    async with two_runners(database, schema, retention=retention) as (a, b):
        for generation in (1, 2, 3):
            await (a if generation % 2 else b).save(stopped(record("k", generation)))

        def kept() -> list[int]:
            rows = run(
                in_schema(database, schema),
                "SELECT generation FROM records WHERE stopped_at IS NOT NULL ORDER BY stopped",
            )
            return [generation for (generation,) in rows]

        assert kept() == [1, 2, 3]  # younger than an hour, all of them
        # Generation 1 stopped two hours ago, as far as the database can tell.
        run(
            in_schema(database, schema),
            "UPDATE records SET stopped_at = stopped_at - interval '2 hours' WHERE generation = 1",
        )
        await b.save(record("k", 4))
        assert kept() == [1, 2, 3]  # only a new stop evicts
        await b.save(stopped(record("k", 4)))
        assert kept() == [2, 3, 4]
        # The cap in all evicts the oldest, however young.
        await a.save_many([stopped(record("x", 1)), stopped(record("y", 1))])
        assert kept() == [3, 4, 1, 1]  # k3, k4, x1, y1
        ((counted, there),) = run(
            in_schema(database, schema),
            "SELECT (SELECT sum(stopped) FROM stop_counts), "
            "(SELECT count(*) FROM records WHERE stopped IS NOT NULL)",
        )
        assert counted == there == 4


# -- the store's promises --------------------------------------------------------------


async def test_concurrent_saves_share_transactions(database: str, schema: str) -> None:
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        for generation in range(1, 4):
            await store.save(record("a", generation))
        assert store.commits == 3, "a save alone is a transaction of its own"
        async with trio.open_nursery() as nursery:
            for number in range(1, 101):
                nursery.start_soon(store.save, record(f"k{number}", 1))
        assert len(await store.list()) == 103
        assert store.commits - 3 <= 20, "group commit batches the queue"


async def test_a_commit_window_gathers_the_saves_of_a_busy_runner(
    database: str, schema: str
) -> None:
    """commit_window: a save waits up to that long for others to share its commit. Saves
    started together land in one commit, where without the window the first commits
    alone; each is durable once its call returns, as ever."""
    async with PostgresStore(database, runner_id="a", schema=schema, commit_window=1.0) as store:
        async with trio.open_nursery() as nursery:
            for number in range(5):
                nursery.start_soon(store.save, record(f"w{number}", 1))
        assert store.commits == 1
        assert len(await store.list()) == 5


@pytest.mark.parametrize("window", [-0.1, 1.5, math.inf, True, "0.1"])
def test_a_commit_window_out_of_range_is_refused_by_name(window: Any) -> None:
    with pytest.raises(ValueError, match=r"commit_window must be a number of seconds from 0 to 1"):
        PostgresStore("postgresql://nowhere/x", runner_id="a", commit_window=window)


async def test_a_save_cancelled_in_the_queue_writes_nothing(database: str, schema: str) -> None:
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        outcomes = []
        for generation in range(1, 31):
            saved = record("a", generation)
            with trio.move_on_after(0) as scope:
                await store.save(saved)
            present = saved.handle.token in {kept.handle.token for kept in await store.list()}
            assert present != scope.cancelled_caught, "cancelled means not written"
            outcomes.append(scope.cancelled_caught)
        assert any(outcomes)


async def test_retention_is_fleet_wide_and_keeps_the_high_water(database: str, schema: str) -> None:
    retention = Retention(stopped_per_key=2, stopped_total=3)
    async with (
        PostgresStore(database, runner_id="a", schema=schema, retention=retention) as a,
        PostgresStore(database, runner_id="b", schema=schema, retention=retention) as b,
    ):
        for generation in range(1, 5):
            await (a if generation % 2 else b).save(stopped(record("a", generation)))
        await a.save(record("b", 1))
        await b.save(stopped(record("c", 1)))
        await b.save(stopped(record("c", 2)))
        kept = [
            (kept.record.handle.key.instance, kept.record.handle.generation, kept.runner_id)
            for kept in await a.fleet_records()
        ]
        # a: 3 and 4 are its newest two, but the cap of 3 Stopped evicts a3 as the oldest.
        assert kept == [("a", 4, "b"), ("b", 1, "a"), ("c", 1, "b"), ("c", 2, "b")]
        assert (await a.high_water())[key("a")] == 4
        assert [r.handle.key.instance for r in await a.list()] == ["b"]


operations = st.lists(
    st.tuples(st.sampled_from("abc"), st.integers(min_value=1, max_value=6), st.booleans()),
    max_size=12,
)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batches=st.lists(operations, min_size=1, max_size=3),
    per_key=st.integers(1, 3),
    total=st.integers(1, 4),
    kept_for=st.sampled_from([0.0, 3600.0]),
)
def test_fleet_wide_retention_matches_the_memory_store(
    database: str,
    batches: list[list[tuple[str, int, bool]]],
    per_key: int,
    total: int,
    kept_for: float,
) -> None:
    # Batches alternate between two runners: retention and the marks are the fleet's.
    # With stopped_for an hour, every Stopped record is young throughout (the memory
    # store's clock stands still): only the cap in all evicts.
    retention = Retention(stopped_per_key=per_key, stopped_total=total, stopped_for=kept_for)
    schema = fresh_schema()

    def step(instance: str, generation: int, stop: bool) -> SessionRecord:
        opened = record(instance, generation)
        return stopped(opened) if stop else StoppingRecord.of(opened, Disposed())

    async def apply() -> tuple[list[SessionRecord], list[SessionRecord]]:
        memory = MemoryStore(retention=retention, clock=lambda: 0.0)
        async with (
            PostgresStore(database, runner_id="a", schema=schema, retention=retention) as a,
            PostgresStore(database, runner_id="b", schema=schema, retention=retention) as b,
        ):
            for number, batch in enumerate(batches):
                records = [step(*operation) for operation in batch]
                await memory.save_many(records)
                await (a if number % 2 else b).save_many(records)
            fleet = [kept.record for kept in await a.fleet_records()]
            assert await b.high_water() == await memory.high_water()
            # The runners' counters of Stopped records, which the cap reads, add up.
            ((counted, there),) = run(
                in_schema(database, schema),
                "SELECT (SELECT sum(stopped) FROM stop_counts), "
                "(SELECT count(*) FROM records WHERE stopped IS NOT NULL)",
            )
            assert counted == there
            return fleet, list(await memory.list())

    fleet, in_memory = trio.run(apply)
    assert fleet == in_memory


async def test_a_corrupt_row_is_a_record_format_error_naming_it(database: str, schema: str) -> None:
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        await store.save(record("a", 1))
        await store.save(record("b", 1))
        run(in_schema(database, schema), "UPDATE records SET body = '{no' WHERE instance = 'a'")
        with pytest.raises(RecordFormatError, match="is unreadable") as caught:
            await store.list()
        assert "p/a" in caught.value.detail
        assert "127.0.0.1" in caught.value.detail
        body = codec.encode(record("b", 1))
        run(in_schema(database, schema), "UPDATE records SET body = %s WHERE instance = 'a'", body)
        with pytest.raises(RecordFormatError, match="holds the record of another session"):
            await store.fleet_records()


async def test_an_error_never_shows_the_dsn_s_password(database: str, schema: str) -> None:
    params = conninfo_to_dict(database)
    unreachable = make_conninfo(database, password="hunter2-secret", port=1)
    with pytest.raises(StateStorageError) as caught:
        async with PostgresStore(unreachable, runner_id="a", schema=schema, connect_timeout=2):
            pytest.fail("reached port 1")
    assert "hunter2-secret" not in str(caught.value)
    assert "hunter2-secret" not in repr(caught.value.__cause__)
    assert f"{params.get('host')}:1/" in caught.value.detail
    # A password the server does not need (trust) still never shows, in a later error.
    with_password = make_conninfo(database, password="hunter2-secret")
    async with PostgresStore(with_password, runner_id="a", schema=schema) as store:
        assert "hunter2-secret" not in store.dsn
        await store.save(record("a", 1))
        run(in_schema(database, schema), "UPDATE records SET body = '{' WHERE instance = 'a'")
        with pytest.raises(RecordFormatError) as failed:
            await store.list()
        assert "hunter2-secret" not in str(failed.value)


async def test_connections_have_keepalives_timeouts_and_a_user_timeout(
    database: str, schema: str
) -> None:
    async with PostgresStore(database, runner_id="a", schema=schema, statement_timeout=7) as store:
        assert store._worker is not None
        connection = store._worker._connection
        assert connection is not None
        parameters = connection.info.get_parameters()
        assert parameters["keepalives"] == "1"
        assert parameters["tcp_user_timeout"] == "7000"
        probe = socket.socket(fileno=socket.dup(connection.pgconn.socket))
        try:
            if probe.family in (socket.AF_INET, socket.AF_INET6):
                assert probe.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
                assert probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 2
                assert probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
                assert probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 7000
        finally:
            probe.detach()
        assert connection.execute("SHOW statement_timeout").fetchone() == ("7s",)
        assert connection.execute("SHOW lock_timeout").fetchone() == ("7s",)
        assert connection.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("7s",)
        connection.rollback()


async def test_b1_a_broken_connection_is_opened_again_at_once_and_still_fenced(
    database: str, schema: str
) -> None:
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        await store.save(record("a", 1))
        run(
            database,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'trio_supervisor a' AND datname = current_database()",
        )
        # The save meets the dropped connection, connects again and lands: a blip is
        # no failure.
        await store.save(record("a", 2))
        run(in_schema(database, schema), "UPDATE runners SET epoch = epoch + 1")
        run(
            database,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'trio_supervisor a' AND datname = current_database()",
        )
        # A new connection does not get past the fence (F4): refused, not unavailable.
        with pytest.raises(StateStorageError, match="taken over") as refused:
            await store.save(record("a", 3))
        assert not isinstance(refused.value, StoreUnavailableError)
        assert [r.handle.generation for r in await store.list()] == [1, 2]


async def saved_once_back(store: PostgresStore, saved: SessionRecord) -> None:
    """Save, again until it works: the proxy applies restore() on its own thread, so
    the first connection may still meet the cut."""

    async def save() -> bool:
        try:
            await store.save(saved)
        except StateStorageError:
            return False
        return True

    await until(save, "a save once the network is back", bound=15)


async def test_a_network_that_stops_delivering_fails_a_call_in_seconds(
    database: str, schema: str
) -> None:
    with TcpProxy.to(database) as proxy:
        through = proxy.through(database)
        async with PostgresStore(
            through,
            runner_id="a",
            schema=schema,
            statement_timeout=1,
            connect_timeout=2,
            store_wait=1,
            runner_lease=3,
        ) as store:
            await store.save(record("n1", 1))
            # Held bytes: no reset, no keepalive failure (the proxy acknowledges them).
            # The save was sent: whether it landed stays unknown, since no look gets an
            # answer either within the runner's lease (B1).
            proxy.pause()
            with trio.fail_after(20), pytest.raises(StateStorageError, match="cannot tell"):
                await store.save(record("n2", 1))
            proxy.restore()
            await saved_once_back(store, record("n3", 1))  # connected again
            # A cut network: connections reset, new ones refused.
            proxy.cut()
            with trio.fail_after(15), pytest.raises(StateStorageError, match="cannot save"):
                await store.save(record("n4", 1))
            proxy.restore()
            await saved_once_back(store, record("n5", 1))
            assert [r.handle.key.instance for r in await store.list()] == ["n1", "n3", "n5"]


async def test_a_read_whose_caller_left_is_not_tried_again_while_the_store_is_away(
    database: str, schema: str
) -> None:
    """B1: a read is tried again while the store is out of reach for its caller's sake
    only: once that caller stopped waiting, the thread moves on (here, to the close)
    instead of trying it for the rest of ``store_wait``."""
    with TcpProxy.to(database) as proxy:
        through = proxy.through(database)
        async with PostgresStore(through, runner_id="a", schema=schema, store_wait=30) as store:
            proxy.cut()
            with trio.move_on_after(0.5) as left:
                await store.list()
            assert left.cancelled_caught
            # The close is shielded: it waits for the thread, however long.
            began = time.monotonic()
            await store.aclose()
            assert time.monotonic() - began < 10


async def test_a_save_whose_commit_answer_was_lost_is_looked_for_and_reported_landed(
    database: str, schema: str
) -> None:
    """The save reaches the server and commits; its answer is held, then the connection
    is reset. The store looks on a new connection, finds its rows, and the save returns
    normally: what landed is never reported as failed (which would poison a runner and
    leave an Open record without its session)."""
    with TcpProxy.to(database) as proxy:
        through = proxy.through(database)
        async with PostgresStore(through, runner_id="a", schema=schema) as store:
            await store.save(record("l1", 1))
            # Held from the batch on (one statement, committed as it runs): its answer
            # never comes back.
            proxy.hold_answers(after=b"write_batch")
            opened = record("l2", 1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.save, opened)  # raises if reported failed

                def committed() -> bool:
                    rows = run(
                        in_schema(database, schema),
                        "SELECT 1 FROM records WHERE token = %s",
                        opened.handle.token,
                    )
                    return bool(rows)

                await until(committed, "the save committed, its answer held")
                proxy.cut()
                proxy.restore()
            assert [r.handle.key.instance for r in await store.list()] == ["l1", "l2"]
            # A save that never reached the server is still reported as failed.
            proxy.cut()
            with trio.fail_after(15), pytest.raises(StateStorageError, match="cannot save"):
                await store.save(record("l3", 1))
            proxy.restore()


# -- global fencing of generations ----------------------------------------------------


async def test_racing_opens_of_one_key_have_one_winner_per_generation(
    database: str, schema: str
) -> None:
    async with two_runners(database, schema) as (a, b):

        async def race(
            store: PostgresStore, generation: int, outcomes: dict[str, BaseException | None]
        ) -> None:
            try:
                await store.save(record("k", generation, token=f"{store.member}{generation}"))
            except StaleSessionError as error:
                outcomes[store.member] = error
            else:
                outcomes[store.member] = None

        for generation in range(1, 11):
            outcomes: dict[str, BaseException | None] = {}

            async with trio.open_nursery() as nursery:
                nursery.start_soon(race, a, generation, outcomes)
                nursery.start_soon(race, b, generation, outcomes)
            winners = [runner for runner, error in outcomes.items() if error is None]
            assert len(winners) == 1, outcomes
            (loser,) = set(outcomes) - set(winners)
            assert f"generation {generation} of p/k" in str(outcomes[loser])
            assert f"high-water in the fleet is {generation}" in str(outcomes[loser])
        tokens = [(f.runner_id, f.record.handle.token) for f in await a.fleet_records()]
        assert len(tokens) == 10
        assert all(token.startswith(runner) for runner, token in tokens)
        assert (await b.high_water())[key("k")] == 10


async def test_a_lost_open_writes_nothing_and_the_rest_of_its_batch_lands(
    database: str, schema: str
) -> None:
    async with two_runners(database, schema) as (a, b):
        await a.save(record("k", 1))
        await b.save(record("first", 1))
        commits = b.commits
        # b's worker waits for its row, locked here: the saves queued meanwhile make one
        # batch when it is let go.
        with connect(in_schema(database, schema)) as blocker:
            blocker.execute("BEGIN")
            blocker.execute("SELECT 1 FROM runners WHERE runner_id = 'b' FOR UPDATE")
            outcomes: dict[str, BaseException | None] = {}

            async def save(name: str, *records: SessionRecord) -> None:
                try:
                    await b.save_many(records)
                except StaleSessionError as error:
                    outcomes[name] = error
                else:
                    outcomes[name] = None

            async with trio.open_nursery() as nursery:
                nursery.start_soon(save, "blocked", record("first", 2))
                await trio.sleep(0.3)  # taken by the worker, which waits for the lock
                nursery.start_soon(
                    save, "loser", record("other", 1), record("k", 1, token="b" * 32)
                )
                nursery.start_soon(save, "bystander", record("third", 1))
                await trio.sleep(0.3)
                blocker.execute("COMMIT")
        assert outcomes["blocked"] is None
        assert outcomes["bystander"] is None
        assert isinstance(outcomes["loser"], StaleSessionError)
        assert "high-water in the fleet is 1" in str(outcomes["loser"])
        assert b.commits - commits == 2, "the loser and the bystander were one batch"
        instances = [r.handle.key.instance for r in await b.list()]
        assert instances == ["first", "first", "third"], "nothing of the lost save landed"
        assert key("other") not in await b.high_water()


# -- incarnations, fencing, takeover ---------------------------------------------------


async def test_f1_a_restart_is_a_new_epoch_that_lists_the_old_records(
    database: str, schema: str
) -> None:
    """F1: a restart under the same id is a new epoch, and lists its earlier records."""
    async with PostgresStore(database, runner_id="a", schema=schema) as first:
        await first.save(record("a", 1))
        old = first.epoch
    async with PostgresStore(database, runner_id="a", schema=schema) as second:
        assert second.epoch == old + 1
        assert [r.handle.token for r in await second.list()] == [record("a", 1).handle.token]
        await second.save(stopped(record("a", 1)))
        (kept,) = await second.fleet_records()
        assert kept.epoch == second.epoch


async def test_a_restart_while_the_old_row_lives_warns(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        PostgresStore(database, runner_id="a", schema=schema),
        PostgresStore(database, runner_id="a", schema=schema) as twin,
    ):
        assert twin.epoch == 2
    assert "another process may be running under this id" in caplog.text


async def test_runners_advertising_one_url_are_warned_of_and_the_fleet_is_logged(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="trio_supervisor.stores.postgres")
    async with PostgresStore(database, runner_id="a", schema=schema, advertise="http://h:1"):
        assert "runner a registered as epoch 1; no other runner alive" in caplog.text
        async with PostgresStore(database, runner_id="b", schema=schema, advertise="http://h:1"):
            pass
    assert "runner b advertises http://h:1, as a already does" in caplog.text
    assert "give each runner its own --advertise URL" in caplog.text
    async with (
        PostgresStore(database, runner_id="c", schema=schema, advertise="http://h:2"),
        PostgresStore(database, runner_id="d", schema=schema, advertise="http://h:3"),
    ):
        pass
    assert "runner d registered as epoch 1; 1 other runner alive (c)" in caplog.text


def expire(database: str, schema: str, runner: str, seconds: float) -> None:
    run(
        in_schema(database, schema),
        "UPDATE runners SET lease_until = clock_timestamp() - make_interval(secs => %s) "
        "WHERE runner_id = %s",
        seconds,
        runner,
    )


async def test_takeover_waits_for_the_margin_then_stops_the_records_as_runner_lost(
    database: str, schema: str
) -> None:
    async with two_runners(database, schema) as (a, b):
        await a.save(record("x", 1))  # lease 5 s
        await a.save(stopped(record("y", 1)))
        assert await a._ask("renew", 2.0)  # its stop_bound: 2 s
        expire(database, schema, "a", 6.0)  # past the lease, not past lease + stop_bound
        assert await b.take_over_dead() == 0
        assert (await b.owner(record("x", 1).handle.token)) is not None
        expire(database, schema, "a", 7.5)
        assert await b.take_over_dead() == 1
        assert await b.take_over_dead() == 0, "taken over once"
        records = {f.record.handle.key.instance: f for f in await b.fleet_records()}
        taken = records["x"]
        assert taken.runner_id == "a"
        assert isinstance(taken.record, StoppedRecord)
        assert taken.record.reason.kind == "Recovery"
        assert taken.record.termination.describe() == "exited (runner lost; exit status unknown)"
        (info,) = [r for r in await b.runners() if r.runner_id == "a"]
        assert info.epoch == a.epoch + 1
        assert not info.alive
        assert info.sessions == 0
        # The epoch moved on to fence it, not because it started again: the row says so.
        assert info.taken_over_by == "b"
        assert info.taken_over_at is not None
        assert info.started_at < info.taken_over_at <= time.time() + 5
        (seen_by_b,) = [r for r in await b.runners() if r.runner_id == "b"]
        assert (seen_by_b.taken_over_at, seen_by_b.taken_over_by) == (None, None)
        # Every write of a's old incarnation is refused now, and nothing of it lands.
        with pytest.raises(StateStorageError, match="taken over"):
            await a.save(record("z", 1))
        with pytest.raises(StateStorageError, match="taken over"):
            await a.save_many([record("z", 1), stopped(record("x", 1))])
        after = {f.record.handle.key.instance: f.record for f in await b.fleet_records()}
        assert "z" not in after
        assert after["x"] == taken.record
        assert key("z") not in await b.high_water()
    # A new incarnation of a registers: it is no longer a runner taken over.
    async with PostgresStore(database, runner_id="a", schema=schema) as again:
        (info,) = [r for r in await again.runners() if r.runner_id == "a"]
        assert (info.epoch, info.taken_over_at, info.taken_over_by) == (again.epoch, None, None)


async def test_a_runner_frozen_past_its_takeover_writes_nothing_once_it_resumes(
    database: str, schema: str
) -> None:
    with TcpProxy.to(database) as proxy:
        through = proxy.through(database)
        async with (
            PostgresStore(through, runner_id="a", schema=schema, statement_timeout=5) as a,
            PostgresStore(database, runner_id="b", schema=schema) as b,
        ):
            await a.save(record("x", 1))
            proxy.pause()  # a is frozen, to the database
            outcome: list[BaseException | None] = []

            async def write() -> None:
                try:
                    await a.save_many([stopped(record("x", 1)), record("y", 1)])
                except StateStorageError as error:
                    outcome.append(error)
                else:
                    outcome.append(None)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(write)
                expire(database, schema, "a", 60.0)
                assert await b.take_over_dead() == 1
                proxy.resume()  # a's write, held all along, reaches the database now
            (error,) = outcome
            assert error is not None
            assert "taken over" in str(error)
            kept = {f.record.handle.key.instance: f.record for f in await b.fleet_records()}
            assert list(kept) == ["x"]
            assert isinstance(kept["x"], StoppedRecord)
            assert kept["x"].reason.kind == "Recovery"
            assert key("y") not in await b.high_water()


async def test_takeover_rechecks_the_epoch_it_saw(database: str, schema: str) -> None:
    async with two_runners(database, schema) as (a, b):
        await a.save(record("x", 1))
        expire(database, schema, "a", 60.0)
        # a restarted (or was taken over) after b saw its epoch: b's takeover is void.
        assert await b._submit(Job("takeover", args=("a", a.epoch - 1))) == []
        assert await b.take_over_dead() == 1


# -- membership ------------------------------------------------------------------------


async def test_run_member_hears_a_supersede_by_notification(database: str, schema: str) -> None:
    async with two_runners(database, schema) as (a, b):
        a._check_period = 3600.0  # only the notification can tell it in time
        await a.save(record("k", 1))
        member = Member({key("k"): 1})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_member, member)
            await until(
                lambda: a._listening is not None and a._listening.is_set(), "LISTEN", bound=10
            )
            await b.save(record("k", 2))
            await until(lambda: member.calls, "superseded() called", bound=5)
            assert member.calls == [(key("k"), 2)]
            nursery.cancel_scope.cancel()


async def test_run_member_finds_a_supersede_it_was_not_told_of(database: str, schema: str) -> None:
    async with two_runners(database, schema, runner_lease=3) as (a, b):
        await a.save(record("k", 1))
        # b supersedes it while a listens to nothing: the notification is lost, the
        # row in a's inbox is not.
        await b.save(record("k", 2))
        assert run(in_schema(database, schema), "SELECT runner_id, generation FROM inbox") == [
            ("a", 2)
        ]
        member = Member({key("k"): 1})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_member, member)
            await until(lambda: member.calls, "superseded() called", bound=5)
            assert member.calls[0] == (key("k"), 2)
            nursery.cancel_scope.cancel()
        # Read once, and cleared.
        assert run(in_schema(database, schema), "SELECT * FROM inbox") == []


async def test_run_member_checks_at_least_every_third_of_the_shortest_lease(
    database: str, schema: str
) -> None:
    """F5: a lost notification costs at most one renew period, however rare the store's
    own check period: the check follows the member's shortest lease."""
    async with PostgresStore(database, runner_id="a", schema=schema) as a:
        a._check_period = 3600.0  # only the sessions' leases bring the check round
        await a.save(record("k", 1))
        member = Member({key("k"): 1})
        member.lease = 0.3  # renewed every 0.1 s by its host
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_member, member)
            await until(lambda: member.checks, "the first check", bound=5)
            # The row another runner's Open of generation 2 writes, without its
            # notification: as if that had been lost.
            run(in_schema(database, schema), "INSERT INTO inbox VALUES ('a', 'p', 'k', 2)")
            await until(lambda: member.calls, "superseded() called", bound=5)
            assert member.calls[0] == (key("k"), 2)
            nursery.cancel_scope.cancel()


async def test_run_member_fails_once_its_row_is_taken(database: str, schema: str) -> None:
    async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.5) as a:

        async def take() -> None:
            await trio.sleep(0.5)
            run(in_schema(database, schema), "UPDATE runners SET epoch = epoch + 1")

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(take)
                with pytest.raises(StateStorageError, match="lost its row"):
                    await a.run_member(Member())


async def test_run_member_fails_when_a_renewal_is_not_answered_in_time(
    database: str, schema: str
) -> None:
    async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.5) as a:
        with connect(in_schema(database, schema)) as blocker:
            blocker.execute("BEGIN")
            blocker.execute("SELECT 1 FROM runners WHERE runner_id = 'a' FOR UPDATE")
            with trio.fail_after(10), pytest.raises(StateStorageError, match="could not renew"):
                await a.run_member(Member())
            blocker.execute("ROLLBACK")


async def test_run_member_keeps_the_row_alive_and_writes_its_stop_bound(
    database: str, schema: str
) -> None:
    async with (
        PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.0) as a,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(a.run_member, Member(stop_bound=3.25))
        await trio.sleep(2.0)  # two leases
        (info,) = await a.runners()
        assert info.alive
        assert run(in_schema(database, schema), "SELECT stop_bound FROM runners") == [(3.25,)]
        nursery.cancel_scope.cancel()


async def test_run_member_publishes_its_sessions_times_when_a_listing_asks(
    database: str, schema: str
) -> None:
    """A renewal of a session's lease writes nothing (R6), and neither does the renewal
    of its runner's row: a listing of the fleet's records asks every runner for its
    sessions' times, and reads each as published then, by the database's clock, for the
    sessions that are not Stopped."""
    live, unpublished, ended = record("live", 1), record("new", 1), record("ended", 1)
    async with (
        # A runner lease that renews nothing within the test: only the asks publish.
        two_runners(database, schema, runner_lease=60.0) as (a, b),
        trio.open_nursery() as nursery,
    ):
        for saved in (live, unpublished, ended, stopped(ended)):
            await a.save(saved)
        member = Member(times={live.handle.token: (2.0, 8.0), ended.handle.token: (1.0, 4.0)})
        nursery.start_soon(a.run_member, member)

        async def read() -> dict[str, FleetRecord] | None:
            found = {f.record.handle.key.instance: f for f in await b.fleet_records()}
            return found if found["live"].age is not None else None

        found = await until(read, "a's sessions' times published", bound=5)
        # Read a moment after a published them: a little older, a little less left.
        assert 2.0 <= (found["live"].age or 0) < 2.5, found["live"]
        assert 7.5 < (found["live"].lease_left or 0) <= 8.0, found["live"]
        assert (found["new"].age, found["new"].lease_left) == (None, None)  # not yet told
        assert (found["ended"].age, found["ended"].lease_left) == (None, None)  # Stopped
        # Neither is part of the record: a record compares as it did.
        assert found["live"] == FleetRecord(record=live, runner_id="a", epoch=a.epoch)
        # The host renewed the session, and another session began: the next listing
        # asks again, and a answers with what is true now.
        member.ages_and_leases[live.handle.token] = (30.0, 14.0)
        member.ages_and_leases[unpublished.handle.token] = (0.5, 15.0)
        again = {f.record.handle.key.instance: f for f in await b.fleet_records()}
        assert 30.0 <= (again["live"].age or 0) < 31.0, again["live"]
        assert 13.0 < (again["live"].lease_left or 0) <= 14.0, again["live"]
        assert 0.5 <= (again["new"].age or 0) < 1.5, again["new"]
        # One row of times per runner, written as it began to listen and when asked.
        assert run(in_schema(database, schema), "SELECT count(*) FROM runner_times") == [(1,)]
        nursery.cancel_scope.cancel()


async def test_a_listing_does_not_wait_for_runners_that_do_not_listen(
    database: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner that is no member (it never listened) is not waited for: it answers no
    request for times, and says so by having published none."""
    # The wait for runners that do answer, made long enough that a listing that waited
    # is told from one that did not by a bound no busy machine comes near (the listing
    # is three round trips: milliseconds).
    monkeypatch.setattr(defaults, "TIMES_WAIT", 60.0)
    async with two_runners(database, schema) as (a, b):
        await a.save(record("k", 1))
        with trio.fail_after(30):  # half the wait for runners that do answer
            (found,) = await b.fleet_records()
        assert (found.age, found.lease_left) == (None, None)


async def test_run_member_takes_over_dead_runners(database: str, schema: str) -> None:
    async with (
        PostgresStore(database, runner_id="a", schema=schema) as a,
        PostgresStore(database, runner_id="b", schema=schema, runner_lease=1.5) as b,
    ):
        await a.save(record("x", 1))
        expire(database, schema, "a", 60.0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.run_member, Member())

            async def taken() -> bool:
                (info,) = [r for r in await b.runners() if r.runner_id == "a"]
                return info.sessions == 0

            await until(taken, "a taken over", bound=5)
            nursery.cancel_scope.cancel()


# -- an open waits for older generations on other runners ------------------------------


async def test_an_open_waits_until_the_older_generation_stopped(database: str, schema: str) -> None:
    async with two_runners(database, schema) as (a, b):
        first = record("k", 1)
        await a.save(first)
        second = record("k", 2)
        await b.save(second)
        done = trio.Event()

        async def wait() -> None:
            await b.wait_older_stopped(second.handle)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.sleep(0.5)
            assert not done.is_set()
            await a.save(stopped(first, Superseded()))
            with trio.fail_after(5):
                await done.wait()


async def test_an_open_takes_a_dead_holder_over_and_fails_on_a_live_one_that_never_stops(
    database: str, schema: str
) -> None:
    async with two_runners(database, schema) as (a, b):
        await a.save(record("dead", 1))
        await a.save(record("live", 1))
        await b.save(record("live", 2))
        with trio.fail_after(10), pytest.raises(TerminationUnconfirmedError, match="runner a"):
            await b.wait_older_stopped(record("live", 2).handle)
        await b.save(record("dead", 2))
        expire(database, schema, "a", 60.0)
        with trio.fail_after(10):
            await b.wait_older_stopped(record("dead", 2).handle)
        owner = await b.owner(record("dead", 1).handle.token)
        assert owner is not None
        assert owner.runner_id == "a"


async def test_lookup_finds_the_mark_and_a_request_of_any_runner(
    database: str, schema: str
) -> None:
    async with two_runners(database, schema) as (a, b):
        assert await b.lookup(key("k"), "r1") == (0, None)
        await a.save(record("k", 1))
        assert await b.lookup(key("k"), "r1") == (1, record("k", 1))
        assert await b.lookup(key("k"), None) == (1, None)
        assert await b.lookup(key("k"), "r9") == (1, None)


async def test_every_failure_names_the_database(database: str) -> None:
    store = PostgresStore(database, runner_id="a", schema=fresh_schema())
    await store.aclose()
    with pytest.raises(StateStorageError, match="is closed"):
        await store.save(record("a", 1))


def test_member_protocol_fits_the_test_member() -> None:
    member: FleetMember = Member()
    assert member.live() == {}


# -- supervisors on it -----------------------------------------------------------------


async def test_two_supervisors_on_one_database_act_as_one(database: str, schema: str) -> None:
    async with (
        PostgresStore(database, runner_id="a", schema=schema, runner_lease=3) as on_a,
        PostgresStore(database, runner_id="b", schema=schema, runner_lease=3) as on_b,
        supervise_embedded(on_a, FakeExecution()) as a,
        supervise_embedded(on_b, FakeExecution()) as b,
    ):
        first = await a.open(KEY, "r1")
        await a.load(first.handle, Load(specifier="x"))
        # b's open claims generation 2, tells a, and returns once a stopped generation 1.
        with trio.fail_after(15):
            second = await b.open(KEY, "r2", expected_generation=1)
        assert second.handle.generation == 2
        # Durable before b's open returned; a's own view takes a step more to catch up.
        stopped_on_a = await until_stopped(a, first.handle, bound=5)
        assert stopped_on_a.reason.kind == "Superseded"
        # Either runner knows the key's high-water, and a's view of it is not stale.
        assert await a.high_water(KEY) == 2
        with pytest.raises(StaleSessionError):
            await a.open(KEY, "r3", expected_generation=1)
        third = await a.open(KEY, "r3", expected_generation=2)
        assert third.handle.generation == 3
        with trio.fail_after(15):
            await until_stopped(b, second.handle)
        holders = {f.record.handle.generation: f.runner_id for f in await on_a.fleet_records()}
        assert holders == {2: "b", 3: "a"}  # 1 went by retention (one Stopped per key)


async def test_a_stop_notifies_only_when_a_newer_generation_is_held_by_another_runner(
    database: str, schema: str
) -> None:
    """NOTIFY takes a global lock at commit: a superseded stop notifies only when an
    opener on another runner may be waiting for it (F6), never within one runner."""
    with connect(database) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(schema)))
        async with (
            PostgresStore(database, runner_id="a", schema=schema) as a,
            PostgresStore(database, runner_id="b", schema=schema) as b,
        ):
            first, second, third = record("n", 1), record("n", 2), record("n", 3)
            await a.save(first)
            await a.save(second)  # a supersedes its own generation: nobody else waits
            await a.save(stopped(first, Superseded()))
            await b.save(third)  # b supersedes a's generation 2, and waits for its stop
            await a.save(stopped(second, Superseded()))
        heard = [json.loads(note.payload) for note in listener.notifies(timeout=1, stop_after=10)]
    assert [(note["kind"], note["generation"]) for note in heard] == [
        ("superseded", 3),  # b's open told a
        ("stopped", 2),  # a's stop told b
    ], heard


async def test_a_runner_of_version_5_keeps_saving_through_save_batch(
    database: str, schema: str
) -> None:
    """Version 6 keeps save_batch as a wrapper of write_batch: a runner of the version
    before, still running, saves as it did (its refusals in their old shape), and its
    Opens fill the inbox of the runners whose sessions they supersede."""
    async with two_runners(database, schema) as (a, b):
        await a.save(record("k", 1))
        old_call = VERSION_6_CALL.replace("write_batch", "save_batch")

        def saved_by_b(*opens: OpenRecord) -> list[tuple[Any, ...]]:
            rows = [[(opened, encode(opened))] for opened in opens]
            return run(
                in_schema(database, schema), old_call, "b", b.epoch, 8, 1000, *columns(rows), None
            )

        assert saved_by_b(record("k", 2)) == []
        assert run(in_schema(database, schema), "SELECT runner_id, generation FROM inbox") == [
            ("a", 2)
        ]
        (refusal,) = saved_by_b(record("k", 2, token="again".rjust(32, "0")))
        assert refusal[:5] == (0, "p", "k", 2, 2)  # job, key, generation, the mark
        assert len(refusal) == 9
        assert [r.handle.generation for r in await b.list()] == [2]


async def test_a_batch_the_server_ends_a_deadlock_with_is_written_again(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch the server rolls back to end a deadlock wrote nothing: the worker writes
    it again at once, and its callers never see the conflict."""
    caplog.set_level(logging.INFO, logger="trio_supervisor.stores.postgres")
    async with PostgresStore(database, runner_id="a", schema=schema) as a:
        await a.save_many([record("d1", 1), record("d2", 1)])
        other = await trio.to_thread.run_sync(
            lambda: psycopg.connect(in_schema(database, schema), autocommit=False)
        )
        try:
            # The other transaction waits longest before it looks for a deadlock, so
            # the batch's session finds it first, and the batch is the one rolled back.
            await trio.to_thread.run_sync(other.execute, "SET deadlock_timeout = '30s'")
            await trio.to_thread.run_sync(
                other.execute, "SELECT 1 FROM high_water WHERE instance = 'd2' FOR UPDATE"
            )

            def waiting() -> bool:
                rows = run(
                    database,
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity s USING (pid) "
                    "WHERE NOT l.granted AND s.application_name = 'trio_supervisor a' "
                    "AND s.datname = current_database()",
                )
                return bool(rows[0][0] > 0)

            async with trio.open_nursery() as nursery:
                # An Open of each key: the batch locks d1's mark, then waits for d2's.
                nursery.start_soon(a.save_many, [record("d1", 2), record("d2", 2)])
                await until(waiting, "the batch waits for the other transaction", bound=10)

                # The other now waits for d1's: a deadlock, which the batch's session
                # finds (after its deadlock_timeout, 1 s) and ends by rolling back.
                async def lock_d1() -> None:
                    await trio.to_thread.run_sync(
                        other.execute, "SELECT 1 FROM high_water WHERE instance = 'd1' FOR UPDATE"
                    )

                nursery.start_soon(lock_d1)
                # Rolled back, it is written again, and waits for d2 once more, until
                # the other transaction ends.
                await until(
                    lambda: any("written again" in r.getMessage() for r in caplog.records),
                    "the batch rolled back to end the deadlock, and written again",
                    bound=10,
                )
                await trio.to_thread.run_sync(other.rollback)
        finally:
            await trio.to_thread.run_sync(other.close)
        marks = await a.high_water()
        assert (marks[key("d1")], marks[key("d2")]) == (2, 2)
    # Once, or twice on a busy machine: the rewritten batch may take d1's lock back
    # before the other transaction's waiter wakes, and deadlock once more (the worker
    # writes a batch up to three times).
    retried = [r.getMessage() for r in caplog.records if "written again" in r.getMessage()]
    assert 1 <= len(retried) <= 2, retried
    assert all("deadlock detected" in message for message in retried), retried


def test_the_write_path_s_sql_has_every_python_name_put_in() -> None:
    """The kinds' numbers and the fencing SQLSTATE are written once, in Python, and put
    into the SQL as the module is imported (``_named``): none is left as a name."""
    from trio_supervisor.stores import _postgres_write as write

    names = "KIND_OTHER, KIND_OPEN, KIND_STOPPED, KIND_SUPERSEDED; SQLSTATE_FENCED"
    assert write._named(names) == "0, 1, 2, 3; TS001"
    for text in (write.WRITE_BATCH, write.QUOTA_REFUSAL):
        assert "KIND_" not in text
        assert "SQLSTATE_FENCED" not in text
    assert write.FENCED in write.WRITE_BATCH


async def test_any_runner_looks_up_a_key_s_mark_and_the_record_its_request_opened(
    database: str, schema: str
) -> None:
    async with two_runners(database, schema) as (a, b):
        assert await b.lookup(key("k"), "r1") == (0, None)
        opened = record("k", 1)
        await a.save(opened)
        assert await b.lookup(key("k"), "r1") == (1, opened)  # whichever runner holds it
        assert await b.lookup(key("k"), "r2") == (1, None)
        assert await a.lookup(key("k"), None) == (1, None)
        assert await a.lookup(key("other"), "r1") == (0, None)
        assert await b.held(opened.handle.token) == FleetRecord(
            record=opened, runner_id="a", epoch=a.epoch
        )
        assert await b.held("no-such-token".rjust(32, "0")) is None


async def test_an_open_that_lost_its_generation_says_which_one_opens_next(
    database: str, schema: str
) -> None:
    async with two_runners(database, schema) as (a, b):
        await a.save(record("k", 1))
        with pytest.raises(StaleSessionError) as lost:
            await b.save(record("k", 1, token="b-k-1".rjust(32, "0")))
        assert lost.value.detail == (
            "generation 1 of p/k was not opened: the key's high-water in the fleet is 1, so "
            "the next open is generation 2 (another open claimed it first); nothing of this "
            "save was written"
        )


async def test_a_draining_runner_says_so_in_the_fleet_s_listing(database: str, schema: str) -> None:
    async with two_runners(database, schema) as (a, b):
        await a.drain()
        draining = {info.runner_id: info.draining for info in await b.runners()}
        assert draining == {"a": True, "b": False}


async def test_a_store_that_meets_another_server_writes_back_what_that_one_lost(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """B6 on one server: the store of the runner's last incarnation wrote to another
    server (its memory says so), and this one lacks some of it, as a standby promoted
    without the last commits would. The new store writes back the records and marks it
    lacks before anything else (a Stopped record that is gone was evicted: it stays
    gone), and hands out no generation until every live runner of the fleet checked its
    writes on this server."""
    caplog.set_level(logging.INFO, logger="trio_supervisor.stores.postgres")
    kept, lost, gone = record("kept", 1), record("lost", 1), stopped(record("gone", 1))
    async with PostgresStore(database, runner_id="a", schema=schema) as a:
        for saved in (kept, lost, gone):
            await a.save(saved)
    memory = a.memory
    tables = in_schema(database, schema)
    run(tables, "DELETE FROM records WHERE instance IN ('lost', 'gone')")
    run(tables, "DELETE FROM high_water WHERE instance = 'lost'")
    memory.server = "another server/00000001"
    checked = "UPDATE runners SET checked = %s WHERE runner_id IN ('b', 'c')"
    async with (
        PostgresStore(database, runner_id="b", schema=schema) as b,
        PostgresStore(database, runner_id="c", schema=schema),
    ):
        # b and c have checked their writes on the other server only.
        run(tables, checked, memory.server)
        async with PostgresStore(
            database, runner_id="a", schema=schema, memory=memory, store_wait=2.0
        ) as again:
            assert again.lost_writes == 2  # lost's record, and its mark
            assert (
                f"{again.dsn}: the store's server changed (from another server/00000001 to "
                f"{memory.server}: a failover?); this runner's records and marks are "
                "checked before anything else"
            ) in caplog.messages
            listed = {held.handle.token for held in await again.list()}
            assert listed == {kept.handle.token, lost.handle.token}
            assert (await again.high_water())[key("lost")] == 1
            with pytest.raises(StoreUnavailableError) as waiting:
                await again.lookup(key("lost"), "r1")
            assert waiting.value.detail == (
                f"{again.dsn}: the database's server changed (a failover?), and runners b, "
                "c of the fleet did not check yet for writes it lost; no generation is "
                "handed out until each did, or its row expired"
            )
            assert memory.server != "another server/00000001"

            async def check_in() -> None:
                await trio.sleep(0.2)
                run(tables, checked, memory.server)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(check_in)
                # It waits for them, within store_wait.
                assert await again.lookup(key("lost"), "r1") == (1, lost)
            # Checked by all once: a runner unchecked afterwards holds up nothing.
            run(tables, checked, "elsewhere")
            assert await again.lookup(key("lost"), "r1") == (1, lost)
            assert (await b.held(lost.handle.token)) == FleetRecord(
                record=lost, runner_id="a", epoch=again.epoch
            )

            async def meets(server: str) -> None:
                """The store's connection ends; the next one meets ``server``'s successor."""
                memory.server = server
                ended = (
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                    "datname = current_database() AND application_name = 'trio_supervisor a'"
                )
                run(database, ended)
                gone = ended.replace("pg_terminate_backend(pid)", "pid")
                await until(lambda: not run(database, gone), "a's session ended", bound=10)

            # The server changes again while the store runs: it looks as it connects
            # again, before the call that connects does anything.
            run(tables, "DELETE FROM records WHERE instance IN ('kept', 'lost')")
            await meets("a third server/00000002")
            assert len(await again.list()) == 2
            assert again.lost_writes == 4
            # And once more, with nothing lost: said so, and nothing counted.
            await meets("a fourth server/00000003")
            assert len(await again.list()) == 2
            assert again.lost_writes == 4
    shown = again.dsn
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    told = (
        "{}: the database lost writes of this runner (a failover to a standby that had not "
        "received them): {} and {} below generations it handed out; written back, so no "
        "generation is handed out twice by the fleet's live runners. Only synchronous "
        "replication keeps every acknowledged write through a failover"
    )
    assert warned == [
        told.format(shown, "1 record (p/lost#1 Open)", "1 high-water mark"),
        told.format(shown, "2 records (p/kept#1 Open, p/lost#1 Open)", "0 high-water marks"),
    ]
    assert f"{shown}: no write of this runner was lost" in caplog.messages


async def test_run_member_acts_on_the_fleet_s_notifications_and_ignores_others(
    database: str,
    schema: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A notified stop wakes an open waiting for it at once (the wait looks again only
    every OLDER_POLL otherwise: a minute here), a supersede is acted on only by the
    runner it names, and a notification no runner sent is logged and ignored."""
    monkeypatch.setattr(defaults, "OLDER_POLL", 60.0)
    caplog.set_level(logging.WARNING, logger="trio_supervisor.stores.postgres")
    tables = in_schema(database, schema)
    older, newer = record("k", 1), record("k", 2, token="b-k-2".rjust(32, "0"))
    member = Member(live={key("k"): 2})
    async with two_runners(database, schema) as (a, b), trio.open_nursery() as nursery:
        await a.save(older)
        nursery.start_soon(b.run_member, member)
        # It publishes its sessions' times as it begins to listen.
        await until(
            lambda: run(tables, "SELECT 1 FROM runner_times WHERE runner_id = 'b'"),
            "b listens",
            bound=10,
        )
        run(tables, "SELECT pg_notify(%s, 'not json')", schema)
        for runner in ("a", "b"):
            note = {"kind": "superseded", "identity": "p", "instance": "x", "generation": 3}
            run(tables, "SELECT pg_notify(%s, %s)", schema, json.dumps({**note, "runner": runner}))
        await until(lambda: member.calls, "b told of its supersede", bound=10)
        assert member.calls == [(key("x"), 3)]
        (warned,) = [r for r in caplog.records if "no runner sent" in r.getMessage()]
        assert warned.getMessage() == (
            f"{b.dsn}: a notification no runner sent: 'not json' "
            "(Expecting value: line 1 column 1 (char 0))"
        )
        await b.save(newer)
        with trio.fail_after(10):
            async with trio.open_nursery() as waits:
                waits.start_soon(b.wait_older_stopped, newer.handle)
                await a.save(stopped(older, Superseded()))
        nursery.cancel_scope.cancel()


async def test_a_commit_window_holds_a_batch_for_saves_that_come_within_it(
    database: str, schema: str
) -> None:
    """The window counts from the batch's first save: saves called 0.2 s apart share
    its commit, made once the window passed; a read ends the wait at once (a read is
    never held back), and the save it ended commits with what came before it."""
    async with PostgresStore(database, runner_id="a", schema=schema, commit_window=1.0) as store:
        commits = store.commits
        began = time.monotonic()
        async with trio.open_nursery() as nursery:
            for number in range(3):
                nursery.start_soon(store.save, record(f"w{number}", 1))
                await trio.sleep(0.2)
        assert store.commits == commits + 1
        assert time.monotonic() - began >= 1.0
        began = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.save, record("r", 1))
            await trio.sleep(0.1)
            assert len(await store.list()) == 4
        assert time.monotonic() - began < 0.9  # the window was 1 s
        assert store.commits == commits + 2
