"""The reference model's stops: what happens below its calls (docs/design.md,
"Semantics": stop, child exit, lease expiry).

:class:`Stops` is that half of :class:`~trio_supervisor.testing.reference.Model`: the
saves and poisonings of the model's supervisor, the operations that wait for a stop and
are resumed once it is over, the children's ends, the stop that happens exactly once
(P1-P6), and the clock that fires leases, graces and confirmations (T1, P3) in order.
The model builds its calls, shutdown and recovery on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from typing import Literal

from ..model import ExitStatus, Termination
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

__all__ = ["Stops"]


class Stops:
    """The stops of the model's supervisor, and the clock that starts and ends them.

    Its attributes are the model's (``Model.__init__`` sets them; see there).
    """

    grace: float
    confirmation: float
    exit_status: Callable[[Ending, int], ExitStatus]
    now: float
    store: ModelStore
    sessions: dict[SessionId, Session]
    children: dict[SessionId, Child]
    poisoned: str | None
    poisoned_with: set[str]
    _poisoned_at: int | None
    pending: list[Pending]

    # -- the store ------------------------------------------------------------------

    def _save(self, ident: SessionId, record: Durable) -> bool:
        """Save one record; False (and poisoned) when the store refuses it."""
        if self.store.faults.refuses(ident, record.phase):
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

    # -- operations that wait for a stop -------------------------------------------------

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
        stopping = session.ending("Stopping")
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
        stopped = session.ending("Stopped", termination)
        if self._save(session.ident, stopped):  # P5
            session.stopped = True
            self.sessions.pop(session.ident, None)
            session.outcome = error(STORAGE) if session.fenced else ok(termination)
        else:
            session.outcome = error(STORAGE)

    def _finish_childless(self, session: Session, stopping: Durable) -> None:
        """Stopping and Stopped of a session that never had a child, saved together."""
        assert session.reason is not None
        assert not session.registered  # no child was ever spawned
        termination = NO_CHILD
        stopped = session.ending("Stopped", termination)
        session.stage, session.stage_until = "over", math.inf
        if self.store.faults.refuses(session.ident, stopping.phase):  # the one save, refused
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
