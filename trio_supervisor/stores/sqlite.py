"""A store in one SQLite file: the embedded default.

* One file, in WAL mode with ``synchronous=FULL``: when a save returns, its record
  survives a crash of the process or of the machine.
* One store (so one supervisor) owns the file: it holds an ownership lock on it, and
  SQLite's ``locking_mode=EXCLUSIVE``. A second store opening it gets a clear error at
  once, naming the process that holds it, instead of two supervisors fencing one key
  each their own way (``_sqlite_file.py``). A lock no store holds (a checkpoint, a
  tool's brief transaction) is waited for, up to ``timeout``.
* The file and its companions are readable and writable by their owner alone (mode
  0600): a new file is made so, and an existing one (with any write-ahead log or
  journal an earlier run left) is made so when the store opens. SQLite gives the
  companions it makes the file's own mode.
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

import os
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import _defaults as defaults
from ..codec import encode
from ..model import Key, SessionRecord
from ..retention import Retention
from ._jobs import Desk, Job, Opening
from ._sqlite_worker import Worker

__all__ = ["SqliteStore"]


class SqliteStore(Opening):
    """Records in one SQLite file.

    Use it as ``async with SqliteStore(path) as store:`` or call :meth:`aclose`; the
    worker thread and its connection start on first use.

    Args:
        path: The database file; its directory must exist. Made with mode 0600 if it
            does not exist, and given that mode when the store opens if it has another.
        retention: Which Stopped records to keep.
        timeout: Seconds SQLite waits for a lock that no store owns (another
            connection's brief transaction, a checkpoint) before failing; a file another
            store owns is refused at once.
        clock: The wall clock a stop's time is read from, for ``retention.stopped_for``
            (seconds since the Unix epoch); each Stopped row keeps its time, so the
            window holds across restarts. Tests give one they move themselves.

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
        timeout: float = defaults.SQLITE_LOCK_WAIT,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = os.fspath(path)
        self._retention = retention or Retention()
        self._timeout = timeout
        self._clock = clock
        self._worker: Worker | None = None
        self._desk = Desk(f"trio_supervisor sqlite {self.path}", self.path, self._start)

    @property
    def commits(self) -> int:
        """How many transactions this store has committed."""
        return 0 if self._worker is None else self._worker.commits

    @property
    def retention(self) -> Retention:
        """The retention policy this store applies."""
        return self._retention

    # -- the face ----------------------------------------------------------------------

    async def open(self) -> None:
        """Open the file now rather than on first use, so a bad file fails here.

        Raises:
            StateStorageError: The file cannot be opened, is owned by another store
                (the message names its process where the system says), stays locked
                past ``timeout``, or has a schema version this library does not know.
        """
        # The worker opens the file before it serves any job; this one only waits for
        # that, whatever its kind is called (mutmut leaves the name alone).
        await self._submit(Job("open"))  # pragma: no mutate

    async def save(self, record: SessionRecord) -> None:
        """Make ``record`` durable (group commit); see the module docs for cancellation.

        Implements :meth:`trio_supervisor.abc.Store.save`: returns once the transaction
        holding it committed with ``synchronous=FULL``.

        Raises:
            StateStorageError: The write failed (a full disk, say) or the file is
                locked by another store.
        """
        # The desk's own call, not _submit: a save is the busiest call of the store.
        await self._desk.submit(Job("save", [(record, encode(record))]))

    async def save_many(self, records: Sequence[SessionRecord]) -> None:
        """Make every record durable in one transaction.

        Implements :meth:`trio_supervisor.abc.BatchStore.save_many`.

        Raises:
            StateStorageError: The write failed; none of the records landed.
        """
        await self._desk.submit(Job("save", [(record, encode(record)) for record in records]))

    async def list(self) -> Sequence[SessionRecord]:
        """Every retained record, in the order they were last saved.

        Implements :meth:`trio_supervisor.abc.Store.list` (V1).

        Raises:
            RecordFormatError: A row is malformed, of an unknown version, or holds the
                record of another token or key; the message names the row.
        """
        records: list[SessionRecord] = await self._submit(Job("list"))
        return records

    async def high_water(self) -> Mapping[Key, int]:
        """Every key's highest generation ever saved.

        Implements :meth:`trio_supervisor.abc.Store.high_water`.
        """
        marks: dict[Key, int] = await self._submit(Job("high_water"))
        return marks

    async def aclose(self) -> None:
        """Finish the writes already queued, close the connection, stop the worker.

        Raises:
            StateStorageError: SQLite failed to close the file; every save that
                returned is durable all the same.
        """
        failure = await self._desk.close()
        if failure is not None:
            raise failure

    # -- talking to the worker ---------------------------------------------------------

    def _start(self, jobs: queue.SimpleQueue[Job]) -> Callable[[], None]:
        self._worker = Worker(
            self.path,
            retention=self._retention,
            timeout=self._timeout,
            jobs=jobs,
            clock=self._clock,
        )
        return self._worker.run

    async def _submit(self, job: Job) -> Any:
        return await self._desk.submit(job)
