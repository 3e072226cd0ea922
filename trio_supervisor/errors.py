"""The errors of docs/design.md, "Public surface", and those of the runner's client.

Every error a supervisor raises on purpose is a :class:`SupervisorError`. Each class has
a ``code``: the reference implementation's name for it, which is also its wire code, so
a host on the other end of a network can tell them apart without Python. The last three
classes are raised by the client only (:mod:`trio_supervisor.client`, docs/service.md
section A): a runner that refused the caller's token, and a session whose lease the
client could not keep.
"""

from __future__ import annotations

from typing import ClassVar, Self

__all__ = [
    "BY_CODE",
    "ExecutionError",
    "LeaseExpiredError",
    "MisdirectedError",
    "OperatorsOnlyError",
    "PackageError",
    "RecordFormatError",
    "RunnerAccessError",
    "RunnerClosingError",
    "SessionConflictError",
    "SessionLostError",
    "SessionStoppedError",
    "StaleSessionError",
    "StateStorageError",
    "SupervisorError",
    "TerminationUnconfirmedError",
]


class SupervisorError(Exception):
    """Base class of every error the supervisor raises on purpose.

    Attributes:
        detail: A sentence for humans saying what went wrong.
    """

    code: ClassVar[str] = "SupervisorError"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.detail!r})"

    def again(self) -> Self:
        """Return a fresh copy of this error, chained to it.

        One outcome (a stop, a load, the poisoning of the supervisor) is often reported
        to several callers. Raising one exception object from several tasks would splice
        their tracebacks together; each caller gets its own copy instead, whose
        ``__cause__`` is the original with the original traceback.
        """
        copy = Exception.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.args = self.args
        copy.__cause__ = self
        return copy


class StaleSessionError(SupervisorError):
    """The handle names no retained session: unknown token, or wrong key or generation."""

    code = "StaleSession"


class LeaseExpiredError(SupervisorError):
    """The session's lease ran out."""

    code = "LeaseExpired"


class SessionStoppedError(SupervisorError):
    """The session is stopping or stopped for a reason other than its lease."""

    code = "SessionStopped"


class SessionConflictError(SupervisorError):
    """The session was already asked to load a different specifier."""

    code = "SessionConflict"


class StateStorageError(SupervisorError):
    """The store failed to make a record durable, or returned records it cannot vouch for."""

    code = "StateStorageError"


class RecordFormatError(StateStorageError):
    """A stored record is malformed, or written in a version this library cannot read."""

    code = "StateStorageError"


class ExecutionError(SupervisorError):
    """The execution adapter failed to spawn, start, signal or watch a unit."""

    code = "ExecutionError"


class PackageError(SupervisorError):
    """The code named by a load cannot be resolved, imported or started."""

    code = "PackageError"


class TerminationUnconfirmedError(SupervisorError):
    """A child was asked to stop and then killed, and its exit was still not observed.

    Attributes:
        causes: The exceptions met on the way (while interrupting, killing, waiting
            or releasing the unit), in the order they happened.
    """

    code = "TerminationUnconfirmed"

    def __init__(self, detail: str, causes: tuple[BaseException, ...] = ()) -> None:
        super().__init__(detail)
        self.causes = causes


class RunnerClosingError(SupervisorError):
    """The supervisor is shutting down and accepts no new work."""

    code = "RunnerClosing"


class RunnerAccessError(SupervisorError):
    """The runner refused the call's bearer token: missing, or not one it knows (401)."""

    code = "Unauthorized"


class OperatorsOnlyError(RunnerAccessError):
    """The call is for the runner's operators, and was made with the hosts' token (403)."""

    code = "Forbidden"


class MisdirectedError(SupervisorError):
    """A call on a session reached a runner of a fleet that does not hold it (421), and
    the runner it named did not hold it either, or could not be named.

    The client follows a runner's 421 once, to the runner it names (docs/service.md
    section C); this is what it raises when that is not enough. The detail names both
    runners.
    """

    code = "Misdirected"


class SessionLostError(SupervisorError):
    """A session's lease could not be kept: it expired, stopped or was superseded.

    Raised by :meth:`trio_supervisor.client.RemoteSupervisor.session` when a background
    renew fails for good; the block was cancelled.

    Attributes:
        cause: The error the renew met (``LeaseExpiredError``, ``SessionStoppedError``
            or ``StaleSessionError``), or None.
    """

    code = "SessionLost"

    def __init__(self, detail: str, cause: BaseException | None = None) -> None:
        super().__init__(detail)
        self.cause = cause


BY_CODE: dict[str, type[SupervisorError]] = {
    kind.code: kind
    for kind in (
        SupervisorError,
        StaleSessionError,
        LeaseExpiredError,
        SessionStoppedError,
        SessionConflictError,
        StateStorageError,  # before its subclass: a wire code names the documented class
        ExecutionError,
        PackageError,
        TerminationUnconfirmedError,
        RunnerClosingError,
        RunnerAccessError,
        OperatorsOnlyError,
        MisdirectedError,
        SessionLostError,
    )
}
"""Every error class by its wire code, for a client that gets the code back."""
