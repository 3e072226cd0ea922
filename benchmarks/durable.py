"""durable.*: open + dispose cycles on the SQLite store, 100 concurrent clients.

The baseline of ``durable.concurrent`` is the same 100 Trio clients writing the same
records as the same JSON, in the same writes as the supervisor: per cycle the Open
record, awaited, then the Stopping and Stopped records together (a childless stop saves
both in one transaction, docs/design.md deviation (k)), awaited. They go to sqlite3 in WAL
mode with synchronous=FULL through the group commit a careful SQLite user would write:
one writer thread that takes whatever is queued, writes it in one transaction, and then
wakes the writers of that batch. ``durable.concurrent.naive`` (informational) keeps the
older baseline: one commit per write, whichever is faster of calling it blocking in the
event loop or through ``trio.to_thread``.
"""

from __future__ import annotations

import queue
import sqlite3
import tempfile
import threading
import time
import uuid
from pathlib import Path

import trio

from trio_supervisor import (
    Disposed,
    ExitStatus,
    Handle,
    Key,
    Limits,
    MemoryStore,
    OpenRecord,
    SqliteStore,
    StoppedRecord,
    StoppingRecord,
    Supervisor,
    Termination,
    codec,
    open_supervisor,
)
from trio_supervisor.abc import Store
from trio_supervisor.testing import FakeExecution

from .measure import Result, compare

CLIENTS = 100
LEASE = 1e6
_UPSERT = (
    "INSERT INTO records (token, body) VALUES (?, ?) "
    "ON CONFLICT (token) DO UPDATE SET body = excluded.body"
)


async def _cycles(supervisor: Supervisor, client: int, cycles: int) -> None:
    key = Key(identity="durable", instance=str(client))
    generation = await supervisor.high_water(key)
    for cycle in range(cycles):
        record = await supervisor.open(key, f"{client}-{cycle}", expected_generation=generation)
        generation = record.handle.generation
        await supervisor.dispose(record.handle)


def ours_rate(make_store: object, cycles: int) -> float:
    async def main() -> float:
        store: Store = make_store()  # type: ignore[operator]
        async with open_supervisor(store, FakeExecution(), lease=LEASE) as supervisor:
            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for client in range(CLIENTS):
                    nursery.start_soon(_cycles, supervisor, client, cycles)
            elapsed = time.perf_counter() - started
        closer = getattr(store, "aclose", None)
        if closer is not None:
            await closer()
        return CLIENTS * cycles / elapsed

    return trio.run(main)


def _records(client: int, cycle: int) -> list[list[str]]:
    """The writes of one cycle: the Open record, then Stopping and Stopped together."""
    handle = Handle(
        key=Key(identity="durable", instance=str(client)),
        token=str(uuid.uuid4()),
        generation=cycle + 1,
    )
    opened = OpenRecord(handle=handle, request_id=f"{client}-{cycle}", lease=LEASE, limits=Limits())
    stopping = StoppingRecord.of(opened, Disposed())
    stopped = StoppedRecord.of(
        opened, Disposed(), Termination(kind="exited", exit=ExitStatus(code=0))
    )
    return [[codec.encode(opened)], [codec.encode(stopping), codec.encode(stopped)]]


def _connect(path: Path) -> sqlite3.Connection:
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = FULL")
    connection.execute(
        "CREATE TABLE IF NOT EXISTS records (token TEXT PRIMARY KEY, body TEXT NOT NULL)"
    )
    return connection


def _write(connection: sqlite3.Connection, token: str, bodies: list[str]) -> None:
    connection.execute("BEGIN IMMEDIATE")
    connection.executemany(_UPSERT, [(token, body) for body in bodies])
    connection.execute("COMMIT")


def baseline_rate(cycles: int, *, threaded: bool) -> float:
    async def main(path: Path) -> float:
        connection = _connect(path)
        lock = trio.Lock()  # one connection: writes take turns, as they must
        limiter = trio.CapacityLimiter(1)

        async def client(number: int) -> None:
            for cycle in range(cycles):
                token = str(uuid.uuid4())
                for bodies in _records(number, cycle):
                    if threaded:
                        async with lock:
                            await trio.to_thread.run_sync(
                                _write, connection, token, bodies, limiter=limiter
                            )
                    else:
                        _write(connection, token, bodies)
                        await trio.lowlevel.checkpoint()

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for number in range(CLIENTS):
                nursery.start_soon(client, number)
        elapsed = time.perf_counter() - started
        connection.close()
        return CLIENTS * cycles / elapsed

    with tempfile.TemporaryDirectory() as directory:
        return trio.run(main, Path(directory) / "baseline.db")


# A write: its rows' token and bodies, and the event to set once they are committed.
_Write = tuple[str, list[str], trio.Event]


def _group_commit(
    connection: sqlite3.Connection,
    writes: queue.SimpleQueue[_Write | None],
    trio_token: trio.lowlevel.TrioToken,
) -> None:
    """The writer thread: each batch is whatever is queued, in one transaction."""
    while True:
        first = writes.get()
        if first is None:
            return
        batch = [first]
        stop = False
        while True:
            try:
                more = writes.get_nowait()
            except queue.Empty:
                break
            if more is None:
                stop = True
                break
            batch.append(more)
        connection.execute("BEGIN IMMEDIATE")
        connection.executemany(
            _UPSERT, [(token, body) for token, bodies, _ in batch for body in bodies]
        )
        connection.execute("COMMIT")
        events = [event for _, _, event in batch]

        def wake(events: list[trio.Event] = events) -> None:
            for event in events:
                event.set()

        trio_token.run_sync_soon(wake)
        if stop:
            return


def batched_rate(cycles: int) -> float:
    """The same clients and writes through a group-committing writer thread."""

    async def main(path: Path) -> float:
        connection = _connect(path)
        writes: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        writer = threading.Thread(
            target=_group_commit,
            args=(connection, writes, trio.lowlevel.current_trio_token()),
            daemon=True,
        )
        writer.start()

        async def client(number: int) -> None:
            for cycle in range(cycles):
                token = str(uuid.uuid4())
                for bodies in _records(number, cycle):
                    done = trio.Event()
                    writes.put((token, bodies, done))
                    await done.wait()

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for number in range(CLIENTS):
                nursery.start_soon(client, number)
        elapsed = time.perf_counter() - started
        writes.put(None)
        await trio.to_thread.run_sync(writer.join)
        connection.close()
        return CLIENTS * cycles / elapsed

    with tempfile.TemporaryDirectory() as directory:
        return trio.run(main, Path(directory) / "batched.db")


def run(quick: bool, rounds: int) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="trio-supervisor-bench-") as directory:
        return _run(quick, rounds, Path(directory))


def _run(quick: bool, rounds: int, directory: Path) -> list[Result]:
    cycles = 3 if quick else 20

    def sqlite_store() -> Store:
        return SqliteStore(directory / f"{uuid.uuid4().hex}.db")

    def best_baseline() -> float:
        return max(baseline_rate(cycles, threaded=False), baseline_rate(cycles, threaded=True))

    return [
        compare(
            "durable.concurrent",
            ours=lambda: ours_rate(sqlite_store, cycles),
            baseline=lambda: batched_rate(cycles),
            baseline_name="sqlite3 WAL+FULL, group commit by a writer thread",
            unit="cycles/s",
            better="higher",
            target=0.8,
            rounds=rounds,
            note=f"{CLIENTS} clients; the writer thread commits whatever is queued at once",
        ),
        compare(
            "durable.concurrent.naive",
            ours=lambda: ours_rate(sqlite_store, cycles),
            baseline=best_baseline,
            baseline_name="sqlite3 WAL+FULL, one commit per write",
            unit="cycles/s",
            better="higher",
            target=4.0,
            rounds=rounds,
            note="the faster of blocking sqlite3 calls and trio.to_thread",
            informational=True,
        ),
        compare(
            "durable.vs_memory",
            ours=lambda: ours_rate(sqlite_store, cycles),
            baseline=lambda: ours_rate(MemoryStore, cycles),
            baseline_name="ours on MemoryStore",
            unit="cycles/s",
            better="higher",
            target=0.65,
            rounds=rounds,
        ),
        compare(
            "durable.vs_memory.floor",
            ours=lambda: batched_rate(cycles),
            baseline=lambda: ours_rate(MemoryStore, cycles),
            baseline_name="ours on MemoryStore",
            unit="cycles/s",
            better="higher",
            target=0.65,
            rounds=rounds,
            note="the batched sqlite3 baseline (the same writes, no supervisor at all) "
            "against ours on MemoryStore: no store writing to SQLite in this process, "
            "where the supervisor's work comes on top of the same writes, can do better "
            "at durable.vs_memory",
            informational=True,
        ),
    ]
