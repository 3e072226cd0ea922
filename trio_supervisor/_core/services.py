"""What a session (``session.py``) is given and how it answers: the supervisor's
services it runs on (:class:`Services`), the adapters' calls as it makes them (a failure
becomes a documented error; a unit's identity and code are checked), the names its
tasks carry, and the :class:`Reply` through which it publishes a load's code and its
stop's outcome."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs
import trio

from ..abc import Execution, Unit
from ..errors import ExecutionError, SupervisorError
from ..model import ChildIdentity, CodeIdentity, Handle, QuotaClaim, SessionRecord
from .health import Health

__all__ = [
    "Persist",
    "Reply",
    "Services",
    "adapter_call",
    "adapter_error",
    "code_of",
    "identity_of",
    "task_name",
]

_T = TypeVar("_T")
# The session the callbacks are given: generic, so that this module, below the session's,
# need not know it.
_S = TypeVar("_S")


class Reply(Generic[_T]):
    """A result published once and read by any number of waiters.

    The event that wakes waiters is made by the first one to wait: most replies (an
    idle session's outcome) are never waited for before they are set, or never set.
    """

    __slots__ = ("_event", "done", "error", "value")

    def __init__(self) -> None:
        self._event: trio.Event | None = None
        self.done = False
        self.value: _T | None = None
        self.error: SupervisorError | None = None

    def set(self, value: _T) -> None:
        if not self.done:
            self.value = value
            self._wake()

    def fail(self, error: SupervisorError) -> None:
        if not self.done:
            self.error = error
            self._wake()

    def _wake(self) -> None:
        self.done = True
        if self._event is not None:
            self._event.set()

    def result(self) -> _T:
        """The published value, or a copy of the published error raised; once done."""
        if self.error is not None:
            raise self.error.again()
        assert self.value is not None
        return self.value

    async def wait(self) -> _T:
        if self.done:
            await trio.lowlevel.checkpoint()
        else:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        return self.result()


class Persist(Protocol):
    """Makes a record durable (and poisons on failure); with a quota claim, a fleet's
    store counts it first (F9) and may refuse it with ``QuotaExceededError``."""

    def __call__(
        self, record: SessionRecord, quota: QuotaClaim | None = None
    ) -> Awaitable[None]: ...


@attrs.define
class Services(Generic[_S]):
    """What a session needs of the supervisor that owns it.

    Attributes:
        execution: Spawns the session's child.
        health: Poisoned by a failure the supervisor cannot vouch for (H1).
        persist: Makes a record durable (and poisons on failure), counting a quota
            claim in a fleet (:class:`Persist`).
        persist_together: Makes several records durable in one transaction where the
            store can (and poisons on failure).
        spawn: Starts a task in the supervisor's nursery: ``spawn(function, name)``.
        grace: Seconds between the interrupt and the kill (P3).
        confirmation: Seconds to wait for an exit after the kill, and for a release.
        stopped: Called once the session's Stopped record is durable (P5): from then
            on its record answers for it.
        ended: Called once the stop is over, before anyone hears of it (P6).
    """

    execution: Execution
    health: Health
    persist: Persist
    persist_together: Callable[[Sequence[SessionRecord]], Awaitable[None]]
    spawn: Callable[[Callable[[], Awaitable[Any]], str], None]
    grace: float
    confirmation: float
    stopped: Callable[[_S], None]
    ended: Callable[[_S], None]
    # The graces of the terminations under way; all cut short by skip_grace.
    graces: set[trio.CancelScope] = attrs.field(factory=set)
    hurried: bool = False

    def skip_grace(self) -> None:
        """From now on, terminations go straight from the interrupt to the kill."""
        self.hurried = True
        for scope in self.graces:
            scope.cancel()


def adapter_error(error: Exception, what: str) -> SupervisorError:
    """An adapter's failure as one of the documented errors."""
    if isinstance(error, SupervisorError):
        return error
    wrapped = ExecutionError(f"{what} failed: {error!r}")
    wrapped.__cause__ = error
    return wrapped


async def adapter_call(call: Awaitable[_T], what: str) -> _T:
    """Await an adapter call; its failures become documented errors."""
    try:
        return await call
    except Exception as error:
        raise adapter_error(error, what) from error


def task_name(role: str, handle: Handle) -> str:
    """What a debugger or an instrument shows for a session's task: role, key, generation.

    Made for every session task, so not from the handle's repr (which costs more).
    """
    return (
        f"trio_supervisor {role} {handle.key.identity}/{handle.key.instance} #{handle.generation}"
    )


def identity_of(unit: Unit) -> ChildIdentity:
    """The unit's child identity, checked: what L4 saves to find the child again.

    Raises:
        ExecutionError: The execution gave something else.
    """
    identity = unit.identity
    if not isinstance(identity, ChildIdentity):
        raise ExecutionError(
            f"the unit's identity is a {type(identity).__name__}, not a ChildIdentity"
        )
    return identity


def code_of(unit: Unit) -> CodeIdentity:
    """The unit's code identity, checked: what its Loaded record saves.

    Raises:
        ExecutionError: The execution gave something else.
    """
    code = unit.code
    if not isinstance(code, CodeIdentity):
        raise ExecutionError(f"the unit's code is a {type(code).__name__}, not a CodeIdentity")
    return code
