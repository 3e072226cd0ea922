"""Where a supervisor meets its fleet: alone, or as a member of one (docs/design.md,
"The fleet", F1-F9).

Theory of operation
-------------------
The supervisor keeps the rules; what they need to know of other runners is asked here,
of a :class:`Fleet` chosen once, when the supervisor is made (as trio's
``_subprocess_platform`` picks one implementation behind one set of names):

* :class:`Alone`, for a store of one supervisor: the key's high-water is its own index's,
  no open waits for anyone, and no session lives elsewhere. Nothing here awaits, so a
  supervisor alone checkpoints exactly where it did before fleets existed.
* :class:`Member`, for a :class:`~trio_supervisor.abc.FleetStore`: an open whose host
  expects the generation this runner knows for the key goes straight to its Open
  record, whose compare-and-set checks that against the fleet (F3): one round trip. An
  open that expects another, or whose record lost, asks the store for the key's
  high-water and a retried request's record first. The open then waits for older
  generations held by other runners (F6); a session this supervisor does not
  hold may be Stopped elsewhere (F8); and a task keeps the runner's row and hears of
  supersedes (F1, F2, F5), stopping the sessions a later generation opened elsewhere
  supersedes. A renew asks the fleet nothing: the store tells of supersedes by
  notification, and by its periodic check of every live key in one statement, at least
  every third of the shortest lease here (F5).
"""

from __future__ import annotations

import logging

import trio

from ..abc import FleetStore
from ..errors import RunnerClosingError
from ..model import Handle, Key, SessionRecord, StoppedRecord
from .health import Health
from .records import Records, storage_call
from .running import Running

__all__ = ["Alone", "Fleet", "Member"]

logger = logging.getLogger("trio_supervisor.supervisor")

_UNREADABLE = "the fleet's store could not be read"


class Fleet:
    """What the supervisor asks of its fleet. Every method is a no-op alone."""

    async def high_water(self, key: Key) -> int:
        """The key's highest generation (0: never opened) as the fleet knows it."""
        raise NotImplementedError

    async def before_open(self, key: Key, request_id: str, expected: int) -> SessionRecord | None:
        """Ahead of an open's checks, where its host ``expected`` another generation
        than the index knows: raise the index's mark for ``key`` to the fleet's, and
        return the record another runner made for this request id, if any (O3)."""
        raise NotImplementedError

    async def after_lost_open(self, key: Key, request_id: str) -> SessionRecord | None:
        """The open's Open record lost its compare-and-set (another runner holds a later
        generation): raise the index's mark to the fleet's, and return the record of
        this request id another runner made, if any (a retry, O3)."""
        raise NotImplementedError

    async def wait_older(self, handle: Handle) -> BaseException | None:
        """Wait until no older generation of the key runs on another runner (F6); what
        ended the wait otherwise (a cancellation included), for the open to raise once
        its session exists."""
        raise NotImplementedError

    async def stopped_elsewhere(self, handle: Handle) -> StoppedRecord | None:
        """The Stopped record of a session this supervisor does not hold, as another
        runner stored it (F8); None when no runner holds one."""
        raise NotImplementedError

    async def run(self, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        """Be in the fleet until the returned scope is cancelled."""
        raise NotImplementedError

    def close(self) -> None:
        """The supervisor shuts down: end every wait for other runners (Z1)."""
        raise NotImplementedError


class Alone(Fleet):
    """A supervisor on a store of its own: its index is the whole truth."""

    def __init__(self, records: Records) -> None:
        self._records = records

    async def high_water(self, key: Key) -> int:
        return self._records.high_water(key)

    async def before_open(self, key: Key, request_id: str, expected: int) -> SessionRecord | None:
        return None

    async def after_lost_open(self, key: Key, request_id: str) -> SessionRecord | None:
        return None

    async def wait_older(self, handle: Handle) -> BaseException | None:
        return None

    async def stopped_elsewhere(self, handle: Handle) -> StoppedRecord | None:
        return None

    async def run(self, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        task_status.started(trio.CancelScope())

    def close(self) -> None:
        pass


class Member(Fleet):
    """A supervisor whose store a fleet shares (docs/service.md section C).

    Args:
        store: The fleet's store.
        records: The supervisor's records: their index takes the fleet's marks.
        health: Poisoned when the runner leaves the fleet (H1).
        stop_bound: How long past its lease a session's child may take to end: its grace,
            confirmation and the execution's switch slack (F7's margin, with the lease).
        running: The supervisor's sessions: what the store's member is told of them,
            and what a later generation opened elsewhere stops.
    """

    def __init__(
        self,
        store: FleetStore,
        records: Records,
        health: Health,
        *,
        stop_bound: float,
        running: Running,
    ) -> None:
        self._store = store
        self._records = records
        self._health = health
        self.stop_bound = stop_bound
        self._running = running
        self.live = running.live
        self.times = running.all_times
        self.shortest_lease = running.shortest_lease
        self._waits: set[trio.CancelScope] = set()  # opens waiting on older generations

    async def _lookup(self, key: Key, request_id: str | None) -> tuple[int, SessionRecord | None]:
        return await storage_call(self._store.lookup(key, request_id), _UNREADABLE)

    async def high_water(self, key: Key) -> int:
        # Another runner of the fleet may have opened it since: the store knows.
        high, _ = await self._lookup(key, None)
        return high

    async def before_open(self, key: Key, request_id: str, expected: int) -> SessionRecord | None:
        if expected == self._records.high_water(key):
            # What the host expects is what this runner knows: the Open record's
            # compare-and-set tells whether the fleet agrees (after_lost_open if not).
            return None
        return await self.after_lost_open(key, request_id)

    async def after_lost_open(self, key: Key, request_id: str) -> SessionRecord | None:
        mark, prior = await self._lookup(key, request_id)
        if prior is None:
            self._records.index.raise_high_water(key, mark)
        return prior

    async def wait_older(self, handle: Handle) -> BaseException | None:
        # A shutdown does not wait for this wait (it may last a takeover margin): it
        # cancels it, and the session, once it exists, stops with the others (Z2).
        with trio.CancelScope() as scope:
            self._waits.add(scope)
            if self._running.closing:
                scope.cancel()
            try:
                await self._store.wait_older_stopped(handle)
            except trio.Cancelled as cancelled:
                if scope.cancel_called:
                    return RunnerClosingError("the supervisor is shutting down")
                return cancelled  # the caller's: raised again in the caller's scope
            except BaseException as error:
                return error
            finally:
                self._waits.discard(scope)
        return None

    def superseded(self, key: Key, high_water: int) -> None:
        # Another runner of the fleet opened a later generation (F5, O5).
        self._records.index.raise_high_water(key, high_water)
        self._running.stop_below(key, high_water)

    async def stopped_elsewhere(self, handle: Handle) -> StoppedRecord | None:
        # A Stopped record never changes, so any member may answer for it: a session
        # another member stopped, or took over from a dead one (F7). A live session
        # held elsewhere stays unknown here (the runner service sends the host to its
        # holder: F8).
        held = await storage_call(self._store.held(handle.token), _UNREADABLE)
        record = None if held is None else held.record
        if isinstance(record, StoppedRecord) and record.handle == handle:
            return record
        return None

    async def run(self, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            try:
                await self._store.run_member(self)
            except trio.Cancelled:
                return  # as the lease timer: the block's own Cancelled carries it out
            except Exception as error:
                # Its row is lost or taken: no write of this runner may land any more
                # (H1); its children end by their leases (H2).
                logger.error("this runner left the fleet: %s", error)
                self._health.poison(error)

    def close(self) -> None:
        for scope in self._waits:
            scope.cancel()
