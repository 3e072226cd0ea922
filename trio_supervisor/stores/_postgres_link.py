"""The PostgreSQL store's worker, first layer: its hold on the server.

The worker is one thread, built in layers, one room each: this one keeps its connection
(made again when it broke, or when the server hung up while it was idle), runs each
piece of work once under the watchdog and tells a store out of reach (B1) from a call
that failed, tries the first again until a deadline, and meets every new connection's
server: a standby is out of reach for writes (B4), a server of another identity or
timeline may have lost this runner's last writes (B6), which it remembers in
:class:`Memory`. On it stand :mod:`._postgres_records` (the session records),
:mod:`._postgres_member` (this runner in the fleet) and :mod:`._postgres_worker` (the
thread's loop).
"""

from __future__ import annotations

import contextlib
import logging
import select
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

from .. import _defaults as defaults
from .._extras import needs_extra
from ..errors import StateStorageError, StoreUnavailableError
from ..model import Key, SessionRecord
from ._postgres_connection import Settings, Watchdog
from ._postgres_sql import SERVER, SERVER_IDENTITY

with needs_extra("postgres", "trio_supervisor.stores.postgres", "psycopg"):
    import psycopg

__all__ = ["Link", "Memory", "unavailable"]

logger = logging.getLogger("trio_supervisor.stores.postgres")

# SQLSTATEs that say the server cannot serve now, not that the call is wrong: every
# connection exception (class 08), a server shutting down, crashed or starting up
# (57P01-57P03), and a server that is read-only (25006: a standby, or a primary that
# was demoted), where the next connection may reach the new primary.
UNAVAILABLE_STATES: Final = ("57P01", "57P02", "57P03", "25006")


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
            if len(written) > defaults.REMEMBERED:
                del written[next(iter(written))]
            key = handle.key
            if handed.get(key, 0) < handle.generation:
                handed.pop(key, None)
                handed[key] = handle.generation
                if len(handed) > defaults.REMEMBERED:
                    del handed[next(iter(handed))]


class _Standby(psycopg.OperationalError):
    """The connection reached a server in recovery: it takes no writes (B4)."""

    sqlstate = "25006"


class Link:
    """The worker's connection to its server, and the retries of a store out of reach.

    Everything the worker does runs inside :meth:`_attempt`, which turns a
    ``psycopg.Error`` (or anything but a :class:`StateStorageError`) into the
    :class:`StateStorageError` its callers get; no failure ends the thread, which would
    leave its callers waiting.
    """

    def __init__(self, settings: Settings, memory: Memory | None = None) -> None:
        self.settings = settings
        # Written by this thread only, read by anyone.
        self.commits = 0
        self.epoch = 0
        self.lost_writes = 0  # records and marks found lost by a failover (B6)
        self._connection: psycopg.Connection[Any] | None = None
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

    def _retrying(
        self,
        action: str,
        work: Callable[[], None],
        deadline: float,
        abandoned: Callable[[], bool] = lambda: False,
    ) -> StateStorageError | None:
        """:meth:`_attempt`, again and again while the store does not answer, until
        ``deadline`` (B1) or until its caller stopped waiting (``abandoned``); what the
        caller is to get."""
        pause = defaults.STORE_FIRST_PAUSE
        while True:
            if self._down is not None and time.monotonic() >= deadline:
                # Out of reach a moment ago, and this job's wait is over: it is not
                # kept waiting for one more connection attempt.
                return self._given_up(self._down, action)
            failure = self._attempt(action, work)
            if not isinstance(failure, StoreUnavailableError):
                return failure
            if time.monotonic() >= deadline or abandoned():
                # Nobody waits for a read whose caller left: the jobs behind it do.
                return self._given_up(failure, action)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, defaults.STORE_LAST_PAUSE)

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

    def _restore(self, connection: psycopg.Connection[Any]) -> None:
        """Write back what a change of server lost (B6): the records' layer does."""
        raise NotImplementedError
