"""The jobs a store's thread serves: how a caller in the Trio run hands work to a thread
that owns a connection, and gets its answer back.

A caller puts a :class:`Job` on its store's queue and parks its task; the thread takes
it, does the work, and wakes the task through the run's token (:func:`deliver`). A job
still queued can be withdrawn by a caller that was cancelled; once taken, it is
answered, so that a write either happened and is reported, or never happened. A job
that writes nothing may be *abandoned* even once taken: its caller stops waiting, and
the thread drops the answer.

Both sides are here once, for every store with a thread: :class:`Desk` is the caller's
(it starts the thread on first use, submits jobs, and closes it), :func:`next_batch` the
thread's (everything queued while the last transaction ran goes into the next one: group
commit).
"""

from __future__ import annotations

import contextlib
import enum
import queue
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Final, Self

import trio

from ..errors import StateStorageError
from ..model import SessionRecord
from ..realtime import outside_the_run

__all__ = ["Desk", "Job", "Opening", "State", "deliver", "next_batch"]


class State(enum.Enum):
    QUEUED = "queued"  # the caller may still take it back
    TAKEN = "taken"  # the thread has it; it will be reported
    WITHDRAWN = "withdrawn"  # the caller gave up first; the thread skips it, or drops its answer


class Job:
    """One request to a store's thread, and the task that waits for its answer.

    Attributes:
        kind: What to do ("open", "save", "list", ..., "close"); each store has its own.
        rows: The records a save writes, each with its encoded body.
        args: What else the job needs, as the kind says.
        wait: Seconds from its making within which a store that does not answer is
            tried again (None: the store's own ``store_wait``).
        born: When it was made (``time.monotonic()``): its wait counts from then.
    """

    __slots__ = (
        "args",
        "born",
        "error",
        "kind",
        "result",
        "rows",
        "state",
        "task",
        "token",
        "wait",
    )

    def __init__(
        self,
        kind: str,
        rows: list[tuple[SessionRecord, str]] | None = None,
        args: Any = None,
        *,
        wait: float | None = None,
    ) -> None:
        self.kind = kind
        self.rows = rows or []
        self.args = args
        self.wait = wait
        self.born = time.monotonic()
        self.state = State.QUEUED
        self.task = trio.lowlevel.current_task()
        self.token = trio.lowlevel.current_trio_token()
        self.result: Any = None
        self.error: BaseException | None = None

    def take(self) -> bool:
        """The thread's claim on the job: False if its caller withdrew it first."""
        return self._claim(State.TAKEN)

    def withdraw(self) -> bool:
        """The caller's claim: False if the thread took the job first."""
        return self._claim(State.WITHDRAWN)

    def _claim(self, state: State) -> bool:
        """Move the job out of QUEUED into ``state``: False if the other side did first."""
        with _claims:
            if self.state is State.QUEUED:
                self.state = state
                return True
            return False

    def abandon(self) -> None:
        """The caller stops waiting, taken or not: for a job that writes nothing."""
        with _claims:
            self.state = State.WITHDRAWN

    def abandoned(self) -> bool:
        """Whether the caller stopped waiting (the thread may stop trying it again)."""
        return self.state is State.WITHDRAWN


# Guards every job's state: the caller and the thread both move it out of QUEUED, and
# only one of them may. Held for a comparison and an assignment, so one lock serves all.
_claims: Final = threading.Lock()


def deliver(jobs: Sequence[Job | None]) -> None:
    """Wake the callers of finished jobs, one callback per event loop."""
    by_loop: dict[trio.lowlevel.TrioToken, list[Job]] = {}
    for job in jobs:
        if job is not None:
            by_loop.setdefault(job.token, []).append(job)
    for token, waiting in by_loop.items():
        # A finished event loop has nobody waiting any more.
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(_wake_all, waiting)


def _wake_all(jobs: list[Job]) -> None:
    # In the run: a caller abandons its job in the run too, so it cannot do so between
    # this look and the wake-up; and the thread no longer moves a job it answered. So
    # the look takes no lock (Job.answered's): the thread may hold that one while it
    # waits for the GIL, and the wake-ups would wait for the thread.
    for job in jobs:
        if job.state is not State.WITHDRAWN:
            trio.lowlevel.reschedule(job.task)


def next_batch(jobs: queue.SimpleQueue[Job]) -> tuple[list[Job], Job | None]:
    """The thread's next batch: it waits for a job, then takes every job queued since.

    Returns:
        The jobs to serve (those their callers did not withdraw first), and the close
        job if one came: the thread serves the batch, then closes.
    """
    batch = [jobs.get()]
    while True:
        try:
            batch.append(jobs.get_nowait())
        except queue.Empty:
            break
    taken: list[Job] = []
    closing: Job | None = None
    for job in batch:
        if job.kind == "close":
            closing = job
        elif job.take():
            taken.append(job)
    return taken, closing


class Desk:
    """The caller's side of a store's thread: where the store's methods hand in jobs.

    Args:
        name: The thread's name (shown by debuggers and ``py-spy``).
        where: What the store is, for the error of a call after :meth:`close`.
        start: Makes the thread's work from the job queue, when the first job comes:
            returns the function the thread runs (a worker's ``run``).
    """

    def __init__(
        self, name: str, where: str, start: Callable[[queue.SimpleQueue[Job]], Callable[[], None]]
    ) -> None:
        self._name = name
        self._where = where
        self._start = start
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    async def submit(self, job: Job, *, abandonable: bool = False) -> Any:
        """Hand ``job`` to the thread and wait for its answer.

        Cancelling is safe: a job still queued is taken back and ``Cancelled`` goes
        through; a taken one is waited for and reported (the write may land), unless
        it is ``abandonable`` (it writes nothing), when the caller just stops waiting.

        Raises:
            StateStorageError: The store is closed, or the job failed.
        """
        if self._closed:
            await trio.lowlevel.checkpoint()
            raise StateStorageError(f"the store {self._where} is closed")
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._start(self._jobs), name=self._name, daemon=True
            )
            self._thread.start()
        self._jobs.put(job)

        def abort(_: object) -> trio.lowlevel.Abort:
            if abandonable:
                job.abandon()
                return trio.lowlevel.Abort.SUCCEEDED
            # Bounded when not withdrawn: one transaction, and the store's own timeouts.
            return trio.lowlevel.Abort.SUCCEEDED if job.withdraw() else trio.lowlevel.Abort.FAILED

        with outside_the_run():  # the thread's time is not the run's (realtime.py)
            await trio.lowlevel.wait_task_rescheduled(abort)
        if job.error is not None:
            raise job.error
        return job.result

    async def close(self) -> BaseException | None:
        """Let the thread finish the jobs already queued, then close and end; what
        closing failed with, if anything. Later calls do nothing.

        Bounded by the jobs already queued; a cancellation waits for it too (and is seen
        at the caller's next checkpoint).
        """
        if self._closed or self._thread is None:
            self._closed = True
            await trio.lowlevel.checkpoint()
            return None
        self._closed = True
        job = Job("close")
        job.take()
        self._jobs.put(job)
        with outside_the_run():
            await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        return job.error


class Opening:
    """``async with store:`` for a store with ``open()`` and ``aclose()``.

    Entering opens the store; a store that failed to open is closed on the way out
    (``async with`` does not leave what it failed to enter: its thread would live on,
    idle, for as long as the process does). Leaving closes it.
    """

    async def open(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            await self.open()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
