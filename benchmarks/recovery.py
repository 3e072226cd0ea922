"""recovery.*: open_supervisor on a store holding records that are not Stopped.

Ours: ``open_supervisor`` on a SqliteStore left with 10k Open records (sessions without
a child, as after a crash); it reads them, stops each with reason Recovery, and writes
the Stopped records back.

``recovery.10k`` is judged against the floor that V3 and the record format
(docs/design.md, "Persistence and retention") set for any implementation: sqlite3
reading the rows and writing back, in one transaction, the very Stopped records our
recovery wrote (each holds its ``previous`` snapshot, so it is about twice the size of
the row it replaces), with their parsing, checking and encoding done beforehand,
untimed. No implementation that writes those records can beat it.
``recovery.10k.raw`` (informational) is the older baseline: sqlite3 reading the rows and
writing each back unchanged. ``recovery.100k`` is ours on 100k records against ours on
10k, measured alternately in the same run: linear recovery gives 10. Both keep every
Stopped record (``RETENTION``), so both do the same work per record.

Ours runs in a process of its own each time, as a recovery does (it is what a process
does as it starts): run after another in the same process, a recovery also pays for
the one before it. A closed supervisor's records go with Python's next full collection
(its object graph has cycles), which the next recovery's records then trigger: 10%
more at 10k; after a 100k recovery, a 10k one took up to 2.5 times as long.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import trio

from trio_supervisor import (
    Handle,
    Key,
    Limits,
    OpenRecord,
    Retention,
    SqliteStore,
    open_supervisor,
)
from trio_supervisor.testing import FakeExecution

from .measure import Result, compare

# Every Stopped record is kept at both sizes: with the default cap (10,000 in all),
# recovering 100k records would also evict 90k of them, work that 10k never does.
RETENTION = Retention(stopped_per_key=1, stopped_total=1_000_000)


def _prepare(path: Path, records: int) -> None:
    """A store left behind by a crash: ``records`` Open records, nothing Stopped."""

    async def main() -> None:
        async with SqliteStore(path, retention=RETENTION) as store:
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
        async with (
            SqliteStore(scratch, retention=RETENTION) as store,
            open_supervisor(store, FakeExecution()),
        ):
            elapsed = time.perf_counter() - started
        return elapsed

    return trio.run(main)


def ours_fresh(template: Path, scratch: Path) -> float:
    """:func:`ours` in a process of its own, so no run inherits another's heap."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.recovery", str(template), str(scratch)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    return float(done.stdout)


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
        large = directory / "large.db"
        _prepare(large, 10 * records)
        scratch = directory / "scratch.db"
        stopped = _stopped_bodies(template, scratch)
        size = f"{records:,}"
        return [
            compare(
                "recovery.10k",
                ours=lambda: ours_fresh(template, scratch),
                baseline=lambda: baseline(template, scratch, stopped),
                baseline_name="floor: sqlite3 writing back our Stopped records, pre-encoded",
                unit="s",
                better="lower",
                target=1.5,
                rounds=rounds,
                note=f"open_supervisor over {size} unstopped records vs the V3 write-back",
            ),
            compare(
                "recovery.10k.raw",
                ours=lambda: ours_fresh(template, scratch),
                baseline=lambda: baseline(template, scratch),
                baseline_name="sqlite3 read + write back unchanged, one transaction",
                unit="s",
                better="lower",
                target=2.0,
                rounds=rounds,
                note="the rows written back as they were: less than V3 asks",
                informational=True,
            ),
            compare(
                "recovery.100k",
                ours=lambda: ours_fresh(large, scratch),
                baseline=lambda: ours_fresh(template, scratch),
                baseline_name=f"ours over {size} records",
                unit="s",
                better="lower",
                target=11.0,
                rounds=rounds,
                note=f"{10 * records:,} records vs {size}: linear is 10",
            ),
        ]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    print(ours(Path(sys.argv[1]), Path(sys.argv[2])))
