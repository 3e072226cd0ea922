"""Leases: every session's deadline, and the one task that stops the expired (T1).

Theory of operation
-------------------
A session's deadline is a number in its lifecycle; renewing moves it later (R6) and
costs nothing else. :class:`Leases` keeps a heap of ``(deadline, n, session)`` entries,
one per live session, and one timer task (:meth:`Leases.run`) that sleeps until the
earliest of them. The heap is *lazy*: a renew does not touch it. When an entry comes
due, the timer looks at the session itself:

* stopped or stopping: the entry is dropped;
* renewed since the entry was made (its deadline lies ahead): it goes back into the
  heap at that deadline;
* otherwise the lease ran out and the deadline has not moved since: the session stops
  with reason Expired (T1).

So an open pushes one entry, a renew pushes none, and a session is looked at about
once per lease. A new session whose deadline comes before the one the timer sleeps
towards moves the timer's deadline earlier. Entries of sessions that stopped before
their deadline stay in the heap until they come due, each holding its session; once
they are more than half of the heap, the heap is rebuilt without them, so its size stays
within twice the number of live sessions, at an amortized O(1) per stop.

Why not a cancel scope per session, whose deadline renew moves? Trio handles that well,
but a scope costs every session a task to hold it (an idle session has no task here:
see ``session.py``), and entering, moving and cancelling it are each a few
microseconds of a control plane's busiest calls.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from typing import TYPE_CHECKING

import trio

from ..model import Expired, log_fields

if TYPE_CHECKING:
    from .session import Session

__all__ = ["Leases"]

# The public name, not the private module's.
logger = logging.getLogger("trio_supervisor.leases")

# Below this many entries the heap is never rebuilt: stale entries cost little there.
_REBUILD_FLOOR = 1024


class Leases:
    """The deadlines of a supervisor's live sessions, and its lease timer."""

    __slots__ = ("_heap", "_order", "_stale", "_timer")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Session]] = []
        # Ties in deadline are broken by arrival, never by comparing sessions.
        self._order = itertools.count()
        # Entries whose session stopped before they came due.
        self._stale = 0
        # The scope the timer sleeps in; its deadline is the earliest entry's.
        self._timer: trio.CancelScope | None = None

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, session: Session) -> None:
        """Watch ``session``'s lease from now on (it is live, its deadline is set)."""
        deadline = session.lifecycle.deadline
        heapq.heappush(self._heap, (deadline, next(self._order), session))
        timer = self._timer
        if timer is not None and deadline < timer.deadline:
            timer.deadline = deadline

    def stopped(self) -> None:
        """A watched session stopped: its entry is stale now."""
        self._stale += 1
        if self._stale > _REBUILD_FLOOR and 2 * self._stale > len(self._heap):
            self._heap = [entry for entry in self._heap if entry[2].lifecycle.live]
            heapq.heapify(self._heap)
            self._stale = 0

    async def run(self) -> None:
        """The lease timer: stop each session whose lease ran out (T1). Runs forever."""
        while True:
            now = trio.current_time()
            # Read afresh each time: a rebuild (see stopped) replaces the list.
            while self._heap and self._heap[0][0] <= now:
                heap = self._heap
                _, _, session = heapq.heappop(heap)
                lifecycle = session.lifecycle
                if not lifecycle.live:
                    self._stale = max(self._stale - 1, 0)
                elif lifecycle.deadline > now:
                    heapq.heappush(heap, (lifecycle.deadline, next(self._order), session))
                else:
                    handle = session.handle
                    key = handle.key
                    logger.info(
                        "the lease of %s/%s generation %d expired",
                        key.identity,
                        key.instance,
                        handle.generation,
                        extra=log_fields(key, handle.generation),
                    )
                    session.stop_soon(Expired())
            heap = self._heap
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as timer:
                self._timer = timer
                await trio.sleep_forever()
            self._timer = None
