"""SqliteStore: durability, crashes, group commit, retention, high-water, bad data."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_supervisor import (
    Disposed,
    ExitStatus,
    Fault,
    Handle,
    Key,
    Limits,
    Load,
    LoadFailed,
    MemoryStore,
    OpenRecord,
    RecordFormatError,
    Retention,
    SessionRecord,
    SqliteStore,
    StateStorageError,
    StoppedRecord,
    Termination,
    codec,
)
from trio_supervisor.abc import Store
from trio_supervisor.stores._sqlite_sql import ROWS, SCHEMA_VERSION
from trio_supervisor.testing import FakeExecution

from ..support.processes import launched
from ..support.sessions import KEY, opened, supervise

DONE = Termination(kind="exited", exit=ExitStatus(code=0))


def copy_database(source: Path, target: Path) -> None:
    """Copy a database and its write-ahead log as they are, the way a crash leaves them."""
    for suffix in ("", "-wal"):
        if Path(f"{source}{suffix}").exists():
            shutil.copy(f"{source}{suffix}", f"{target}{suffix}")


def open_record(instance: str, generation: int, *, token: str | None = None) -> OpenRecord:
    handle = Handle(
        key=Key(identity="p", instance=instance),
        token=token or f"{instance}-{generation}".rjust(32, "0"),
        generation=generation,
    )
    return OpenRecord(handle=handle, request_id=f"r{generation}", lease=5.0, limits=Limits())


def stopped(instance: str, generation: int) -> StoppedRecord:
    return StoppedRecord.of(open_record(instance, generation), Disposed(), DONE)


async def test_records_survive_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    records: list[SessionRecord] = [open_record("a", 1), stopped("b", 1), open_record("b", 2)]
    async with SqliteStore(path) as store:
        for record in records:
            await store.save(record)
    async with SqliteStore(path) as store:
        assert list(await store.list()) == records
        assert await store.high_water() == {
            Key(identity="p", instance="a"): 1,
            Key(identity="p", instance="b"): 2,
        }


async def test_a_record_replaces_the_earlier_record_of_its_token(tmp_path: Path) -> None:
    async with SqliteStore(tmp_path / "state.db") as store:
        await store.save(open_record("a", 1))
        await store.save(stopped("a", 1))
        assert list(await store.list()) == [stopped("a", 1)]


def test_acknowledged_records_survive_a_kill_without_close(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    writer = textwrap.dedent(
        f"""
        import sys, trio
        from tests.adapters.test_sqlite_store import open_record
        from trio_supervisor import SqliteStore

        async def main():
            store = SqliteStore({str(path)!r})
            for generation in range(1, 21):
                await store.save(open_record("a", generation))
            print("saved", flush=True)
            await trio.sleep_forever()

        trio.run(main)
        """
    )
    # The readiness handshake: its "saved" line; then it is killed, mid-run.
    command = [sys.executable, "-c", writer]
    with launched(command, ready=lambda line: line == "saved\n", stop=signal.SIGKILL) as child:
        assert child.lines == ["saved\n"]
    assert child.process.returncode == -signal.SIGKILL

    async def read() -> tuple[list[SessionRecord], dict[Key, int]]:
        async with SqliteStore(path) as store:
            return list(await store.list()), dict(await store.high_water())

    records, marks = trio.run(read)
    assert records == [open_record("a", generation) for generation in range(1, 21)]
    assert marks == {Key(identity="p", instance="a"): 20}


async def test_a_copy_taken_mid_run_holds_everything_acknowledged(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    copy = tmp_path / "copy"
    copy.mkdir()
    store = SqliteStore(path)
    for generation in range(1, 6):
        await store.save(open_record("a", generation))
    copy_database(path, copy / "state.db")
    async with SqliteStore(copy / "state.db") as twin:
        assert list(await twin.list()) == list(await store.list())
    await store.aclose()


def modes(directory: Path) -> dict[str, str]:
    """Each file of ``directory`` and its mode, in octal."""
    return {file.name: oct(stat.S_IMODE(file.stat().st_mode)) for file in directory.iterdir()}


@pytest.fixture
def no_umask() -> Iterator[None]:
    """A umask of 0, so that a file's mode is the one it is made with: SQLite's own, 0644,
    for a file it makes with no mode to copy."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.mark.usefixtures("no_umask")
async def test_the_file_and_its_write_ahead_log_are_their_owners_alone(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    async with SqliteStore(path) as store:
        await store.save(open_record("a", 1))
        seen = modes(tmp_path)
        assert "state.db-wal" in seen  # SQLite made it, with the file's mode
        assert seen == dict.fromkeys(seen, "0o600")
    seen = modes(tmp_path)
    assert seen == dict.fromkeys(seen, "0o600")
    assert "state.db" in seen


@pytest.mark.usefixtures("no_umask")
async def test_a_file_and_the_log_a_crash_left_are_made_their_owners_alone(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    copy = tmp_path / "copy"
    copy.mkdir()
    store = SqliteStore(path)
    await store.save(open_record("a", 1))
    copy_database(path, copy / "state.db")  # a file and its log, as a crash leaves them
    await store.aclose()
    for file in copy.iterdir():
        file.chmod(0o644)
    assert modes(copy) == {"state.db": "0o644", "state.db-wal": "0o644"}
    async with SqliteStore(copy / "state.db") as twin:
        seen = modes(copy)
        assert "state.db-wal" in seen
        assert seen == dict.fromkeys(seen, "0o600")
        assert list(await twin.list()) == [open_record("a", 1)]


async def test_concurrent_saves_share_transactions(tmp_path: Path) -> None:
    async with SqliteStore(tmp_path / "state.db") as store:
        for generation in range(1, 4):
            await store.save(open_record("a", generation))
        assert store.commits == 3, "a save alone is a transaction of its own"
        async with trio.open_nursery() as nursery:
            for generation in range(1, 101):
                nursery.start_soon(store.save, open_record(f"k{generation}", 1))
        assert len(await store.list()) == 103
        assert store.commits - 3 <= 10, "group commit batches the queue"


async def test_a_save_cancelled_in_the_queue_writes_nothing(tmp_path: Path) -> None:
    async with SqliteStore(tmp_path / "state.db") as store:
        outcomes = []
        for generation in range(1, 31):
            record = open_record("a", generation)
            with trio.move_on_after(0) as scope:
                await store.save(record)
            present = record.handle.token in {stored.handle.token for stored in await store.list()}
            outcomes.append((scope.cancelled_caught, present))
            # Cancelled means not written; returned means written.
            assert present != scope.cancelled_caught
        assert any(cancelled for cancelled, _ in outcomes)


async def test_retention_keeps_the_newest_per_key_and_a_total_cap(tmp_path: Path) -> None:
    retention = Retention(stopped_per_key=2, stopped_total=3)
    async with SqliteStore(tmp_path / "state.db", retention=retention) as store:
        for generation in range(1, 5):
            await store.save(stopped("a", generation))
        await store.save(open_record("b", 1))
        await store.save(stopped("c", 1))
        await store.save(stopped("c", 2))
        kept = [
            (record.handle.key.instance, record.handle.generation) for record in await store.list()
        ]
        # a: 3 and 4 are its newest two, but the cap of 3 Stopped evicts a3 as the oldest.
        assert kept == [("a", 4), ("b", 1), ("c", 1), ("c", 2)]
        assert (await store.high_water())[Key(identity="p", instance="a")] == 4


async def contents(*stores: Store) -> list[tuple[list[SessionRecord], Mapping[Key, int]]]:
    """Each store's records and high-water marks."""
    return [(list(await store.list()), await store.high_water()) for store in stores]


def operation(instance: str, generation: int, stop: bool) -> SessionRecord:
    """The record one step of a retention test saves."""
    return stopped(instance, generation) if stop else open_record(instance, generation)


operations = st.lists(
    st.tuples(st.sampled_from("abc"), st.integers(min_value=1, max_value=6), st.booleans()),
    max_size=25,
)
# Retention's stopped_for: none, a few steps of the clock (records come of age during
# an example), or past every example.
KEPT_FOR = st.sampled_from([0.0, 12.0, 1000.0])
STEP = 5.0  # seconds the clock moves per saved record


class Clock:
    """A wall clock for retention that the test moves itself."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_a_young_stopped_record_outlives_the_count_per_key_across_a_restart(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    retention = Retention(stopped_per_key=1, stopped_total=10, stopped_for=60.0)
    clock = Clock()
    async with SqliteStore(path, retention=retention, clock=clock) as store:
        for generation in (1, 2, 3):
            await store.save(stopped("a", generation))
            clock.now += 20.0
        # Stopped at 0, 20 and 40 s; the newest is kept by the count, the two others
        # because they are younger than a minute.
        assert [record.handle.generation for record in await store.list()] == [1, 2, 3]
    clock.now += 10.0  # 70 s: generation 1 is 70 s old, generation 2 is 50 s old
    async with SqliteStore(path, retention=retention, clock=clock) as store:
        # Only a new stop evicts: reopening takes nothing away.
        assert [record.handle.generation for record in await store.list()] == [1, 2, 3]
        await store.save(open_record("a", 4))
        assert len(await store.list()) == 4
        await store.save(stopped("a", 4))
        assert [record.handle.generation for record in await store.list()] == [2, 3, 4]
        # The cap in all evicts the oldest, however young.
        for instance in "bcdefghi":
            await store.save(stopped(instance, 1))
        assert [record.handle.generation for record in await store.list()][:2] == [3, 4]


async def test_a_version_1_file_is_migrated_and_its_stops_count_as_long_ago(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    old = stopped("a", 1)
    connection = sqlite3.connect(path)
    connection.executescript(
        """
        CREATE TABLE schema_version (version INTEGER NOT NULL);
        INSERT INTO schema_version VALUES (1);
        CREATE TABLE records (
            token TEXT PRIMARY KEY, identity TEXT NOT NULL, instance TEXT NOT NULL,
            saved INTEGER NOT NULL, stopped INTEGER, body TEXT NOT NULL
        );
        CREATE TABLE high_water (
            identity TEXT NOT NULL, instance TEXT NOT NULL, generation INTEGER NOT NULL,
            PRIMARY KEY (identity, instance)
        ) WITHOUT ROWID;
        """
    )
    connection.execute(
        "INSERT INTO records VALUES (?, 'p', 'a', 1, 1, ?)",
        (old.handle.token, codec.encode(old)),
    )
    connection.execute("INSERT INTO high_water VALUES ('p', 'a', 1)")
    connection.commit()
    connection.close()
    retention = Retention(stopped_per_key=1, stopped_total=10, stopped_for=3600.0)
    async with SqliteStore(path, retention=retention) as store:
        assert list(await store.list()) == [old]
        await store.save(stopped("a", 2))
        assert list(await store.list()) == [stopped("a", 2)]
    connection = sqlite3.connect(path)
    assert connection.execute("SELECT version FROM schema_version").fetchall() == [(2,)]
    connection.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=operations,
    per_key=st.integers(1, 3),
    total=st.integers(1, 5),
    kept_for=KEPT_FOR,
)
def test_retention_matches_the_memory_store(
    tmp_path: Path, ops: list[tuple[str, int, bool]], per_key: int, total: int, kept_for: float
) -> None:
    retention = Retention(stopped_per_key=per_key, stopped_total=total, stopped_for=kept_for)
    clock = Clock()

    async def apply() -> list[tuple[list[SessionRecord], Mapping[Key, int]]]:
        path = tmp_path / f"r{abs(hash((tuple(ops), per_key, total, kept_for)))}.db"
        path.unlink(missing_ok=True)
        memory = MemoryStore(retention=retention, clock=clock)
        async with SqliteStore(path, retention=retention, clock=clock) as sqlite:
            for instance, generation, stop in ops:
                clock.now += STEP
                record = operation(instance, generation, stop)
                await memory.save(record)
                await sqlite.save(record)
            return await contents(memory, sqlite)

    (in_memory, memory_marks), (in_sqlite, sqlite_marks) = trio.run(apply)
    assert in_sqlite == in_memory
    assert sqlite_marks == memory_marks


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batches=st.lists(operations, min_size=1, max_size=4),
    per_key=st.integers(1, 3),
    total=st.integers(1, 5),
    kept_for=KEPT_FOR,
)
def test_retention_in_batches_and_across_reopens_matches_the_memory_store(
    tmp_path: Path,
    batches: list[list[tuple[str, int, bool]]],
    per_key: int,
    total: int,
    kept_for: float,
) -> None:
    # Each batch is one transaction (save_many) at one instant, and the file is closed
    # and opened again between batches: what the store knows of the table (its stops'
    # times too) must survive both.
    retention = Retention(stopped_per_key=per_key, stopped_total=total, stopped_for=kept_for)
    clock = Clock()

    async def apply() -> list[tuple[list[SessionRecord], Mapping[Key, int]]]:
        path = tmp_path / f"b{abs(hash((repr(batches), per_key, total, kept_for)))}.db"
        path.unlink(missing_ok=True)
        memory = MemoryStore(retention=retention, clock=clock)
        for batch in batches:
            clock.now += STEP * len(batch)
            records = [operation(*step) for step in batch]
            for record in records:
                await memory.save(record)
            async with SqliteStore(path, retention=retention, clock=clock) as sqlite:
                await sqlite.save_many(records)
        async with SqliteStore(path, retention=retention, clock=clock) as sqlite:
            return await contents(memory, sqlite)

    (in_memory, memory_marks), (in_sqlite, sqlite_marks) = trio.run(apply)
    assert in_sqlite == in_memory
    assert sqlite_marks == memory_marks


async def test_a_failed_transaction_changes_nothing_and_later_saves_apply_retention(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    retention = Retention(stopped_per_key=1, stopped_total=10)
    async with SqliteStore(path, retention=retention) as store:
        await store.save(stopped("a", 1))
    # A trigger makes any transaction that writes generation 3 of "a" fail.
    connection = sqlite3.connect(path)
    poisoned = stopped("a", 3).handle.token
    connection.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON records "
        f"WHEN NEW.token = '{poisoned}' BEGIN SELECT RAISE(ABORT, 'refused'); END"
    )
    connection.commit()
    connection.close()
    async with SqliteStore(path, retention=retention) as store:
        with pytest.raises(StateStorageError, match="refused"):
            await store.save_many([stopped("a", 2), stopped("a", 3)])
        # Nothing of the failed batch landed: a1 is still a's one Stopped record.
        assert [record.handle.generation for record in await store.list()] == [1]
        assert (await store.high_water())[Key(identity="p", instance="a")] == 1
        # A later save evicts a1, as if the failed batch had never been tried.
        await store.save(stopped("a", 4))
        assert [record.handle.generation for record in await store.list()] == [4]
        await store.save(stopped("b", 1))
        kept = [(r.handle.key.instance, r.handle.generation) for r in await store.list()]
        assert kept == [("a", 4), ("b", 1)]


async def test_a_batch_of_several_statements_is_still_one_transaction(tmp_path: Path) -> None:
    # A batch is written as multi-row statements of at most ROWS rows; one bigger than
    # that takes several, which must land together or not at all.
    batch = [open_record(f"k{number}", 1) for number in range(2 * ROWS + 10)]
    path = tmp_path / "state.db"
    async with SqliteStore(path) as store:
        await store.save(open_record("first", 1))
    connection = sqlite3.connect(path)
    connection.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON records "
        f"WHEN NEW.token = '{batch[-1].handle.token}' BEGIN SELECT RAISE(ABORT, 'refused'); END"
    )
    connection.commit()
    connection.close()
    async with SqliteStore(path) as store:
        with pytest.raises(StateStorageError, match="refused"):
            await store.save_many(batch)
        assert [record.handle.key.instance for record in await store.list()] == ["first"]
        assert list(await store.high_water()) == [Key(identity="p", instance="first")]
        await store.save_many(batch[:-1])  # the same batch but for the refused record
        assert len(await store.list()) == len(batch)
        assert len(await store.high_water()) == len(batch)


@pytest.mark.parametrize("reopen", [False, True])
async def test_a_batch_larger_than_one_statement_keeps_what_the_memory_store_keeps(
    tmp_path: Path, reopen: bool
) -> None:
    # A batch of more than ROWS changes is written by plain statements, one kind of
    # change at a time (Worker._write_large), not through the trigger: evictions, marks
    # (one raised by a record the batch then evicts too) and un-stopped records must
    # come out as the memory store has them.
    retention = Retention(stopped_per_key=1, stopped_total=ROWS // 2)
    earlier = [stopped(f"k{number}", 1) for number in range(ROWS // 4)]
    batch: list[SessionRecord] = []
    for number in range(ROWS):
        instance = f"k{number}"
        batch += [stopped(instance, 5), stopped(instance, 2), open_record(instance, 7)]
        if number % 3 == 0:
            batch.append(open_record(instance, 2))  # un-stops the Stopped record of 2
    memory = MemoryStore(retention=retention)
    path = tmp_path / "state.db"
    async with SqliteStore(path, retention=retention) as store:
        for records in (earlier, batch):
            await memory.save_many(records)
            await store.save_many(records)
        in_sqlite = await contents(store)
    if reopen:
        async with SqliteStore(path, retention=retention) as store:
            in_sqlite = await contents(store)
    assert in_sqlite == await contents(memory)


async def test_the_high_water_outlives_eviction_and_generations_continue(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    fake = FakeExecution()
    retention = Retention(stopped_per_key=1, stopped_total=1)
    async with SqliteStore(path, retention=retention) as store, supervise(store, fake) as sup:
        for generation in range(1, 4):
            await sup.dispose(await opened(sup, request_id=f"r{generation}"))
        await sup.dispose(await opened(sup, key=Key(identity="other", instance="x")))
    async with SqliteStore(path, retention=retention) as store:
        assert all(record.handle.key != KEY for record in await store.list())
        async with supervise(store, fake) as sup:
            assert await sup.high_water(KEY) == 3
            assert (await sup.open(KEY, "again", expected_generation=3)).handle.generation == 4


async def test_a_supervisor_runs_on_sqlite_and_recovers_from_it(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    fake = FakeExecution()
    async with SqliteStore(path) as store, supervise(store, fake) as sup:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="x"))
        assert (await sup.dispose(handle)).exit.signal == signal.SIGTERM
        survivor = await opened(sup, request_id="r2")
        await sup.load(survivor, Load(specifier="x"))
        # A crash now: a copy of the file is what the next run finds.
        copy_database(path, tmp_path / "crashed.db")
        async with (
            SqliteStore(tmp_path / "crashed.db") as crashed,
            supervise(crashed, fake) as second,
        ):
            record = await second.status(survivor)
            assert isinstance(record, StoppedRecord)
            assert record.reason.kind == "Recovery"
            assert await second.high_water(KEY) == 2


def corrupt(path: Path, sql: str, *args: object) -> None:
    with sqlite3.connect(path) as connection:
        connection.execute(sql, args)
    connection.close()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("{not json", "is unreadable: a stored record is not valid JSON"),
        ('{"version": 2}', r"unsupported record version 2"),
        (None, "holds the record of another session"),
    ],
)
async def test_a_corrupt_row_is_a_clear_error_naming_it(
    tmp_path: Path, body: str | None, words: str
) -> None:
    path = tmp_path / "state.db"
    async with SqliteStore(path) as store:
        await store.save(open_record("a", 1))
        await store.save(open_record("b", 1))
    if body is None:
        body = codec.encode(open_record("b", 1))
    corrupt(path, "UPDATE records SET body = ? WHERE instance = 'a'", body)
    async with SqliteStore(path) as store:
        with pytest.raises(RecordFormatError, match=words) as caught:
            await store.list()
        assert "p/a" in caught.value.detail
        assert str(path) in caught.value.detail
    with pytest.raises(RecordFormatError):
        async with SqliteStore(path) as store, supervise(store, FakeExecution()):
            pytest.fail("started on a corrupt store")


def failed(record: OpenRecord, message: str) -> StoppedRecord:
    termination = Termination(
        kind="exited", exit=ExitStatus(code=1), cause=(Fault(type="OSError", message=message),)
    )
    return StoppedRecord.of(record, LoadFailed(cause=()), termination)


async def test_records_json_writes_in_more_than_one_way_are_stored_as_they_are(
    tmp_path: Path,
) -> None:
    # Text that is not ASCII, and what only the fallback writer writes: an integer beyond
    # 64 bits and a lone surrogate (which SQLite could not store unescaped).
    records: list[SessionRecord] = [
        failed(open_record("a", 1), "fichier supprimé 🗑"),
        failed(open_record("b", 1), "no such file: b'\udcff'"),
        StoppedRecord.of(
            OpenRecord(
                handle=open_record("c", 1).handle,
                request_id="r",
                lease=5.0,
                limits=Limits(memory_bytes=2**70),
            ),
            Disposed(),
            DONE,
        ),
    ]
    path = tmp_path / "state.db"
    async with SqliteStore(path) as store:
        await store.save_many(records)
    async with SqliteStore(path) as store:
        assert list(await store.list()) == records


async def test_a_row_sqlite_lets_through_but_no_record_can_hold_is_named(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    async with SqliteStore(path) as store:
        await store.save(open_record("a", 1))
    corrupt(path, "UPDATE records SET token = NULL")  # a TEXT PRIMARY KEY may be NULL
    async with SqliteStore(path) as store:
        with pytest.raises(RecordFormatError, match="a record row is malformed") as caught:
            await store.list()
        assert str(path) in caught.value.detail


async def test_a_store_that_failed_to_open_leaves_the_file_to_others(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    async with SqliteStore(path):
        pass
    corrupt(path, "UPDATE schema_version SET version = 9")
    with pytest.raises(StateStorageError, match="schema version"):
        async with SqliteStore(path):
            pass
    # Its worker thread ends (it may still be on its way out, but not stay).
    for worker in threading.enumerate():
        if worker.name == f"trio_supervisor sqlite {path}":
            worker.join(timeout=5)
            assert not worker.is_alive()
    # Neither its connection nor its lock outlived it: the file can be repaired.
    corrupt(path, f"UPDATE schema_version SET version = {SCHEMA_VERSION}")
    async with SqliteStore(path) as store:
        assert list(await store.list()) == []


async def test_an_unknown_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    async with SqliteStore(path):
        pass
    corrupt(path, "UPDATE schema_version SET version = 9")
    with pytest.raises(StateStorageError, match=r"schema version \[9\]"):
        async with SqliteStore(path):
            pass


async def test_a_second_store_on_the_same_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    async with SqliteStore(path) as first:
        await first.save(open_record("a", 1))
        with pytest.raises(StateStorageError) as refused:
            async with SqliteStore(path):
                pass
        assert refused.value.detail == (
            f"{path}: cannot open: the file is locked by another store that owns it, in "
            "this process"
        )
        await first.save(open_record("a", 2))  # the first one is undisturbed
    async with SqliteStore(path) as again:  # and gave the file up as it closed
        assert [record.handle.generation for record in await again.list()] == [1, 2]


def test_a_store_another_process_owns_is_refused_at_once_naming_that_process(
    tmp_path: Path,
) -> None:
    # Another process's store owns the file: the second store says so as it opens,
    # naming the process, instead of waiting out SQLite's lock timeout (a minute here;
    # had it waited, its message would say the lock was waited out).
    path = tmp_path / "state.db"
    owner = textwrap.dedent(
        f"""
        import trio
        from trio_supervisor import SqliteStore

        async def main():
            async with SqliteStore({str(path)!r}):
                print("open", flush=True)
                await trio.sleep_forever()

        trio.run(main)
        """
    )
    command = [sys.executable, "-c", owner]
    with launched(command, ready=lambda line: line == "open\n") as holder:

        async def second() -> StateStorageError:
            with pytest.raises(StateStorageError) as refused:
                async with SqliteStore(path, timeout=60.0):
                    pass
            return refused.value

        detail = trio.run(second).detail
        assert detail.startswith(
            f"{path}: cannot open: the file is locked by another store that owns it, in "
            f"process {holder.process.pid} ("
        ), detail
        assert holder.process.poll() is None  # the owner serves on
    assert holder.process.returncode == -signal.SIGTERM


def test_a_lock_no_store_owns_is_waited_for(tmp_path: Path) -> None:
    # A brief writer that is no store (a tool, a checkpoint) holds SQLite's lock: a
    # store that opens meanwhile waits for it, up to its timeout, rather than refusing.
    path = tmp_path / "state.db"

    async def make() -> None:
        async with SqliteStore(path) as store:
            await store.save(open_record("a", 1))

    trio.run(make)
    writer = textwrap.dedent(
        f"""
        import sqlite3, sys
        connection = sqlite3.connect({str(path)!r}, isolation_level=None)
        connection.execute("BEGIN EXCLUSIVE")
        print("held", flush=True)
        sys.stdin.readline()  # held until the test says
        connection.execute("COMMIT")
        connection.close()
        print("released", flush=True)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", writer], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as tool:
        assert tool.stdin is not None
        assert tool.stdout is not None
        assert tool.stdout.readline() == "held\n"

        async def impatient() -> str:
            with pytest.raises(StateStorageError) as refused:
                async with SqliteStore(path, timeout=0.05):
                    pass
            return refused.value.detail

        # Past its timeout a store says the file stayed locked, and by no store.
        detail = trio.run(impatient)
        assert "locked by another connection for longer than the store waits" in detail

        async def patient() -> list[SessionRecord]:
            async with trio.open_nursery() as nursery:
                # The tool lets go while the store waits (or, on a slow machine, before
                # the store began to: it opens then all the same).
                nursery.start_soon(trio.to_thread.run_sync, release, tool)
                async with SqliteStore(path, timeout=60.0) as store:
                    return list(await store.list())

        assert trio.run(patient) == [open_record("a", 1)]
        assert tool.wait(timeout=60) == 0


def release(tool: subprocess.Popen[str]) -> None:
    """Tell the tool of the test above to let its lock go, and wait until it did."""
    assert tool.stdin is not None
    assert tool.stdout is not None
    tool.stdin.write("go\n")
    tool.stdin.flush()
    assert tool.stdout.readline() == "released\n"


async def test_a_closed_store_refuses_saves(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    await store.save(open_record("a", 1))
    await store.aclose()
    with pytest.raises(StateStorageError, match="closed"):
        await store.save(open_record("a", 2))


async def test_a_mark_raised_by_a_record_the_same_batch_evicts_is_kept(tmp_path: Path) -> None:
    # Generation 5 raises the key's mark and stops first; generation 2 stops after it and
    # evicts it (one Stopped record per key). The mark rode in 5's row: it must survive.
    path = tmp_path / "state.db"
    retention = Retention(stopped_per_key=1)
    async with SqliteStore(path, retention=retention) as store:
        await store.save_many([stopped("a", 5), stopped("a", 2)])
    async with SqliteStore(path, retention=retention) as store:
        assert [record.handle.generation for record in await store.list()] == [2]
        assert await store.high_water() == {Key(identity="p", instance="a"): 5}


async def test_a_mark_stays_when_its_token_is_saved_again_in_the_batch(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    async with SqliteStore(path) as store:
        await store.save_many([open_record("a", 3), stopped("a", 3)])
    async with SqliteStore(path) as store:
        assert await store.list() == [stopped("a", 3)]
        assert await store.high_water() == {Key(identity="p", instance="a"): 3}


def test_only_a_flock_names_the_holder_of_a_file(tmp_path: Path) -> None:
    """The store's ownership is a flock: a POSIX lock on the same file (SQLite's own
    kind) holds nothing the store looks for (kills mutmut's mutants of holder)."""
    import fcntl

    from trio_supervisor.stores._sqlite_file import holder

    path = tmp_path / "state.db"
    path.touch()
    fd = os.open(path, os.O_RDWR)
    try:
        assert holder(fd) is None
        fcntl.lockf(fd, fcntl.LOCK_EX)
        assert holder(fd) is None
        fcntl.lockf(fd, fcntl.LOCK_UN)
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert holder(fd) == "this process"
    finally:
        os.close(fd)


def test_a_holder_s_command_line_is_one_line_cut_short_past_120_characters() -> None:
    """Arguments joined by single spaces whatever whitespace they hold, bytes that are
    not UTF-8 replaced, cut to 117 characters and "..." past 120; nothing for a process
    without a command line (a zombie) or without a /proc entry."""
    from trio_supervisor.stores._sqlite_file import _command_of

    from ..support.waits import settled

    script = "print('ready', flush=True); import sys; sys.stdin.read()"
    # argv[0] is "py" whatever the interpreter's path: the line's length is the test's.
    words = ["py", "-c", script, "two  words\nhere", os.fsdecode(b"\xff")]
    shown = f"py -c {script} two words here \ufffd"

    def command_of(padding: int) -> str:
        argv = [*words, "p" * padding]
        with subprocess.Popen(
            argv,
            executable=sys.executable,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as child:
            assert child.stdout is not None
            assert child.stdin is not None
            assert child.stdout.readline() == "ready\n"
            found = _command_of(child.pid)
            child.stdin.close()
        return found

    fits = 120 - len(shown) - 1  # the padding's length that makes the line 120 long
    assert command_of(fits) == f" ({shown} {'p' * fits})"
    assert command_of(fits + 1) == f" ({(shown + ' ' + 'p' * (fits + 1))[:117]}...)"
    with subprocess.Popen([sys.executable, "-c", "pass"]) as zombie:
        stat_file = Path(f"/proc/{zombie.pid}/stat")
        assert settled(lambda: stat_file.read_text().rsplit(")", 1)[1].split()[0] == "Z", 10.0)
        assert _command_of(zombie.pid) == ""
    assert _command_of(int(Path("/proc/sys/kernel/pid_max").read_text()) + 1) == ""


def test_a_batch_is_written_in_chunks_of_its_size_then_of_halves_of_it() -> None:
    """A few sizes only, so that sqlite3 keeps their statements prepared."""
    from trio_supervisor.stores._sqlite_worker import _chunks

    assert [len(chunk) for chunk in _chunks(list(range(27)), 8)] == [8, 8, 8, 2, 1]
    assert list(_chunks(list(range(5)), 8)) == [[0, 1, 2, 3], [4]]
    assert list(_chunks([], 8)) == []


async def test_save_orders_edited_by_hand_are_listed_as_sqlite_sorts_them(
    tmp_path: Path,
) -> None:
    """A save order Python cannot compare with the others (text, put there by hand) is
    sorted by SQLite instead: numbers first, then text."""
    path = tmp_path / "state.db"
    async with SqliteStore(path) as store:
        for instance in ("a", "b", "c"):
            await store.save(open_record(instance, 1))
    with sqlite3.connect(path) as edited:
        edited.execute("UPDATE records SET saved = 'by hand' WHERE instance = 'a'")
    edited.close()
    async with SqliteStore(path) as store:
        listed = [record.handle.key.instance for record in await store.list()]
    assert listed == ["b", "c", "a"]


async def test_the_marks_read_before_any_listing_name_their_keys(tmp_path: Path) -> None:
    """high_water() names each mark's key whether or not list() read it first."""
    path = tmp_path / "state.db"
    async with SqliteStore(path) as store:
        await store.save(open_record("a", 3))
    async with SqliteStore(path) as store:
        assert await store.high_water() == {Key(identity="p", instance="a"): 3}
