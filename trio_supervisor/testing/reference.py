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
holds of the store in :mod:`.reference_store`. Here are the calls, the shutdown and
recovery; the stops and the clock beneath them are :mod:`.reference_stops`'s.

Where the run may order events at one virtual instant either way (stops whose deadlines
coincide, a shutdown stopping everything at once, concurrent operations), the model
cannot predict the order: it evicts in an order of its own and takes the store's choice
once it has seen the store, and it accepts whichever of the poisonings of that instant
the supervisor reports first (:meth:`Model.learn_poisoning`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable

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
from .reference_stops import Stops
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


class Model(Stops):
    """The reference model of one supervisor's life, across restarts.

    Args:
        lease: The supervisor's default lease.
        grace: Seconds between interrupt and kill.
        confirmation: Seconds between kill and giving up (and recovery's timeout).
        stopped_per_key: The store's retention of Stopped records per key.
        stopped_total: The store's retention of Stopped records in all.
        stopped_for: The store's ``stopped_for``: 0, or longer than the example runs.
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
        stopped_for: float = 0.0,
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
        self.store = ModelStore(stopped_per_key, stopped_total, stopped_for)
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
        """A call on a handle: the live session object, or the error (the supervisor's
        health, then R2/R3, then the session's stop or its lease)."""
        refused = self._usable()
        if refused:
            return refused
        record = self.store.records.get(ident)
        if record is None:
            return error("StaleSessionError")
        session = self.sessions.get(ident)
        if session is None:
            if record.reason is not None:
                return self._stop_error(record.reason)
            return error("SessionStoppedError")
        if session.reason is not None:
            return self._stop_error(session.reason)
        if self.now >= session.deadline:
            return error("LeaseExpiredError")
        return session

    # -- operations ---------------------------------------------------------------------

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
        found = self._session(ident)
        if not isinstance(found, Session):
            return found
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
        session = self._session(ident)
        if not isinstance(session, Session):
            return session
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
        self.store.faults.once.clear()

    def recover(self) -> Outcome:
        """Enter a new supervisor on the store (V1-V5).

        Returns:
            ok, or the error ``open_supervisor`` raises.
        """
        self.store.faults.broken = False
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
