"""What the PostgreSQL store's SQL does on a real server (``_postgres_schema``,
``_postgres_write``, ``_postgres_sql``): the schema migrated from each older version
with the rows already there, ``write_batch``'s fencing, retention at its limits, the
quotas at their exact boundaries, and a tenant's patterns taking no character of an
identity as special."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from trio_supervisor import (
    Disposed,
    ExitStatus,
    Handle,
    Key,
    Limits,
    Load,
    LoadingRecord,
    OpenRecord,
    PostgresStore,
    QuotaClaim,
    QuotaExceededError,
    Retention,
    StoppedRecord,
    StoppingRecord,
    Termination,
)
from trio_supervisor.codec import encode
from trio_supervisor.model import carried
from trio_supervisor.stores._postgres_records import columns
from trio_supervisor.stores._postgres_schema import (
    FENCED,
    MIGRATIONS,
    SCHEMA_VERSION,
    create_schema,
)
from trio_supervisor.stores._postgres_sql import SAVE_BATCH, listen, session_settings

from ..support.postgres import own_schema
from ..support.postgres import query_in as run

DONE = Termination(kind="exited", exit=ExitStatus(code=0))


def opened(
    instance: str, generation: int = 1, *, identity: str = "p", memory: int | None = None,
    cpu: int | None = None,
) -> OpenRecord:  # fmt: skip
    return OpenRecord(
        handle=Handle(
            key=Key(identity=identity, instance=instance),
            token=f"{identity}/{instance}#{generation}",
            generation=generation,
        ),
        request_id="r",
        lease=5.0,
        limits=Limits(memory_bytes=memory, cpu_percent=cpu),
    )


def loading(record: OpenRecord) -> LoadingRecord:
    return LoadingRecord(**carried(record), load=Load(specifier="x"), child=None)


def stopped(record: OpenRecord) -> StoppedRecord:
    return StoppedRecord.of(record, Disposed(), DONE)


# -- the schema, migrated --------------------------------------------------------------


def make_version(database: str, schema: str, version: int) -> None:
    """``schema`` as a runner of ``version`` left it: a runner's row, a live Loading
    record that holds 64 bytes of memory, and a Stopped record."""
    live, gone = opened("live", memory=64), stopped(opened("gone"))
    with psycopg.connect(database, autocommit=True) as connection:
        connection.execute(create_schema(schema))
        connection.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        connection.execute("CREATE TABLE schema_version (version integer NOT NULL)")
        connection.execute("INSERT INTO schema_version VALUES (%s)", (version,))
        for step in range(1, version + 1):
            for statement in MIGRATIONS[step]:
                connection.execute(statement)
        connection.execute("INSERT INTO runners VALUES ('old', 1, '', now(), now(), 0)")
        insert = (
            "INSERT INTO records (token, identity, instance, generation, request_id, "
            "runner_id, epoch, saved, stopped, lease, body) VALUES (%s, 'p', %s, 1, 'r', "
            "'old', 1, %s, %s, 5, %s)"
        )
        connection.execute(insert, (live.handle.token, "live", 1, None, encode(loading(live))))
        connection.execute(insert, (gone.handle.token, "gone", 2, 1, encode(gone)))
        if version >= 2:  # its runners wrote what the quotas count
            connection.execute(
                "UPDATE records SET phase = 'Loading', memory_bytes = 64 WHERE stopped IS NULL"
            )
            connection.execute("UPDATE records SET phase = 'Stopped' WHERE stopped IS NOT NULL")
        if version >= 6:  # and counted their Stopped records
            connection.execute("UPDATE stop_counts SET stopped = 1")
        connection.execute("INSERT INTO high_water VALUES ('p', 'live', 1), ('p', 'gone', 1)")
        connection.execute("SELECT setval('save_order', 2), setval('stop_order', 1)")


@pytest.mark.parametrize("version", range(1, SCHEMA_VERSION))
async def test_a_schema_of_each_older_version_is_migrated_with_its_rows(
    database: str, schema: str, version: int
) -> None:
    make_version(database, schema, version)
    claim = QuotaClaim(tenant="t", identities=["p"], memory_bytes=100)
    retention = Retention(stopped_per_key=1, stopped_for=3600.0)
    async with PostgresStore(database, runner_id="a", schema=schema, retention=retention) as a:
        assert run(database, schema, "SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
        assert run(
            database,
            schema,
            "SELECT instance, phase, memory_bytes, cpu_percent, stopped_at FROM records "
            "ORDER BY saved",
        ) == [("live", "Loading", 64, None, None), ("gone", "Stopped", None, None, None)]
        assert run(database, schema, "SELECT sum(stopped) FROM stop_counts") == [(1,)]
        assert run(
            database,
            schema,
            "SELECT runner_id, draining, session_times, checked, taken_over_at, "
            "taken_over_by FROM runners ORDER BY runner_id",
        ) == [("a", False, {}, a.memory.server, None, None), ("old", False, {}, "", None, None)]
        # The live record counts against a quota; the Stopped one, stopped before
        # version 7 (long ago), goes at the key's next stop.
        with pytest.raises(QuotaExceededError, match="memory_bytes, requested 40, used 64"):
            await a.save_within(loading(opened("new", memory=40)), claim)
        await a.save(opened("gone", 2))
        await a.save(stopped(opened("gone", 2)))
        assert run(database, schema, "SELECT instance, generation FROM records ORDER BY saved") == [
            ("live", 1),
            ("gone", 2),
        ]
        assert run(database, schema, "SELECT sum(stopped) FROM stop_counts") == [(1,)]


async def test_the_store_s_own_statements_quote_the_schema_s_name(database: str) -> None:
    """A schema named with a quote, a space and capitals is the one the store's
    statements create, set as their connections' search path and settings, and listen
    on (its notification channel)."""
    with own_schema(database) as base:
        name = base + ' Odd"Name'
        try:
            async with PostgresStore(database, runner_id="a", schema=name) as store:
                await store.save(opened("k"))
                assert run(database, name, "SELECT token FROM records") == [("p/k#1",)]
            with (
                psycopg.connect(database, autocommit=True) as connection,
                psycopg.connect(database, autocommit=True) as other,
            ):
                connection.execute(create_schema(name))  # there already: no error
                connection.execute(session_settings("250ms", name))
                for setting in ("statement_timeout", "lock_timeout"):
                    assert connection.execute(f"SHOW {setting}").fetchone() == ("250ms",)
                shown = connection.execute("SHOW idle_in_transaction_session_timeout")
                assert shown.fetchone() == ("250ms",)
                assert connection.execute("SELECT current_schema()").fetchone() == (name,)
                connection.execute(listen(name))
                other.execute("SELECT pg_notify(%s, 'hello')", (name,))
                notes = connection.notifies(timeout=5, stop_after=1)
                heard = [(note.channel, note.payload) for note in notes]
                assert heard == [(name, "hello")]
        finally:
            with psycopg.connect(database, autocommit=True) as connection:
                connection.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
                )


# -- write_batch -----------------------------------------------------------------------


def write_batch(
    database: str, schema: str, runner: str, epoch: int, *records: Any, per_key: int = 5
) -> list[tuple[Any, ...]]:
    """One call of write_batch, as a runner's worker sends it: each record a job."""
    jobs = [[(record, encode(record))] for record in records]
    return run(database, schema, SAVE_BATCH, runner, epoch, per_key, 100, 0.0, *columns(jobs), None)


async def test_write_batch_refuses_an_epoch_the_runner_s_row_does_not_hold(
    database: str, schema: str
) -> None:
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        epoch = store.epoch
    for runner, epoch_sent, holds in (("a", epoch + 1, str(epoch)), ("nobody", 1, "no epoch")):
        with pytest.raises(psycopg.Error) as caught:
            write_batch(database, schema, runner, epoch_sent, opened("k"))
        assert caught.value.sqlstate == FENCED == "TS001"
        assert caught.value.diag.message_primary == (
            f"runner {runner}: its epoch {epoch_sent} was taken over (the row holds {holds})"
        )
    assert run(database, schema, "SELECT count(*) FROM records") == [(0,)]
    assert write_batch(database, schema, "a", epoch, opened("k")) == []


async def test_an_open_that_supersedes_another_runner_s_session_writes_its_inbox(
    database: str, schema: str
) -> None:
    async with (
        PostgresStore(database, runner_id="a", schema=schema, runner_lease=30) as a,
        PostgresStore(database, runner_id="b", schema=schema) as b,
    ):
        await a.save(opened("k", 1))
        run(database, schema, "UPDATE runners SET stop_bound = 1.5 WHERE runner_id = 'a'")
        (row,) = write_batch(database, schema, "b", b.epoch, opened("k", 2))
        assert row[:9] == (0, None, None, None, None, None, None, None, None)
        assert row[9:14] == ("a", a.epoch, 1, 5.0, 1.5)
        assert -31 < row[14] < -25  # a's row expires in about 30 s
        assert run(database, schema, "SELECT * FROM inbox") == [("a", "p", "k", 2)]
        assert run(database, schema, "SELECT generation FROM high_water") == [(2,)]
        # Its own older generation is no other runner's: nothing in an inbox.
        assert write_batch(database, schema, "b", b.epoch, opened("j", 1), opened("j", 2)) == []
        assert run(database, schema, "SELECT count(*) FROM inbox") == [(1,)]


# -- retention, at its limits ----------------------------------------------------------


def stopped_rows(database: str, schema: str) -> list[tuple[str, int]]:
    return [
        (instance, generation)
        for instance, generation in run(
            database,
            schema,
            "SELECT instance, generation FROM records WHERE stopped IS NOT NULL ORDER BY stopped",
        )
    ]


def counted(database: str, schema: str) -> tuple[int, int]:
    """The runners' counters of Stopped records, summed, and the Stopped rows."""
    ((summed, there),) = run(
        database,
        schema,
        "SELECT (SELECT coalesce(sum(stopped), 0) FROM stop_counts), "
        "(SELECT count(*) FROM records WHERE stopped IS NOT NULL)",
    )
    return summed, there


async def test_retention_keeps_exactly_the_number_per_key_and_in_all(
    database: str, schema: str
) -> None:
    retention = Retention(stopped_per_key=2, stopped_total=3)
    async with PostgresStore(database, runner_id="a", schema=schema, retention=retention) as a:
        await a.save(stopped(opened("k", 1)))
        await a.save(stopped(opened("k", 2)))
        assert stopped_rows(database, schema) == [("k", 1), ("k", 2)]  # two per key: kept
        await a.save(stopped(opened("k", 3)))
        assert stopped_rows(database, schema) == [("k", 2), ("k", 3)]
        await a.save(stopped(opened("j", 1)))
        assert stopped_rows(database, schema) == [("k", 2), ("k", 3), ("j", 1)]  # three in all
        await a.save(stopped(opened("i", 1)))
        assert stopped_rows(database, schema) == [("k", 3), ("j", 1), ("i", 1)]
        assert counted(database, schema) == (3, 3)
        # Saved Stopped again: it keeps its place and time, and evicts nothing.
        before = run(
            database, schema, "SELECT stopped, stopped_at FROM records WHERE instance = 'k'"
        )
        await a.save(stopped(opened("k", 3)))
        assert stopped_rows(database, schema) == [("k", 3), ("j", 1), ("i", 1)]
        assert (
            run(database, schema, "SELECT stopped, stopped_at FROM records WHERE instance = 'k'")
            == before
        )
        assert counted(database, schema) == (3, 3)
        # Un-stopped (only a caller that saves it so): one Stopped record fewer, counted.
        await a.save(StoppingRecord.of(opened("j", 1), Disposed()))
        assert stopped_rows(database, schema) == [("k", 3), ("i", 1)]
        assert run(database, schema, "SELECT stopped_at FROM records WHERE instance = 'j'") == [
            (None,)
        ]
        assert counted(database, schema) == (2, 2)


async def test_a_stopped_record_goes_once_it_is_as_old_as_stopped_for(
    database: str, schema: str
) -> None:
    retention = Retention(stopped_per_key=1, stopped_for=600.0)
    async with PostgresStore(database, runner_id="a", schema=schema, retention=retention) as a:
        for generation in (1, 2, 3):
            await a.save(stopped(opened("k", generation)))
        older = "UPDATE records SET stopped_at = stopped_at - %s::interval WHERE generation = %s"
        run(database, schema, older, "590 seconds", 1)  # ten seconds short of it
        run(database, schema, older, "610 seconds", 2)
        await a.save(stopped(opened("k", 4)))
        assert stopped_rows(database, schema) == [("k", 1), ("k", 3), ("k", 4)]
        assert counted(database, schema) == (3, 3)


# -- quotas, at their exact boundaries -------------------------------------------------


async def test_each_quota_admits_up_to_its_limit_and_refuses_one_past(
    database: str, schema: str
) -> None:
    claim = QuotaClaim(
        tenant="t", identities=["p"], sessions=2, children=2, memory_bytes=100, cpu_percent=150
    )
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        one, two = opened("1"), opened("2", memory=40, cpu=50)
        await store.save_within(one, claim)
        await store.save_within(two, claim)
        with pytest.raises(QuotaExceededError) as refused:
            await store.save_within(opened("3"), claim)
        assert (refused.value.quota, refused.value.used, refused.value.hard) == ("sessions", 2, 2)
        # A later generation of a live key supersedes it: no new session, at the limit.
        newer = opened("1", 2, memory=60, cpu=100)
        await store.save_within(newer, claim)
        await store.save(stopped(one))
        # 60 + 40 bytes is the quota itself, 100 + 50 percent too: admitted.
        await store.save_within(loading(two), claim)
        await store.save_within(loading(newer), claim)
        # The same session's next Loading record takes no second child.
        await store.save_within(loading(two), claim)
        with pytest.raises(QuotaExceededError) as refused:
            await store.save_within(loading(opened("5")), claim)
        assert (refused.value.quota, refused.value.used, refused.value.hard) == ("children", 2, 2)
        await store.save(stopped(two))  # a Stopped session holds nothing
        for memory, cpu, quota, requested, used in (
            (41, 1, "memory_bytes", 41, 60),
            (40, 51, "cpu_percent", 51, 100),
        ):
            with pytest.raises(QuotaExceededError) as refused:
                await store.save_within(loading(opened("4", memory=memory, cpu=cpu)), claim)
            assert (refused.value.quota, refused.value.requested, refused.value.used) == (
                quota,
                requested,
                used,
            )
        await store.save_within(loading(opened("4", memory=40, cpu=50)), claim)


@pytest.mark.parametrize(
    ("pattern", "counted_identities"),
    [
        ("a_c", ["a_c"]),  # "_" is LIKE's one character: here it is itself
        ("100%", ["100%"]),  # "%" is LIKE's any run
        ("x.y", ["x.y"]),  # "." is a regular expression's any character
        ("a\\c", ["a\\c"]),  # a backslash escapes nothing
        ("[_%]*", ["_x", "%"]),
        ("*", ["a_c", "abc", "100%", "1000", "x.y", "xzy", "a\\c", "_x", "%"]),
    ],
)
async def test_a_tenant_s_pattern_takes_no_character_of_an_identity_as_special(
    database: str, schema: str, pattern: str, counted_identities: list[str]
) -> None:
    everyone = ["a_c", "abc", "100%", "1000", "x.y", "xzy", "a\\c", "_x", "%"]
    claim = QuotaClaim(tenant="t", identities=[pattern], sessions=len(counted_identities))
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        for identity in everyone:
            await store.save(opened("1", identity=identity))
        with pytest.raises(QuotaExceededError) as refused:
            await store.save_within(opened("2", identity="new"), claim)
        assert refused.value.used == len(counted_identities)
        # One more under the quota: room for exactly one.
        roomy = QuotaClaim(tenant="t", identities=[pattern], sessions=len(counted_identities) + 1)
        await store.save_within(opened("2", identity="new"), roomy)
