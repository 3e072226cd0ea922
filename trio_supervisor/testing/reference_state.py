"""What the reference model knows of each session and its child, and what it predicts.

:class:`Session` is the model's view of one session object of the supervisor: its
lease and deadline, the load it runs, its stop reason and how far its stop has come
(``stage``: live, interrupting, killing, over). :class:`Child` is its child as the
conformance harness's unit behaves: whether it runs, whether it ignores its signals,
how often it was interrupted, killed, released and recovered, and the exit status it
reported once it ended. :class:`Pending` is an operation that waits for a stop.

An :data:`Outcome` is what an operation gives, as the machine compares it: ``("ok",
summary)``, ``("error", class name)``, or ``("crash", text)`` for anything that is not
a ``SupervisorError``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator
from typing import Literal, TypeAlias

from ..model import ExitStatus, Key, Termination
from .reference_store import Durable, SessionId

__all__ = [
    "NO_CHILD",
    "STORAGE",
    "UNCONFIRMED",
    "Child",
    "Ending",
    "Outcome",
    "Pending",
    "Session",
    "error",
    "ok",
]

Outcome: TypeAlias = tuple[Literal["ok", "error", "crash"], object]

# How a child ends, as far as its exit status goes: it exits by itself (with a code),
# it heeds its interrupt, it is killed, recovery kills it, or recovery finds it gone.
Ending: TypeAlias = Literal["exit", "interrupt", "kill", "recover", "gone"]


def ok(value: object = None) -> Outcome:
    return ("ok", value)


def error(name: str) -> Outcome:
    return ("error", name)


STORAGE = "StateStorageError"
UNCONFIRMED = "TerminationUnconfirmedError"
# P3, V2: a session whose code never ran (no load, or a load that failed before its
# code started) ends with no child, whatever the execution had prepared.
NO_CHILD = Termination(kind="none", exit=ExitStatus())


@dataclasses.dataclass
class Child:
    """The model's idea of a session's child."""

    ignore_interrupt: bool = False
    ignore_kill: bool = False
    alive: bool = True
    started: bool = False
    interrupts: int = 0
    kills: int = 0
    closes: int = 0
    recovers: int = 0
    exit: ExitStatus | None = None  # what it reports, once it ended


@dataclasses.dataclass
class Session:
    key: Key
    generation: int
    request_id: str
    lease: float
    deadline: float
    specifier: str | None = None
    child: Child | None = None  # spawned (owned by the session)
    registered: bool = False  # the child's record is durable
    loaded: bool = False
    reason: str | None = None  # None while live
    stage: str = "live"  # live, interrupting, killing, over
    stage_until: float = math.inf
    fenced: bool = False  # the Stopping save failed (P2)
    outcome: Outcome | None = None  # of the stop, once over
    load_failure: str | None = None
    stopped: bool = False  # the Stopped record is durable

    @property
    def ident(self) -> SessionId:
        return (self.key, self.generation)

    @property
    def active_phase(self) -> str:
        if self.loaded:
            return "Loaded"
        return "Loading" if self.specifier is not None else "Open"

    def ending(self, phase: str, termination: Termination | None = None) -> Durable:
        """The record of this session's stop: its Stopping (``termination`` None), or
        its Stopped, after the phase it was active in."""
        return Durable(
            phase,
            False,
            self.request_id,
            previous=self.active_phase,
            previous_child=self.registered,
            reason=self.reason,
            termination=termination,
        )


@dataclasses.dataclass
class Pending:
    """An operation that waits for something (a stop to be over)."""

    name: str
    steps: Generator[Session, None, Outcome]
    waiting: Session | None = None
    outcome: Outcome | None = None
