"""The PostgreSQL store's worker: the thread that owns the store's connection, and the
jobs it serves.

Theory of operation
-------------------
Callers (``PostgresStore``, in the Trio run) put :class:`~._jobs.Job` s on a queue and
park; the worker takes everything queued, writes the saves of that batch in one
transaction through one call of ``write_batch`` (group commit), then serves the other
jobs one transaction each, and wakes each caller through its run's token. Every
statement runs under ``statement_timeout`` and ``lock_timeout``, on a socket with TCP
keepalives and ``tcp_user_timeout``, and every job under a watchdog
(:mod:`._postgres_connection`): no job waits on a dead network for more than seconds.
A connection that broke is dropped, and the next job connects again (its writes are
still fenced by the epoch, which is what a reconnect cannot bypass).

A read is a job like a save, served after the saves of its batch (so it sees them);
its caller may stop waiting for it at any time (``Job.abandon``). A takeover is a write:
its caller waits for its answer, as a save's does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import select
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from .._extras import needs_extra
from ..codec import encode
from ..errors import (
    QuotaExceededError,
    RunnerFencedError,
    StaleSessionError,
    StateStorageError,
    StoreUnavailableError,
)
from ..model import (
    ExitStatus,
    FleetRecord,
    Key,
    OpenRecord,
    Phase,
    QuotaClaim,
    RunnerInfo,
    SessionRecord,
    StoppedRecord,
    Superseded,
    Termination,
    recovered,
)
from ._jobs import Job, deliver, next_batch
from ._postgres_connection import Settings, Watchdog
from ._postgres_patterns import identity_regex
from ._postgres_sql import (
    ASK_TIMES,
    CHECKED,
    CLEAR_SCHEMA_VERSION,
    CREATE_SCHEMA_VERSION,
    DEAD,
    DEAD_ROW,
    DRAINING,
    DUE,
    EXPIRE,
    FENCED,
    FLEET_RECORDS,
    HELD,
    HIGH_WATER,
    INBOX,
    LANDED,
    LIST,
    LOOKUP,
    LOW_MARKS,
    MIGRATION_LOCK,
    MIGRATIONS,
    NEXT_EPOCH,
    OLDER,
    OTHERS_ALIVE,
    OWN_ROW,
    OWNER,
    POOL_MARK,
    POOL_SEEN,
    PUBLISH_TIMES,
    RAISE_MARKS,
    REFILL_INBOX,
    REGISTER,
    RENEW,
    RUNNERS,
    SAVE_BATCH,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    SERVER,
    SERVER_IDENTITY,
    TAKE_MIGRATION_LOCK,
    TIMES_DUE,
    UNCHECKED,
    WRITE_SCHEMA_VERSION,
    WRITTEN_PHASES,
    Kind,
    create_schema,
)
from ._rows import key_of, record_of

with needs_extra("postgres", "trio_supervisor.stores.postgres", "psycopg"):
    import psycopg
    from psycopg.types.json import Jsonb

__all__ = ["Memory", "Older", "Worker", "migrate"]

logger = logging.getLogger("trio_supervisor.stores.postgres")

# What a dead runner's sessions are stopped with when another runner takes them over.
RUNNER_LOST: Final = Termination(kind="exited", exit=ExitStatus(runner_lost=True))
# Seconds between two tries of a store that does not answer: the first pause, doubled
# up to the last. A server back from a restart is seen within the last.
FIRST_PAUSE: Final = 0.05
LAST_PAUSE: Final = 0.25
# SQLSTATEs that say the server cannot serve now, not that the call is wrong: every
# connection exception (class 08), a server shutting down, crashed or starting up
# (57P01-57P03), and a server that is read-only (25006: a standby, or a primary that
# was demoted), where the next connection may reach the new primary.
UNAVAILABLE_STATES: Final = ("57P01", "57P02", "57P03", "25006")
# SQLSTATEs of a transaction the server rolled back to end a conflict with another
# (deadlock_detected, serialization_failure), and how often a batch so ended is written
# again before its callers get the error.
CONFLICT_STATES: Final = ("40P01", "40001")
CONFLICT_TRIES: Final = 3
# How many tokens' last records and keys' last generations a runner remembers, to write
# them again should the database lose them (a failover to a standby that missed them).
REMEMBERED: Final = 1 << 16


def unavailable(error: BaseException, connection: psycopg.Connection[Any] | None) -> bool:
    """Whether ``error`` says the store is out of reach for now (docs/design.md, B1),
    rather than that the call failed: then it is tried again on a new connection."""
    if not isinstance(error, psycopg.Error):
        return False
    state = error.sqlstate
    if state is not None and (state.startswith("08") or state in UNAVAILABLE_STATES):
        return True
    if isinstance(error, psycopg.OperationalError) and state is None:
        return True  # no connection, or one that broke: libpq's, with no SQLSTATE
    return connection is not None and (connection.broken or connection.closed)


def _conflicted(failure: StateStorageError) -> bool:
    """Whether a save failed because the server rolled it back to end a deadlock or a
    serialization failure with another transaction: it wrote nothing, and may be tried
    again at once."""
    cause = failure.__cause__
    return isinstance(cause, psycopg.Error) and cause.sqlstate in CONFLICT_STATES


def _hung_up(connection: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection has something to read: its server's last words (a
    FATAL message as it shuts down or ends the session) or its end. Nothing else comes
    on an idle connection that does not LISTEN."""
    if connection.broken or connection.closed:
        return True
    try:
        readable, _, _ = select.select([connection.pgconn.socket], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return True
    return bool(readable)


_PHASES: Final = [phase.value for phase in Phase]  # the order a record moves in


class Memory:
    """What a runner wrote, which a failover to a standby that missed it would take back
    (B6), and the server it wrote it to; handed from one incarnation's store to the next.

    Attributes:
        server: The server last seen, as its system identifier and timeline.
        check_lost: Whether the server changed since, and its writes are to be checked.
        written: The last record saved of each of the latest tokens, with its body.
        handed: The highest generation saved of each of the latest keys.
    """

    def __init__(self) -> None:
        self.server: str | None = None
        self.check_lost = False
        self.written: dict[str, tuple[SessionRecord, str]] = {}
        self.handed: dict[Key, int] = {}

    def wrote(self, rows: Iterable[tuple[SessionRecord, str]]) -> None:
        """Take in the records of a save that landed (the oldest forgotten first)."""
        written, handed = self.written, self.handed
        for record, body in rows:
            handle = record.handle
            written.pop(handle.token, None)
            written[handle.token] = (record, body)
            if len(written) > REMEMBERED:
                del written[next(iter(written))]
            key = handle.key
            if handed.get(key, 0) < handle.generation:
                handed.pop(key, None)
                handed[key] = handle.generation
                if len(handed) > REMEMBERED:
                    del handed[next(iter(handed))]


class Older(NamedTuple):
    """An unstopped record of a key, below a generation opened, on another runner."""

    runner: str
    epoch: int  # its runner's
    generation: int
    lease: float  # the record's
    stop_bound: float  # its runner's
    expired_for: float  # seconds since its runner's row expired; negative: alive


class _Standby(psycopg.OperationalError):
    """The connection reached a server in recovery: it takes no writes (B4)."""

    sqlstate = "25006"


class Worker:
    """The thread that owns the store's connection.

    Everything it does runs inside :meth:`_attempt`, which turns a ``psycopg.Error`` (or
    anything but a :class:`StateStorageError`) into the :class:`StateStorageError` its
    callers get; no failure ends the thread, which would leave its callers waiting.
    """

    def __init__(
        self, settings: Settings, jobs: queue.SimpleQueue[Job], memory: Memory | None = None
    ) -> None:
        self.settings = settings
        self._jobs = jobs
        # Written by this thread only, read by anyone.
        self.commits = 0
        self.epoch = 0
        self.lost_writes = 0  # records and marks found lost by a failover (B6)
        self._connection: psycopg.Connection[Any] | None = None
        self._open_error: StateStorageError | None = None
        self._watchdog = Watchdog(
            2 * settings.statement_timeout + settings.connect_timeout, lambda: self._connection
        )
        # Whether the statement that may commit was sent (a failure after it leaves the
        # outcome unknown until a look tells), and since when the store is unreachable.
        self._sent = False
        self._down: StoreUnavailableError | None = None
        # What this runner wrote, and the server it last saw (B6): handed on from the
        # store of its last incarnation, so that one fenced by a failover remembers.
        self.memory = memory if memory is not None else Memory()
        # Set when this worker saw the server change, until every live runner of the
        # fleet checked its writes on the new one (PostgresStore.lookup waits for it).
        self.failover_pending = False

    def run(self) -> None:
        jobs = self._jobs
        self._watchdog.start()
        self._open_error = self._retrying(
            "open the store", self._open, time.monotonic() + self.settings.store_wait
        )
        closing: Job | None = None
        while closing is None:
            taken, closing = next_batch(jobs)  # group commit
            if closing is None and self.settings.commit_window > 0:
                closing = self._gather(taken)
            self._serve(taken)
            taken = []  # answered: nothing of them is held while the next batch waits
        if self._open_error is None:
            failure = self._attempt("mark this runner's row expired", self._close)
            if failure is not None:
                # Only a courtesy to the fleet (its lease runs out all the same); every
                # save that returned is durable.
                logger.warning("%s", failure)
        if self._connection is not None:
            with contextlib.suppress(psycopg.Error):
                self._connection.close()
        self._watchdog.stop()
        deliver([closing])

    def _gather(self, taken: list[Job]) -> Job | None:
        """Hold a batch of saves open for more, up to ``commit_window`` from its first
        save's call, so that the saves of a busy runner share fewer commits; a job that
        is not a save ends the wait (a read is not held back). The close job, if one
        came, is returned."""
        saves = [job.born for job in taken if job.kind == "save"]
        if not saves or len(saves) < len(taken):
            return None
        until = min(saves) + self.settings.commit_window
        while (left := until - time.monotonic()) > 0:
            try:
                job = self._jobs.get(timeout=left)
            except queue.Empty:
                return None
            if job.kind == "close":
                return job
            if job.take():
                taken.append(job)
                if job.kind != "save":
                    return None
        return None

    def _serve(self, jobs: list[Job]) -> None:
        if self._open_error is not None:
            for job in jobs:
                job.error = self._open_error
            deliver(jobs)
            return
        # Writes first, so a read queued after a save sees it.
        saves = [job for job in jobs if job.kind == "save"]
        if saves:
            self._save_batch(saves)
        for job in jobs:
            if job.kind == "open":
                continue  # the thread opened the store as it started: nothing left to do
            if job.kind != "save":
                action = _ACTIONS.get(job.kind, job.kind)
                job.error = self._retrying(
                    action, functools.partial(self._do, job), self._deadline(job)
                )
        deliver(jobs)

    def _deadline(self, job: Job) -> float:
        """Until when ``job`` may try again a store that does not answer (B1)."""
        return job.born + (self.settings.store_wait if job.wait is None else job.wait)

    def _save_batch(self, saves: list[Job]) -> None:
        """Write the saves of a batch in one transaction, trying again within their wait
        while the store does not answer (B1).

        A save given up on certainly wrote nothing: where the connection broke after the
        batch was sent, the batch may have committed before its answer was lost, so the
        rows are looked at on a new connection (for as long as the runner's row could
        last, should the store stay away) before anything is tried again or reported.
        Jobs that landed are done; the others are written again (an Open that lost its
        compare-and-set, or a claim refused, is refused again, and says why).
        """
        deadline = max(self._deadline(job) for job in saves)
        pending = saves
        pause = FIRST_PAUSE
        conflicts = 0
        while pending:
            for job in pending:
                job.error = None
            failure = self._attempt("save", functools.partial(self._save, pending))
            if failure is None:
                return
            if _conflicted(failure) and conflicts < CONFLICT_TRIES:
                # The server chose this batch to end a deadlock (or a serialization
                # failure): it rolled back, nothing of it landed; written again at once.
                conflicts += 1
                logger.info("%s; written again", failure)
                continue
            if isinstance(failure, StoreUnavailableError) and self._sent:
                landed = self._look(pending)
                if landed is None:
                    failure = StateStorageError(
                        f"{self.settings.shown}: cannot tell whether a save landed: the "
                        "connection broke as it was sent, and the store did not answer "
                        f"for {self._look_bound():g} s after"
                    )
                    failure.__cause__ = self._down
                else:
                    if landed:
                        logger.warning(
                            "%s: the connection broke as a save committed; it had landed",
                            self.settings.shown,
                        )
                    pending = [job for index, job in enumerate(pending) if index not in landed]
                    if not pending:
                        return
            if not isinstance(failure, StoreUnavailableError) or time.monotonic() >= deadline:
                for job in pending:
                    job.error = job.error or self._given_up(failure, "save")
                return
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, LAST_PAUSE)

    def _look_bound(self) -> float:
        """How long a save whose outcome is unknown is looked for: past the runner's
        own lease, it would have been fenced anyway."""
        return max(self.settings.store_wait, self.settings.runner_lease)

    def _look(self, jobs: list[Job]) -> set[int] | None:
        """The indexes of ``jobs`` that landed (empty: the batch did not commit), or
        None when the store did not answer within :meth:`_look_bound`."""
        until = time.monotonic() + self._look_bound()
        pause = FIRST_PAUSE
        while True:
            landed: set[int] = set()
            look = functools.partial(self._landed, jobs, landed)
            if self._attempt("look for a save whose answer was lost", look) is None:
                return landed
            if time.monotonic() >= until:
                return None
            time.sleep(pause)
            pause = min(2 * pause, LAST_PAUSE)

    def _retrying(
        self, action: str, work: Callable[[], None], deadline: float
    ) -> StateStorageError | None:
        """:meth:`_attempt`, again and again while the store does not answer, until
        ``deadline`` (B1); what the caller is to get."""
        pause = FIRST_PAUSE
        while True:
            if self._down is not None and time.monotonic() >= deadline:
                # Out of reach a moment ago, and this job's wait is over: it is not
                # kept waiting for one more connection attempt.
                return self._given_up(self._down, action)
            failure = self._attempt(action, work)
            if not isinstance(failure, StoreUnavailableError):
                return failure
            if time.monotonic() >= deadline:
                return self._given_up(failure, action)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, LAST_PAUSE)

    def _given_up(self, failure: StateStorageError, action: str) -> StateStorageError:
        """The error of a call that gave up on a store out of reach: it wrote nothing."""
        if not isinstance(failure, StoreUnavailableError):
            return failure
        given = StoreUnavailableError(
            f"{failure.detail}; gave up after {self.settings.store_wait:g} s of trying "
            f"(store_wait): nothing of this {action} was written"
            if action == "save"
            else f"{failure.detail}; gave up after {self.settings.store_wait:g} s of trying "
            "(store_wait)"
        )
        given.__cause__ = failure.__cause__
        return given

    def _attempt(self, action: str, work: Callable[[], None]) -> StateStorageError | None:
        """Run ``work`` in a transaction once; return the error its callers are to get, if
        any: a :class:`StoreUnavailableError` where the store was out of reach."""
        self._sent = False
        try:
            with self._watchdog:
                work()
        except StateStorageError as error:  # RecordFormatError too: worded already
            self._end_transaction()
            return error
        except Exception as error:
            down = unavailable(error, self._connection) or self._watchdog.fired
            self._end_transaction(drop=down)
            if self._watchdog.fired:
                text = (
                    f"{self.settings.shown}: cannot {action}: no answer within "
                    f"{self._watchdog.bound:g} s (the network or the server is stuck); "
                    "the connection was dropped"
                )
            else:
                text = self.settings.explain(action, error)
            failure = StoreUnavailableError(text) if down else StateStorageError(text)
            failure.__cause__ = error
            if down:
                if self._down is None:
                    logger.warning("%s; trying again", text)
                self._down = failure if isinstance(failure, StoreUnavailableError) else None
            return failure
        if self._down is not None and self._connection is not None:
            # Only a connection says so (closing without one talks to nobody).
            logger.info("%s: the store answers again", self.settings.shown)
            self._down = None
        return None

    def _end_transaction(self, *, drop: bool = False) -> None:
        connection = self._connection
        if connection is None:
            return
        if drop or connection.broken or connection.closed:
            # Dropped: the next job connects again (to another host of a multi-host
            # DSN, where this one is a standby now).
            with contextlib.suppress(psycopg.Error):
                connection.close()
            self._connection = None
            return
        try:
            connection.rollback()
        except psycopg.Error:
            with contextlib.suppress(psycopg.Error):
                connection.close()
            self._connection = None

    def _connected(self) -> psycopg.Connection[Any]:
        if self._connection is not None and _hung_up(self._connection):
            # The server ended the session while it was idle (a restart, a failover, an
            # administrator): connect again now, before anything is sent on it, so that
            # a call after a restart certainly wrote nothing where it fails.
            with contextlib.suppress(psycopg.Error):
                self._connection.close()
            self._connection = None
        if self._connection is None:
            connection = self.settings.connect(autocommit=True)
            try:
                self._meet(connection)
            except BaseException:
                connection.close()
                raise
            self._connection = connection
            if self.memory.check_lost and self.epoch:
                # B6: at once, before this job writes, and before another runner of the
                # fleet hands out a generation this one handed out (they wait for it).
                self._restore(connection)
        return self._connection

    def _meet(self, connection: psycopg.Connection[Any]) -> None:
        """Check a new connection's server: a standby is out of reach for writes (B4);
        a server of another identity or timeline than the last one may have lost this
        runner's last writes (B6), which are looked for before its next write."""
        in_recovery, walfile = connection.execute(SERVER).fetchone() or (False, None)
        if in_recovery:
            raise _Standby(
                "the server is a standby in recovery (read-only); looking for the primary"
            )
        try:
            identity: object = connection.execute(SERVER_IDENTITY).fetchone()
        except psycopg.errors.InsufficientPrivilege:
            # Where pg_control_system() is revoked, the timeline alone tells a failover.
            identity = None
        # A WAL file's name begins with its timeline: a promoted standby starts a new one.
        server = f"{identity[0] if isinstance(identity, tuple) else '?'}/{str(walfile)[:8]}"
        memory = self.memory
        if memory.server is not None and server != memory.server:
            logger.warning(
                "%s: the store's server changed (from %s to %s: a failover?); this "
                "runner's records and marks are checked before anything else",
                self.settings.shown,
                memory.server,
                server,
            )
            memory.check_lost = True
            self.failover_pending = True
        memory.server = server

    # -- opening: the schema, then this runner's row ------------------------------------

    def _open(self) -> None:
        connection = self._connected()
        self._refuse_transaction_pooling(connection)
        migrate(connection, self.settings)
        settings = self.settings
        runner = settings.runner_id
        with connection.transaction():
            previous = connection.execute(OWN_ROW, (runner,)).fetchone()
            row = connection.execute(
                REGISTER,
                {"runner": runner, "advertise": settings.advertise, "lease": settings.runner_lease},
            ).fetchone()
            others = connection.execute(OTHERS_ALIVE, (runner,)).fetchall()
        assert row is not None
        self.epoch = row[0]
        if self.memory.check_lost:
            self._restore(connection)  # the last incarnation's writes, on a new server
        else:
            connection.execute(CHECKED, (self.memory.server, runner, self.epoch))
        twins = [other for other, where in others if where and where == settings.advertise]
        if twins:
            logger.warning(
                "%s: runner %s advertises %s, as %s already does%s: hosts sent there reach "
                "only one of them; give each runner its own --advertise URL",
                settings.shown,
                runner,
                settings.advertise,
                ", ".join(twins),
                "" if len(twins) == 1 else " each",
            )
        if previous is not None and previous[1]:
            logger.warning(
                "%s: runner %s registered as epoch %d while the row of its epoch %d was "
                "still within its lease: another process may be running under this id",
                settings.shown,
                runner,
                self.epoch,
                previous[0],
            )
        else:
            logger.info(
                "%s: runner %s registered as epoch %d; %s",
                settings.shown,
                runner,
                self.epoch,
                f"{len(others)} other runner{'s' if len(others) != 1 else ''} alive "
                f"({', '.join(other for other, _ in others)})"
                if others
                else "no other runner alive",
            )

    def _refuse_transaction_pooling(self, connection: psycopg.Connection[Any]) -> None:
        """Refuse a pooler that shares server sessions between transactions (B7).

        The store needs a session of its own: its settings (timeouts, search path) are
        set once per connection, and its LISTEN lasts as long as the session. A mark set
        in this session is looked for from a second connection: through PgBouncer's
        ``pool_mode=transaction`` the second gets the server session the first left idle
        (its pools are last-in first-out), and sees the mark.
        """
        mark = uuid.uuid4().hex
        connection.execute(POOL_MARK, (mark,))
        with self.settings.connect(autocommit=True) as other:
            row = other.execute(POOL_SEEN).fetchone()
        if row is not None and row[0] == mark:
            raise StateStorageError(
                f"{self.settings.shown}: this store shares one server session between "
                "its clients' transactions (a pooler such as PgBouncer with "
                "pool_mode=transaction or statement), and the fleet needs sessions of "
                "its own (its settings, and LISTEN for supersedes): point --store at the "
                "server, or at a pool with pool_mode=session"
            )

    def _close(self) -> None:
        # Its row stops counting as alive now, so that the fleet need not wait out its
        # lease (a takeover still waits out each record's margin from here).
        if self._connection is None or self._connection.closed:
            return
        self._connection.execute(EXPIRE, (self.settings.runner_id, self.epoch))

    # -- saving ------------------------------------------------------------------------

    def _save(self, jobs: list[Job]) -> None:
        # A save's args are its quota claim, if it carries one (PostgresStore.save_within).
        claims = {index: job.args for index, job in enumerate(jobs) if job.args is not None}
        refused, older = self._write(
            self.settings.runner_id, self.epoch, [job.rows for job in jobs], claims
        )
        for index, refusal in refused.items():
            jobs[index].error = _refusal_error(refusal, claims.get(index))
        for index, job in enumerate(jobs):
            job.result = older.get(index, [])
        self._remember(job for index, job in enumerate(jobs) if index not in refused)

    def _remember(self, jobs: Iterable[Job]) -> None:
        for job in jobs:
            self.memory.wrote(job.rows)

    def _restore(self, connection: psycopg.Connection[Any]) -> None:
        """After a change of server: check that every record this runner wrote last is
        there, at least as far on as it wrote it, and no key's mark is below what it
        handed out; write back what the database lost (B6), say so, and check in, so
        that the fleet's other runners may hand out generations again."""
        memory = self.memory
        written = memory.written
        held = dict(connection.execute(WRITTEN_PHASES, (list(written),)).fetchall())
        lost = [
            rows
            for token, rows in written.items()
            # A Stopped record that is gone was evicted (retention); a row further on
            # than this runner wrote it was moved on by the fleet (a takeover): both
            # stay as they are.
            if (token not in held and not isinstance(rows[0], StoppedRecord))
            or (token in held and _PHASES.index(held[token]) < _PHASES.index(rows[0].phase.value))
        ]
        keys = list(memory.handed)
        marks = (
            [key.identity for key in keys],
            [key.instance for key in keys],
            [memory.handed[key] for key in keys],
        )
        with connection.transaction():
            low = connection.execute(LOW_MARKS, marks).fetchall()
            if lost or low:
                connection.execute(RAISE_MARKS, marks)
                # Another runner's live older generation of such a key is superseded,
                # and the Open's row in its inbox may be lost too: written again.
                connection.execute(REFILL_INBOX, (*marks, self.settings.runner_id))
            connection.execute(CHECKED, (memory.server, self.settings.runner_id, self.epoch))
        if lost:
            # Written again as they were (no Open's compare-and-set: their generations
            # were handed out already), under this runner's epoch, which fences it.
            self._write(self.settings.runner_id, self.epoch, [lost], restore=True)
        memory.check_lost = False
        if not lost and not low:
            logger.info("%s: no write of this runner was lost", self.settings.shown)
            return
        self.lost_writes += len(lost) + len(low)
        logger.critical(
            "%s: the database lost writes of this runner (a failover to a standby that "
            "had not received them): %d record%s (%s) and %d high-water mark%s below "
            "generations it handed out; written back, so no generation is handed out "
            "twice by the fleet's live runners. Only synchronous replication keeps every "
            "acknowledged write through a failover",
            self.settings.shown,
            len(lost),
            "" if len(lost) == 1 else "s",
            ", ".join(
                f"{r.handle.key.identity}/{r.handle.key.instance}#{r.handle.generation} "
                f"{r.phase.value}"
                for r, _ in lost
            )
            or "none",
            len(low),
            "" if len(low) == 1 else "s",
        )

    def _unchecked(self, connection: psycopg.Connection[Any]) -> list[str]:
        """The fleet's live runners that have not checked their writes on this server."""
        rows = connection.execute(
            UNCHECKED, (self.settings.runner_id, self.memory.server or "")
        ).fetchall()
        return [runner for (runner,) in rows]

    def _landed(self, jobs: list[Job], landed: set[int]) -> None:
        """Add to ``landed`` the index of every job of a batch that committed.

        The batch is one transaction: it committed if any of its tokens holds what the
        batch wrote last for it, under this runner's epoch. Then every job landed but
        one whose Open lost its compare-and-set (its token is absent), and one whose
        quota claim was refused (a row of it that is not Stopped does not hold what it
        wrote); a Stopped row absent was evicted by retention in the same batch.
        """
        connection = self._connected()
        last = {record.handle.token: body for job in jobs for record, body in job.rows}
        held = {
            token: (epoch, body)
            for token, epoch, body in connection.execute(LANDED, (list(last),)).fetchall()
        }
        if not any(held.get(token) == (self.epoch, body) for token, body in last.items()):
            return  # it did not commit: the failure stands
        for index, job in enumerate(jobs):
            if not any(
                (isinstance(record, OpenRecord) and record.handle.token not in held)
                or (
                    job.args is not None
                    and not isinstance(record, StoppedRecord)
                    and held.get(record.handle.token) != (self.epoch, body)
                )
                for record, body in job.rows
            ):
                landed.add(index)
        self.commits += 1
        self._remember(jobs[index] for index in landed)

    def _write(
        self,
        runner: str,
        epoch: int,
        jobs: list[list[tuple[SessionRecord, str]]],
        claims: Mapping[int, QuotaClaim] | None = None,
        *,
        restore: bool = False,
    ) -> tuple[dict[int, tuple[Any, ...]], dict[int, list[Older]]]:
        """One call of write_batch, in autocommit (or in the caller's transaction): one
        round trip. The jobs (each its rows, some with a quota claim, by index) refused,
        by index, with write_batch's row for each; and the older generations of its keys
        each job's Opens superseded on other runners, by index.
        ``restore``: rows written back after a lost write, Opens without their
        compare-and-set (their marks rise with them)."""
        connection = self._connected()
        retention = self.settings.retention
        try:
            self._sent = True
            rows = connection.execute(
                SAVE_BATCH,
                (
                    runner,
                    epoch,
                    retention.stopped_per_key,
                    retention.stopped_total,
                    *columns(jobs, restore=restore),
                    None if not claims else Jsonb(claimed(claims)),
                ),
            ).fetchall()
        except psycopg.Error as error:
            if error.sqlstate == FENCED:
                raise RunnerFencedError(
                    f"{self.settings.shown}: cannot save: the epoch {epoch} of runner "
                    f"{runner} was taken over by another runner of the fleet; nothing "
                    "of this write landed"
                ) from error
            raise
        self.commits += 1
        refusals: dict[int, tuple[Any, ...]] = {}
        older: dict[int, list[Older]] = {}
        for row in rows:
            if row[9] is None:
                refusals[row[0]] = tuple(row[1:9])
            else:
                older.setdefault(row[0], []).append(Older(*row[9:15]))
        return refusals, older

    # -- everything else ---------------------------------------------------------------

    def _do(self, job: Job) -> None:
        connection = self._connected()
        # In autocommit: a job of one statement is one round trip; a job of several
        # that must land together opens a transaction of its own.
        job.result = getattr(self, f"_{job.kind}")(connection, *(job.args or ()))

    def _list(self, connection: psycopg.Connection[Any]) -> list[SessionRecord]:
        rows = connection.execute(LIST, (self.settings.runner_id,)).fetchall()
        return [record_of(self.settings.shown, *row) for row in rows]

    def _high_water(self, connection: psycopg.Connection[Any]) -> dict[Key, int]:
        rows = connection.execute(HIGH_WATER).fetchall()
        return {
            key_of(self.settings.shown, identity, instance): generation
            for identity, instance, generation in rows
        }

    def _lookup(
        self, connection: psycopg.Connection[Any], key: Key, request_id: str | None
    ) -> tuple[int, SessionRecord | None]:
        row = connection.execute(
            LOOKUP, {"i": key.identity, "n": key.instance, "r": request_id}
        ).fetchone()
        assert row is not None
        mark, token, body = row
        record = (
            None
            if token is None
            else record_of(self.settings.shown, token, key.identity, key.instance, body)
        )
        return mark or 0, record

    def _runners(
        self, connection: psycopg.Connection[Any], only: str | None = None
    ) -> list[RunnerInfo]:
        rows = connection.execute(RUNNERS, {"only": only}).fetchall()
        return [
            RunnerInfo(
                runner_id=runner,
                epoch=epoch,
                advertise=advertise,
                started_at=float(started),
                lease_until=float(until),
                alive=alive,
                sessions=sessions,
                stop_bound=stop_bound,
                draining=draining,
            )
            for (
                runner,
                epoch,
                advertise,
                started,
                until,
                alive,
                sessions,
                stop_bound,
                draining,
            ) in rows
        ]

    def _owner(self, connection: psycopg.Connection[Any], token: str) -> RunnerInfo | None:
        row = connection.execute(OWNER, (token,)).fetchone()
        if row is None:
            return None
        found = self._runners(connection, row[0])
        return found[0] if found else None

    def _held(self, connection: psycopg.Connection[Any], token: str) -> FleetRecord | None:
        row = connection.execute(HELD, (token,)).fetchone()
        if row is None:
            return None
        token, identity, instance, body, runner, epoch = row
        return FleetRecord(
            record=record_of(self.settings.shown, token, identity, instance, body),
            runner_id=runner,
            epoch=epoch,
        )

    def _fleet_records(self, connection: psycopg.Connection[Any]) -> list[FleetRecord]:
        rows = connection.execute(FLEET_RECORDS).fetchall()
        return [
            FleetRecord(
                record=record_of(self.settings.shown, token, identity, instance, body),
                runner_id=runner,
                epoch=epoch,
                age=age,
                lease_left=None if lease_left is None else max(lease_left, 0.0),
            )
            for token, identity, instance, body, runner, epoch, age, lease_left in rows
        ]

    def _renew(self, connection: psycopg.Connection[Any], stop_bound: float) -> bool:
        """Renew this runner's row; whether it still held this epoch."""
        settings = self.settings
        done = connection.execute(
            RENEW, (settings.runner_lease, stop_bound, settings.runner_id, self.epoch)
        )
        return done.rowcount == 1

    def _draining(self, connection: psycopg.Connection[Any]) -> None:
        connection.execute(DRAINING, (self.settings.runner_id, self.epoch))

    def _inbox(self, connection: psycopg.Connection[Any]) -> dict[Key, int]:
        """This runner's inbox, read and cleared: the keys of its sessions a later
        generation opened elsewhere supersedes, with that generation (F5)."""
        rows = connection.execute(INBOX, (self.settings.runner_id,)).fetchall()
        return {
            key_of(self.settings.shown, identity, instance): generation
            for identity, instance, generation in rows
        }

    def _ask_times(self, connection: psycopg.Connection[Any]) -> float:
        """Ask every runner of the fleet for its sessions' times; the moment asked."""
        row = connection.execute(ASK_TIMES).fetchone()
        assert row is not None
        return float(row[0])

    def _times_due(self, connection: psycopg.Connection[Any], asked: float) -> list[str]:
        """The live runners that answer such requests and did not since ``asked``."""
        return [runner for (runner,) in connection.execute(TIMES_DUE, (asked,)).fetchall()]

    def _publish_times(
        self, connection: psycopg.Connection[Any], times: Mapping[str, tuple[float, float]]
    ) -> None:
        """Publish this runner's sessions' ``times`` (by token: age and lease left, in
        seconds) as moments of the database's clock."""
        tokens = list(times)
        connection.execute(
            PUBLISH_TIMES,
            (
                self.settings.runner_id,
                tokens,
                [times[token][0] for token in tokens],
                [times[token][1] for token in tokens],
            ),
        )

    def _older(self, connection: psycopg.Connection[Any], key: Key, generation: int) -> list[Older]:
        """Unstopped records of ``key`` below ``generation`` on other runners."""
        rows = connection.execute(
            OLDER,
            (key.identity, key.instance, generation, self.settings.runner_id),
        ).fetchall()
        return [Older(*row) for row in rows]

    def _dead(self, connection: psycopg.Connection[Any]) -> list[tuple[str, int]]:
        """Other runners whose row expired with a record whose margin passed too."""
        rows = connection.execute(DEAD, (self.settings.runner_id,)).fetchall()
        return [(runner, epoch) for runner, epoch in rows]

    def _takeover(
        self, connection: psycopg.Connection[Any], runner: str, seen: int
    ) -> list[StoppedRecord]:
        """Take a dead runner's records over, if its row still is as it was seen."""
        with connection.transaction():
            row = connection.execute(DEAD_ROW, (runner,)).fetchone()
            if row is None or row[0] != seen or not row[1]:
                return []  # it renewed, restarted, or another runner took it over first
            rows = connection.execute(DUE, (runner,)).fetchall()
            # Its epoch moves on first: whatever its old incarnation still tries is refused.
            connection.execute(NEXT_EPOCH, (runner,))
            stopped = [recovered(record_of(self.settings.shown, *row), RUNNER_LOST) for row in rows]
            self._write(runner, seen + 1, [[(record, encode(record)) for record in stopped]])
        logger.warning(
            "%s: runner %s (epoch %d) is dead past its takeover margin; took over %d of its "
            "sessions: %s",
            self.settings.shown,
            runner,
            seen,
            len(stopped),
            ", ".join(
                f"{r.handle.key.identity}/{r.handle.key.instance}#{r.handle.generation}"
                for r in stopped
            )
            or "none",
        )
        return stopped


_ACTIONS: Final = {
    "list": "list records",
    "high_water": "read the high-water marks",
    "lookup": "look a key up",
    "runners": "list the runners",
    "owner": "find a session's runner",
    "fleet_records": "list the fleet's records",
    "held": "read a session's record",
    "renew": "renew this runner's row",
    "draining": "mark this runner draining",
    "inbox": "read this runner's inbox of supersedes",
    "ask_times": "ask the fleet's runners for their sessions' times",
    "times_due": "look for runners that did not publish their sessions' times",
    "publish_times": "publish this runner's sessions' times",
    "older": "look for older generations",
    "unchecked": "look for runners that did not check their writes after a failover",
    "dead": "look for dead runners",
    "takeover": "take a dead runner's records over",
}


def columns(
    jobs: Sequence[Sequence[tuple[SessionRecord, str]]], *, restore: bool = False
) -> tuple[list[Any], ...]:
    """write_batch's row arrays for ``jobs`` (each its records with their bodies), in its
    parameters' order: job, token, identity, instance, generation, request id, lease,
    kind, body, phase, and the memory_bytes and cpu_percent limits. ``restore``: no
    record is an Open (see :meth:`Worker._write`)."""
    built: tuple[list[Any], ...] = ([], [], [], [], [], [], [], [], [], [], [], [])
    (
        numbers,
        tokens,
        identities,
        instances,
        generations,
        requests,
        leases,
        kinds,
        bodies,
        phases,
        memory,
        cpu,
    ) = built
    for number, rows in enumerate(jobs):
        for record, body in rows:
            handle = record.handle
            numbers.append(number)
            tokens.append(handle.token)
            identities.append(handle.key.identity)
            instances.append(handle.key.instance)
            generations.append(handle.generation)
            requests.append(record.request_id)
            leases.append(record.lease)
            opened = restore and isinstance(record, OpenRecord)
            kinds.append(Kind.OTHER if opened else _kind(record))
            bodies.append(body)
            phases.append(record.phase.value)
            memory.append(record.limits.memory_bytes)
            cpu.append(record.limits.cpu_percent)
    return built


def claimed(claims: Mapping[int, QuotaClaim]) -> dict[str, dict[str, Any]]:
    """write_batch's ``p_claims``: each job's claim by its number, as quota_refusal reads it."""
    return {
        str(number): {
            "tenant": claim.tenant,
            "pattern": identity_regex(claim.identities),
            "sessions": claim.sessions,
            "children": claim.children,
            "memory_bytes": claim.memory_bytes,
            "cpu_percent": claim.cpu_percent,
            "unlimited_memory_bytes": claim.unlimited_memory_bytes,
            "unlimited_cpu_percent": claim.unlimited_cpu_percent,
        }
        for number, claim in claims.items()
    }


def _refusal_error(
    refusal: tuple[Any, ...], claim: QuotaClaim | None
) -> StaleSessionError | QuotaExceededError:
    """What the caller of a job write_batch refused gets: its row says why."""
    identity, instance, generation, mark, quota, requested, used, hard = refusal
    if quota is None:
        return StaleSessionError(
            f"generation {generation} of {identity}/{instance} was not opened: the key's "
            f"high-water in the fleet is {mark}, so the next open is generation "
            f"{mark + 1} (another open claimed it first); nothing of this save was written"
        )
    tenant = claim.tenant if claim is not None else "?"
    return QuotaExceededError.of(tenant, quota, int(requested), int(used), int(hard))


def _kind(record: SessionRecord) -> int:
    if isinstance(record, OpenRecord):
        return Kind.OPEN
    if isinstance(record, StoppedRecord):
        return Kind.SUPERSEDED if isinstance(record.reason, Superseded) else Kind.STOPPED
    return Kind.OTHER


def migrate(connection: psycopg.Connection[Any], settings: Settings) -> None:
    """Create or migrate the schema, in one transaction under the advisory lock."""
    with connection.transaction():
        connection.execute(TAKE_MIGRATION_LOCK, (MIGRATION_LOCK,))
        connection.execute(create_schema(settings.schema))
        connection.execute(CREATE_SCHEMA_VERSION)
        versions = [row[0] for row in connection.execute(SCHEMA_VERSIONS)]
        version = max(versions, default=0)
        if version > SCHEMA_VERSION:
            raise StateStorageError(
                f"{settings.shown}: the schema {settings.schema} has version {version}; this "
                f"library knows version {SCHEMA_VERSION} at most (a newer trio_supervisor "
                "wrote it)"
            )
        for step in range(version + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[step]:
                connection.execute(statement)
        if version < SCHEMA_VERSION:
            connection.execute(CLEAR_SCHEMA_VERSION)
            connection.execute(WRITE_SCHEMA_VERSION, (SCHEMA_VERSION,))
            logger.info(
                "%s: schema %s migrated from version %d to %d",
                settings.shown,
                settings.schema,
                version,
                SCHEMA_VERSION,
            )
