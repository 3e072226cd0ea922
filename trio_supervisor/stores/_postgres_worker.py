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
import time
from typing import Final

from .. import _defaults as defaults
from .._extras import needs_extra
from ..errors import StateStorageError, StoreUnavailableError
from ._jobs import Job, deliver, next_batch
from ._postgres_connection import Settings
from ._postgres_link import Memory
from ._postgres_member import Membership

with needs_extra("postgres", "trio_supervisor.stores.postgres", "psycopg"):
    import psycopg

__all__ = ["Worker"]

logger = logging.getLogger("trio_supervisor.stores.postgres")

# SQLSTATEs of a transaction the server rolled back to end a conflict with another
# (deadlock_detected, serialization_failure); a batch so ended is written again, up to
# defaults.CONFLICT_TRIES times, before its callers get the error.
CONFLICT_STATES: Final = ("40P01", "40001")


def _conflicted(failure: StateStorageError) -> bool:
    """Whether a save failed because the server rolled it back to end a deadlock or a
    serialization failure with another transaction: it wrote nothing, and may be tried
    again at once."""
    cause = failure.__cause__
    return isinstance(cause, psycopg.Error) and cause.sqlstate in CONFLICT_STATES


class Worker(Membership):
    """The thread that owns the store's connection: it takes the jobs queued, saves
    first (group commit), then the others, and answers each."""

    def __init__(
        self, settings: Settings, jobs: queue.SimpleQueue[Job], memory: Memory | None = None
    ) -> None:
        super().__init__(settings, memory)
        self._jobs = jobs
        self._open_error: StateStorageError | None = None

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
                    action,
                    functools.partial(self._do, job),
                    self._deadline(job),
                    abandoned=job.abandoned,
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
        pause = defaults.STORE_FIRST_PAUSE
        conflicts = 0
        while pending:
            for job in pending:
                job.error = None
            failure = self._attempt("save", functools.partial(self._save, pending))
            if failure is None:
                return
            if _conflicted(failure) and conflicts < defaults.CONFLICT_TRIES:
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
            pause = min(2 * pause, defaults.STORE_LAST_PAUSE)

    def _look_bound(self) -> float:
        """How long a save whose outcome is unknown is looked for: past the runner's
        own lease, it would have been fenced anyway."""
        return max(self.settings.store_wait, self.settings.runner_lease)

    def _look(self, jobs: list[Job]) -> set[int] | None:
        """The indexes of ``jobs`` that landed (empty: the batch did not commit), or
        None when the store did not answer within :meth:`_look_bound`."""
        until = time.monotonic() + self._look_bound()
        pause = defaults.STORE_FIRST_PAUSE
        while True:
            landed: set[int] = set()
            look = functools.partial(self._landed, jobs, landed)
            if self._attempt("look for a save whose answer was lost", look) is None:
                return landed
            if time.monotonic() >= until:
                return None
            time.sleep(pause)
            pause = min(2 * pause, defaults.STORE_LAST_PAUSE)

    def _do(self, job: Job) -> None:
        connection = self._connected()
        # In autocommit: a job of one statement is one round trip; a job of several
        # that must land together opens a transaction of its own.
        job.result = getattr(self, f"_{job.kind}")(connection, *(job.args or ()))


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
