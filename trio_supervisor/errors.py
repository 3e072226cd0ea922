"""The errors of docs/design.md, "Public surface", and those of the runner's client.

Every error a supervisor raises on purpose is a :class:`SupervisorError`. Each class has
a ``code``: the reference implementation's name for it, which is also its wire code, so
a host on the other end of a network can tell them apart without Python.

The runner's admission (docs/service.md section D) refuses with three more: a key outside
the caller's identities (:class:`ForbiddenError`), a tenant over its quota or its rate
(:class:`QuotaExceededError`, :class:`ThrottledError`) and a runner without room for
another child (:class:`RunnerFullError`). The client raises them as the runner answered
them; so does the service's ``Admission`` (``trio_supervisor.service.admission``) for an
embedder who admits calls the same way. The access errors and :class:`SessionLostError`
are the client's own: a runner that refused the caller's token, and a session whose lease
the client could not keep.

What an error adds to its problem+json answer (docs/service.md section A, "Errors") is
said once, here: :meth:`SupervisorError.problem_fields` is what the runner writes, and
:meth:`SupervisorError.from_problem` what the client reads back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self

__all__ = [
    "BY_CODE",
    "ExecutionError",
    "ForbiddenError",
    "LeaseExpiredError",
    "MisdirectedError",
    "OperatorsOnlyError",
    "PackageError",
    "ProblemCode",
    "QuotaExceededError",
    "RecordFormatError",
    "RunnerAccessError",
    "RunnerClosingError",
    "RunnerDrainingError",
    "RunnerFencedError",
    "RunnerFullError",
    "RunnerLostError",
    "RunnerRestartingError",
    "RunnerUnreachableError",
    "SessionConflictError",
    "SessionLostError",
    "SessionStoppedError",
    "StaleSessionError",
    "StateStorageError",
    "StoreUnavailableError",
    "SupervisorError",
    "TerminationUnconfirmedError",
    "ThrottledError",
]


class SupervisorError(Exception):
    """Base class of every error the supervisor raises on purpose.

    A plain ``SupervisorError`` wraps a crash of one of the supervisor's own tasks (H1).

    Args:
        detail: A sentence for humans saying what went wrong.

    Attributes:
        detail: The same sentence.
        code: The class's wire code (a class attribute), the name a host sees.
    """

    code: ClassVar[str] = "SupervisorError"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.detail!r})"

    def problem_fields(self) -> dict[str, object]:
        """What this error adds to the runner's problem+json answer, besides its code
        and detail: its attributes a host may act on. Its ``retry_after`` is not among
        them: the answer's ``Retry-After`` header carries it.

        Returns:
            The fields by name; none for most errors.
        """
        return {}

    @classmethod
    def from_problem(
        cls, detail: str, problem: Mapping[str, object], retry_after: float | None
    ) -> Self:
        """The error a problem answer stands for, read back from its body.

        A client reads what a runner of another version may have written: a field
        missing, or not of its type, takes the attribute's default rather than failing.

        Args:
            detail: The problem's detail.
            problem: The problem's body, where :meth:`problem_fields` put its fields.
            retry_after: The answer's ``Retry-After`` in seconds (None: none given); an
                error without a ``retry_after`` ignores it.

        Returns:
            The error, as the runner raised it.
        """
        return cls(detail)

    def again(self) -> Self:
        """Return a fresh copy of this error, chained to it.

        One outcome (a stop, a load, the poisoning of the supervisor) is often reported
        to several callers (P6). Raising one exception object from several tasks would
        splice their tracebacks together; each caller gets its own copy instead, whose
        ``__cause__`` is the original with the original traceback.

        Returns:
            A new error of the same class and attributes.
        """
        copy = Exception.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.args = self.args
        copy.__cause__ = self
        return copy


def _count(value: object) -> int:
    """A problem's whole number, or 0 when it gave none (a bool is not one)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _seconds(value: object) -> float:
    """A problem's number of seconds, or 0.0 when it gave none (a bool is not one)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


class _Retryable(SupervisorError):
    """An error whose call may be made again later, once ``retry_after`` has passed; the
    runner answers it with a ``Retry-After`` header, and the client reads that back.

    Attributes:
        retry_after: Seconds after which the call may be tried again, or None when no
            wait is known.
    """

    # The attributes a subclass adds to its problem answer, each with how the client
    # reads it back: a missing or mistyped field as the attribute's default.
    _wire: ClassVar[tuple[tuple[str, Callable[[object], object]], ...]] = ()

    def __init__(self, detail: str, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.retry_after = retry_after

    def problem_fields(self) -> dict[str, object]:
        """The attributes this error adds to its problem answer, by name."""
        return {name: getattr(self, name) for name, _ in self._wire}

    @classmethod
    def from_problem(
        cls, detail: str, problem: Mapping[str, object], retry_after: float | None
    ) -> Self:
        """The error a problem answer stands for, with its ``retry_after``.

        Args:
            detail: The problem's detail.
            problem: The problem's body; a field missing or of another type reads as
                the attribute's default.
            retry_after: The answer's ``Retry-After`` in seconds, or None.

        Returns:
            The error, as the runner raised it.
        """
        fields: dict[str, Any] = {name: read(problem.get(name, "")) for name, read in cls._wire}
        return cls(detail, retry_after, **fields)


class StaleSessionError(SupervisorError):
    """The handle names no retained session: unknown token, or wrong key or generation.

    Raised by renew, load, dispose and status (R2, D2, S1); and by an open whose
    ``expected_generation`` is not the key's high-water (O4), or that lost the fleet's
    compare-and-set (F3).
    """

    code = "StaleSession"


class LeaseExpiredError(SupervisorError):
    """The session's lease ran out.

    Rules R3, R4 and T1.
    """

    code = "LeaseExpired"


class SessionStoppedError(SupervisorError):
    """The session is stopping or stopped for a reason other than its lease.

    Also raised for a session retired by recovery or eviction (R2, R3, D4, V4).
    """

    code = "SessionStopped"


class SessionConflictError(SupervisorError):
    """The session was already asked to load a different specifier.

    Rule L2.
    """

    code = "SessionConflict"


class StateStorageError(SupervisorError):
    """The store failed to make a record durable, or returned records it cannot vouch for.

    A failed save poisons the supervisor (O8, H1); a store that cannot be read stops it
    from starting (V1).
    """

    code = "StateStorageError"


class StoreUnavailableError(StateStorageError, _Retryable):
    """The store did not answer within its wait (``store_wait``: a broken or refused
    connection, a server restarting, a standby that is read-only), and the call
    certainly wrote nothing (503, ``Retry-After``). Unlike the other storage errors it
    does not poison the supervisor (docs/design.md, B1): the same call may be made again
    once the store answers.

    Args:
        detail: What the store met.
        retry_after: Seconds after which the call may be made again.

    Attributes:
        retry_after: The same seconds, or None.
    """

    code = "StoreUnavailable"

    def __init__(self, detail: str, retry_after: float | None = 1.0) -> None:
        super().__init__(detail, retry_after)


class RunnerFencedError(StateStorageError):
    """This runner may no longer write to its fleet's store: its row was not renewed
    within its local trust, or another runner took its epoch over (docs/design.md, F4
    and B2). Its supervisor is poisoned (H1); the runner service then makes a new
    incarnation of itself (B5). On the wire it is a ``StateStorageError``."""

    code = "StateStorageError"


class RecordFormatError(StateStorageError):
    """A stored record is malformed, or written in a version this library cannot read.

    The detail names the field's path (``$.previous.handle.generation``); docs/design.md,
    "Persistence and retention".
    """

    code = "StateStorageError"


class ExecutionError(SupervisorError):
    """The execution adapter failed to spawn, start, signal or watch a unit.

    Rules L4 and L5.
    """

    code = "ExecutionError"


class PackageError(SupervisorError):
    """The code named by a load cannot be resolved, imported or started.

    Rule L5.
    """

    code = "PackageError"


class TerminationUnconfirmedError(SupervisorError):
    """A child was asked to stop and then killed, and its exit was still not observed.

    Raised by a stop (P3), by recovery (V2), and by an open whose older generation on
    another runner did not stop in time (F6). A stop's unconfirmed termination poisons
    the supervisor (H1).

    Args:
        detail: What was not confirmed.
        causes: The exceptions met on the way.

    Attributes:
        causes: The exceptions met on the way (while interrupting, killing, waiting
            or releasing the unit), in the order they happened.
    """

    code = "TerminationUnconfirmed"

    def __init__(self, detail: str, causes: tuple[BaseException, ...] = ()) -> None:
        super().__init__(detail)
        self.causes = causes


class RunnerClosingError(SupervisorError):
    """The supervisor is shutting down and accepts no new work.

    Rules O1, R1, L1 and Z1.
    """

    code = "RunnerClosing"


class RunnerAccessError(SupervisorError):
    """The runner refused the call's bearer token: missing, or not one it knows (401)."""

    code = "Unauthorized"


class ForbiddenError(RunnerAccessError):
    """The caller's token is valid, but not for this call (403): a key whose identity
    matches none of the tenant's patterns, or a call for the runner's operators."""

    code = "Forbidden"


class OperatorsOnlyError(ForbiddenError):
    """The call is for the runner's operators, and was made with a host's token (403).

    On the wire it is a ``Forbidden`` whose body says ``operators_only``: a client tells
    it from a key refused by its tenant's patterns."""

    def problem_fields(self) -> dict[str, object]:
        """The body's mark that tells this refusal from a key's: ``operators_only``."""
        return {"operators_only": True}


class _Refused(_Retryable):
    """An admission's refusal that may be tried again later: its ``retry_after`` is None
    when only a change elsewhere (a session stopping) can make room."""


class QuotaExceededError(_Refused):
    """The call would take its tenant past a quota (429); nothing changed.

    Raised by a runner's admission and by a fleet's store (F9); it does not poison.

    Args:
        detail: The refusal, in Kubernetes' words (see :meth:`of`).
        retry_after: Seconds after which the call may be tried again, or None when
            only a session stopping can make room.
        quota, requested, used, hard: As the attributes.

    Attributes:
        quota: Which quota: "sessions", "children", "memory_bytes" or "cpu_percent".
        requested, used, hard: What the call asked for, what the tenant holds, and its
            quota, in the quota's unit.
    """

    code = "QuotaExceeded"
    _wire = (("quota", str), ("requested", _count), ("used", _count), ("hard", _count))

    def __init__(
        self,
        detail: str,
        retry_after: float | None = None,
        *,
        quota: str = "",
        requested: int = 0,
        used: int = 0,
        hard: int = 0,
    ) -> None:
        super().__init__(detail, retry_after)
        self.quota = quota
        self.requested = requested
        self.used = used
        self.hard = hard

    @classmethod
    def of(cls, tenant: str, quota: str, requested: int, used: int, hard: int) -> Self:
        """The refusal of ``tenant``'s call, in Kubernetes' words, whoever counted it (a
        runner alone, or the fleet's store).

        Args:
            tenant: The tenant refused.
            quota: Which quota it would pass.
            requested: What the call asked for, in the quota's unit.
            used: What the tenant holds.
            hard: Its quota.

        Returns:
            The error, its detail as ``tenant 'acme' exceeded quota: sessions,
            requested 1, used 100, limited 100``.
        """
        return cls(
            f"tenant {tenant!r} exceeded quota: {quota}, requested {requested}, used "
            f"{used}, limited {hard}",
            quota=quota,
            requested=requested,
            used=used,
            hard=hard,
        )


class ThrottledError(_Refused):
    """The tenant has too many calls in flight, or opens and loads faster than its rate
    (429); nothing changed. ``retry_after`` says when to try again."""

    code = "Throttled"


class RunnerFullError(_Refused):
    """The runner has no room for another child: its children's summed memory ceilings
    or their count is at its capacity (503). The session stays Open and may load later;
    ``retry_after`` says when to try again."""

    code = "RunnerFull"


class RunnerDrainingError(_Refused):
    """The runner drains (503): it takes no new sessions or children, and stops once its
    sessions have ended or its drain's deadline passed (docs/service.md section B). The
    fleet's other runners take them; ``retry_after`` says when to try again (behind a
    balancer, that lands elsewhere)."""

    code = "RunnerDraining"


class RunnerRestartingError(_Retryable):
    """The runner's supervisor was poisoned and the runner makes a new incarnation of it
    by itself (503, ``Retry-After``; docs/design.md, B5): the session calls are refused
    meanwhile, and answered again once it serves. The detail says why it restarts.

    Args:
        detail: Why the runner restarts.
        retry_after: Seconds after which the call may be made again.

    Attributes:
        retry_after: The same seconds, or None.
    """

    code = "RunnerRestarting"

    def __init__(self, detail: str, retry_after: float | None = 1.0) -> None:
        super().__init__(detail, retry_after)


class MisdirectedError(SupervisorError):
    """A call on a session reached a runner of a fleet that does not hold it (421), and
    the runner it named did not hold it either, or could not be named.

    The client follows a runner's 421 once, to the runner it names (docs/service.md
    section C); this is what it raises when that is not enough. The detail names both
    runners.
    """

    code = "Misdirected"


class RunnerLostError(_Retryable):
    """The runner of the fleet that holds the session stopped renewing its row (503
    ``HolderLost``): it is dead or cut off, and its sessions wait for their takeover.

    Answered at once by any runner of the fleet, with ``Retry-After`` until the takeover
    is due (docs/service.md section C). The client waits it out within its retry window,
    then raises it. After the takeover the session reads as Stopped (reason Recovery).

    Attributes:
        owner: The lost runner's id.
        location: Its advertised URL ("" if it advertised none).
        lease_until: When its row's lease ran out, seconds since the Unix epoch (the
            database's clock).
        takeover_at: When another runner may take the session over: ``lease_until`` plus
            the session's lease and the runner's stop bound (same clock).
        retry_after: Seconds until then, as the runner answered them (None if unknown).
    """

    code = "HolderLost"
    _wire = (
        ("owner", str),
        ("location", str),
        ("lease_until", _seconds),
        ("takeover_at", _seconds),
    )

    def __init__(
        self,
        detail: str,
        retry_after: float | None = None,
        *,
        owner: str = "",
        location: str = "",
        lease_until: float = 0.0,
        takeover_at: float = 0.0,
    ) -> None:
        super().__init__(detail, retry_after)
        self.owner = owner
        self.location = location
        self.lease_until = lease_until
        self.takeover_at = takeover_at


class RunnerUnreachableError(SupervisorError):
    """The client could not reach a runner within its window (no connection, or none
    that answered): the runner is down, or not at that URL. The client's own; the
    transport's error is its ``__cause__``.

    Attributes:
        url: The URL that did not answer.
    """

    code = "RunnerUnreachable"

    def __init__(self, detail: str, *, url: str = "") -> None:
        super().__init__(detail)
        self.url = url


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
        StoreUnavailableError,
        ExecutionError,
        PackageError,
        TerminationUnconfirmedError,
        RunnerClosingError,
        RunnerAccessError,
        ForbiddenError,  # the documented class of "Forbidden"
        QuotaExceededError,
        ThrottledError,
        RunnerFullError,
        RunnerDrainingError,
        MisdirectedError,
        RunnerLostError,
        RunnerRestartingError,
        RunnerUnreachableError,
        SessionLostError,
    )
}
"""Every error class by its wire code, for a client that gets the code back."""


class ProblemCode(enum.StrEnum):
    """The wire's codes that are no error class's: what the service refuses before a call
    reaches the supervisor (docs/service.md section A, "Errors"). The app answers them,
    the OpenAPI document lists them and the client reads them, all from here.

    Members: ``MALFORMED`` (400: not JSON, nested too deeply, a bad length),
    ``INVALID`` (422: a body or query parameter that is not valid), ``TOO_LARGE``
    (413), ``NOT_FOUND`` (404), ``METHOD_NOT_ALLOWED`` (405), ``INTERNAL`` (500: the
    runner failed, not the call).
    """

    MALFORMED = "MalformedRequest"  # 400: not JSON, nested too deeply, a bad length
    INVALID = "InvalidRequest"  # 422: a body or query parameter that is not valid
    TOO_LARGE = "RequestTooLarge"  # 413
    NOT_FOUND = "NotFound"  # 404: no such path
    METHOD_NOT_ALLOWED = "MethodNotAllowed"  # 405
    INTERNAL = "InternalError"  # 500: the runner failed, not the call


REFUSED_AS_INVALID: tuple[ProblemCode, ...] = (
    ProblemCode.INVALID,
    ProblemCode.MALFORMED,
    ProblemCode.TOO_LARGE,
)
"""The codes a client raises as ``ValueError``, as the embedded call would."""
