"""Work outside the Trio run, on a virtual clock: real time bounds it, and the clock waits.

Under Trio's own clock nothing here does anything but :func:`trio.move_on_after`. It
matters under a virtual clock (:class:`trio.testing.MockClock`, pytest-trio's
``autojump_clock``), which an application uses to test its own code around a
supervisor. Such a clock jumps to the next deadline as soon as every task waits, and a
task waiting for a store's thread or a child process waits: without this module, a
lease of 15 s would run out while SQLite commits one record, and a bound of 30 s on
that commit would fire a tenth of a second after it began.

Two rules fix that:

- :func:`outside_the_run` marks an await on work done outside the run (a thread, another
  process). While one is under way, a virtual clock stands still: the work takes no
  virtual time, so no lease or grace runs out because a thread was slow to answer.
- :func:`bounded` is the bound on such work: it fires after ``seconds`` of Trio's clock
  or of real time, whichever is first. Under a standing virtual clock only real time
  passes, so a thread that hangs is given up on after the same real seconds as in
  production; work inside the run (a store that awaits forever in the run) still meets
  the bound on the virtual clock, as a test of it expects.

A store or execution of your own that answers from a thread or a process should wrap
its waits in :func:`outside_the_run`, as :class:`~trio_supervisor.SqliteStore` does.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import sys
import threading
import time
from types import TracebackType

import trio

__all__ = ["bounded", "outside_the_run", "sleep"]

# How long the run must sit idle (real seconds) before the clock's holder checks again
# whether the work outside is done; the work's answer wakes the run sooner.
_CUSHION = 0.001


def _virtual() -> bool:
    # A MockClock exists only where trio.testing was imported: no import here, and one
    # dictionary lookup on the production path.
    testing = sys.modules.get("trio.testing")
    return testing is not None and isinstance(trio.lowlevel.current_clock(), testing.MockClock)


# -- holding a virtual clock -----------------------------------------------------------


class _Holder:
    """A system task that keeps a virtual clock from jumping while work is outside.

    Trio does not jump the clock while a task waits in ``wait_all_tasks_blocked``: it
    wakes that task instead once the run has been idle for the task's cushion. The
    holder waits there, in a loop, for as long as any work is outside the run.
    """

    def __init__(self) -> None:
        self.pending = 0
        self._resume = trio.Event()
        self._scope: trio.CancelScope | None = None

    def hold(self) -> None:
        self.pending += 1
        if self.pending == 1:
            self._resume.set()

    def release(self) -> None:
        self.pending -= 1
        if self.pending == 0 and self._scope is not None:
            self._scope.cancel()  # let the clock jump again at once

    async def run(self) -> None:
        from trio.testing import wait_all_tasks_blocked

        while True:
            if not self.pending:
                self._resume = trio.Event()
                await self._resume.wait()
                continue
            with trio.CancelScope() as self._scope:
                await wait_all_tasks_blocked(_CUSHION)
            self._scope = None


_HOLDER: trio.lowlevel.RunVar[_Holder] = trio.lowlevel.RunVar("trio_supervisor clock holder")


class outside_the_run:
    """Mark the awaits in this block as waiting for work outside the run.

    Under a virtual clock, the clock stands still until the block is left; under Trio's
    own clock this does nothing (a class, not a generator: it is on every store save).
    The block must be bounded in real time (by the work itself or by :func:`bounded`):
    a virtual clock cannot end it.
    """

    __slots__ = ("_holder",)

    def __init__(self) -> None:
        self._holder: _Holder | None = None

    def __enter__(self) -> None:
        if not _virtual():
            return
        try:
            holder = _HOLDER.get()
        except LookupError:
            holder = _Holder()
            _HOLDER.set(holder)
            trio.lowlevel.spawn_system_task(holder.run, name="trio_supervisor clock holder")
        holder.hold()
        self._holder = holder

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._holder is not None:
            self._holder.release()
            self._holder = None


# -- bounds in real time ---------------------------------------------------------------


class _Alarm:
    __slots__ = ("deadline", "live", "number", "scope", "token")

    def __init__(self, deadline: float, number: int, scope: trio.CancelScope) -> None:
        self.deadline = deadline
        self.number = number
        self.scope = scope
        self.token = trio.lowlevel.current_trio_token()
        self.live = True

    def __lt__(self, other: _Alarm) -> bool:
        return (self.deadline, self.number) < (other.deadline, other.number)


class _RealTimer:
    """One daemon thread that cancels scopes at real-time deadlines (virtual clocks only)."""

    def __init__(self) -> None:
        self._heap: list[_Alarm] = []
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def call_later(self, seconds: float, scope: trio.CancelScope) -> _Alarm:
        alarm = _Alarm(time.monotonic() + seconds, next(self._order), scope)
        with self._changed:
            heapq.heappush(self._heap, alarm)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="trio_supervisor real-time bounds", daemon=True
                )
                self._thread.start()
            self._changed.notify()
        return alarm

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._heap:
                    self._changed.wait()
                alarm = self._heap[0]
                left = alarm.deadline - time.monotonic()
                if alarm.live and left > 0:
                    self._changed.wait(left)
                    continue
                heapq.heappop(self._heap)
                if not alarm.live:
                    continue
            with contextlib.suppress(trio.RunFinishedError):  # the run ended first
                alarm.token.run_sync_soon(alarm.scope.cancel)


_TIMER = _RealTimer()


class bounded:
    """A cancel scope that ends its block after ``seconds`` of Trio's clock or real time.

    Whichever comes first; under Trio's own clock the two are one. ``with bounded(s) as
    scope:`` gives the scope; its ``cancelled_caught`` says whether the bound fired.

    Args:
        seconds: The bound.
        shield: Shield the block from cancellations from outside, as
            :func:`trio.move_on_after` does.
    """

    __slots__ = ("_alarm", "_scope", "_seconds")

    def __init__(self, seconds: float, *, shield: bool = False) -> None:
        self._seconds = seconds
        self._scope = trio.move_on_after(seconds, shield=shield)
        self._alarm: _Alarm | None = None

    def __enter__(self) -> trio.CancelScope:
        scope = self._scope.__enter__()
        if _virtual():
            self._alarm = _TIMER.call_later(self._seconds, scope)
        return scope

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if self._alarm is not None:
            self._alarm.live = False  # dropped by the timer's thread when it comes to it
        return self._scope.__exit__(kind, error, traceback)


async def sleep(seconds: float) -> None:
    """Pause for ``seconds`` of real time, as a poll of something outside the run must.

    Under Trio's own clock this is :func:`trio.sleep`. Under a virtual clock, a virtual
    sleep in a block marked :func:`outside_the_run` would never end (the clock stands
    still there), and elsewhere it would end at once, turning a poll into a spin: the
    pause is spent in a thread instead, and the clock stands still meanwhile.

    Args:
        seconds: How long to pause, in seconds of real time.
    """
    if not _virtual():
        await trio.sleep(seconds)
        return
    with outside_the_run():
        await trio.to_thread.run_sync(time.sleep, seconds, abandon_on_cancel=True)
