"""The SQLite store's worker: the thread that owns the connection, and its jobs.

Theory of operation
-------------------
Callers (``SqliteStore``, in the Trio run) put :class:`Job` s on a queue and park; the
worker thread takes everything queued, writes the saves of that batch as one statement
(group commit; a batch of more than _ROWS changes, as recovery writes, in one transaction
of several), answers the reads, and wakes each caller through its run's token. A job
still queued can be withdrawn by a cancelled caller; once taken, it is answered. The
worker keeps a :class:`Mirror` of what the table holds (save order, stop order, marks),
so that a write needs no reads first; after a failed write it reads it again.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import queue
import sqlite3
import stat
from collections.abc import Callable, Iterator
from typing import Final, TypeVar

from ..errors import StateStorageError
from ..model import Key, SessionRecord, StoppedRecord
from ..retention import Retention, StopOrder
from ._jobs import Job, deliver, next_batch
from ._rows import key_of, record_of

__all__ = ["SCHEMA_VERSION", "Worker"]


SCHEMA_VERSION: Final = 1
PRIVATE: Final = 0o600  # the database's mode, and so its companions' (SQLite copies it)
# What SQLite keeps beside the database: the write-ahead log, its index (none in
# EXCLUSIVE locking mode), and the rollback journal of the switch to WAL.
COMPANIONS: Final = ("-wal", "-shm", "-journal")

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

# A batch (of up to _ROWS changes: nearly every batch but recovery's) is one statement:
# rows inserted into this view, each a change that the trigger applies (a record to
# write, with the high-water mark it raises if any; a record to delete; a mark alone,
# when the batch evicted the record that raised it). One statement is one call into
# SQLite, which runs without the GIL: the worker needs the GIL back once per batch, not
# once per row, and the event loop keeps it meanwhile.
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
# A batch too large for one statement applies the trigger's changes by these
# (Worker._write_large), each with up to _ROWS rows of VALUES.
_UPSERT_RECORDS = """
INSERT INTO records (token, identity, instance, saved, stopped, body) VALUES {}
    ON CONFLICT (token) DO UPDATE SET
        saved = excluded.saved, stopped = excluded.stopped, body = excluded.body
"""
_RAISE_MARKS = """
INSERT INTO high_water (identity, instance, generation) VALUES {}
    ON CONFLICT (identity, instance) DO UPDATE SET
        generation = max(generation, excluded.generation)
"""
# The most rows of a statement (fewer if the connection's variable limit is lower): a
# batch of at most this many changes is one statement through the view, a larger one
# several plain ones. A statement's text is SQLite's to parse anew unless sqlite3 has it
# prepared (it keeps the last 128, by their text), and parsing a statement of 10,000
# rows cost recovery about half as much as running it; so statements stay this short.
_ROWS: Final = 256
# A row of the view: token, identity, instance, saved, stopped, body, generation.
_Change = tuple[str | None, str | None, str | None, int | None, int | None, str | None, int | None]
_T = TypeVar("_T")
# A row read by list(): token, identity, instance, body, and save order.
_saved: Final = operator.itemgetter(4)


class Mirror:
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
    def read(cls, connection: sqlite3.Connection) -> Mirror:
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


class Worker:
    """The thread that owns the connection.

    Everything it does runs inside :meth:`_attempt`, which turns a ``sqlite3.Error``
    (or anything else but a :class:`StateStorageError`) into the
    :class:`StateStorageError` its callers get: no error of SQLite's escapes the store,
    and no failure ends the thread, which would leave its callers waiting forever.

    Args:
        path: The database file.
        retention: The policy applied on every save.
        timeout: SQLite's wait for a lock held by another connection, seconds.
        jobs: The queue the store puts its jobs on; the worker's only input.
    """

    def __init__(
        self,
        path: str,
        *,
        retention: Retention,
        timeout: float,
        jobs: queue.SimpleQueue[Job],
    ) -> None:
        self.path = path
        self.retention = retention
        self._timeout = timeout
        self._jobs = jobs
        # Transactions committed; written by this thread only, read by anyone.
        self.commits = 0
        self._connection: sqlite3.Connection | None = None
        self._open_error: StateStorageError | None = None
        self._mirror: Mirror | None = None
        self._rows_per_statement = 1  # see _ROWS; set when the connection opens
        self._keys: dict[tuple[str, str], Key] = {}  # the keys of the records list() read

    def run(self) -> None:
        jobs = self._jobs
        self._open_error = self._attempt("open", self._open)
        closing: Job | None = None
        while closing is None:
            taken, closing = next_batch(jobs)  # group commit
            self._serve(taken)
            # Answered: the jobs (their records and texts: all of recovery's) go now,
            # not once the next job comes.
            del taken
        if self._connection is not None:
            closing.error = self._attempt("close", self._connection.close)
        deliver([closing])

    def _serve(self, jobs: list[Job]) -> None:
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
        deliver(jobs)

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
            failure = StateStorageError(_explain(self.path, action, error))
            failure.__cause__ = error
            return failure
        return None

    # -- the connection --------------------------------------------------------------

    def _open(self) -> None:
        path = self.path
        _make_private(path)
        connection = sqlite3.connect(path, timeout=self._timeout, isolation_level=None)
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
            mirror = Mirror.read(connection)
        except BaseException:
            # Closing also rolls back, and gives up the exclusive lock: a store that
            # failed to open must not keep others out of the file.
            connection.close()
            raise
        self._connection = connection
        self._mirror = mirror
        self._rows_per_statement = min(
            _ROWS, connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // 7
        )

    def _write(self, jobs: list[Job]) -> None:
        connection = self._connection
        assert connection is not None
        mirror = self._mirror
        if mirror is None:
            mirror = self._mirror = Mirror.read(connection)
        retention = self.retention
        stops = mirror.stops
        high = mirror.high
        saved = mirror.saved
        # The whole batch is worked out here, against the mirror, into rows of the
        # ``changes`` view; SQLite then gets them as one statement (or, beyond _ROWS of
        # them, as _write_large's several).
        upserts: dict[str, _Change] = {}
        deletes: dict[str, _Change] = {}
        marks: list[_Change] = []  # raised marks whose records the batch then evicted
        for job in jobs:
            for record, body in job.rows:
                handle = record.handle
                token = handle.token
                key = (handle.key.identity, handle.key.instance)
                saved += 1
                # A raised high-water mark travels in its record's row (the trigger
                # applies both), and stays there if the token is saved again.
                generation = handle.generation
                if generation > high.get(key, 0):
                    high[key] = generation
                    mark: int | None = generation
                else:
                    earlier = upserts.get(token)
                    mark = None if earlier is None else earlier[6]
                if deletes:
                    deletes.pop(token, None)
                if not isinstance(record, StoppedRecord):
                    stops.forget(token)  # a caller un-stopped a record; so did the index
                    upserts[token] = (token, *key, saved, None, body, mark)
                    continue
                stop_order, evicted = stops.stop_evicting(token, key, retention)
                upserts[token] = (token, *key, saved, stop_order, body, mark)
                for gone in evicted:
                    dropped = upserts.pop(gone, None)
                    if dropped is not None and dropped[6] is not None:
                        marks.append((None, dropped[1], dropped[2], None, None, None, dropped[6]))
                    deletes[gone] = (gone, None, None, None, None, None, None)
        mirror.saved = saved
        changes = [*deletes.values(), *upserts.values(), *marks]
        if not changes:
            return
        try:
            if len(changes) <= self._rows_per_statement:
                # Nearly every batch: one statement, which is then its own transaction.
                connection.execute(
                    "INSERT INTO changes VALUES "
                    + ", ".join(["(?, ?, ?, ?, ?, ?, ?)"] * len(changes)),
                    [value for change in changes for value in change],
                )
            else:
                self._write_large(connection, deletes, upserts, marks)
        except sqlite3.Error:
            # The mirror ran ahead of a transaction that did not happen: it is read
            # again before the next write.
            self._mirror = None
            if connection.in_transaction:
                # The error to report is the one above, not a failure to roll back.
                with contextlib.suppress(sqlite3.Error):
                    connection.execute("ROLLBACK")
            raise
        self.commits += 1

    def _write_large(
        self,
        connection: sqlite3.Connection,
        deletes: dict[str, _Change],
        upserts: dict[str, _Change],
        marks: list[_Change],
    ) -> None:
        """Write a batch too large for one statement (recovery's, say) in one transaction.

        It takes several statements anyway, so each applies one kind of change to its
        table directly (row by row through the trigger costs SQLite about a third
        more), in chunks of a few sizes only: sqlite3 keeps the statements it prepared,
        by their text, and parsing a statement costs SQLite about half as much as
        running it.
        """
        per_statement = self._rows_per_statement
        connection.execute("BEGIN IMMEDIATE")
        for tokens in _chunks(list(deletes), per_statement):
            connection.execute(
                f"DELETE FROM records WHERE token IN ({', '.join(['?'] * len(tokens))})", tokens
            )
        rows = list(upserts.values())
        for written in _chunks(rows, per_statement):
            connection.execute(
                _UPSERT_RECORDS.format(", ".join(["(?, ?, ?, ?, ?, ?)"] * len(written))),
                [value for row in written for value in row[:6]],
            )
        raised = [
            (change[1], change[2], change[6]) for change in (*rows, *marks) if change[6] is not None
        ]
        for high in _chunks(raised, per_statement):
            connection.execute(
                _RAISE_MARKS.format(", ".join(["(?, ?, ?)"] * len(high))),
                [value for mark in high for value in mark],
            )
        connection.execute("COMMIT")

    def _read(self, job: Job) -> None:
        connection = self._connection
        assert connection is not None
        path = self.path
        if job.kind == "list":
            # fetchall first: a cursor left open by a decoding error would keep the
            # connection (and its exclusive lock) alive past close().
            rows = connection.execute(
                "SELECT token, identity, instance, body, saved FROM records"
            ).fetchall()
            try:
                # In save order. Sorted here: SQLite's sort (no index serves it, see
                # _SCHEMA) costs about as much as reading the rows.
                rows.sort(key=_saved)
            except TypeError:  # a save order no int: a row edited by hand
                rows = connection.execute(
                    "SELECT token, identity, instance, body, saved FROM records ORDER BY saved"
                ).fetchall()
            records: list[SessionRecord] = []
            # The high-water marks are read next (recovery reads both): their keys are
            # mostly these records' own, checked already.
            keys = self._keys = {}
            for token, identity, instance, body, _ in rows:
                record = record_of(path, token, identity, instance, body)
                records.append(record)
                keys[(identity, instance)] = record.handle.key
            job.result = records
        elif job.kind == "high_water":
            marks = connection.execute(
                "SELECT identity, instance, generation FROM high_water"
            ).fetchall()
            keys, self._keys = self._keys, {}
            job.result = {
                keys.get((identity, instance)) or key_of(path, identity, instance): generation
                for identity, instance, generation in marks
            }


def _chunks(items: list[_T], size: int) -> Iterator[list[_T]]:
    """``items`` in chunks of ``size``, then the rest in chunks of halves of it: a few
    sizes only, whose statements sqlite3 keeps prepared."""
    start = 0
    while start < len(items):
        while size > len(items) - start:
            size //= 2
        yield items[start : start + size]
        start += size


def _make_private(path: str) -> None:
    """Make the database file (made here if it does not exist), and the companions an
    earlier run left, readable and writable by their owner alone before SQLite opens it.

    SQLite makes the write-ahead log and the journals with the database's own mode, so
    the companions it makes later are private too. A file that is private already is
    left as it is, whoever owns it.

    Raises:
        StateStorageError: The file cannot be made, or a file cannot be made private
            (it belongs to another user).
    """
    try:
        # Read-only is enough to make the file and to change its mode; SQLite opens it
        # for writing itself, and says so if it cannot.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, PRIVATE)
    except OSError as error:
        raise StateStorageError(f"{path}: cannot open: {error.strerror or error}") from error
    # SQLite names the companions after the file the path leads to.
    real = os.path.realpath(path)
    try:
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) & ~PRIVATE:
                os.fchmod(fd, PRIVATE)
        finally:
            os.close(fd)
        for companion in (real + suffix for suffix in COMPANIONS):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_IMODE(os.stat(companion).st_mode) & ~PRIVATE:
                    os.chmod(companion, PRIVATE)
    except OSError as error:
        raise StateStorageError(
            f"{path}: cannot open: cannot make {error.filename or real} readable and "
            f"writable by its owner alone (mode 0600): {error.strerror or error}"
        ) from error


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
