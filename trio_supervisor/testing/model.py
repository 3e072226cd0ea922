"""A reference model of docs/design.md, "Semantics", for the conformance machine.

It is written from the document, not from the engine: it imports neither the lifecycle
nor the supervisor, only the value types. It is a discrete-event simulation on a
virtual clock: operations run at ``now`` and may wait (an open superseding a child that
ignores its interrupt waits for the grace to pass); :meth:`Model.advance` moves the
clock, fires every deadline in order and resumes whatever waited.

For each operation the model predicts the result or the error class, and after every
step it knows what the store must hold: each record's phase, whether it names a child,
its stop reason and its termination kind, and each key's high-water generation.

The children of the model behave like the conformance harnesses' units: a child exits at
once on a signal it heeds, one that ignores its interrupt is killed after the grace, one
that ignores the kill too is "unconfirmed" after the confirmation timeout.

Sessions are named by ``(key, generation)``; tokens are random and the model never needs
them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Generator, Iterable
from typing import Literal, TypeAlias

from ..model import Key

__all__ = ["Child", "Durable", "Model", "Outcome", "Pending", "SessionId", "error", "ok"]

SessionId: TypeAlias = tuple[Key, int]
Outcome: TypeAlias = tuple[Literal["ok", "error", "crash"], object]


def ok(value: object = None) -> Outcome:
    return ("ok", value)


def error(name: str) -> Outcome:
    return ("error", name)


STORAGE = "StateStorageError"
UNCONFIRMED = "TerminationUnconfirmedError"


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


@dataclasses.dataclass(frozen=True)
class Durable:
    """What the store holds for one session (the fields the machine compares)."""

    phase: str
    child: bool
    request_id: str
    previous: str | None = None  # the phase of ``previous``, for Stopping and Stopped
    previous_child: bool | None = None
    reason: str | None = None
    termination: str | None = None


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
    exit_code: int | None = None  # the child exited by itself (X1)
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


@dataclasses.dataclass
class Pending:
    """An operation that waits for something (a stop to be over)."""

    name: str
    steps: Generator[Session, None, Outcome]
    waiting: Session | None = None
    outcome: Outcome | None = None


class Model:
    """The reference model of one supervisor's life, across restarts.

    Args:
        lease: The supervisor's default lease.
        grace: Seconds between interrupt and kill.
        confirmation: Seconds between kill and giving up (and recovery's timeout).
        stopped_per_key: The store's retention of Stopped records per key.
        missing: The specifier whose spawn fails with PackageError.
        broken: The specifier whose start fails with ExecutionError, if any.
    """

    def __init__(
        self,
        *,
        lease: float,
        grace: float,
        confirmation: float,
        stopped_per_key: int,
        missing: str,
        broken: str | None,
    ) -> None:
        self.lease = lease
        self.grace = grace
        self.confirmation = confirmation
        self.per_key = stopped_per_key
        self.missing = missing
        self.broken = broken
        self.now = 0.0
        # The store: durable records, their save order, the high-water marks.
        self.store: dict[SessionId, Durable] = {}
        self.saved_order: dict[SessionId, int] = {}
        self.stop_order: dict[Key, list[int]] = {}
        self.high: dict[Key, int] = {}
        self._saves = 0
        self.broken_store = False
        self.fail_once: list[Callable[[SessionId, str], bool]] = []
        # The running supervisor.
        self.sessions: dict[SessionId, Session] = {}  # the session objects it holds
        self.children: dict[SessionId, Child] = {}  # every child ever spawned
        self.poisoned: str | None = None
        self.closing = False
        self.pending: list[Pending] = []

    # -- the store ------------------------------------------------------------------

    def _save(self, ident: SessionId, record: Durable) -> bool:
        """Save one record; False (and poisoned) when the store refuses it."""
        refuse = self.broken_store
        for index, rule in enumerate(self.fail_once):
            if rule(ident, record.phase):
                del self.fail_once[index]
                refuse = True
                break
        if refuse:
            self.poison(STORAGE)
            return False
        key, generation = ident
        self._saves += 1
        first_stop = record.phase == "Stopped" and (
            ident not in self.store or self.store[ident].phase != "Stopped"
        )
        self.store[ident] = record
        self.saved_order[ident] = self._saves
        self.high[key] = max(self.high.get(key, 0), generation)
        if first_stop:
            order = self.stop_order.setdefault(key, [])
            order.append(generation)
            while len(order) > self.per_key:
                self._evict((key, order.pop(0)))
        return True

    def _evict(self, ident: SessionId) -> None:
        del self.store[ident]
        del self.saved_order[ident]
        # O10: its session object is retired with it.
        self.sessions.pop(ident, None)

    def poison(self, name: str) -> None:
        if self.poisoned is None:
            self.poisoned = name

    def durable_of_request(self, key: Key, request_id: str) -> SessionId | None:
        for ident, record in self.store.items():
            if ident[0] == key and record.request_id == request_id:
                return ident
        return None

    # -- checks shared by the operations --------------------------------------------

    def _usable(self) -> Outcome | None:
        if self.poisoned is not None:
            return error(self.poisoned)
        if self.closing:
            return error("RunnerClosingError")
        return None

    def _stop_error(self, reason: str) -> Outcome:
        return error("LeaseExpiredError" if reason == "Expired" else "SessionStoppedError")

    def _session(self, ident: SessionId) -> Session | Outcome:
        """R2/R3 for a handle: the live session object, or the error."""
        record = self.store.get(ident)
        if record is None:
            return error("StaleSessionError")
        session = self.sessions.get(ident)
        if session is None:
            if record.reason is not None:
                return self._stop_error(record.reason)
            return error("SessionStoppedError")
        return session

    def _live(self, session: Session) -> Outcome | None:
        if session.reason is not None:
            return self._stop_error(session.reason)
        if self.now >= session.deadline:
            return error("LeaseExpiredError")
        return None

    # -- operations ---------------------------------------------------------------------

    def start(self, name: str, steps: Generator[Session, None, Outcome] | Outcome) -> Pending:
        """Run an operation until it is over or waits.

        Args:
            name: For messages.
            steps: What an operation method returned: an outcome, or a generator that
                yields each session it waits for and returns its outcome.
        """
        if isinstance(steps, tuple):
            return Pending(name, iter(()), outcome=steps)  # type: ignore[arg-type]
        operation = Pending(name, steps)
        self._resume(operation)
        if operation.outcome is None:
            self.pending.append(operation)
        return operation

    def _resume(self, operation: Pending) -> None:
        try:
            waiting = next(operation.steps)
        except StopIteration as done:
            operation.outcome = done.value
            operation.waiting = None
            return
        operation.waiting = waiting

    def _wake(self) -> None:
        progress = True
        while progress:
            progress = False
            for operation in list(self.pending):
                if operation.waiting is not None and operation.waiting.stage == "over":
                    self._resume(operation)
                    progress = True
                    if operation.outcome is not None:
                        self.pending.remove(operation)

    def open(
        self, key: Key, request_id: str, expected: int | None, lease: float | None
    ) -> Generator[Session, None, Outcome]:
        """O1-O11, the whole open; concurrent bursts use its three parts one by one."""
        decided = self.open_check() or self.open_supersede(key, request_id, expected)
        if decided:
            return decided
        yield from self.superseded(key)
        return self.open_commit(key, request_id, lease)

    def open_check(self) -> Outcome | None:
        """O1, before the key's lock is taken."""
        return self._usable()

    def open_supersede(self, key: Key, request_id: str, expected: int | None) -> Outcome | None:
        """O3-O5, holding the key's lock: the outcome if decided, else None."""
        prior = self.durable_of_request(key, request_id)
        if prior is not None:  # O3
            return ok((prior[1], self.store[prior].phase))
        if (expected or 0) != self.high.get(key, 0):  # O4
            return error("StaleSessionError")
        for session in self.superseded(key):
            self._request_stop(session, "Superseded")  # O5
        return None

    def superseded(self, key: Key) -> list[Session]:
        """The sessions of ``key`` whose stop is not over."""
        return [s for s in self.sessions.values() if s.key == key and s.stage != "over"]

    def open_commit(self, key: Key, request_id: str, lease: float | None) -> Outcome:
        """O6-O9, still holding the key's lock."""
        refused = self._usable()  # O6
        if refused:
            return refused
        generation = self.high.get(key, 0) + 1
        ident = (key, generation)
        if not self._save(ident, Durable("Open", False, request_id)):  # O8
            return error(STORAGE)
        seconds = self.lease if lease is None else lease
        session = Session(key, generation, request_id, seconds, self.now + seconds)  # O9
        self.sessions[ident] = session
        if self.closing:  # opened while the shutdown began
            self._request_stop(session, "Shutdown")
        return ok((generation, "Open"))

    def renew(self, ident: SessionId) -> Outcome:
        refused = self._usable()
        if refused:
            return refused
        found = self._session(ident)
        if not isinstance(found, Session):
            return found
        refused = self._live(found)
        if refused:
            return refused
        found.deadline = self.now + found.lease
        return ok(found.lease)

    def load(self, ident: SessionId, specifier: str) -> Generator[Session, None, Outcome]:
        refused = self._usable()
        if refused:
            return refused
        found = self._session(ident)
        if not isinstance(found, Session):
            return found
        session = found
        refused = self._live(session)
        if refused:
            return refused
        if session.specifier is not None:  # L2
            if session.specifier != specifier:
                return error("SessionConflictError")
            return ok(specifier)
        session.specifier = specifier
        failure = self._run_loader(session, specifier)
        if failure is None:
            return ok(specifier)
        session.load_failure = failure
        self._request_stop(session, "LoadFailed")  # L5
        if session.stage != "over":
            yield session
        return error(failure)

    def _run_loader(self, session: Session, specifier: str) -> str | None:
        ident = session.ident
        if not self._save(ident, Durable("Loading", False, session.request_id)):  # L3
            return STORAGE
        if specifier == self.missing:
            return "PackageError"
        child = session.child = self.children[ident] = Child()
        if not self._save(ident, Durable("Loading", True, session.request_id)):  # L4
            return STORAGE
        session.registered = True
        if specifier == self.broken:
            return "ExecutionError"
        child.started = True
        if not self._save(ident, Durable("Loaded", True, session.request_id)):
            return STORAGE
        session.loaded = True
        return None

    def dispose(self, ident: SessionId) -> Generator[Session, None, Outcome]:
        record = self.store.get(ident)
        if record is None:  # D2
            return error("StaleSessionError")
        if record.phase == "Stopped":  # D3
            return ok(record.termination)
        session = self.sessions.get(ident)
        if session is None:  # D4
            return error("SessionStoppedError")
        self._request_stop(session, "Disposed")  # D5
        if session.stage != "over":
            yield session
        assert session.outcome is not None
        return session.outcome

    def status(self, ident: SessionId) -> Outcome:
        record = self.store.get(ident)
        if record is None:
            return error("StaleSessionError")
        return ok((ident[1], record.phase))

    # -- what happens to children ------------------------------------------------------

    def child_exits(self, ident: SessionId, code: int) -> None:
        """A registered, running child exits by itself."""
        child = self.children[ident]
        if not child.alive:
            return
        child.alive = False
        session = self.sessions.get(ident)
        if session is None or session.stage == "over":
            return
        if session.reason is None:
            self._request_stop(session, "Exited", exit_code=code)  # X1
        elif session.stage == "interrupting":
            self._finish(session, "exited")
        elif session.stage == "killing":
            self._finish(session, "killed")
        self._wake()

    def ignore(self, ident: SessionId, *, interrupt: bool, kill: bool) -> None:
        child = self.children[ident]
        child.ignore_interrupt = child.ignore_interrupt or interrupt
        child.ignore_kill = child.ignore_kill or kill

    # -- the stop, exactly once -----------------------------------------------------------

    def _request_stop(self, session: Session, reason: str, exit_code: int | None = None) -> None:
        if session.reason is not None:  # P1
            return
        session.reason = reason
        session.exit_code = exit_code
        stopping = Durable(
            "Stopping",
            False,
            session.request_id,
            previous=session.active_phase,
            previous_child=session.registered,
            reason=reason,
        )
        if not self._save(session.ident, stopping):  # P2
            session.fenced = True
        child = session.child if session.registered else None
        if exit_code is not None or child is None or not child.alive:
            self._finish(session, "exited")
            return
        child.interrupts += 1
        if not child.ignore_interrupt:
            child.alive = False
            self._finish(session, "exited")
            return
        session.stage, session.stage_until = "interrupting", self.now + self.grace

    def _kill(self, session: Session) -> None:
        child = session.child
        assert child is not None
        child.kills += 1
        if not child.ignore_kill or not child.alive:
            child.alive = False
            self._finish(session, "killed")
            return
        session.stage, session.stage_until = "killing", self.now + self.confirmation

    def _release(self, session: Session) -> None:
        child = session.child
        if child is not None:  # P4
            child.closes += 1
            if not child.started:
                child.alive = False

    def _finish(self, session: Session, kind: str) -> None:
        self._release(session)
        session.stage, session.stage_until = "over", math.inf
        assert session.reason is not None
        stopped = Durable(
            "Stopped",
            False,
            session.request_id,
            previous=session.active_phase,
            previous_child=session.registered,
            reason=session.reason,
            termination=kind,
        )
        if self._save(session.ident, stopped):  # P5
            session.stopped = True
            self.sessions.pop(session.ident, None)
            session.outcome = error(STORAGE) if session.fenced else ok(kind)
        else:
            session.outcome = error(STORAGE)

    def _unconfirmed(self, session: Session) -> None:
        self._release(session)
        session.stage, session.stage_until = "over", math.inf
        self.poison(UNCONFIRMED)
        session.outcome = error(UNCONFIRMED)

    # -- time -------------------------------------------------------------------------

    def next_event(self) -> float:
        times = [math.inf]
        for session in self.sessions.values():
            if session.reason is None:
                times.append(session.deadline)
            elif session.stage in ("interrupting", "killing"):
                times.append(session.stage_until)
        return min(times)

    def advance(self, target: float) -> None:
        """Move the clock to ``target``, firing every deadline on the way in order."""
        while True:
            when = self.next_event()
            if when > target:
                break
            self.now = when
            for session in list(self.sessions.values()):
                if session.reason is None and session.deadline <= when:
                    self._request_stop(session, "Expired")  # T1
                elif session.stage == "interrupting" and session.stage_until <= when:
                    self._kill(session)
                elif session.stage == "killing" and session.stage_until <= when:
                    self._unconfirmed(session)
            self._wake()
        self.now = target

    def settle_time(self) -> float:
        """When every stop now in progress will be over (for shutdown and restarts)."""
        when = self.now
        for session in self.sessions.values():
            if session.stage == "interrupting":
                child = session.child
                assert child is not None
                extra = self.confirmation if child.ignore_kill else 0.0
                when = max(when, session.stage_until + extra)
            elif session.stage == "killing":
                when = max(when, session.stage_until)
        return when

    # -- shutdown, crash, recovery ----------------------------------------------------------

    def shutdown(self) -> tuple[float, bool]:
        """Leave the supervisor (Z1-Z3).

        Returns:
            When the shutdown is over, and whether it raises an error group.
        """
        self.closing = True
        for session in list(self.sessions.values()):
            if session.stage != "over":
                self._request_stop(session, "Shutdown")
        self.advance(self.settle_time())
        raises = self.poisoned is not None
        self._forget_supervisor()
        return self.now, raises

    def crash(self) -> None:
        """The supervisor dies: no more signals, no more writes."""
        self._forget_supervisor()

    def _forget_supervisor(self) -> None:
        self.sessions.clear()
        self.pending.clear()
        self.poisoned = None
        self.closing = False
        self.fail_once.clear()

    def recover(self, *, heal: Callable[[SessionId], None] | None = None) -> Outcome:
        """Enter a new supervisor on the store (V1-V5).

        Returns:
            ok, or the error ``open_supervisor`` raises.
        """
        self.broken_store = False
        pending = sorted(
            (ident for ident, record in self.store.items() if record.phase != "Stopped"),
            key=self.saved_order.__getitem__,
        )
        failed = False
        waited = False
        results: dict[SessionId, str] = {}
        for ident in pending:
            record = self.store[ident]
            has_child = record.previous_child if record.phase == "Stopping" else record.child
            if not has_child:
                results[ident] = "exited"
                continue
            child = self.children[ident]
            child.recovers += 1
            if not child.alive:
                results[ident] = "exited"
            elif child.ignore_kill:
                failed = waited = True
            else:
                child.alive = False
                results[ident] = "killed"
        for ident in pending:
            if ident not in results:
                continue
            record = self.store[ident]
            if record.phase == "Stopping":
                previous, previous_child = record.previous, record.previous_child
            else:
                previous, previous_child = record.phase, record.child
            self._save(
                ident,
                Durable(
                    "Stopped",
                    False,
                    record.request_id,
                    previous=previous,
                    previous_child=previous_child,
                    reason="Recovery",
                    termination=results[ident],
                ),
            )
        if waited:
            self.now += self.confirmation
        return error(UNCONFIRMED) if failed else ok()

    def immortal_orphans(self) -> Iterable[SessionId]:
        """Children that recovery cannot kill (they ignore the kill)."""
        for ident, record in self.store.items():
            if record.phase == "Stopped":
                continue
            child = self.children.get(ident)
            if child is not None and child.alive and child.ignore_kill:
                yield ident
