"""durable.*: open + dispose cycles on the SQLite store, 100 concurrent clients.

The baseline is the same 100 Trio clients writing the same records (one Open, one
Stopping, one Stopped per cycle, as the same JSON) with sqlite3 in WAL mode with
synchronous=FULL, one commit per write; whichever is faster of calling it blocking in
the event loop or through ``trio.to_thread``.
"""

from __future__ import annotations

import sqlite3
import tempfile
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
from trio_supervisor.stores.base import Store
from trio_supervisor.testing import FakeExecution

from .measure import Result, compare

CLIENTS = 100
LEASE = 1e6


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


def _records(client: int, cycle: int) -> list[str]:
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
    return [codec.encode(record) for record in (opened, stopping, stopped)]


def _connect(path: Path) -> sqlite3.Connection:
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = FULL")
    connection.execute(
        "CREATE TABLE IF NOT EXISTS records (token TEXT PRIMARY KEY, body TEXT NOT NULL)"
    )
    return connection


def _write(connection: sqlite3.Connection, token: str, body: str) -> None:
    connection.execute("BEGIN IMMEDIATE")
    connection.execute(
        "INSERT INTO records (token, body) VALUES (?, ?) "
        "ON CONFLICT (token) DO UPDATE SET body = excluded.body",
        (token, body),
    )
    connection.execute("COMMIT")


def baseline_rate(cycles: int, *, threaded: bool) -> float:
    async def main(path: Path) -> float:
        connection = _connect(path)
        lock = trio.Lock()  # one connection: writes take turns, as they must
        limiter = trio.CapacityLimiter(1)

        async def client(number: int) -> None:
            for cycle in range(cycles):
                token = str(uuid.uuid4())
                for body in _records(number, cycle):
                    if threaded:
                        async with lock:
                            await trio.to_thread.run_sync(
                                _write, connection, token, body, limiter=limiter
                            )
                    else:
                        _write(connection, token, body)
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


def run(quick: bool, rounds: int) -> list[Result]:
    cycles = 3 if quick else 20
    directory = Path(tempfile.mkdtemp(prefix="trio-supervisor-bench-"))

    def sqlite_store() -> Store:
        return SqliteStore(directory / f"{uuid.uuid4().hex}.db")

    def best_baseline() -> float:
        return max(baseline_rate(cycles, threaded=False), baseline_rate(cycles, threaded=True))

    return [
        compare(
            "durable.concurrent",
            ours=lambda: ours_rate(sqlite_store, cycles),
            baseline=best_baseline,
            unit="cycles/s",
            better="higher",
            target=4.0,
            rounds=rounds,
            note="baseline: the faster of blocking sqlite3 calls and trio.to_thread",
        ),
        compare(
            "durable.vs_memory",
            ours=lambda: ours_rate(sqlite_store, cycles),
            baseline=lambda: ours_rate(MemoryStore, cycles),
            unit="cycles/s",
            better="higher",
            target=0.7,
            rounds=rounds,
        ),
    ]
