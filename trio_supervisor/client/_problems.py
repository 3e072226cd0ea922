"""What the client raises: a runner's problem answer read back as its error class, and
the client's own errors for a runner that did not answer, or did not make the call.

A problem's extra fields are read by the error classes themselves
(:meth:`~trio_supervisor.errors.SupervisorError.from_problem`), which also say what the
runner writes, so both ends read one definition.
"""

from __future__ import annotations

import ssl

import httpx

from ..errors import (
    BY_CODE,
    REFUSED_AS_INVALID,
    ForbiddenError,
    OperatorsOnlyError,
    RunnerAccessError,
    RunnerRestartingError,
    RunnerUnreachableError,
    StoreUnavailableError,
    SupervisorError,
)

# What a runner answers for a call it did not make, and will make later: any call waits
# it out within its window (docs/service.md section E).
Unavailable = StoreUnavailableError | RunnerRestartingError


def error_of(response: httpx.Response) -> Exception:
    """The exception a problem answer stands for."""
    try:
        problem = response.json()
        code, detail = str(problem["code"]), str(problem["detail"])
    except (ValueError, KeyError, TypeError):
        return SupervisorError(f"the runner answered {response.status_code}: {response.text:.200}")
    if response.status_code == 401:
        return RunnerAccessError(detail)
    if response.status_code == 403:
        # One wire code, two classes: the body says which refusal it was.
        refusal = OperatorsOnlyError if problem.get("operators_only") else ForbiddenError
        return refusal(detail)
    if code in REFUSED_AS_INVALID:
        return ValueError(detail)
    kind = BY_CODE.get(code, SupervisorError)
    error = kind.from_problem(detail, problem, retry_after_of(response))
    notes = problem.get("notes")
    if isinstance(notes, list):
        for note in notes:
            error.add_note(str(note))
    return error


def retry_after_of(response: httpx.Response) -> float | None:
    """The seconds of the answer's ``Retry-After``, if it gives a number of them."""
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def misdirection(response: httpx.Response) -> tuple[str, str]:
    """The runner a 421 names, and its URL ("" when it names none)."""
    try:
        problem = response.json()
        return str(problem.get("owner", "")), str(problem.get("location", ""))
    except (ValueError, AttributeError):
        return "", ""


def unreachable(url: str, error: httpx.TransportError, elapsed: float) -> RunnerUnreachableError:
    """The client's error for a runner at ``url`` that did not answer for ``elapsed`` s."""
    why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    if refused_by_tls(error):
        what = "refused the TLS handshake"
    elif isinstance(error, httpx.ConnectError | httpx.ConnectTimeout):
        what = "is not answering" + (f" (tried for {elapsed:.1f} s)" if elapsed >= 0.1 else "")
    else:
        what = "stopped answering the call"
    return RunnerUnreachableError(f"the runner at {url} {what}: {why}", url=url)


def refused_by_tls(error: BaseException) -> bool:
    """Whether a failed connection failed in the TLS handshake (no retry mends that)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ssl.SSLError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def still_unavailable(error: Unavailable, url: str, waited: float, window: float) -> Unavailable:
    """The error raised for a runner at ``url`` that answered ``error`` until the call's
    ``window`` ended, ``waited`` s after it began: of the same class, its detail naming
    the runner, the wait and the runner's cause."""
    what = (
        "could not reach its store" if isinstance(error, StoreUnavailableError) else "is restarting"
    )
    if waited >= 0.1:
        how_long = f"waited {waited:.1f} s of the call's {window:g} s window"
    else:
        how_long = f"not waited: the call's window is {window:g} s"
    again = type(error)(
        f"the runner at {url} {what} ({how_long}; the call changed nothing): {error.detail}",
        error.retry_after,
    )
    for note in getattr(error, "__notes__", ()):
        again.add_note(note)
    return again


def note_before(error: RunnerUnreachableError, unavailable: tuple[Unavailable, str] | None) -> None:
    """Note on ``error`` what a runner answered the call before it stopped answering."""
    if unavailable is not None:
        answer, url = unavailable
        error.add_note(f"before, the runner at {url} answered {answer.code}: {answer.detail}")
