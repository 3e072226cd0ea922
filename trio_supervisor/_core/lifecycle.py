"""The session lifecycle: a pure state machine, with no Trio and no I/O.

Theory of operation
-------------------
A session moves through five phases::

    Open --begin_load--> Loading --loaded--> Loaded
    | ^----- refused -----'  |                  /
    +---------- stop --------+-----------------+--> Stopping --stopped--> Stopped

The driver (``session.py``, one per session) feeds events in and gets records out; it persists the
records, signals and waits, and comes back with the next event. Two kinds of event
exist, and the difference is the whole design:

* **Requests** (begin a load, stop) are decided here, at once, with no await in
  between: the first stop request fixes the reason and fences the session (no renew,
  no load) before anything is written. Every later stop request joins the first (P1).
* **Facts** (a child's identity is durable, Loaded is durable, Stopped is durable; or
  the store refused the first Loading record, over a tenant's quota) are things a
  store already answered. A fact is always taken in, even when a stop
  request arrived while its write was in flight: what is durable is what recovery will
  find, so the session must track it too. That is why ``register`` and ``loaded`` are
  legal in Stopping.

Before the driver writes a fact it asks for the record to write (``child_record``,
``loaded_record``); those calls check the rules (L4: still live, no second child) and
change nothing. All legal moves are in ``_TRANSITIONS``; any other move is refused at
one place, ``_next``, with the error of the rule it breaks.

Deadlines are plain numbers on the caller's clock (``trio.current_time()`` in the
driver); they are passed in as ``now``, never read here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Final

from ..errors import (
    ExecutionError,
    LeaseExpiredError,
    SessionConflictError,
    SessionStoppedError,
    StaleSessionError,
    SupervisorError,
)
from ..model import (
    ActiveRecord,
    ChildIdentity,
    CodeIdentity,
    ExitStatus,
    Expired,
    Handle,
    Key,
    Load,
    LoadedRecord,
    LoadingRecord,
    OpenRecord,
    Phase,
    StoppedRecord,
    StoppingRecord,
    StopReason,
    Termination,
    carried,
)

__all__ = ["Event", "Lifecycle", "stop_error", "unexpected_generation"]


class Event(enum.Enum):
    """What moves a session from one phase to the next."""

    BEGIN_LOAD = "begin load"  # request: a host asked to load code (L3)
    REGISTER = "register child"  # fact: the Loading record with the child is durable (L4)
    LOADED = "loaded"  # fact: the Loaded record is durable (L4)
    # Fact: a fleet's store refused the first Loading record, over its tenant's quota
    # (F9): nothing of the load was written, so the session is Open again.
    REFUSED = "load refused"
    STOP = "stop"  # request: the first stop request (P1)
    STOPPED = "stopped"  # fact: the Stopped record is durable (P5)


_O, _LG, _LD, _SG, _SD = Phase.OPEN, Phase.LOADING, Phase.LOADED, Phase.STOPPING, Phase.STOPPED

_TRANSITIONS: Final[Mapping[tuple[Phase, Event], Phase]] = {
    (_O, Event.BEGIN_LOAD): _LG,
    (_LG, Event.REGISTER): _LG,
    (_LG, Event.LOADED): _LD,
    (_LG, Event.REFUSED): _O,
    (_O, Event.STOP): _SG,
    (_LG, Event.STOP): _SG,
    (_LD, Event.STOP): _SG,
    # Facts whose write was in flight when the stop request came in.
    (_SG, Event.REGISTER): _SG,
    (_SG, Event.LOADED): _SG,
    (_SG, Event.STOPPED): _SD,
}


def stop_error(reason: StopReason, handle: Handle) -> SupervisorError:
    """The error a caller gets from ``handle``'s session, which stopped for ``reason``
    (R3); it names the session."""
    if isinstance(reason, Expired):
        return LeaseExpiredError(f"the lease of {_named(handle)} has expired")
    return SessionStoppedError(f"{_named(handle)} is stopping or stopped ({reason.kind})")


def unexpected_generation(
    key: Key, expected_generation: int | None, high: int
) -> StaleSessionError:
    """O4's error: the host expected another generation than the key's high-water."""
    expected = (
        "a key never opened" if expected_generation is None else f"generation {expected_generation}"
    )
    return StaleSessionError(
        f"{key.identity}/{key.instance}: expected {expected}, but its high-water "
        f"generation is {high}; pass expected_generation={high or None} to open the next one"
    )


def _named(handle: Handle) -> str:
    return f"{handle.key.identity}/{handle.key.instance} generation {handle.generation}"


class Lifecycle:
    """The state of one session.

    Attributes:
        phase: Where the session is. Stopping starts with the first stop request, before
            the Stopping record is written: the fence is in memory first.
        deadline: When the lease runs out, on the driver's clock.
        reason: Why the session stops; None while it is live.
        exit: The child's exit status when it exited by itself (X1), else None.
        load: The load requested, once there was one.
        child: The child's identity, once the record holding it is durable.
        code: The loaded code's identity, once the Loaded record is durable.
        stopped: The Stopped record, once durable.
    """

    __slots__ = (
        "_active",
        "_next_active",
        "_open",
        "child",
        "code",
        "deadline",
        "exit",
        "load",
        "phase",
        "reason",
        "stopped",
    )

    def __init__(self, record: OpenRecord, deadline: float) -> None:
        self._open = record
        self.phase = Phase.OPEN
        self.deadline = deadline
        self.reason: StopReason | None = None
        self.exit: ExitStatus | None = None
        self.load: Load | None = None
        self.child: ChildIdentity | None = None
        self.code: CodeIdentity | None = None
        self.stopped: StoppedRecord | None = None
        # The active record once built: a stop writes it into two records (P2, P5).
        self._active: ActiveRecord | None = None
        # The record of the fact on its way (child_record, loaded_record): once the fact
        # is taken in, it is the active record, not built again.
        self._next_active: LoadingRecord | LoadedRecord | None = None

    # -- reading ------------------------------------------------------------------------

    @property
    def record(self) -> OpenRecord:
        """The Open record the session was created with."""
        return self._open

    @property
    def live(self) -> bool:
        """True until the first stop request."""
        return self.reason is None

    def active(self) -> ActiveRecord:
        """The session's active record: what ``previous`` of a Stopping record holds."""
        base = self._open
        if self.load is None:
            return base
        if self._active is not None:
            return self._active
        built: ActiveRecord
        if self.code is not None and self.child is not None:
            built = LoadedRecord(**carried(base), load=self.load, code=self.code, child=self.child)
        else:
            built = LoadingRecord(**carried(base), load=self.load, child=self.child)
        self._active = built
        return built

    def check_live(self, now: float) -> None:
        """Refuse to act on a session that is stopping or whose lease ran out (R3, R4).

        Raises:
            LeaseExpiredError: The lease ran out, whether or not the timer fired yet.
            SessionStoppedError: The session stops for another reason.
        """
        if self.reason is not None:
            raise stop_error(self.reason, self._open.handle)
        if now >= self.deadline:
            raise LeaseExpiredError(f"the lease of {_named(self._open.handle)} has expired")

    def remaining(self, now: float) -> float:
        """Seconds left on the lease."""
        return max(self.deadline - now, 0.0)

    # -- requests -----------------------------------------------------------------------

    def renew(self, now: float) -> float:
        """Move the deadline to ``now`` plus the lease (R4, R6); return the new deadline."""
        self.check_live(now)
        self.deadline = now + self._open.lease
        return self.deadline

    def begin_load(self, load: Load, now: float) -> bool:
        """Ask to load ``load`` (L1-L3).

        Returns:
            True when the caller must start the loader; False when a load of the same
            specifier is already in flight or done (L2), so the caller joins it.

        Raises:
            LeaseExpiredError, SessionStoppedError: As :meth:`check_live`.
            SessionConflictError: Another specifier was asked for before.
        """
        self.check_live(now)
        if self.load is not None:
            if self.load.specifier != load.specifier:
                raise SessionConflictError(
                    f"the session already loads {self.load.specifier!r}; "
                    f"it cannot also load {load.specifier!r}"
                )
            return False
        self.phase = self._next(Event.BEGIN_LOAD)
        self.load = load
        self._active = None
        return True

    def request_stop(self, reason: StopReason, exit: ExitStatus | None = None) -> bool:
        """Ask the session to stop (P1).

        Args:
            reason: Why.
            exit: The child's exit status, when the child exited by itself (X1).

        Returns:
            True when this request is the first and fixed the reason; False when the
            session was already stopping, and this request joins that stop.
        """
        if self.reason is not None:
            return False
        self.phase = self._next(Event.STOP)
        self.reason = reason
        self.exit = exit
        return True

    # -- facts and the records to write for them ----------------------------------------

    def child_record(self, child: ChildIdentity, now: float) -> LoadingRecord:
        """The Loading record naming ``child``, to be written before it starts (L4).

        Raises:
            LeaseExpiredError, SessionStoppedError: The session is no longer live.
            ExecutionError: The session has a child already.
        """
        self.check_live(now)
        self._next(Event.REGISTER)
        if self.child is not None:
            raise ExecutionError("the execution adapter registered more than one child")
        record = self.active()
        assert isinstance(record, LoadingRecord)
        built = LoadingRecord(**carried(record), load=record.load, child=child)
        self._next_active = built
        return built

    def register(self, child: ChildIdentity) -> None:
        """Take in that the Loading record naming ``child`` is durable."""
        self.phase = self._next(Event.REGISTER)
        self.child = child
        self._active = self._taken_in(lambda record: record.child is child)

    def loaded_record(self, code: CodeIdentity, now: float) -> LoadedRecord:
        """The Loaded record, to be written once the child started (L4).

        Raises:
            LeaseExpiredError, SessionStoppedError: The session is no longer live.
            ExecutionError: No child was registered.
        """
        self.check_live(now)
        self._next(Event.LOADED)
        if self.child is None or self.load is None:
            raise ExecutionError("the execution adapter started without registering its child")
        built = LoadedRecord(**carried(self._open), load=self.load, code=code, child=self.child)
        self._next_active = built
        return built

    def refused(self) -> None:
        """Take in that the store refused the load's first Loading record (a tenant's
        quota, F9): nothing of the load is durable, so the session is Open again and may
        load later. Legal only while live (a stop request that came first wins: the
        session stops as asked) and before a child is registered.
        """
        if self.child is not None:
            raise RuntimeError("a load whose child is registered cannot be refused")
        self.phase = self._next(Event.REFUSED)
        self.load = None
        self._active = None

    def loaded(self, code: CodeIdentity) -> None:
        """Take in that the Loaded record is durable."""
        self.phase = self._next(Event.LOADED)
        self.code = code
        self._active = self._taken_in(
            lambda record: isinstance(record, LoadedRecord) and record.code is code
        )

    def _taken_in(
        self, describes: Callable[[LoadingRecord | LoadedRecord], bool]
    ) -> ActiveRecord | None:
        """The record built for the fact just taken in, if it is the one that
        ``describes`` it (else None: :meth:`active` builds it)."""
        built, self._next_active = self._next_active, None
        return built if built is not None and describes(built) else None

    def stopping_record(self) -> StoppingRecord:
        """The Stopping record of the stop in progress (P2)."""
        if self.reason is None:
            raise RuntimeError("the session was not asked to stop")
        return StoppingRecord.of(self.active(), self.reason)

    def stopped_record(self, termination: Termination) -> StoppedRecord:
        """The Stopped record of the stop in progress (P5)."""
        if self.reason is None:
            raise RuntimeError("the session was not asked to stop")
        return StoppedRecord.of(self.active(), self.reason, termination)

    def finish(self, record: StoppedRecord) -> None:
        """Take in that the Stopped record is durable."""
        self.phase = self._next(Event.STOPPED)
        self.stopped = record

    # -- the one place a move is refused ------------------------------------------------

    def _next(self, event: Event) -> Phase:
        phase = _TRANSITIONS.get((self.phase, event))
        if phase is not None:
            return phase
        if self.reason is not None and event is not Event.STOPPED:
            raise stop_error(self.reason, self._open.handle)
        if event in (Event.REGISTER, Event.LOADED):
            raise ExecutionError(
                f"the execution adapter reported {event.value!r} while the session is "
                f"{self.phase.value}, not loading"
            )
        raise RuntimeError(f"no transition from {self.phase.value} on {event.value!r}")
