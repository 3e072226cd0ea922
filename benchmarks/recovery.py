"""recovery.10k: open_supervisor on a store holding 10k records that are not Stopped.

Ours: ``open_supervisor`` on a SqliteStore left with that many Open records (sessions
without a child, as after a crash); it reads them, stops each with reason Recovery, and
writes the Stopped records back. Baseline: sqlite3 reading those rows and writing each
back once, in one transaction.

Also measured, against the same baseline: the floor that V3 and the record format
(docs/design.md, "Persistence and retention") set for any implementation. It is sqlite3
reading the rows and writing back, in one transaction, the very Stopped records our
recovery wrote (each holds its ``previous`` snapshot, so it is about twice the size of
the row it replaces), with their parsing, checking and encoding done beforehand,
untimed. Its ratio is in the result's ``extra``: no implementation that writes those
records can beat it.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
import time
import uuid
from pathlib import Path

import trio

from trio_supervisor import Handle, Key, Limits, OpenRecord, SqliteStore, open_supervisor
from trio_supervisor.testing import FakeExecution

from .measure import Result, compare, with_floor


def _prepare(path: Path, records: int) -> None:
    """A store left behind by a crash: ``records`` Open records, nothing Stopped."""

    async def main() -> None:
        async with SqliteStore(path) as store:
            batch = [
                OpenRecord(
                    handle=Handle(
                        key=Key(identity="recovery", instance=str(number)),
                        token=str(uuid.uuid4()),
                        generation=1,
                    ),
                    request_id="r",
                    lease=15.0,
                    limits=Limits(),
                )
                for number in range(records)
            ]
            await store.save_many(batch)

    trio.run(main)


def ours(template: Path, scratch: Path) -> float:
    shutil.copyfile(template, scratch)

    async def main() -> float:
        started = time.perf_counter()
        async with SqliteStore(scratch) as store, open_supervisor(store, FakeExecution()):
            elapsed = time.perf_counter() - started
        return elapsed

    return trio.run(main)


def baseline(template: Path, scratch: Path, stopped: dict[str, str] | None = None) -> float:
    """sqlite3 reading every row and writing it back, in one transaction.

    With ``stopped`` (bodies by token), each row gets that body instead of its own: the
    floor, writing back the Stopped records V3 requires.
    """
    shutil.copyfile(template, scratch)
    started = time.perf_counter()
    connection = sqlite3.connect(scratch, isolation_level=None)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = FULL")
    connection.execute("BEGIN IMMEDIATE")
    rows = connection.execute("SELECT token, body FROM records").fetchall()
    bodies = [(body if stopped is None else stopped[token], token) for token, body in rows]
    connection.executemany("UPDATE records SET body = ? WHERE token = ?", bodies)
    connection.execute("COMMIT")
    elapsed = time.perf_counter() - started
    connection.close()
    return elapsed


def _stopped_bodies(template: Path, scratch: Path) -> dict[str, str]:
    """The Stopped records our recovery writes for ``template``, by token."""
    ours(template, scratch)
    connection = sqlite3.connect(scratch)
    try:
        return dict(connection.execute("SELECT token, body FROM records").fetchall())
    finally:
        connection.close()


def run(quick: bool, rounds: int) -> list[Result]:
    records = 500 if quick else 10_000
    directory = Path(tempfile.mkdtemp(prefix="trio-supervisor-recovery-"))
    try:
        template = directory / "template.db"
        _prepare(template, records)
        scratch = directory / "scratch.db"
        result = compare(
            "recovery.10k",
            ours=lambda: ours(template, scratch),
            baseline=lambda: baseline(template, scratch),
            baseline_name="sqlite3 read + write back, one transaction",
            unit="s",
            better="lower",
            target=2.0,
            rounds=rounds,
            note=f"open_supervisor over {records:,} unstopped records vs sqlite3 read+write",
        )
        stopped = _stopped_bodies(template, scratch)
        return [
            with_floor(
                result,
                "write_back_floor_s",
                floor=lambda: baseline(template, scratch, stopped),
                baseline=lambda: baseline(template, scratch),
                rounds=rounds,
            )
        ]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
