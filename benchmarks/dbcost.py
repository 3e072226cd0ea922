"""dbcost: what a session costs the database, counted rather than timed (issue 43, item 2).

Each operation runs alone (one at a time, so each of its saves is a batch of its own)
``repeats`` times on a fleet of two runners, ``a`` and ``b``: supervisors in this
process over ``PostgresStore`` s of one schema, with ``FakeExecution`` (no child
process; a load saves its three records as a real one does). Per operation
the table gives:

* **statements** the stores sent, by name (the constants of ``_postgres_sql``), and
  **round trips**: the store's connections are in autocommit, so a statement alone is
  one round trip and a transaction of its own; a job whose statements must land
  together (a takeover, a registration) adds its ``BEGIN`` and ``COMMIT``;
* **commits** (transactions), and of them **write commits** (a transaction that wrote:
  the ones whose commit waits for the WAL to reach the disk);
* **rows written** (inserted, updated or deleted), read from the server's own counters
  (``pg_stat_user_tables`` of the schema, once the backends flushed them);
* **NOTIFY** s sent, heard by a listener of this benchmark on the fleet's channel.

How it counts: :class:`Counting` wraps ``execute``, ``transaction``, ``commit`` and
``rollback`` of every connection the stores open while it is active (it replaces
``Settings.connect``, the one place they connect: a hook of this benchmark's, the
store's code is unchanged).
The membership's periodic work (the row's renewal, the read of its inbox, the scan for
dead runners) runs meanwhile and is not the operation's: its statements are left
out by name (``UPKEEP``), and the rows a renewal writes (one each) are taken off. That
work is measured on its own, per runner per second, by a member holding ``live``
sessions with the default leases (``upkeep``), and the statements that might grow with
the sessions a runner holds (the inbox, the renewal, the publication of its sessions'
times when a listing asks) are timed with 10,000 sessions (``scale``).

pg_stat_statements is not used: it must be in the server's
``shared_preload_libraries``, which needs a restart of a server other work shares.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Final
from unittest import mock

import attrs
import psycopg
import trio
from psycopg import pq, sql

from trio_supervisor import (
    Handle,
    Key,
    Limits,
    Load,
    OpenRecord,
    PostgresStore,
    Supervisor,
)
from trio_supervisor._defaults import LEASE as LEASE_DEFAULT
from trio_supervisor._defaults import RUNNER_LEASE
from trio_supervisor.stores import _postgres_schema, _postgres_sql
from trio_supervisor.stores._postgres_connection import Settings
from trio_supervisor.stores._postgres_sql import INBOX, PUBLISH_TIMES, RENEW

from . import postgres
from .fleet import Member, members
from .measure import Table

# Every statement of the store by its constant's name; a composed one (the connection's
# settings, LISTEN, the schema's creation) is "other".
NAMES: Final = {
    value: name
    for name, value in {**vars(_postgres_schema), **vars(_postgres_sql)}.items()
    if name.isupper() and isinstance(value, str)
}
# What the membership sends by itself, whatever the sessions do.
UPKEEP: Final = frozenset({"RENEW", "INBOX", "DEAD"})
# The statements that write (a transaction with one of them commits to the WAL). The
# inbox's read deletes what it reads: a write only where a supersede left a row.
WRITES: Final = frozenset(
    {
        "SAVE_BATCH",
        "RENEW",
        "DRAINING",
        "EXPIRE",
        "REGISTER",
        "DEAD_ROW",
        "NEXT_EPOCH",
        "PUBLISH_TIMES",
    }
)
LEASE: Final = 60.0  # the sessions' lease in the operations' fleet: none expires
QUIET_RUNNER_LEASE: Final = 600.0  # ... and its runners renew and scan only as they start
LIVE: Final = 100  # sessions the upkeep's member holds
SCALE: Final = 10_000  # sessions of one runner, for the statements that grow with them


# -- counting ---------------------------------------------------------------------------


@attrs.define
class Transaction:
    """One transaction of one connection: its statements, by name, and how it ended."""

    statements: list[str] = attrs.Factory(list)
    autocommit: bool = False
    committed: bool = True
    deleted: int = 0  # rows its statements deleted from the inbox (the upkeep's INBOX)

    @property
    def round_trips(self) -> int:
        # BEGIN and COMMIT (or ROLLBACK) are round trips of their own, outside autocommit.
        return len(self.statements) + (0 if self.autocommit else 2)

    @property
    def wrote(self) -> bool:
        return any(name in WRITES for name in self.statements)


class Log:
    """The finished transactions of one connection, in order (appended by its thread)."""

    def __init__(self, runner: str, autocommit: bool) -> None:
        self.runner = runner
        self.autocommit = autocommit
        self.done: list[Transaction] = []
        self._open: Transaction | None = None

    def executed(self, query: object, idle: bool) -> Transaction:
        """Count a statement; the transaction it is part of."""
        name = NAMES.get(query, "other") if isinstance(query, str) else "other"
        if self.autocommit and idle and self._open is None:
            alone = Transaction(statements=[name], autocommit=True)
            self.done.append(alone)
            return alone
        if self._open is None or (idle and not self.autocommit):
            self._open = Transaction()
        self._open.statements.append(name)
        return self._open

    def began(self) -> None:
        """A transaction block began (``BEGIN``, in autocommit)."""
        self._open = Transaction()

    def ended(self, *, committed: bool) -> None:
        if self._open is not None:
            self._open.committed = committed
            self.done.append(self._open)
            self._open = None


class Counting:
    """Every connection a store opens while this is active, counted (see the module docs)."""

    def __init__(self) -> None:
        self.logs: list[Log] = []
        self._patch = mock.patch.object(Settings, "connect", self._connect())

    def __enter__(self) -> Counting:
        self._patch.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._patch.stop()

    def mark(self) -> list[int]:
        """Where each connection's log stands now (:meth:`since` counts from here)."""
        return [len(log.done) for log in self.logs]

    def since(self, marks: Sequence[int]) -> list[tuple[str, Transaction]]:
        """The transactions finished since ``marks``, each with its runner."""
        found: list[tuple[str, Transaction]] = []
        for index, log in enumerate(list(self.logs)):
            start = marks[index] if index < len(marks) else 0
            found.extend((log.runner, done) for done in log.done[start:])
        return found

    def _connect(self) -> Callable[..., psycopg.Connection[Any]]:
        original = Settings.connect
        logs = self.logs

        def connect(settings: Settings, *, autocommit: bool = False) -> psycopg.Connection[Any]:
            connection = original(settings, autocommit=autocommit)
            log = Log(settings.runner_id, autocommit)
            execute, commit, rollback = connection.execute, connection.commit, connection.rollback
            transaction = connection.transaction

            def counted_execute(query: Any, params: Any = None, **options: Any) -> Any:
                idle = connection.info.transaction_status == pq.TransactionStatus.IDLE
                transaction = log.executed(query, idle)
                cursor = execute(query, params, **options)
                if transaction.statements[-1] == "INBOX":
                    transaction.deleted += max(0, cursor.rowcount)
                return cursor

            def counted_commit() -> None:
                log.ended(committed=True)
                commit()

            def counted_rollback() -> None:
                log.ended(committed=False)
                rollback()

            @contextlib.contextmanager
            def counted_transaction(*args: Any, **options: Any) -> Iterator[Any]:
                log.began()
                try:
                    with transaction(*args, **options) as block:
                        yield block
                except BaseException:
                    log.ended(committed=False)
                    raise
                log.ended(committed=True)

            connection.execute = counted_execute  # type: ignore[method-assign]
            connection.transaction = counted_transaction  # type: ignore[method-assign]
            connection.commit = counted_commit  # type: ignore[method-assign]
            connection.rollback = counted_rollback  # type: ignore[method-assign]
            logs.append(log)
            return connection

        return connect


# -- one operation's cost -------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Counts:
    """What the server was sent and wrote: statements (by their names in
    ``_postgres_sql``), round trips, commits (and those that wrote), rows written, and
    the WAL that took."""

    statements: dict[str, float]
    round_trips: float
    commits: float
    write_commits: float
    rows: float
    wal_bytes: float


@attrs.frozen(kw_only=True)
class Cost(Counts):
    """What ``repeats`` runs of an operation cost, per run."""

    operation: str
    repeats: int
    notifies: dict[str, float]

    @property
    def statement_count(self) -> float:
        return sum(self.statements.values())

    @property
    def notify_count(self) -> float:
        return sum(self.notifies.values())

    def row(self) -> tuple[str, ...]:
        return (
            self.operation,
            _number(self.statement_count),
            ", ".join(f"{name} {_number(n)}" for name, n in self.statements.items()) or "-",
            _number(self.round_trips),
            _number(self.commits),
            _number(self.write_commits),
            _number(self.rows),
            f"{self.wal_bytes:,.0f}",
            ", ".join(f"{kind} {_number(n)}" for kind, n in self.notifies.items()) or "0",
        )


COST_COLUMNS: Final = (
    "operation",
    "statements",
    "which",
    "round trips",
    "commits",
    "write commits",
    "rows written",
    "WAL bytes",
    "NOTIFY",
)


def _number(value: float) -> str:
    return f"{value:g}" if value == round(value) else f"{value:.2f}"


class Server:
    """What the server says of a schema: the rows written to its tables and the WAL that
    took, read from the WAL itself (pg_walinspect: exact, and at once, where the
    statistics views lag by up to seconds); and the NOTIFYs sent on its channel."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.schema = schema
        self._wal = psycopg.connect(dsn, autocommit=True)
        self._wal.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        # The WAL read back must outlive checkpoints: other work on the server (a test
        # suite's CREATE DATABASE, say) can have a segment recycled within a window.
        # A temporary slot of this connection's reserves it from now on, and goes with
        # the connection.
        self._wal.execute(
            "SELECT pg_create_physical_replication_slot(%s, true, true)",
            (f"ts_cost_{os.getpid()}_{id(self)}",),
        )
        self._listener = psycopg.connect(dsn, autocommit=True)
        self._listener.execute(_postgres_sql.listen(schema))

    def close(self) -> None:
        self._wal.close()
        self._listener.close()

    def position(self) -> str:
        """Where the WAL stands now (an LSN)."""
        row = self._wal.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
        assert row is not None
        return str(row[0])

    def written(self, since: str) -> tuple[int, int]:
        """Rows inserted, updated or deleted in the schema's tables since ``since``, and
        the WAL bytes of this database's relations (full-page images left out)."""
        if self.position() == since:
            return 0, 0  # nothing written since (and pg_walinspect refuses the range)
        row = self._wal.execute(WRITTEN, (since, self.schema)).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def notifies(self) -> collections.Counter[str]:
        """The notifications sent on the fleet's channel since the last call, by kind."""
        kinds: collections.Counter[str] = collections.Counter()
        for note in self._listener.notifies(timeout=0.3):
            kinds[json.loads(note.payload).get("kind", "?")] += 1
        return kinds


# Server.written: the WAL's records since an LSN, of this database's relations (each
# record's first block reference names its tablespace, database and relation file).
WRITTEN: Final = r"""
WITH w AS (
    SELECT resource_manager, record_type, record_length - fpi_length AS bytes,
           regexp_match(block_ref, 'rel \d+/(\d+)/(\d+)') AS rel
    FROM pg_get_wal_records_info(%s::pg_lsn, pg_current_wal_flush_lsn())
)
SELECT count(*) FILTER (
           WHERE resource_manager = 'Heap'
             AND record_type ~ '^(INSERT|UPDATE|HOT_UPDATE|DELETE)'
             AND rel[2]::oid IN (
                 SELECT c.relfilenode FROM pg_class c
                 JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname = %s AND c.relkind = 'r')),
       coalesce(sum(bytes), 0)
FROM w
WHERE rel[1]::oid = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


async def cost_of(
    operation: str,
    counting: Counting,
    server: Server,
    runs: Sequence[Callable[[], Awaitable[object]]],
    *,
    upkeep: frozenset[str] = UPKEEP,
) -> Cost:
    """Run each of ``runs`` in turn, alone, and count what they cost, per run."""
    await trio.to_thread.run_sync(server.notifies)
    since = await trio.to_thread.run_sync(server.position)
    marks = counting.mark()
    for run in runs:
        await run()
    found = counting.since(marks)
    rows, wal = await trio.to_thread.run_sync(server.written, since)
    heard = await trio.to_thread.run_sync(server.notifies)
    ours = [done for _, done in found if not set(done.statements) <= upkeep]
    names: collections.Counter[str] = collections.Counter()
    for done in ours:
        names.update(done.statements)
    count = len(runs)
    # A renewal of the membership's (left out) updates one row: its runner's.
    renewals = sum(done.statements.count("RENEW") for _, done in found)
    # ... and a read of an inbox the rows it found (an operation's supersede, read by
    # the holder's upkeep within the operation's window or after it, as it happens).
    renewals += sum(done.deleted for _, done in found)
    return Cost(
        operation=operation,
        repeats=count,
        statements={name: n / count for name, n in names.items()},
        round_trips=sum(done.round_trips for done in ours) / count,
        commits=sum(1 for done in ours if done.committed) / count,
        write_commits=sum(1 for done in ours if done.wrote and done.committed) / count,
        rows=(rows - renewals) / count,
        wal_bytes=wal / count,
        notifies={kind: n / count for kind, n in sorted(heard.items())},
    )


# -- the operations --------------------------------------------------------------------


def _key(name: str) -> Key:
    return Key(identity="cost", instance=name)


async def operations(dsn: str, schema: str, repeats: int) -> list[Cost]:
    """Each operation's cost, ``repeats`` runs of it (takeovers: one of each size)."""
    with Counting() as counting, contextlib.closing(Server(dsn, schema)) as server:
        async with members(
            dsn, schema, ["a", "b"], lease=LEASE, runner_lease=QUIET_RUNNER_LEASE
        ) as (a, b):
            return await _operations(dsn, counting, server, a, b, repeats)


async def _operations(
    dsn: str, counting: Counting, server: Server, a: Member, b: Member, repeats: int
) -> list[Cost]:
    ours, theirs = a.supervisor, b.supervisor
    handles: list[Handle] = []

    def each(
        names: str, call: Callable[[int, Key], Awaitable[object]]
    ) -> list[Callable[[], Awaitable[object]]]:
        return [
            functools.partial(call, number, _key(f"{names}{number}")) for number in range(repeats)
        ]

    generations: dict[Key, int] = {}  # what a host knows of each key

    async def open_(number: int, key: Key, *, on: Supervisor = ours) -> None:
        record = await on.open(key, uuid.uuid4().hex, expected_generation=generations.get(key))
        generations[key] = record.handle.generation
        handles.append(record.handle)

    async def opened(names: str) -> list[Handle]:
        """Sessions opened on ``a`` outside any count."""
        handles.clear()
        for run in each(names, open_):
            await run()
        return list(handles)

    costs = [await cost_of("open", counting, server, each("o", open_))]
    loaded = list(handles)
    costs.append(
        await cost_of(
            "high_water",
            counting,
            server,
            each("o", lambda _, key: ours.high_water(key)),
        )
    )
    costs.append(
        await cost_of(
            "load",
            counting,
            server,
            [functools.partial(ours.load, handle, Load(specifier="x")) for handle in loaded],
        )
    )
    costs.append(
        await cost_of("renew", counting, server, [functools.partial(ours.renew, h) for h in loaded])
    )
    costs.append(
        await cost_of(
            "dispose, loaded",
            counting,
            server,
            [functools.partial(ours.dispose, handle) for handle in loaded],
        )
    )
    childless = await opened("c")
    costs.append(
        await cost_of(
            "dispose, no child",
            counting,
            server,
            [functools.partial(ours.dispose, handle) for handle in childless],
        )
    )
    await opened("s")
    costs.append(
        await cost_of(
            "supersede across runners",
            counting,
            server,
            each("s", functools.partial(open_, on=theirs)),
        )
    )
    for sessions in (1, 100):
        await _dead_runner(dsn, b.store.schema, f"dead{sessions}", sessions)
        costs.append(
            await cost_of(
                f"takeover, {sessions} session{'s' * (sessions > 1)}",
                counting,
                server,
                [b.store.take_over_dead],
                upkeep=UPKEEP - {"DEAD"},
            )
        )
    return costs


async def _dead_runner(dsn: str, schema: str, runner: str, sessions: int) -> None:
    """A runner that saved ``sessions`` Open records and left: its row is expired, and
    their leases are so short that their takeover is due at once."""
    async with PostgresStore(dsn, schema=schema, runner_id=runner) as dead:
        await dead.save_many(
            [
                OpenRecord(
                    handle=Handle(key=_key(f"{runner}-{n}"), token=uuid.uuid4().hex, generation=1),
                    request_id=f"{runner}-{n}",
                    lease=0.001,
                    limits=Limits(),
                )
                for n in range(sessions)
            ]
        )
    await trio.sleep(0.05)


# -- the membership's own work ----------------------------------------------------------


@attrs.frozen(kw_only=True)
class Upkeep(Counts):
    """What one runner's membership sends by itself, per second, holding ``live`` sessions."""

    live: int
    seconds: float

    def row(self) -> tuple[str, ...]:
        return (
            f"one runner, {self.live} live sessions, {self.seconds:.1f} s",
            _number(sum(self.statements.values())),
            ", ".join(f"{name} {n:.2f}" for name, n in sorted(self.statements.items())),
            f"{self.round_trips:.2f}",
            f"{self.commits:.2f}",
            f"{self.write_commits:.2f}",
            f"{self.rows:.2f}",
            f"{self.wal_bytes:,.0f}",
        )


UPKEEP_COLUMNS: Final = (
    "per second",
    "statements",
    "which",
    "round trips",
    "commits",
    "write commits",
    "rows written",
    "WAL bytes",
)


async def upkeep(
    dsn: str,
    schema: str,
    seconds: float,
    *,
    live: int = LIVE,
    lease: float = LEASE_DEFAULT,
    runner_lease: float = RUNNER_LEASE,
) -> Upkeep:
    """The membership's statements per second over ``seconds``, holding ``live``
    sessions of ``lease`` (by default, the library's default leases)."""
    with Counting() as counting, contextlib.closing(Server(dsn, schema)) as server:
        async with members(dsn, schema, ["u"], lease=lease, runner_lease=runner_lease) as (u,):
            for number in range(live):
                await u.supervisor.open(_key(f"u{number}"), f"u-{number}")
            since = await trio.to_thread.run_sync(server.position)
            marks = counting.mark()
            started = time.monotonic()
            await trio.sleep(seconds)
            found = [done for runner, done in counting.since(marks) if runner == "u"]
            rows, wal = await trio.to_thread.run_sync(server.written, since)
            elapsed = time.monotonic() - started
    names: collections.Counter[str] = collections.Counter()
    for done in found:
        names.update(done.statements)
    return Upkeep(
        live=live,
        seconds=elapsed,
        statements={name: n / elapsed for name, n in names.items()},
        round_trips=sum(done.round_trips for done in found) / elapsed,
        commits=sum(1 for done in found if done.committed) / elapsed,
        write_commits=sum(1 for done in found if done.wrote and done.committed) / elapsed,
        rows=rows / elapsed,
        wal_bytes=wal / elapsed,
    )


# -- the statements that grow with a runner's sessions --------------------------------


SCALE_COLUMNS: Final = (
    "statement",
    "sessions",
    "ms (client, median)",
    "ms (server, EXPLAIN ANALYZE)",
    "WAL bytes",
    "note",
)


async def scale(dsn: str, schema: str, sessions: int, others: int, samples: int) -> Table:
    """What a runner of ``sessions`` live sessions sends that might grow with them: the
    read of its inbox, its row's renewal, and (on demand only) the publication of its
    sessions' times; on tables that also hold ``others`` keys and records of other
    runners."""
    async with PostgresStore(dsn, schema=schema, runner_id="big") as store:
        epoch = store.epoch
    return await trio.to_thread.run_sync(_scale, dsn, schema, epoch, sessions, others, samples)


def _scale(dsn: str, schema: str, epoch: int, sessions: int, others: int, samples: int) -> Table:
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
        connection.execute(
            "INSERT INTO high_water (identity, instance, generation) "
            "SELECT 'scale', i::text, 1 FROM generate_series(1, %s) AS i "
            "UNION ALL SELECT 'other', i::text, 1 FROM generate_series(1, %s) AS i",
            (sessions, others),
        )
        # Other runners' supersedes waiting in their inboxes: the index is not empty.
        connection.execute(
            "INSERT INTO inbox (runner_id, identity, instance, generation) "
            "SELECT 'other' || (i %% 100), 'other', i::text, 2 "
            "FROM generate_series(1, %s) AS i",
            (max(1, others // 100),),
        )
        connection.execute("ANALYZE high_water")
        connection.execute("ANALYZE inbox")
        tokens = [uuid.uuid4().hex for _ in range(sessions)]
        statements = (
            ("INBOX", INBOX, ("big",), "the check for supersedes: an empty inbox"),
            ("RENEW", RENEW, (600.0, 7.0, "big", epoch), "the runner's row"),
            (
                "PUBLISH_TIMES",
                PUBLISH_TIMES,
                ("big", tokens, [10.0] * sessions, [5.0] * sessions),
                "its sessions' times, only when a listing asks",
            ),
        )
        rows: list[tuple[str, ...]] = []
        for name, statement, params, note in statements:
            times = []
            for _ in range(samples):
                started = time.perf_counter()
                cursor = connection.execute(statement, params)
                if cursor.description is not None:
                    cursor.fetchall()
                times.append(time.perf_counter() - started)
            with connection.transaction(force_rollback=True):
                plan = connection.execute(
                    sql.SQL("EXPLAIN (ANALYZE, WAL, FORMAT JSON) ") + sql.SQL(statement), params
                ).fetchone()
            assert plan is not None
            top = plan[0][0]
            wal = top["Plan"].get("WAL Bytes", 0)
            if name == "PUBLISH_TIMES":
                size = connection.execute(
                    "SELECT pg_column_size(times) FROM runner_times WHERE runner_id = 'big'"
                ).fetchone()
                assert size is not None
                note += f" ({size[0]:,} bytes stored, compressed)"
            rows.append(
                (
                    name,
                    f"{sessions:,}",
                    f"{1000 * statistics.median(times):.2f}",
                    f"{top['Execution Time']:.2f}",
                    f"{wal:,}",
                    note,
                )
            )
    return Table(
        name="dbcost.scale",
        note=f"medians of {samples} statements, each in autocommit",
        columns=SCALE_COLUMNS,
        rows=rows,
    )


# -- the group -------------------------------------------------------------------------


def run(quick: bool, rounds: int) -> list[Table]:
    with postgres.database() as dsn:
        return trio.run(_tables, dsn, quick, rounds)


async def _tables(dsn: str, quick: bool, rounds: int) -> list[Table]:
    repeats = 3 if quick else 20
    costs = await operations(dsn, "costs", repeats)
    kept = await upkeep(dsn, "upkeep", 2.0 if quick else 10.0)
    sessions, others = (1_000, 1_000) if quick else (SCALE, 10 * SCALE)
    return [
        Table(
            name="dbcost",
            note=f"per operation, each alone, {repeats} runs (a takeover: one), a fleet of "
            "two runners; the membership's own statements left out",
            columns=COST_COLUMNS,
            rows=[cost.row() for cost in costs],
        ),
        Table(
            name="dbcost.upkeep",
            note=f"the default leases: the runner's {RUNNER_LEASE:g} s, the sessions' "
            f"{LEASE_DEFAULT:g} s",
            columns=UPKEEP_COLUMNS,
            rows=[kept.row()],
        ),
        await scale(dsn, "scale", sessions, others, max(3, rounds)),
    ]
