"""durable.postgres: open + dispose cycles on PostgresStore, 100 concurrent clients; and the
server every PostgreSQL scenario uses.

Ours is a supervisor over ``PostgresStore``, a member of a fleet of one (so, as a
runner's, each open is fenced by the fleet's compare-and-set, and the save tells of
older generations held elsewhere). Its baseline is raw psycopg doing the same SQL with
the same batching: one thread owns a connection in autocommit and takes whatever the
100 clients queued; the saves of a batch go in one call of the store's own
``write_batch`` function (the same rows, the same JSON, the same retention), and then
each read is served as a statement of its own, as the store's worker does. Per cycle a
client asks the thread for what our supervisor asks the store for: the Open record
(its host expects the generation the runner knows: no lookup, docs/design.md F3), and
the Stopping and Stopped records together (a childless stop saves both at once,
deviation (k)); each awaited before the next; a client reads its key's high-water
once, before its first cycle, as ours does. ``durable.postgres.solo`` (informational)
is the same without the fleet: the store behind a plain ``BatchStore`` face, so the
supervisor neither reads nor waits, and the baseline does not read.

The server is ``$TRIO_SUPERVISOR_BENCH_DSN`` (an admin connection; by default the one
every machine of this project runs), on which the group makes a database of its own
and drops it at the end. When it does not answer, the group is skipped, not failed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, Final

import psycopg
import trio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from trio_supervisor import (
    BatchStore,
    Disposed,
    ExitStatus,
    Handle,
    Key,
    Limits,
    OpenRecord,
    PostgresStore,
    SessionRecord,
    StoppedRecord,
    StoppingRecord,
    Supervisor,
    Termination,
    codec,
    open_supervisor,
)
from trio_supervisor.stores._postgres_records import columns
from trio_supervisor.stores._postgres_schema import Kind
from trio_supervisor.stores._postgres_sql import LOOKUP, SAVE_BATCH
from trio_supervisor.testing import FakeExecution

from .measure import Result, Skipped, interleaved_async

VARIABLE: Final = "TRIO_SUPERVISOR_BENCH_DSN"
DEFAULT_DSN: Final = "postgresql://postgres@127.0.0.1:5432/test"
CLIENTS: Final = 100
LEASE: Final = 1e6


# -- the server ------------------------------------------------------------------------


def shown(dsn: str) -> str:
    """The DSN without its password, for messages."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        return "a DSN that does not parse"
    params.pop("password", None)
    return make_conninfo("", **params)


@contextlib.contextmanager
def database() -> Iterator[str]:
    """A fresh database on the benchmarks' server, dropped afterwards; its DSN.

    Raises:
        Skipped: The server did not answer.
    """
    dsn = os.environ.get(VARIABLE, DEFAULT_DSN)
    try:
        admin = psycopg.connect(dsn, connect_timeout=5, autocommit=True)
    except psycopg.Error as error:
        reason = str(error).strip() or type(error).__name__
        raise Skipped(
            f"PostgreSQL at {shown(dsn)} did not answer ({reason}); set {VARIABLE} to a "
            "server to run this group"
        ) from error
    named = f"ts_bench_{os.getpid()}"
    name = sql.Identifier(named)
    with admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(name))
    try:
        yield make_conninfo(dsn, dbname=named)
    finally:
        with psycopg.connect(dsn, connect_timeout=5, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))


# -- the baseline: raw psycopg, group commit through save_batch ------------------------

# One row of a save: the record, its kind for save_batch, and its JSON.
Row = tuple[SessionRecord, int, str]


class Request:
    """One client's call to the writer thread: a save (``rows``) or a read (``query``)."""

    __slots__ = ("done", "params", "query", "result", "rows")

    def __init__(self, *, rows: Sequence[Row] = (), query: str = "", params: Any = None) -> None:
        self.rows = rows
        self.query = query
        self.params = params
        self.result: Any = None
        self.done = trio.Event()


class Writer:
    """A thread owning one psycopg connection, serving :class:`Request` s in batches.

    Each batch is whatever is queued: its saves in one ``write_batch`` call (in
    autocommit: one round trip, one commit), then each read as a statement of its own,
    then the clients of the batch are woken through the run's token.
    """

    def __init__(self, dsn: str, schema: str, runner: str, epoch: int) -> None:
        self._connection = psycopg.connect(dsn, autocommit=True)
        self._connection.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
        self.runner = runner
        self._epoch = epoch
        self._requests: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self.commits = 0  # write transactions, as PostgresStore.commits counts them

    async def call(self, request: Request) -> Any:
        self._requests.put(request)
        await request.done.wait()
        return request.result

    async def aclose(self) -> None:
        self._requests.put(None)
        await trio.to_thread.run_sync(self._thread.join)
        self._connection.close()

    def _serve(self) -> None:
        connection = self._connection
        while True:
            first = self._requests.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while True:
                try:
                    more = self._requests.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            saves = [request for request in batch if request.rows]
            if saves:
                refused = connection.execute(SAVE_BATCH, self._columns(saves)).fetchall()
                self.commits += 1
                assert not refused, refused
            for request in batch:
                if not request.rows:
                    request.result = connection.execute(request.query, request.params).fetchall()
            self._token.run_sync_soon(_wake, batch)
            if stop:
                return

    def _columns(self, saves: list[Request]) -> tuple[Any, ...]:
        """write_batch's arguments, built as the store's worker builds them."""
        jobs = [[(record, body) for record, _, body in save.rows] for save in saves]
        # The store's default retention: one Stopped record per key, 10,000 in all, none
        # kept longer; no quota claims.
        return (self.runner, self._epoch, 1, 10_000, 0.0, *columns(jobs), None)


def _wake(batch: list[Request]) -> None:
    for request in batch:
        request.done.set()


async def baseline_rate(
    writer: Writer, identity: str, cycles: int, *, fleet: bool, marks: dict[Key, int]
) -> float:
    """The baseline's cycles per second: the module docs say what a cycle asks for.

    Without ``fleet`` it keeps each key's high-water in ``marks``, as a supervisor alone
    does, instead of asking the database.
    """
    tag = uuid.uuid4().hex[:8]

    async def lookup(key: Key, request_id: str | None) -> int:
        params = {"i": key.identity, "n": key.instance, "r": request_id}
        rows = await writer.call(Request(query=LOOKUP, params=params))
        mark: int | None = rows[0][0]
        return mark or 0

    async def client(number: int) -> None:
        key = Key(identity=identity, instance=str(number))
        # As Supervisor.high_water: the fleet's store, or what this runner knows.
        generation = await lookup(key, None) if fleet else marks.get(key, 0)
        for cycle in range(cycles):
            request_id = f"{tag}-{cycle}"
            handle = Handle(key=key, token=str(uuid.uuid4()), generation=generation + 1)
            opened = OpenRecord(handle=handle, request_id=request_id, lease=LEASE, limits=Limits())
            await writer.call(Request(rows=[(opened, Kind.OPEN, codec.encode(opened))]))
            generation = handle.generation
            marks[key] = generation
            stopping = StoppingRecord.of(opened, Disposed())
            stopped = StoppedRecord.of(
                opened, Disposed(), Termination(kind="exited", exit=ExitStatus(code=0))
            )
            rows: list[Row] = [
                (stopping, Kind.OTHER, codec.encode(stopping)),
                (stopped, Kind.STOPPED, codec.encode(stopped)),
            ]
            await writer.call(Request(rows=rows))

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for number in range(CLIENTS):
            nursery.start_soon(client, number)
    return CLIENTS * cycles / (time.perf_counter() - started)


# -- ours ------------------------------------------------------------------------------


class Solo:
    """A PostgresStore behind a plain ``BatchStore`` face: its supervisor is no fleet
    member, so it neither looks keys up in the store nor waits for other runners."""

    def __init__(self, store: PostgresStore) -> None:
        # Its bound methods themselves: no coroutine of ours in between.
        self.save: Callable[[SessionRecord], Coroutine[Any, Any, None]] = store.save
        self.save_many: Callable[[Sequence[SessionRecord]], Coroutine[Any, Any, None]] = (
            store.save_many
        )
        self.list: Callable[[], Coroutine[Any, Any, Sequence[SessionRecord]]] = store.list
        self.high_water: Callable[[], Coroutine[Any, Any, Mapping[Key, int]]] = store.high_water
        self.retention = store.retention


async def ours_rate(supervisor: Supervisor, identity: str, cycles: int) -> float:
    """Our cycles per second: durable.concurrent's cycle, 100 clients at once."""
    tag = uuid.uuid4().hex[:8]

    async def client(number: int) -> None:
        key = Key(identity=identity, instance=str(number))
        generation = await supervisor.high_water(key)
        for cycle in range(cycles):
            record = await supervisor.open(key, f"{tag}-{cycle}", expected_generation=generation)
            generation = record.handle.generation
            await supervisor.dispose(record.handle)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for number in range(CLIENTS):
            nursery.start_soon(client, number)
    return CLIENTS * cycles / (time.perf_counter() - started)


async def durable_rows(dsn: str, quick: bool, rounds: int) -> list[Result]:
    cycles = 1 if quick else 20
    # The baseline's schema and runner row, made by the store itself (untimed).
    async with PostgresStore(dsn, schema="raw", runner_id="raw") as made:
        epoch = made.epoch
    return [
        await _fleet_of_one(dsn, epoch, cycles, rounds),
        await _solo(dsn, epoch, cycles, rounds),
    ]


async def _fleet_of_one(dsn: str, epoch: int, cycles: int, rounds: int) -> Result:
    async with (
        PostgresStore(dsn, schema="ours", runner_id="ours") as store,
        open_supervisor(store, FakeExecution(), lease=LEASE) as supervisor,
    ):
        writer = Writer(dsn, "raw", "raw", epoch)
        try:
            commits = store.commits, writer.commits

            async def ours() -> float:
                return await ours_rate(supervisor, "durable", cycles)

            async def baseline() -> float:
                return await baseline_rate(writer, "durable", cycles, fleet=True, marks={})

            mine, theirs = await interleaved_async(ours, baseline, rounds)
            saves = 2 * CLIENTS * cycles * rounds
            batching = {
                "ours_saves_per_commit": saves / (store.commits - commits[0]),
                "baseline_saves_per_commit": saves / (writer.commits - commits[1]),
            }
        finally:
            await writer.aclose()
    return Result(
        name="durable.postgres",
        unit="cycles/s",
        better="higher",
        target=0.8,
        ours=mine,
        baseline=theirs,
        baseline_name="raw psycopg: the same SQL, group commit by a writer thread",
        note=f"{CLIENTS} clients; per cycle a lookup, the Open, the look for older "
        "generations and Stopping+Stopped, each awaited; the thread commits the saves "
        "queued at once in one save_batch call, then serves the reads",
        extra=batching,
    )


async def _solo(dsn: str, epoch: int, cycles: int, rounds: int) -> Result:
    marks: dict[Key, int] = {}
    async with PostgresStore(dsn, schema="solo", runner_id="solo") as alone:
        solo: BatchStore = Solo(alone)
        async with open_supervisor(solo, FakeExecution(), lease=LEASE) as supervisor:
            writer = Writer(dsn, "raw", "raw", epoch)
            try:

                async def ours() -> float:
                    return await ours_rate(supervisor, "solo", cycles)

                async def baseline() -> float:
                    return await baseline_rate(writer, "solo", cycles, fleet=False, marks=marks)

                mine, theirs = await interleaved_async(ours, baseline, rounds)
            finally:
                await writer.aclose()
    return Result(
        name="durable.postgres.solo",
        unit="cycles/s",
        better="higher",
        target=0.8,
        ours=mine,
        baseline=theirs,
        baseline_name="raw psycopg: the same SQL without reads, group commit",
        note="durable.postgres with the supervisor in no fleet (the store behind a plain "
        "BatchStore face): the Open and Stopping+Stopped only, on both sides",
        informational=True,
    )
