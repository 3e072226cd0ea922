"""The jobs a store's thread serves: how a caller in the Trio run hands work to a thread
that owns a connection, and gets its answer back.

A caller puts a :class:`Job` on its store's queue and parks its task; the thread takes
it, does the work, and wakes the task through the run's token (:func:`deliver`). A job
still queued can be withdrawn by a caller that was cancelled; once taken, it is
answered, so that a write either happened and is reported, or never happened. A job
that writes nothing may be *abandoned* even once taken: its caller stops waiting, and
the thread drops the answer.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Sequence
from typing import Any, Final

import trio

from ..model import SessionRecord

__all__ = ["Job", "State", "deliver"]


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
    """

    __slots__ = ("args", "error", "kind", "result", "rows", "state", "task", "token")

    def __init__(
        self, kind: str, rows: list[tuple[SessionRecord, str]] | None = None, args: Any = None
    ) -> None:
        self.kind = kind
        self.rows = rows or []
        self.args = args
        self.state = State.QUEUED
        self.task = trio.lowlevel.current_task()
        self.token = trio.lowlevel.current_trio_token()
        self.result: Any = None
        self.error: BaseException | None = None

    def take(self) -> bool:
        """The thread's claim on the job: False if its caller withdrew it first."""
        with _claims:
            if self.state is State.QUEUED:
                self.state = State.TAKEN
                return True
            return False

    def withdraw(self) -> bool:
        """The caller's claim: False if the thread took the job first."""
        with _claims:
            if self.state is State.QUEUED:
                self.state = State.WITHDRAWN
                return True
            return False

    def abandon(self) -> None:
        """The caller stops waiting, taken or not: for a job that writes nothing."""
        with _claims:
            self.state = State.WITHDRAWN

    def answered(self) -> bool:
        """Whether the caller still waits for the answer (the thread's last look)."""
        with _claims:
            return self.state is not State.WITHDRAWN


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
    # this look and the wake-up.
    for job in jobs:
        if job.answered():
            trio.lowlevel.reschedule(job.task)
