"""The SQLite store's worker: the thread that owns the connection, and its jobs.

Theory of operation
-------------------
Callers (``SqliteStore``, in the Trio run) put :class:`Job` s on a queue and park; the
worker thread takes everything queued, writes the saves of that batch as one statement
(group commit; a batch of more than sql.ROWS changes, as recovery writes, in one
transaction of several), answers the reads, and wakes each caller through its run's token. A job
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
from collections.abc import Callable, Iterator
from typing import Final, TypeVar

from ..errors import StateStorageError
from ..model import Key, SessionRecord, StoppedRecord
from ..retention import Retention, StopOrder
from . import _sqlite_sql as sql
from ._jobs import Job, deliver, next_batch
from ._rows import key_of, record_of
from ._sqlite_file import claim

__all__ = ["Worker"]

# A row of the view: token, identity, instance, saved, stopped, body, generation,
# stopped_at.
_Change = tuple[
    str | None, str | None, str | None, int | None, int | None, str | None, int | None, float | None
]
_T = TypeVar("_T")
# A row read by list(): token, identity, instance, body, and save order.
_saved: Final = operator.itemgetter(4)


class Mirror:
    """What the worker knows of the table, so that a write needs no reads first.

    The last save order given, every Stopped row's token in stop order with its time
    (retention's :class:`~trio_supervisor.retention.StopOrder`, the one the record index
    uses) and the high-water marks; read once when the file opens, kept in step by every write,
    and read again after a write that failed.
    """

    __slots__ = ("high", "saved", "stops")

    def __init__(self, saved: int) -> None:
        self.saved = saved  # the last save order given
        self.stops: StopOrder[tuple[str, str]] = StopOrder()
        self.high: dict[tuple[str, str], int] = {}

    @classmethod
    def read(cls, connection: sqlite3.Connection) -> Mirror:
        (saved,) = connection.execute(sql.LAST_SAVED).fetchone()
        mirror = cls(saved)
        for token, identity, instance, number, at in connection.execute(sql.STOPS).fetchall():
            mirror.stops.restore(token, (identity, instance), number, at)
        for identity, instance, generation in connection.execute(sql.HIGH_WATER).fetchall():
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
        clock: The wall clock a stop's time is read from, once a batch.
    """

    def __init__(
        self,
        path: str,
        *,
        retention: Retention,
        timeout: float,
        jobs: queue.SimpleQueue[Job],
        clock: Callable[[], float],
    ) -> None:
        self.path = path
        self.retention = retention
        self._clock = clock
        self._timeout = timeout
        self._jobs = jobs
        # Transactions committed; written by this thread only, read by anyone.
        self.commits = 0
        self._connection: sqlite3.Connection | None = None
        self._owning: int | None = None  # the descriptor that holds the file's ownership
        # Set before anything reads them (run() and _open()): other start values are
        # equivalent mutants (mutmut leaves them out).
        # pragma: no mutate start
        self._open_error: StateStorageError | None = None
        self._mirror: Mirror | None = None
        self._rows_per_statement = 1  # see sql.ROWS; set when the connection opens
        # pragma: no mutate end
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
            # Closing on its own thread does not fail: the action's word is never shown.
            closing.error = self._attempt("close", self._connection.close)  # pragma: no mutate
        self._disown()
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
        # Claimed first: a file another store owns is refused at once, without waiting
        # out SQLite's lock timeout (a lock no store holds is still waited for below).
        self._owning = claim(path)
        try:
            connection = sqlite3.connect(path, timeout=self._timeout, isolation_level=None)
        except BaseException:
            self._disown()
            raise
        try:
            connection.execute(sql.EXCLUSIVE)
            mode = connection.execute(sql.WAL).fetchone()[0]
            if mode != "wal":
                raise StateStorageError(f"{path}: SQLite refused WAL mode (got {mode!r})")
            connection.execute(sql.SYNCHRONOUS)
            connection.execute(sql.BEGIN)
            for statement in sql.SCHEMA:
                connection.execute(statement)
            versions = [row[0] for row in connection.execute(sql.SCHEMA_VERSIONS)]
            if not versions:
                connection.execute(sql.WRITE_SCHEMA_VERSION, (sql.SCHEMA_VERSION,))
            elif len(versions) == 1 and versions[0] in range(1, sql.SCHEMA_VERSION):
                # An earlier library's file: migrated in this transaction.
                for step in range(versions[0] + 1, sql.SCHEMA_VERSION + 1):
                    for statement in sql.MIGRATIONS[step]:
                        connection.execute(statement)
                connection.execute(sql.UPDATE_SCHEMA_VERSION, (sql.SCHEMA_VERSION,))
            elif versions != [sql.SCHEMA_VERSION]:
                raise StateStorageError(
                    f"{path} has schema version {versions}; "
                    f"this library reads version {sql.SCHEMA_VERSION}"
                )
            connection.execute(sql.COMMIT)
            for statement in sql.CHANGES:
                connection.execute(statement)
            mirror = Mirror.read(connection)
        except BaseException:
            # Closing also rolls back, and gives up the exclusive lock: a store that
            # failed to open must not keep others out of the file.
            connection.close()
            self._disown()
            raise
        self._connection = connection
        self._mirror = mirror
        self._rows_per_statement = min(
            sql.ROWS, connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // 8
        )

    def _disown(self) -> None:
        """Give up the file's ownership, once its connection closed (or never opened)."""
        if self._owning is not None:
            with contextlib.suppress(OSError):
                os.close(self._owning)
            self._owning = None

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
        now = self._clock()  # every stop of the batch happens at its write
        # The whole batch is worked out here, against the mirror, into rows of the
        # ``changes`` view; SQLite then gets them as one statement (or, beyond sql.ROWS of
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
                    upserts[token] = (token, *key, saved, None, body, mark, None)
                    continue
                stop_order, evicted = stops.stop_evicting(token, key, retention, now)
                upserts[token] = (
                    token,
                    *key,
                    saved,
                    stop_order,
                    body,
                    mark,
                    stops.stopped_at(token),
                )
                for gone in evicted:
                    dropped = upserts.pop(gone, None)
                    if dropped is not None and dropped[6] is not None:
                        marks.append(
                            (None, dropped[1], dropped[2], None, None, None, dropped[6], None)
                        )
                    deletes[gone] = (gone, None, None, None, None, None, None, None)
        mirror.saved = saved
        changes = [*deletes.values(), *upserts.values(), *marks]
        if not changes:
            return
        try:
            if len(changes) <= self._rows_per_statement:
                # Nearly every batch: one statement, which is then its own transaction.
                connection.execute(
                    sql.apply_changes(len(changes)),
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
                    connection.execute(sql.ROLLBACK)
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
        connection.execute(sql.BEGIN)
        for tokens in _chunks(list(deletes), per_statement):
            connection.execute(sql.delete_records(len(tokens)), tokens)
        rows = list(upserts.values())
        for written in _chunks(rows, per_statement):
            connection.execute(
                sql.upsert_records(len(written)),
                [value for row in written for value in (*row[:6], row[7])],
            )
        raised = [
            (change[1], change[2], change[6]) for change in (*rows, *marks) if change[6] is not None
        ]
        for high in _chunks(raised, per_statement):
            connection.execute(
                sql.raise_marks(len(high)), [value for mark in high for value in mark]
            )
        connection.execute(sql.COMMIT)

    def _read(self, job: Job) -> None:
        connection = self._connection
        assert connection is not None
        path = self.path
        if job.kind == "list":
            # fetchall first: a cursor left open by a decoding error would keep the
            # connection (and its exclusive lock) alive past close().
            rows = connection.execute(sql.RECORDS).fetchall()
            try:
                # In save order. Sorted here: SQLite's sort (no index serves it, see
                # sql.SCHEMA) costs about as much as reading the rows.
                rows.sort(key=_saved)
            except TypeError:  # a save order no int: a row edited by hand
                rows = connection.execute(sql.RECORDS_IN_SAVE_ORDER).fetchall()
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
            marks = connection.execute(sql.HIGH_WATER).fetchall()
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


def _explain(path: str, action: str, error: Exception) -> str:
    if not isinstance(error, sqlite3.Error):
        return f"{path}: cannot {action}: {error!r}"
    text = str(error)
    if "locked" in text:
        # No store owns it (claim() said so at once): another connection held it for
        # longer than the store's lock timeout.
        return (
            f"{path}: cannot {action}: the file is locked by another connection for "
            f"longer than the store waits ({text})"
        )
    return f"{path}: cannot {action}: {text}"
