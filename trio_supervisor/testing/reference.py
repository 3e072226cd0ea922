"""A reference model of docs/design.md, "Semantics", for the conformance machine.

It is written from the document, not from the engine: it imports neither the lifecycle
nor the supervisor, only the value types. It is a discrete-event simulation on a
virtual clock: operations run at ``now`` and may wait (an open superseding a child that
ignores its interrupt waits for the grace to pass); :meth:`Model.advance` moves the
clock, fires every deadline in order and resumes whatever waited.

For each operation the model predicts the result or the error class, and after every
step it knows what the store must hold (:mod:`.reference_store`): each record's phase,
whether it names a child, its stop reason and its whole termination, and each key's
high-water generation, with retention applied per key and in all.

The children of the model behave like the conformance harnesses' units: a child exits at
once on a signal it heeds, one that ignores its interrupt is killed after the grace, one
that ignores the kill too is "unconfirmed" after the confirmation timeout. How a child
reports its end differs per execution (a process reports the signal, an in-process task
that it was cancelled), so the model asks ``exit_status``, which the harness provides,
for the :class:`~trio_supervisor.model.ExitStatus` of each way a child ends (``Ending``).

Sessions are named by ``(key, generation)``; tokens are random and the model never needs
them. What the model holds of each session and child is in :mod:`.reference_state`, what it
holds of the store in :mod:`.reference_store`.

Where the run may order events at one virtual instant either way (stops whose deadlines
coincide, a shutdown stopping everything at once, concurrent operations), the model
cannot predict the order: it evicts in an order of its own and takes the store's choice
once it has seen the store, and it accepts whichever of the poisonings of that instant
the supervisor reports first (:meth:`Model.learn_poisoning`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable
from typing import Literal

from ..model import ExitStatus, Key, Termination
from .reference_state import (
    NO_CHILD,
    STORAGE,
    UNCONFIRMED,
    Child,
    Ending,
    Outcome,
    Pending,
    Session,
    error,
    ok,
)
from .reference_store import Durable, ModelStore, SessionId

__all__ = [
    "Child",
    "Durable",
    "Ending",
    "Model",
    "Outcome",
    "Pending",
    "SessionId",
    "error",
    "ok",
]


class Model:
    """The reference model of one supervisor's life, across restarts.

    Args:
        lease: The supervisor's default lease.
        grace: Seconds between interrupt and kill.
        confirmation: Seconds between kill and giving up (and recovery's timeout).
        stopped_per_key: The store's retention of Stopped records per key.
        stopped_total: The store's retention of Stopped records in all.
        missing: The specifier whose spawn fails with PackageError.
        broken: The specifier whose start fails with ExecutionError, if any.
        exit_status: The status the execution's children report when they end in a
            given way (with a given code, for ``"exit"``); a plain function, since the
            model is copied while bursts are explained.
    """

    def __init__(
        self,
        *,
        lease: float,
        grace: float,
        confirmation: float,
        stopped_per_key: int,
        stopped_total: int,
        missing: str,
        broken: str | None,
        exit_status: Callable[[Ending, int], ExitStatus],
    ) -> None:
        self.lease = lease
        self.grace = grace
        self.confirmation = confirmation
        self.missing = missing
        self.broken = broken
        self.exit_status = exit_status
        self.now = 0.0
        self.store = ModelStore(stopped_per_key, stopped_total)
        # The running supervisor.
        self.sessions: dict[SessionId, Session] = {}  # the session objects it holds
        self.children: dict[SessionId, Child] = {}  # every child ever spawned
        self.poisoned: str | None = None
        # What else poisoned it at the instant of the first poisoning: which came first
        # is the scheduler's choice (see learn_poisoning).
        self.poisoned_with: set[str] = set()
        self._poisoned_at: int | None = None
        self.closing = False
        self.pending: list[Pending] = []

    # -- the store ------------------------------------------------------------------

    def _save(self, ident: SessionId, record: Durable) -> bool:
        """Save one record; False (and poisoned) when the store refuses it."""
        if self.store.refuses(ident, record.phase):
            self.poison(STORAGE)
            return False
        for evicted in self.store.save(ident, record):
            self.sessions.pop(evicted, None)  # O10: its session object is retired
        return True

    def poison(self, name: str) -> None:
        store = self.store
        if self.poisoned is None:
            self.poisoned, self.poisoned_with = name, {name}
            self._poisoned_at = store.instant if store.joined else None
        elif store.joined and store.instant == self._poisoned_at:
            self.poisoned_with.add(name)

    def learn_poisoning(self, name: str | None, *, settled: bool = False) -> None:
        """Take the supervisor's word on which poisoning of one instant came first.

        Args:
            name: The class name of the supervisor's poisoning error, or None.
            settled: The step is over: from now on only that name is expected.
        """
        if name in self.poisoned_with:
            self.poisoned = name
        if settled:
            self.poisoned_with = {self.poisoned} if self.poisoned else set()

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
        record = self.store.records.get(ident)
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
        prior = self.store.of_request(key, request_id)
        if prior is not None:  # O3
            return ok((prior[1], self.store.records[prior].phase))
        if (expected or 0) != self.store.high.get(key, 0):  # O4
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
        generation = self.store.high.get(key, 0) + 1
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
        """L1-L6, the whole load; concurrent bursts use its two parts one by one."""
        decided = self.load_begin(ident, specifier)
        if decided:
            return decided
        return (yield from self.load_run(ident))

    def load_begin(self, ident: SessionId, specifier: str) -> Outcome | None:
        """The load call's checks (L1, L2): the outcome if decided, else None and the
        load is the session's; its loader runs later (deviation (f))."""
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
        return None

    def load_run(self, ident: SessionId) -> Generator[Session, None, Outcome]:
        """The loader (L3-L5), in the session's task: what the supervisor's health was
        when the call was accepted decides nothing here any more."""
        session = self.sessions[ident]
        specifier = session.specifier
        assert specifier is not None
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
        record = self.store.records.get(ident)
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
        record = self.store.records.get(ident)
        if record is None:
            return error("StaleSessionError")
        return ok((ident[1], record.phase))

    # -- what happens to children ------------------------------------------------------

    def child_exits(self, ident: SessionId, code: int) -> None:
        """A registered, running child exits by itself."""
        child = self.children[ident]
        if not child.alive:
            return
        self._end(child, "exit", code)
        session = self.sessions.get(ident)
        if session is None or session.stage == "over":
            return
        if session.reason is None:
            self._request_stop(session, "Exited")  # X1: no signal, the child's own status
        elif session.stage == "interrupting":
            self._finish(session, "exited")
        elif session.stage == "killing":
            self._finish(session, "killed")
        self._wake()

    def running_children(self) -> list[SessionId]:
        """The sessions whose child is registered, started and still runs."""
        return [
            ident
            for ident, session in self.sessions.items()
            if session.registered
            and session.child is not None
            and session.child.started
            and session.child.alive
        ]

    def ignore(self, ident: SessionId, *, interrupt: bool, kill: bool) -> None:
        child = self.children[ident]
        child.ignore_interrupt = child.ignore_interrupt or interrupt
        child.ignore_kill = child.ignore_kill or kill

    def _end(self, child: Child, ending: Ending, code: int = 0) -> None:
        """The child ends, and reports what the execution's children report for ``ending``."""
        child.alive = False
        child.exit = self.exit_status(ending, code)

    # -- the stop, exactly once -----------------------------------------------------------

    def _request_stop(self, session: Session, reason: str) -> None:
        if session.reason is not None:  # P1
            return
        session.reason = reason
        stopping = Durable(
            "Stopping",
            False,
            session.request_id,
            previous=session.active_phase,
            previous_child=session.registered,
            reason=reason,
        )
        if session.child is None:
            # Nothing was ever spawned: Stopping and Stopped are one save, one
            # transaction (docs/design.md, deviations: P2 with no child).
            self._finish_childless(session, stopping)
            return
        if not self._save(session.ident, stopping):  # P2
            session.fenced = True
        child = session.child if session.registered else None
        if child is None or not child.alive:  # P3: no child, or it exited by itself
            self._finish(session, "exited")
            return
        child.interrupts += 1
        if not child.ignore_interrupt:
            self._end(child, "interrupt")
            self._finish(session, "exited")
            return
        session.stage, session.stage_until = "interrupting", self.now + self.grace

    def _kill(self, session: Session) -> None:
        child = session.child
        assert child is not None
        child.kills += 1
        if child.alive and not child.ignore_kill:
            self._end(child, "kill")
        if not child.alive:
            self._finish(session, "killed")
            return
        session.stage, session.stage_until = "killing", self.now + self.confirmation

    def _release(self, session: Session) -> None:
        child = session.child
        if child is not None:  # P4
            child.closes += 1
            if not child.started:
                child.alive = False

    def _finish(self, session: Session, kind: Literal["exited", "killed"]) -> None:
        child = session.child if session.registered else None
        if child is None or not child.started:
            termination = NO_CHILD  # the session's code never ran
        else:
            assert child.exit is not None, "the model ends a stop before its child ended"
            termination = Termination(kind=kind, exit=child.exit)
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
            termination=termination,
        )
        if self._save(session.ident, stopped):  # P5
            session.stopped = True
            self.sessions.pop(session.ident, None)
            session.outcome = error(STORAGE) if session.fenced else ok(termination)
        else:
            session.outcome = error(STORAGE)

    def _finish_childless(self, session: Session, stopping: Durable) -> None:
        """Stopping and Stopped of a session that never had a child, saved together."""
        assert session.reason is not None
        termination = NO_CHILD
        stopped = Durable(
            "Stopped",
            False,
            session.request_id,
            previous=session.active_phase,
            previous_child=False,
            reason=session.reason,
            termination=termination,
        )
        session.stage, session.stage_until = "over", math.inf
        if self.store.refuses(session.ident, stopping.phase):  # the one save, refused
            self.poison(STORAGE)
            session.outcome = error(STORAGE)
            return
        self._save(session.ident, stopping)
        self._save(session.ident, stopped)
        session.stopped = True
        self.sessions.pop(session.ident, None)
        session.outcome = ok(termination)

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
            with self.store.together():  # what happens at one instant, in any order
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
        with self.store.together():  # Z2: all at once
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
        self.poisoned_with = set()
        self.closing = False
        self.store.fail_once.clear()

    def recover(self) -> Outcome:
        """Enter a new supervisor on the store (V1-V5).

        Returns:
            ok, or the error ``open_supervisor`` raises.
        """
        self.store.broken = False
        groups = self.store.pending_recovery()
        pending = [ident for group in groups for ident in group]
        failed = False
        waited = False
        results: dict[SessionId, Termination] = {}
        for ident in pending:
            record = self.store.records[ident]
            has_child = record.previous_child if record.phase == "Stopping" else record.child
            if not has_child:
                results[ident] = NO_CHILD
                continue
            child = self.children[ident]
            child.recovers += 1
            if not child.alive:
                results[ident] = Termination(kind="exited", exit=self.exit_status("gone", 0))
            elif child.ignore_kill:
                failed = waited = True
            else:
                self._end(child, "recover")
                assert child.exit is not None
                results[ident] = Termination(kind="killed", exit=child.exit)
        for group in groups:
            with self.store.together():  # V3: in the store's order, unknown within an instant
                for ident in group:
                    if ident in results:
                        self._recovered(ident, results[ident])
        if waited:
            self.now += self.confirmation
        return error(UNCONFIRMED) if failed else ok()

    def _recovered(self, ident: SessionId, termination: Termination) -> None:
        record = self.store.records[ident]
        if record.phase == "Stopping":
            previous, previous_child = record.previous, record.previous_child
        else:
            previous, previous_child = record.phase, record.child
        stopped = Durable(
            "Stopped",
            False,
            record.request_id,
            previous=previous,
            previous_child=previous_child,
            reason="Recovery",
            termination=termination,
        )
        self._save(ident, stopped)

    def immortal_orphans(self) -> Iterable[SessionId]:
        """Children that recovery cannot kill (they ignore the kill)."""
        for ident, record in self.store.records.items():
            if record.phase == "Stopped":
                continue
            child = self.children.get(ident)
            if child is not None and child.alive and child.ignore_kill:
                yield ident
