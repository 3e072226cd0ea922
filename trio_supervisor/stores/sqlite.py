"""A store in one SQLite file: the embedded default.

* One file, in WAL mode with ``synchronous=FULL``: when a save returns, its record
  survives a crash of the process or of the machine.
* ``locking_mode=EXCLUSIVE``: one store (so one supervisor) owns the file. A second
  process opening it gets a clear error instead of two supervisors fencing one key
  each their own way.
* Every SQLite call runs on one worker thread that owns the connection; the event loop
  never blocks on the disk.
* Group commit: saves that arrive while a transaction is being written wait in the
  queue and are written together in the next transaction, so 100 concurrent saves cost
  a handful of fsyncs, not 100. Each save returns only after its own batch committed.
* Retention (docs/design.md, "Persistence and retention") is applied in the same
  transaction as the save, and the high-water generation of every key lives in its own
  table, never evicted.
* Every failure reaches the caller as a :class:`StateStorageError` naming the file and
  what failed (a :class:`RecordFormatError` for a row no record can be read from); the
  worker thread outlives it, so no caller is left waiting.

Cancelling a save is safe: while the record still waits in the queue, it is taken
back and ``Cancelled`` is raised; once the worker took it, the save waits for the
commit and reports it (the cancellation is then seen at the caller's next checkpoint).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import queue
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Self

import trio

from ..codec import decode, encode
from ..errors import RecordFormatError, StateStorageError
from ..model import Key, SessionRecord, StoppedRecord
from ..retention import Retention, StopOrder

__all__ = ["SqliteStore"]

SCHEMA_VERSION: Final = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    token    TEXT PRIMARY KEY,
    identity TEXT NOT NULL,
    instance TEXT NOT NULL,
    saved    INTEGER NOT NULL,  -- save order, for list()
    stopped  INTEGER,           -- stop order, NULL while not Stopped: retention's order
    body     TEXT NOT NULL      -- the versioned JSON record
);
-- No secondary indexes: every write goes by token, and the orders above are only read
-- when the file opens (retention's) or at recovery (list's), by one scan each. An index
-- would cost every save an update to spare those two scans a sort.
CREATE TABLE IF NOT EXISTS high_water (
    identity   TEXT NOT NULL,
    instance   TEXT NOT NULL,
    generation INTEGER NOT NULL,
    PRIMARY KEY (identity, instance)
) WITHOUT ROWID;
"""

# A batch is one statement: rows inserted into this view, each a change that the trigger
# applies (a record to write, with the high-water mark it raises if any; a record to
# delete; a mark alone, when the batch evicted the record that raised it). One
# statement is one call into SQLite, which runs without the GIL: the worker needs the
# GIL back once per batch, not once per row, and the event loop keeps it meanwhile.
# Both live in the connection's temporary schema; the file never holds them.
_CHANGES = (
    """
CREATE TEMP VIEW changes (token, identity, instance, saved, stopped, body, generation)
    AS SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL WHERE 0
""",
    """
CREATE TEMP TRIGGER apply_change INSTEAD OF INSERT ON changes BEGIN
    DELETE FROM records WHERE NEW.body IS NULL AND token = NEW.token;
    INSERT INTO records (token, identity, instance, saved, stopped, body)
        SELECT NEW.token, NEW.identity, NEW.instance, NEW.saved, NEW.stopped, NEW.body
        WHERE NEW.body IS NOT NULL
        ON CONFLICT (token) DO UPDATE SET
            saved = excluded.saved, stopped = excluded.stopped, body = excluded.body;
    INSERT INTO high_water (identity, instance, generation)
        SELECT NEW.identity, NEW.instance, NEW.generation
        WHERE NEW.generation IS NOT NULL
        ON CONFLICT (identity, instance) DO UPDATE SET
            generation = max(generation, excluded.generation);
END
""",
)
# A row of the view: token, identity, instance, saved, stopped, body, generation.
_Change = tuple[str | None, str | None, str | None, int | None, int | None, str | None, int | None]


class _State(enum.Enum):
    QUEUED = "queued"  # the caller may still take it back
    TAKEN = "taken"  # the worker has it; it will be reported
    WITHDRAWN = "withdrawn"  # the caller was cancelled first; the worker skips it


class _Job:
    """One request to the worker, and the task that waits for its answer."""

    __slots__ = ("error", "kind", "result", "rows", "state", "task", "token")

    def __init__(self, kind: str, rows: list[tuple[SessionRecord, str]] | None = None) -> None:
        self.kind = kind  # "open", "save", "list", "high_water", "close"
        self.rows = rows or []
        self.state = _State.QUEUED
        self.task = trio.lowlevel.current_task()
        self.token = trio.lowlevel.current_trio_token()
        self.result: Any = None
        self.error: BaseException | None = None

    def take(self) -> bool:
        """The worker's claim on the job: False if its caller withdrew it first."""
        with _claims:
            if self.state is _State.QUEUED:
                self.state = _State.TAKEN
                return True
            return False

    def withdraw(self) -> bool:
        """The caller's claim: False if the worker took the job first."""
        with _claims:
            if self.state is _State.QUEUED:
                self.state = _State.WITHDRAWN
                return True
            return False


# Guards every job's state: the caller and the worker both move it out of QUEUED, and
# only one of them may. Held for a comparison and an assignment, so one lock serves all.
_claims: Final = threading.Lock()


class SqliteStore:
    """Records in one SQLite file.

    Use it as ``async with SqliteStore(path) as store:`` or call :meth:`aclose`; the
    worker thread and its connection start on first use.

    Args:
        path: The database file; its directory must exist.
        retention: Which Stopped records to keep.
        timeout: Seconds SQLite waits for a lock before failing a write.

    Attributes:
        path: The database file, as a string.
        commits: How many transactions this store has committed. With group commit it
            grows slower than the number of saves under concurrency: the ratio of the
            two is what batching saves you in fsyncs. A save's transaction is counted
            before the save returns.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retention: Retention | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.path = os.fspath(path)
        self._retention = retention or Retention()
        self._timeout = timeout
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._commits = 0  # written by the worker thread only

    @property
    def commits(self) -> int:
        """How many transactions this store has committed."""
        return self._commits

    @property
    def retention(self) -> Retention:
        """The retention policy this store applies."""
        return self._retention

    # -- the face ----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        try:
            await self.open()
        except BaseException:
            # ``async with`` does not leave what it failed to enter: stop the worker
            # here, or it would live on, idle, for as long as the process does.
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Open the file now rather than on first use, so a bad file fails here.

        Raises:
            StateStorageError: The file cannot be opened, is locked by another store,
                or has a schema version this library does not know.
        """
        await self._submit(_Job("open"))

    async def save(self, record: SessionRecord) -> None:
        """Make ``record`` durable (group commit); see the module docs for cancellation."""
        await self._submit(_Job("save", [(record, encode(record))]))

    async def save_many(self, records: Sequence[SessionRecord]) -> None:
        """Make every record durable in one transaction."""
        await self._submit(_Job("save", [(record, encode(record)) for record in records]))

    async def list(self) -> Sequence[SessionRecord]:
        """Every retained record, in the order they were last saved.

        Raises:
            RecordFormatError: A row is malformed, of an unknown version, or holds the
                record of another token or key; the message names the row.
        """
        records: list[SessionRecord] = await self._submit(_Job("list"))
        return records

    async def high_water(self) -> Mapping[Key, int]:
        """Every key's highest generation ever saved."""
        marks: dict[Key, int] = await self._submit(_Job("high_water"))
        return marks

    async def aclose(self) -> None:
        """Finish the writes already queued, close the connection, stop the worker.

        Raises:
            StateStorageError: SQLite failed to close the file; every save that
                returned is durable all the same.
        """
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        if self._thread is None:
            await trio.lowlevel.checkpoint()
            return
        job = _Job("close")
        job.state = _State.TAKEN
        self._jobs.put(job)
        # Bounded by the writes already queued; the thread exits right after. A
        # cancellation waits for it too (and is seen at the caller's next checkpoint).
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        if job.error is not None:
            raise job.error

    # -- talking to the worker ---------------------------------------------------------

    async def _submit(self, job: _Job) -> Any:
        if self._closed:
            await trio.lowlevel.checkpoint()
            raise StateStorageError(f"the store {self.path} is closed")
        if self._thread is None:
            self._thread = threading.Thread(
                target=_Worker(self).run, name=f"trio_supervisor sqlite {self.path}", daemon=True
            )
            self._thread.start()
        self._jobs.put(job)

        def abort(_: object) -> trio.lowlevel.Abort:
            # Still queued: take it back and let the cancellation through. Taken: the
            # write may land, so wait for its answer and report it; bounded by one
            # transaction (and SQLite's lock timeout).
            return trio.lowlevel.Abort.SUCCEEDED if job.withdraw() else trio.lowlevel.Abort.FAILED

        await trio.lowlevel.wait_task_rescheduled(abort)
        if job.error is not None:
            raise job.error
        return job.result


class _Mirror:
    """What the worker knows of the table, so that a write needs no reads first.

    The last save order given, every Stopped row's token in stop order (retention's
    :class:`~trio_supervisor.retention.StopOrder`, the one the record index uses) and
    the high-water marks; read once when the file opens, kept in step by every write,
    and read again after a write that failed.
    """

    __slots__ = ("high", "saved", "stops")

    def __init__(self, saved: int) -> None:
        self.saved = saved  # the last save order given
        self.stops: StopOrder[tuple[str, str]] = StopOrder()
        self.high: dict[tuple[str, str], int] = {}

    @classmethod
    def read(cls, connection: sqlite3.Connection) -> _Mirror:
        (saved,) = connection.execute("SELECT coalesce(max(saved), 0) FROM records").fetchone()
        mirror = cls(saved)
        rows = connection.execute(
            "SELECT token, identity, instance, stopped FROM records "
            "WHERE stopped IS NOT NULL ORDER BY stopped"
        ).fetchall()
        for token, identity, instance, number in rows:
            mirror.stops.restore(token, (identity, instance), number)
        for identity, instance, generation in connection.execute(
            "SELECT identity, instance, generation FROM high_water"
        ).fetchall():
            if isinstance(generation, int):  # a malformed mark is reported by high_water()
                mirror.high[(identity, instance)] = generation
        return mirror

    def raise_high_water(self, key: tuple[str, str], generation: int) -> bool:
        """Whether ``generation`` is above the key's mark (which it then becomes)."""
        if generation <= self.high.get(key, 0):
            return False
        self.high[key] = generation
        return True


class _Worker:
    """The thread that owns the connection.

    Everything it does runs inside :meth:`_attempt`, which turns a ``sqlite3.Error``
    (or anything else but a :class:`StateStorageError`) into the
    :class:`StateStorageError` its callers get: no error of SQLite's escapes the store,
    and no failure ends the thread, which would leave its callers waiting forever.
    """

    def __init__(self, store: SqliteStore) -> None:
        self._store = store
        self._connection: sqlite3.Connection | None = None
        self._open_error: StateStorageError | None = None
        self._mirror: _Mirror | None = None
        self._rows_per_statement = 1  # the connection's variable limit over 7 columns

    def run(self) -> None:
        jobs = self._store._jobs
        self._open_error = self._attempt("open", self._open)
        closing: _Job | None = None
        while closing is None:
            batch = [jobs.get()]
            # Group commit: everything queued while the last transaction was written
            # goes into the next one.
            while True:
                try:
                    batch.append(jobs.get_nowait())
                except queue.Empty:
                    break
            taken = []
            for job in batch:
                if job.kind == "close":
                    closing = job
                elif job.take():
                    taken.append(job)
            self._serve(taken)
        if self._connection is not None:
            closing.error = self._attempt("close", self._connection.close)
        _deliver([closing])

    def _serve(self, jobs: list[_Job]) -> None:
        saves = [job for job in jobs if job.kind == "save"]
        others = [job for job in jobs if job.kind != "save"]
        if self._open_error is not None:
            for job in jobs:
                job.error = self._open_error
        else:
            # Saves first, so a read queued after a save sees it.
            if saves:
                failure = self._attempt("save", functools.partial(self._write, saves))
                for job in saves:
                    job.error = failure
            for job in others:
                job.error = self._attempt("read", functools.partial(self._read, job))
        _deliver(jobs)

    def _attempt(self, action: str, work: Callable[[], None]) -> StateStorageError | None:
        """Run ``work``; return the error its callers are to get, or None if it worked.

        Args:
            action: What ``work`` does, for the message: "cannot {action}".
            work: SQLite calls. It raises a ``sqlite3.Error``, or a
                :class:`StateStorageError` of its own that is worded already.
        """
        try:
            work()
        except StateStorageError as error:  # RecordFormatError too
            return error
        except Exception as error:  # sqlite3.Error, or a row no record could hold
            failure = StateStorageError(_explain(self._store.path, action, error))
            failure.__cause__ = error
            return failure
        return None

    # -- the connection --------------------------------------------------------------

    def _open(self) -> None:
        path = self._store.path
        connection = sqlite3.connect(path, timeout=self._store._timeout, isolation_level=None)
        try:
            connection.execute("PRAGMA locking_mode = EXCLUSIVE")
            mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode != "wal":
                raise StateStorageError(f"{path}: SQLite refused WAL mode (got {mode!r})")
            connection.execute("PRAGMA synchronous = FULL")
            connection.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    connection.execute(statement)
            versions = [row[0] for row in connection.execute("SELECT version FROM schema_version")]
            if not versions:
                connection.execute(
                    "INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,)
                )
            elif versions != [SCHEMA_VERSION]:
                raise StateStorageError(
                    f"{path} has schema version {versions}; "
                    f"this library reads version {SCHEMA_VERSION}"
                )
            connection.execute("COMMIT")
            for statement in _CHANGES:
                connection.execute(statement)
            mirror = _Mirror.read(connection)
        except BaseException:
            # Closing also rolls back, and gives up the exclusive lock: a store that
            # failed to open must not keep others out of the file.
            connection.close()
            raise
        self._connection = connection
        self._mirror = mirror
        self._rows_per_statement = connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // 7

    def _write(self, jobs: list[_Job]) -> None:
        connection = self._connection
        assert connection is not None
        mirror = self._mirror
        if mirror is None:
            mirror = self._mirror = _Mirror.read(connection)
        retention = self._store.retention
        # The whole batch is worked out here, against the mirror, into rows of the
        # ``changes`` view; SQLite then gets them as one statement.
        upserts: dict[str, _Change] = {}
        deletes: dict[str, _Change] = {}
        marks: list[_Change] = []  # raised marks whose records the batch then evicted
        for job in jobs:
            for record, body in job.rows:
                handle = record.handle
                token = handle.token
                key = (handle.key.identity, handle.key.instance)
                mirror.saved += 1
                stop_order = None
                if isinstance(record, StoppedRecord):
                    stop_order = mirror.stops.stop(token, key)
                else:
                    mirror.stops.forget(token)  # a caller un-stopped a record; so did the index
                deletes.pop(token, None)
                # A raised high-water mark travels in its record's row (the trigger
                # applies both), and stays there if the token is saved again.
                earlier = upserts.get(token)
                mark = (
                    handle.generation if mirror.raise_high_water(key, handle.generation) else None
                )
                if mark is None and earlier is not None:
                    mark = earlier[6]
                upserts[token] = (token, *key, mirror.saved, stop_order, body, mark)
                if stop_order is None:
                    continue
                for evicted in mirror.stops.evict(key, retention):
                    dropped = upserts.pop(evicted, None)
                    if dropped is not None and dropped[6] is not None:
                        marks.append((None, dropped[1], dropped[2], None, None, None, dropped[6]))
                    deletes[evicted] = (evicted, None, None, None, None, None, None)
        changes = [*deletes.values(), *upserts.values(), *marks]
        # Most batches fit one statement, which is then its own transaction.
        per_statement = self._rows_per_statement
        chunks = [
            changes[start : start + per_statement]
            for start in range(0, len(changes), per_statement)
        ]
        try:
            if len(chunks) > 1:
                connection.execute("BEGIN IMMEDIATE")
            for chunk in chunks:
                connection.execute(
                    "INSERT INTO changes VALUES "
                    + ", ".join(["(?, ?, ?, ?, ?, ?, ?)"] * len(chunk)),
                    [value for change in chunk for value in change],
                )
            if connection.in_transaction:
                connection.execute("COMMIT")
        except sqlite3.Error:
            # The mirror ran ahead of a transaction that did not happen: it is read
            # again before the next write.
            self._mirror = None
            if connection.in_transaction:
                # The error to report is the one above, not a failure to roll back.
                with contextlib.suppress(sqlite3.Error):
                    connection.execute("ROLLBACK")
            raise
        if chunks:
            self._store._commits += 1

    def _read(self, job: _Job) -> None:
        connection = self._connection
        assert connection is not None
        path = self._store.path
        try:
            if job.kind == "list":
                # fetchall first: a cursor left open by a decoding error would keep the
                # connection (and its exclusive lock) alive past close().
                rows = connection.execute(
                    "SELECT token, identity, instance, body FROM records ORDER BY saved"
                ).fetchall()
                job.result = [_decode_row(path, *row) for row in rows]
            elif job.kind == "high_water":
                marks = connection.execute(
                    "SELECT identity, instance, generation FROM high_water"
                ).fetchall()
                job.result = {
                    Key(identity=identity, instance=instance): generation
                    for identity, instance, generation in marks
                }
        except (ValueError, TypeError) as error:
            # A value SQLite let through that no record or mark can hold (a NULL token,
            # an empty identity).
            what = "record" if job.kind == "list" else "high-water"
            raise RecordFormatError(f"{path}: a {what} row is malformed: {error}") from error


def _decode_row(path: str, token: str, identity: str, instance: str, body: str) -> SessionRecord:
    row = f"{path}: the record of {identity}/{instance} (token {token[:8]}...)"
    try:
        record = decode(body)
    except RecordFormatError as error:
        raise RecordFormatError(f"{row} is unreadable: {error.detail}") from error
    handle = record.handle
    if handle.token != token or handle.key.identity != identity or handle.key.instance != instance:
        raise RecordFormatError(
            f"{row} holds the record of another session "
            f"({handle.key.identity}/{handle.key.instance}, token {handle.token[:8]}...)"
        )
    return record


def _explain(path: str, action: str, error: Exception) -> str:
    if not isinstance(error, sqlite3.Error):
        return f"{path}: cannot {action}: {error!r}"
    text = str(error)
    if "locked" in text:
        return (
            f"{path}: cannot {action}: the file is locked, probably by another store "
            f"that owns it ({text})"
        )
    return f"{path}: cannot {action}: {text}"


def _deliver(jobs: Sequence[_Job | None]) -> None:
    """Wake the callers of finished jobs, one callback per event loop."""
    by_loop: dict[trio.lowlevel.TrioToken, list[trio.lowlevel.Task]] = {}
    for job in jobs:
        if job is not None:
            by_loop.setdefault(job.token, []).append(job.task)
    for token, tasks in by_loop.items():
        # A finished event loop has nobody waiting any more.
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(_wake_all, tasks)


def _wake_all(tasks: list[trio.lowlevel.Task]) -> None:
    for task in tasks:
        trio.lowlevel.reschedule(task)
