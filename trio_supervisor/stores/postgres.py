"""A store on PostgreSQL, shared by the runners of a fleet (docs/service.md section C).

Theory of operation
-------------------
* **One worker thread per store** owns its connection and runs psycopg's sync API (its
  async API is asyncio's); callers in the Trio run queue jobs and park, as with
  :class:`~trio_supervisor.SqliteStore`. Saves that queue while a transaction runs are
  written together in the next (group commit), each batch one call of the schema's
  ``write_batch`` function: one round trip, one commit (the connection is in
  autocommit; only a call whose statements must land together opens a transaction). A
  save returns once its batch committed; a save cancelled while still queued is taken
  back and writes nothing. The batch answers with the older generations each Open
  found on other runners, where the open's wait for them (F6) starts.
* **The schema** (``trio_supervisor``) is versioned, and created or migrated on first
  use in one transaction holding an advisory lock, so runners that start together on
  an empty database do not race.
* **Incarnations.** Opening the store registers this runner: its row gets a new
  *epoch*, and a lease judged by the database's clock. Every write checks, in its own
  transaction, that the row still holds this epoch (``FOR SHARE``); another runner
  that takes this one's records over bumps it (``FOR UPDATE``), so nothing a stalled
  runner writes afterwards lands: its writes fail, and its supervisor is poisoned.
* **Global fencing.** An Open record lands only if its generation is its key's
  high-water + 1 in the database, in the transaction that writes it; a save whose
  Open lost raises ``StaleSessionError`` and writes nothing, while the other saves of
  its batch land.
* **Quotas across the fleet** (:meth:`PostgresStore.save_within`): a save may carry
  a tenant's :class:`~trio_supervisor.model.QuotaClaim`; its batch takes an advisory
  lock per tenant claimed, then counts the tenant's live records (their identities
  matched by the claim's fnmatch patterns, as one regular expression:
  ``_postgres_patterns.py``) in the transaction that would write the record, and
  refuses it with ``QuotaExceededError``, writing nothing, past a quota.
* **Membership** (:meth:`PostgresStore.run_member`): the row is renewed every third of
  ``runner_lease``, and trusted locally only for ``runner_lease`` minus a margin from
  when its last renewal was *sent*; a renewal is one short row. An open that supersedes
  a session of this runner writes a row in its inbox and notifies it (LISTEN, on a
  thread of its own); should the notification be lost, the periodic read of the inbox
  finds it. The sessions' times are published only when a listing of the fleet asks
  (a notification too). Dead runners are taken over once their row expired by more
  than a record's lease plus their ``stop_bound``.
* Every failure reaches the caller as a :class:`StateStorageError` naming the database
  (never its password) and what failed; a row no record can be read from is a
  :class:`RecordFormatError` naming the row.

This room is the store's face; its part in the fleet (the waits for older generations,
takeovers, :meth:`PostgresStore.run_member`) is :class:`~._postgres_fleet.Upkeep`'s.
"""

from __future__ import annotations

import logging
import math
import queue
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import trio

from .. import _defaults as defaults
from .. import realtime
from ..codec import encode
from ..errors import (
    RunnerFencedError,
    StoreUnavailableError,
)
from ..model import FleetRecord, Key, OpenRecord, QuotaClaim, RunnerInfo, SessionRecord
from ..retention import Retention
from ._jobs import Desk, Job
from ._postgres_connection import Settings
from ._postgres_fleet import Upkeep
from ._postgres_link import Memory
from ._postgres_records import Older
from ._postgres_worker import Worker

__all__ = ["PostgresStore"]

logger = logging.getLogger("trio_supervisor.stores.postgres")

# The jobs that write for this runner: refused at once once it is fenced.
_WRITES: Final = frozenset({"save", "takeover", "draining"})


class PostgresStore(Upkeep):
    """Records in a PostgreSQL database, shared by the runners of a fleet.

    Use it as ``async with PostgresStore(dsn) as store:`` or call :meth:`open` and
    :meth:`aclose`. A supervisor that is a member of a fleet also runs
    :meth:`~trio_supervisor.stores.FleetStore.run_member` for as long as it serves.

    Args:
        dsn: A libpq connection string or ``postgresql://`` URL.
        runner_id: This runner's name in the fleet, stable across its restarts; the
            host name by default.
        advertise: Where hosts and other runners reach this runner (an URL), or "".
        runner_lease: Seconds this runner's row stays valid without a renewal.
        retention: Which Stopped records to keep (fleet-wide).
        connect_timeout: Seconds a connection attempt may take.
        statement_timeout: Seconds a statement, or a wait for a lock, may take.
        store_wait: Seconds a call that meets a broken or refused connection, or a
            read-only server, reconnects and tries again before it gives up with
            :class:`~trio_supervisor.errors.StoreUnavailableError` (docs/design.md, B1).
        commit_window: Seconds a save may wait for others to share its commit (0, the
            default: none; saves that queue while a commit runs share the next one
            anyway). A runner of a large fleet trades that much of each save's latency
            for fewer commits on the database (docs/benchmarks.md, issue 51).
        schema: The PostgreSQL schema that holds the store's tables: fleets that share
            a database each use their own.
        memory: What the store of this runner's last incarnation wrote, and the server
            it wrote it to (its :attr:`memory`): a runner that makes a new incarnation
            hands it on, so that writes a failover lost are found and written back even
            when the failover fenced it (B6).

    Attributes:
        commits: How many write transactions this store has committed.
        lost_writes: How many of this runner's live records and high-water marks a
            failover was found to have lost, and that were written back (B6).
    """

    def __init__(
        self,
        dsn: str,
        *,
        runner_id: str | None = None,
        advertise: str = "",
        runner_lease: float = defaults.RUNNER_LEASE,
        retention: Retention | None = None,
        connect_timeout: float = defaults.STORE_CONNECT_TIMEOUT,
        statement_timeout: float = defaults.STORE_STATEMENT_TIMEOUT,
        store_wait: float = defaults.STORE_WAIT,
        commit_window: float = defaults.COMMIT_WINDOW,
        schema: str = defaults.FLEET_SCHEMA,
        memory: Memory | None = None,
    ) -> None:
        for name, value in (
            ("runner_lease", runner_lease),
            ("connect_timeout", connect_timeout),
            ("statement_timeout", statement_timeout),
        ):
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"PostgresStore {name} must be a positive number, got {value!r}")
        # 0: a call that meets the store out of reach gives up at once (serve takes it).
        if isinstance(store_wait, bool) or not isinstance(store_wait, int | float):
            raise ValueError(f"PostgresStore store_wait must be a number, got {store_wait!r}")
        if not 0 <= store_wait < math.inf:
            raise ValueError(
                f"PostgresStore store_wait must be 0 or more seconds, got {store_wait!r}"
            )
        if (
            isinstance(commit_window, bool)
            or not isinstance(commit_window, int | float)
            or not 0 <= commit_window <= defaults.MOST_COMMIT_WINDOW
        ):
            raise ValueError(
                "PostgresStore commit_window must be a number of seconds from 0 to "
                f"{defaults.MOST_COMMIT_WINDOW:g}, got {commit_window!r}"
            )
        runner = socket.gethostname() if runner_id is None else runner_id
        if not isinstance(runner, str) or not runner:
            raise ValueError(f"PostgresStore runner_id must be a non-empty string, got {runner!r}")
        self._retention = retention or Retention()
        self._settings = Settings(
            dsn,
            schema=schema,
            runner_id=runner,
            advertise=advertise,
            runner_lease=float(runner_lease),
            retention=self._retention,
            connect_timeout=float(connect_timeout),
            statement_timeout=float(statement_timeout),
            store_wait=float(store_wait),
            commit_window=float(commit_window),
        )
        self._worker: Worker | None = None
        self._memory = memory if memory is not None else Memory()
        self._fenced: RunnerFencedError | None = None  # once run_member found it fenced
        self._desk = Desk(f"trio_supervisor postgres {self.dsn}", self.dsn, self._start)
        # How often run_member checks the live keys' high-water (tests make it rare).
        self._check_period = min(runner_lease / 3, defaults.FLEET_CHECK)
        self._heard: trio.Event | None = None  # set when a stop is notified
        self._listening: trio.Event | None = None  # set once run_member LISTENs
        self._times_asked: trio.Event | None = None  # set when a listing asks for times
        # What the last saves of Opens found superseded on other runners, by token,
        # with the event of the next notified stop as the save began.
        self._older_seen: dict[str, tuple[list[Older], trio.Event]] = {}

    @property
    def dsn(self) -> str:
        """The database, as errors name it: without its password."""
        return self._settings.shown

    @property
    def schema(self) -> str:
        """The PostgreSQL schema that holds the store's tables."""
        return self._settings.schema

    @property
    def member(self) -> str:
        """This runner's id in the fleet."""
        return self._settings.runner_id

    @property
    def epoch(self) -> int:
        """This incarnation's epoch (0 until the store is open)."""
        return 0 if self._worker is None else self._worker.epoch

    @property
    def runner_lease(self) -> float:
        """Seconds this runner's row stays valid without a renewal."""
        return self._settings.runner_lease

    @property
    def commits(self) -> int:
        """How many write transactions this store has committed."""
        return 0 if self._worker is None else self._worker.commits

    @property
    def retention(self) -> Retention:
        """The retention policy this store applies."""
        return self._retention

    @property
    def memory(self) -> Memory:
        """What this runner wrote, and the server it last saw (B6)."""
        return self._memory

    @property
    def lost_writes(self) -> int:
        """How many records and marks of this runner a failover lost (B6)."""
        return 0 if self._worker is None else self._worker.lost_writes

    @property
    def store_wait(self) -> float:
        """Seconds a call tries again a store that does not answer (B1)."""
        return self._settings.store_wait

    # -- the face ----------------------------------------------------------------------

    async def open(self) -> None:
        """Connect, create or migrate the schema, and register this runner (a new epoch).

        Raises:
            StateStorageError: The database cannot be reached, or its schema has a
                version this library does not know.
        """
        await self._submit(Job("open"))

    async def save(self, record: SessionRecord) -> None:
        """Make ``record`` durable (group commit); see the module docs for cancellation.

        Implements :meth:`trio_supervisor.abc.Store.save`, fenced by this runner's epoch
        (F4); an Open record claims its generation fleet-wide (F3).

        Raises:
            StaleSessionError: ``record`` is an Open record whose generation is not its
                key's high-water + 1 in the fleet; nothing was written.
            StoreUnavailableError: The database stayed out of reach for ``store_wait``
                and nothing was written (B1); it does not poison.
            StateStorageError: The record could not be written, or this runner's epoch
                was taken over.
        """
        await self._save(Job("save", [(record, encode(record))]))

    async def save_many(self, records: Sequence[SessionRecord]) -> None:
        """Make every record durable in one transaction, or none of them.

        Implements :meth:`trio_supervisor.abc.BatchStore.save_many`; raises as
        :meth:`save`.
        """
        await self._save(Job("save", [(record, encode(record)) for record in records]))

    async def save_within(self, record: SessionRecord, quota: QuotaClaim) -> None:
        """Make ``record`` durable as :meth:`save` does, if ``quota``'s tenant stays
        within its quota once the record counts; counted in the transaction that writes
        it, after every earlier claim of the tenant's in the fleet committed.

        An Open record takes a session (none when it supersedes a live generation of
        its key); a session's first Loading (or Loaded) record takes a child, with its
        ``memory_bytes`` and ``cpu_percent`` limits. Any other record counts nothing.

        Implements :meth:`trio_supervisor.abc.FleetStore.save_within` (F9).

        Raises:
            QuotaExceededError: A count would pass its quota; nothing was written, and no
                generation was claimed.
            StaleSessionError, StateStorageError: As :meth:`save`.
        """
        await self._save(Job("save", [(record, encode(record))], args=quota))

    async def _save(self, job: Job) -> None:
        """Submit a save; keep what it says of the older generations its Opens
        superseded on other runners, for :meth:`wait_older_stopped` to start from.

        After a failover, an Open waits until every live runner checked its writes on
        the new server (B6), as a lookup does: its compare-and-set is then against
        marks no runner is still to raise back.
        """
        opens = any(isinstance(record, OpenRecord) for record, _ in job.rows)
        if opens and self._worker is not None and self._worker.failover_pending:
            await self._checked_by_all()
        # The event of the next notified stop, taken before the save: a stop heard
        # after it says that what the save found may have stopped since.
        if self._heard is None:
            self._heard = trio.Event()
        heard = self._heard
        older: list[Older] = await self._submit(job)
        for record, _ in job.rows:
            if isinstance(record, OpenRecord):
                handle = record.handle
                self._older_seen[handle.token] = (
                    [row for row in older if row.generation < handle.generation],
                    heard,
                )
                if len(self._older_seen) > defaults.OLDER_KEPT:
                    del self._older_seen[next(iter(self._older_seen))]

    async def list(self) -> Sequence[SessionRecord]:
        """This runner's retained records (of all its epochs), in the order they were saved.

        Implements :meth:`trio_supervisor.abc.Store.list`: recovery settles the records
        of this runner's earlier epochs too (V1, F1).

        Raises:
            RecordFormatError: A row is malformed, of an unknown version, or holds the
                record of another token or key; the message names the row.
        """
        records: list[SessionRecord] = await self._ask("list")
        return records

    async def high_water(self) -> Mapping[Key, int]:
        """Every key's highest generation in the fleet.

        Implements :meth:`trio_supervisor.abc.Store.high_water` (V5, F3).
        """
        marks: dict[Key, int] = await self._ask("high_water")
        return marks

    async def lookup(self, key: Key, request_id: str | None) -> tuple[int, SessionRecord | None]:
        """The key's high-water now, and its retained record opened with ``request_id``
        (whichever runner holds it), if any: one query.

        Implements :meth:`trio_supervisor.abc.FleetStore.lookup` (F3). After a failover
        it waits until every live runner checked its writes on the new server (B6).
        """
        found: tuple[int, SessionRecord | None] = await self._ask("lookup", key, request_id)
        if self._worker is not None and self._worker.failover_pending:
            # B6: after a failover, a mark here may be one another runner is still to
            # raise back; the key is looked up again once every live runner checked.
            await self._checked_by_all()
            found = await self._ask("lookup", key, request_id)
        return found

    async def _checked_by_all(self) -> None:
        """Wait until every live runner of the fleet checked its writes on the server
        this store sees (each does as it first meets it, or at its next renewal).

        Raises:
            StoreUnavailableError: Some still had not within ``store_wait``; the caller
                may try again (nothing was written).
        """
        assert self._worker is not None
        until = time.monotonic() + self._settings.store_wait
        while True:
            unchecked: list[str] = await self._ask("unchecked")
            if not unchecked:
                self._worker.failover_pending = False
                return
            if time.monotonic() >= until:
                raise StoreUnavailableError(
                    f"{self.dsn}: the database's server changed (a failover?), and "
                    f"runner{'s' if len(unchecked) > 1 else ''} {', '.join(unchecked)} "
                    "of the fleet did not check yet for writes it lost; no generation "
                    "is handed out until each did, or its row expired"
                )
            await trio.sleep(defaults.OLDER_POLL)

    async def runners(self) -> Sequence[RunnerInfo]:
        """Every runner of the fleet, by id.

        Implements :meth:`trio_supervisor.abc.FleetStore.runners`.
        """
        found: list[RunnerInfo] = await self._ask("runners")
        return found

    async def fleet_records(self) -> Sequence[FleetRecord]:
        """Every retained record of the fleet, in save order, each with its runner.

        The live sessions' age and lease left are those their runners publish when
        asked: each is asked first, and given up to a second to answer (one that does
        not shows what it published last).
        """
        asked: float = await self._ask("ask_times")
        with realtime.bounded(defaults.TIMES_WAIT):
            while await self._ask("times_due", asked):
                await realtime.sleep(defaults.TIMES_POLL)
        found: list[FleetRecord] = await self._ask("fleet_records")
        return found

    async def held(self, token: str) -> FleetRecord | None:
        """The retained record of ``token``, whichever runner holds it.

        Implements :meth:`trio_supervisor.abc.FleetStore.held` (F8).
        """
        found: FleetRecord | None = await self._ask("held", token)
        return found

    async def owner(self, token: str) -> RunnerInfo | None:
        """The runner that holds the session of ``token``, if a record of it is retained.

        Implements :meth:`trio_supervisor.abc.FleetStore.owner` (F8).
        """
        found: RunnerInfo | None = await self._ask("owner", token)
        return found

    async def drain(self) -> None:
        """Mark this runner draining in the fleet's listing (:meth:`runners`), until it
        starts again: it takes no new sessions, and ends once its own have ended.

        Raises:
            StateStorageError: The row could not be written.
        """
        await self._submit(Job("draining"))

    async def aclose(self) -> None:
        """Finish the writes already queued, mark this runner's row expired, and close.

        The row's expiry is a courtesy to the fleet (a takeover still waits out each
        record's margin); when the database cannot be reached it is logged, not raised.
        """
        failure = await self._desk.close()
        if failure is not None:
            raise failure

    # -- talking to the worker ---------------------------------------------------------

    async def _ask(self, kind: str, *args: Any) -> Any:
        """A job that writes nothing: its caller may stop waiting at any time."""
        return await self._submit(Job(kind, args=args), abandonable=True)

    def _start(self, jobs: queue.SimpleQueue[Job]) -> Callable[[], None]:
        self._worker = Worker(self._settings, jobs, self._memory)
        return self._worker.run

    async def _submit(self, job: Job, *, abandonable: bool = False) -> Any:
        if self._fenced is not None and job.kind in _WRITES:
            await trio.lowlevel.checkpoint()
            raise self._fenced.again()
        return await self._desk.submit(job, abandonable=abandonable)
