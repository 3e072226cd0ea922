"""SqliteStore's failures, each on a real file: one that cannot be opened or made
private, one that is no database or a corrupt one, a schema of another version, rows
edited by hand, a second owner, a store closed under its calls. Every failure is a
StateStorageError naming the file and what failed, and the store serves on (or, where
it failed to open, lets the file go)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

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
    RecordFormatError,
    SessionRecord,
    SqliteStore,
    StateStorageError,
    StoppedRecord,
    Termination,
    codec,
)
from trio_supervisor.stores._sqlite_sql import SCHEMA_VERSION

BOUND = 10.0  # seconds a call of a store may take here before the test fails
DONE = Termination(kind="exited", exit=ExitStatus(code=0))


def record(instance: str, generation: int = 1, *, request_id: str = "r") -> OpenRecord:
    """An open record of key p/``instance``, whose token starts with its instance."""
    handle = Handle(
        key=Key(identity="p", instance=instance),
        token=f"{instance * 8}{generation}".ljust(32, "0"),
        generation=generation,
    )
    return OpenRecord(handle=handle, request_id=request_id, lease=5.0, limits=Limits())


def stopped(instance: str, generation: int = 1) -> StoppedRecord:
    return StoppedRecord.of(record(instance, generation), Disposed(), DONE)


def edit(path: Path, *statements: str) -> None:
    """Change a closed store's file by hand, as a tool would."""
    connection = sqlite3.connect(path)
    try:
        for statement in statements:
            connection.execute(statement)
        connection.commit()
    finally:
        connection.close()


async def made(path: Path, *records: SessionRecord) -> None:
    """Make a store's file at ``path`` holding ``records``."""
    async with SqliteStore(path) as store:
        await store.save_many(records)


def descriptors_of(target: Path | str) -> int:
    """How many of this process's descriptors are open on ``target``."""
    real = os.path.realpath(target)
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == real:
                count += 1
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return count


def link(path: Path | str, target: Path | str) -> str:
    """Make ``path`` a symbolic link to ``target``; where ``path`` leads in the end."""
    os.symlink(target, path)
    return os.path.realpath(path)


def modes(directory: Path) -> dict[str, int]:
    """Each file of ``directory`` and its mode."""
    return {file.name: stat.S_IMODE(file.stat().st_mode) for file in directory.iterdir()}


def workers(path: Path | str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"trio_supervisor sqlite {path}"]


async def refusal(store: SqliteStore) -> StateStorageError:
    """What entering ``store`` fails with (it is closed again on the way out)."""
    with pytest.raises(StateStorageError) as refused:
        async with store:
            pytest.fail(f"opened {store.path}")
    return refused.value


# -- a file that cannot be opened or made private ------------------------------------


async def test_a_file_in_a_missing_directory_fails_every_call_and_the_store_still_closes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "missing" / "state.db"
    store = SqliteStore(path)
    with pytest.raises(StateStorageError) as opening:
        await store.open()
    failure = opening.value
    assert failure.detail == f"{path}: cannot open: No such file or directory"
    assert isinstance(failure.__cause__, FileNotFoundError)
    # Every later call gets the same error; none waits forever.
    with pytest.raises(StateStorageError) as again:
        await store.list()
    assert again.value is failure
    with pytest.raises(StateStorageError) as saving:
        await store.save(record("a"))
    assert saving.value is failure
    (worker,) = workers(path)
    await store.aclose()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert not path.parent.exists()


async def test_a_database_the_system_will_not_make_private_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    real = link(path, "/proc/self/status")
    before = descriptors_of(real)
    failure = await refusal(SqliteStore(path))
    assert failure.detail == (
        f"{path}: cannot open: cannot make {real} readable and writable by its owner "
        "alone (mode 0600): Operation not permitted"
    )
    assert isinstance(failure.__cause__, PermissionError)
    assert descriptors_of(real) == before  # the descriptor it opened is closed again


async def test_a_companion_the_system_will_not_make_private_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    link(f"{path}-wal", "/proc/self/status")
    failure = await refusal(SqliteStore(path))
    assert failure.detail == (
        f"{path}: cannot open: cannot make {path}-wal readable and writable by its owner "
        "alone (mode 0600): Operation not permitted"
    )
    assert descriptors_of(path) == 0


@pytest.mark.usefixtures("no_umask")
async def test_the_companions_of_the_file_a_link_leads_to_are_made_private(
    tmp_path: Path,
) -> None:
    # SQLite names the write-ahead log and the journals after the file a link leads to:
    # those, left by a crash with another mode, are made the owner's alone.
    real = tmp_path / "real"
    real.mkdir()
    await made(real / "state.db", record("a"))
    for suffix in ("-wal", "-shm", "-journal"):
        os.close(os.open(f"{real / 'state.db'}{suffix}", os.O_WRONLY | os.O_CREAT, 0o644))
    for file in real.iterdir():
        file.chmod(0o644)
    link(tmp_path / "link.db", real / "state.db")
    async with SqliteStore(tmp_path / "link.db") as store:
        assert list(await store.list()) == [record("a")]
        seen = {file.name: stat.S_IMODE(file.stat().st_mode) for file in real.iterdir()}
    # SQLite may remove a companion it does not need: what is there is private.
    assert "state.db-shm" in seen
    assert "state.db-journal" in seen
    assert seen == dict.fromkeys(seen, 0o600)


@pytest.fixture
def no_umask() -> Iterator[None]:
    """A umask of 0: a file keeps the mode it is given."""
    previous = os.umask(0)
    yield
    os.umask(previous)


async def test_a_file_and_companions_private_already_keep_their_modes(tmp_path: Path) -> None:
    """Read-only to their owner (0400) is private: the store changes no such mode (root
    writes the file all the same)."""
    if os.geteuid() != 0:
        pytest.skip("only root writes a file of mode 0400")
    path = tmp_path / "state.db"
    await made(path, record("a"))
    for suffix in ("-shm", "-journal"):
        os.close(os.open(f"{path}{suffix}", os.O_WRONLY | os.O_CREAT, 0o400))
    for file in modes(tmp_path):
        (tmp_path / file).chmod(0o400)
    async with SqliteStore(path) as store:
        await store.save(record("b"))
        seen = modes(tmp_path)  # the write-ahead log too: SQLite gives it the file's mode
    assert {"state.db", "state.db-shm", "state.db-journal"} <= set(seen)
    assert seen == dict.fromkeys(seen, 0o400)


async def test_a_lock_no_store_owns_is_waited_for_the_store_s_own_timeout(
    tmp_path: Path,
) -> None:
    """Not SQLite's default of 5 s: a store with a short timeout gives up soon."""
    path = tmp_path / "state.db"
    await made(path, record("a"))
    tool = sqlite3.connect(path, isolation_level=None)  # a tool's transaction
    try:
        tool.execute("BEGIN EXCLUSIVE")
        began = time.monotonic()
        failure = await refusal(SqliteStore(path, timeout=0.05))
        waited = time.monotonic() - began
    finally:
        tool.close()
    assert failure.detail == (
        f"{path}: cannot open: the file is locked by another connection for longer than "
        "the store waits (database is locked)"
    )
    assert waited < 3.0


# -- a file that is no database, or a corrupt one ------------------------------------


async def test_a_file_that_is_no_database_is_refused_and_let_go(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"these are not the bytes of a database\n" * 200)
    store = SqliteStore(path)
    with pytest.raises(StateStorageError) as opening, trio.fail_after(BOUND):
        await store.open()
    assert opening.value.detail == f"{path}: cannot open: file is not a database"
    assert isinstance(opening.value.__cause__, sqlite3.DatabaseError)
    # Left open, the store that failed holds no claim on the file: another store finds
    # the same fault, not an owner.
    assert (await refusal(SqliteStore(path, timeout=0.05))).detail == opening.value.detail
    assert descriptors_of(path) == 0
    await store.aclose()


async def test_a_store_that_failed_to_open_gives_up_no_other_store_s_claim(
    tmp_path: Path,
) -> None:
    # The store that failed to open closes its ownership's descriptor once: when it is
    # closed later, the descriptor of that number is another store's by then.
    broken = tmp_path / "broken.db"
    broken.write_bytes(b"no database\n" * 500)
    failed = SqliteStore(broken)
    with pytest.raises(StateStorageError, match="file is not a database"):
        await failed.open()
    path = tmp_path / "state.db"
    async with SqliteStore(path) as owner:
        await owner.save(record("a"))
        await failed.aclose()
        second = await refusal(SqliteStore(path, timeout=0.05))
        assert second.detail == (
            f"{path}: cannot open: the file is locked by another store that owns it, in "
            "this process"
        )
        await owner.save(record("b"))
    async with SqliteStore(path) as again:
        assert list(await again.list()) == [record("a"), record("b")]


def corrupt_an_overflow_page(path: Path, filler: bytes) -> None:
    """Point the first overflow page filled with ``filler`` at a page the file does not
    have: the row it belongs to cannot be read back."""
    size = 4096
    data = bytearray(path.read_bytes())
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA page_size").fetchone() == (size,)
    connection.close()
    full = [
        number
        for number in range(len(data) // size)
        if data[number * size + 4 : (number + 1) * size] == filler * (size - 4)
    ]
    assert full, "no overflow page found"
    data[full[0] * size : full[0] * size + 4] = b"\xff\xff\xff\xff"
    path.write_bytes(bytes(data))


async def test_a_corrupt_page_fails_the_read_and_the_store_serves_on(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    large = record("a", request_id="x" * 30_000)  # its body spans overflow pages
    await made(path, large, record("b"))
    corrupt_an_overflow_page(path, b"x")
    # Opening reads no body: the corruption shows when the rows are read.
    async with SqliteStore(path) as store:
        with pytest.raises(StateStorageError) as reading:
            await store.list()
        assert reading.value.detail == f"{path}: cannot read: database disk image is malformed"
        assert isinstance(reading.value.__cause__, sqlite3.DatabaseError)
        assert await store.high_water() == {
            Key(identity="p", instance="a"): 1,
            Key(identity="p", instance="b"): 1,
        }
        await store.save(record("c", 2))
        assert (await store.high_water())[Key(identity="p", instance="c")] == 2


async def test_a_path_sqlite_keeps_in_memory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ":memory:" is SQLite's name for a database in memory, which has no write-ahead log.
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # the first store let the name go as it failed
        failure = await refusal(SqliteStore(":memory:"))
        assert failure.detail == ":memory:: SQLite refused WAL mode (got 'memory')"
        assert failure.__cause__ is None


# -- the schema's version ------------------------------------------------------------


@pytest.mark.parametrize("versions", [[0], [SCHEMA_VERSION + 1], [1, 1], [2, 2]])
async def test_a_schema_version_this_library_does_not_read_is_refused(
    tmp_path: Path, versions: list[int]
) -> None:
    path = tmp_path / "state.db"
    await made(path, record("a"))
    edit(
        path,
        "DELETE FROM schema_version",
        *(f"INSERT INTO schema_version VALUES ({version})" for version in versions),
    )
    failure = await refusal(SqliteStore(path))
    assert failure.detail == (
        f"{path} has schema version {versions}; this library reads version {SCHEMA_VERSION}"
    )
    # It let the file go: repaired, it opens.
    edit(
        path, "DELETE FROM schema_version", f"INSERT INTO schema_version VALUES ({SCHEMA_VERSION})"
    )
    async with SqliteStore(path) as store:
        assert list(await store.list()) == [record("a")]


async def test_a_file_whose_version_was_lost_is_given_the_current_one(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    await made(path, record("a"))
    edit(path, "DELETE FROM schema_version")
    async with SqliteStore(path) as store:
        assert list(await store.list()) == [record("a")]
    with sqlite3.connect(path) as connection:
        assert connection.execute("SELECT version FROM schema_version").fetchall() == [
            (SCHEMA_VERSION,)
        ]
    connection.close()


# -- writes that fail, rows edited by hand -------------------------------------------


async def test_a_refused_write_names_the_file_and_the_action(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    await made(path, record("a"))
    poisoned = record("b").handle.token
    edit(
        path,
        "CREATE TRIGGER refuse BEFORE INSERT ON records "
        f"WHEN NEW.token = '{poisoned}' BEGIN SELECT RAISE(ABORT, 'refused'); END",
    )
    async with SqliteStore(path) as store:
        with pytest.raises(StateStorageError) as saving:
            await store.save(record("b"))
        assert saving.value.detail == f"{path}: cannot save: refused"
        assert isinstance(saving.value.__cause__, sqlite3.IntegrityError)
        assert store.commits == 0
        await store.save(record("c"))
        assert store.commits == 1
        assert list(await store.list()) == [record("a"), record("c")]


async def test_a_failure_of_no_sqlite_call_is_still_a_storage_error_naming_the_file(
    tmp_path: Path,
) -> None:
    # A save order edited into text by hand: the store cannot count on from it. Whatever
    # the error, the caller gets a StateStorageError, and the store serves on.
    path = tmp_path / "state.db"
    await made(path, record("a"))
    edit(path, "UPDATE records SET saved = 'by hand'")
    async with SqliteStore(path) as store:
        with pytest.raises(StateStorageError) as saving:
            await store.save(record("b"))
        assert saving.value.detail.startswith(f"{path}: cannot save: TypeError(")
        assert isinstance(saving.value.__cause__, TypeError)
        assert list(await store.list()) == [record("a")]


async def test_a_mark_edited_into_no_number_is_reported_and_spares_the_writes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    await made(path, record("a", 2), record("b", 3))
    edit(path, "UPDATE high_water SET generation = 'x' WHERE instance = 'a'")
    async with SqliteStore(path) as store:
        assert await store.high_water() == {
            Key(identity="p", instance="a"): "x",
            Key(identity="p", instance="b"): 3,
        }
        # Saves of either key are written; the good mark is raised as ever.
        await store.save_many([record("a", 3), record("b", 4)])
        assert (await store.high_water())[Key(identity="p", instance="b")] == 4
        assert [r.handle.generation for r in await store.list()] == [2, 3, 3, 4]


async def test_a_high_water_row_no_key_can_hold_is_named(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    await made(path, record("a"))
    edit(path, "INSERT INTO high_water VALUES ('', 'b', 4)")
    with pytest.raises(ValueError, match="must not be empty") as refused:
        Key(identity="", instance="b")
    async with SqliteStore(path) as store:
        assert list(await store.list()) == [record("a")]
        with pytest.raises(RecordFormatError) as reading:
            await store.high_water()
        assert reading.value.detail == (f"{path}: a high-water row is malformed: {refused.value}")


async def test_the_marks_read_twice_after_a_listing_are_the_same(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    await made(path, record("a", 2), stopped("b", 5))
    marks = {Key(identity="p", instance="a"): 2, Key(identity="p", instance="b"): 5}
    async with SqliteStore(path) as store:
        assert list(await store.list()) == [record("a", 2), stopped("b", 5)]
        assert await store.high_water() == marks
        assert await store.high_water() == marks


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("b", "holds the record of another session (p/b, token bbbbbbbb...)"),
        ("{not json", "is unreadable: {unreadable}"),
    ],
)
async def test_a_row_that_does_not_give_its_record_back_is_named_in_full(
    tmp_path: Path, body: str, words: str
) -> None:
    path = tmp_path / "state.db"
    await made(path, record("a"), record("b"))
    text = codec.encode(record("b")) if body == "b" else body
    with pytest.raises(RecordFormatError) as decoding:
        codec.decode("{not json")
    connection = sqlite3.connect(path)
    connection.execute("UPDATE records SET body = ? WHERE instance = 'a'", (text,))
    connection.commit()
    connection.close()
    async with SqliteStore(path) as store:
        with pytest.raises(RecordFormatError) as reading:
            await store.list()
    expected = words.format(unreadable=decoding.value.detail)
    assert reading.value.detail == f"{path}: the record of p/a (token aaaaaaaa...) {expected}"


async def test_a_row_filed_under_another_identity_is_named(tmp_path: Path) -> None:
    # Its token and instance are the record's own: the identity alone gives it away.
    path = tmp_path / "state.db"
    await made(path, record("a"))
    edit(path, "UPDATE records SET identity = 'q'")
    async with SqliteStore(path) as store:
        with pytest.raises(RecordFormatError) as reading:
            await store.list()
    assert reading.value.detail == (
        f"{path}: the record of q/a (token aaaaaaaa...) holds the record of another session "
        "(p/a, token aaaaaaaa...)"
    )


async def test_a_row_with_no_token_is_named_malformed(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    await made(path, record("a"))
    edit(path, "UPDATE records SET token = NULL")
    async with SqliteStore(path) as store:
        with pytest.raises(RecordFormatError) as reading:
            await store.list()
    assert reading.value.detail == (
        f"{path}: a record row is malformed: 'NoneType' object is not subscriptable"
    )
    assert isinstance(reading.value.__cause__, TypeError)


# -- the store's worker, and closing it ----------------------------------------------


async def test_an_empty_batch_commits_nothing(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    assert store.commits == 0  # before its worker starts
    async with store:
        assert store.commits == 0
        await store.save_many([])
        assert store.commits == 0
        assert list(await store.list()) == []
        await store.save_many([record("a"), record("b")])
        assert store.commits == 1


async def test_the_worker_is_a_named_daemon_thread_that_ends_with_the_store(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    assert workers(path) == []  # none before first use
    await store.open()
    (worker,) = workers(path)
    assert worker.daemon  # a process that never closes its store still exits
    await store.aclose()
    worker.join(timeout=10)
    assert not worker.is_alive()


async def test_a_store_closed_before_use_refuses_calls_and_closes_again(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    await store.aclose()
    with pytest.raises(StateStorageError) as refused:
        await store.save(record("a"))
    assert refused.value.detail == f"the store {path} is closed"
    with pytest.raises(StateStorageError, match="closed"):
        await store.list()
    await store.aclose()
    assert not path.exists()  # it never opened the file
    assert workers(path) == []


async def test_a_store_closed_under_its_saves_writes_them_all_first(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    records = [record(f"k{number}") for number in range(20)]
    store = SqliteStore(path)
    await store.open()
    async with trio.open_nursery() as nursery:
        for one in records:
            nursery.start_soon(store.save, one)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(store.aclose)
    with pytest.raises(StateStorageError, match="closed"):
        await store.save(record("late"))
    async with SqliteStore(path) as again:
        assert sorted(r.handle.token for r in await again.list()) == sorted(
            r.handle.token for r in records
        )


async def test_a_cancelled_close_still_closes(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    await store.save(record("a"))
    with trio.CancelScope() as scope:
        scope.cancel()
        await store.aclose()  # waits for the worker all the same
        await trio.lowlevel.checkpoint()  # where the cancellation is seen
    assert scope.cancelled_caught
    async with SqliteStore(path, timeout=0.05) as again:  # the file is free
        assert list(await again.list()) == [record("a")]


def test_a_child_started_while_the_store_is_open_does_not_hold_its_file(
    tmp_path: Path,
) -> None:
    # A child that inherits every descriptor it may (close_fds=False) gets none of the
    # store's: the store closes, and another opens the file while the child lives.
    path = tmp_path / "state.db"

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"],
            stdin=subprocess.PIPE,
            close_fds=False,
        )

    async def spawn_then_close() -> subprocess.Popen[bytes]:
        async with SqliteStore(path) as store:
            await store.save(record("a"))
            return spawn()

    child = trio.run(spawn_then_close)
    with child:
        assert child.stdin is not None

        async def reopen() -> list[SessionRecord]:
            async with SqliteStore(path, timeout=0.05) as store:
                return list(await store.list())

        try:
            assert trio.run(reopen) == [record("a")]
        finally:
            child.stdin.close()
    assert child.returncode == 0


# What a store that opens the file at argv[1] is refused with ("opened" if it opens).
REFUSAL = textwrap.dedent(
    """
    import sys, trio
    from trio_supervisor import SqliteStore, StateStorageError

    async def refusal(path):
        try:
            async with SqliteStore(path, timeout=0.05):
                return "opened"
        except StateStorageError as error:
            return error.detail

    print(trio.run(refusal, sys.argv[1]), flush=True)
    """
)
# In a PID namespace of its own, as its process 1: be refused the file at argv[1],
# then own the file at argv[2] while a second process of the namespace is refused it.
IN_A_NAMESPACE = REFUSAL + textwrap.dedent(
    """
    import subprocess

    async def own(path):
        async with SqliteStore(path):
            subprocess.run([sys.executable, "-c", sys.argv[3], path], check=True)

    trio.run(own, sys.argv[2])
    """
)


def test_the_owner_is_named_as_the_pid_namespace_of_the_one_refused_shows_it(
    tmp_path: Path,
) -> None:
    """A process outside the reader's PID namespace has no number there: it goes
    unnamed; the namespace's own process 1 is named as such."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    outside = tmp_path / "outside.db"
    inside = tmp_path / "inside.db"

    async def hold() -> str:
        async with SqliteStore(outside):
            # Refused here too, named as this process (which also has mutmut's stats see
            # this test reach holder(): its other callers are the children).
            here = await refusal(SqliteStore(outside, timeout=0.05))
            assert here.detail.endswith("owns it, in this process")
            command = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c"]
            ran = await trio.run_process(
                [*command, IN_A_NAMESPACE, str(outside), str(inside), REFUSAL],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
        if ran.returncode != 0 and b"unshare failed" in ran.stderr:
            pytest.skip(f"no PID namespace here: {ran.stderr.decode()}")
        assert ran.returncode == 0, ran.stderr.decode()
        return ran.stdout.decode()

    lines = trio.run(hold).splitlines()
    refused = "cannot open: the file is locked by another store that owns it, in"
    assert lines[0] == f"{outside}: {refused} a process the system does not name"
    assert lines[1].startswith(f"{inside}: {refused} process 1 ({sys.executable} -c "), lines
