"""The wire format of the runner service: request bodies, answers, and errors.

Every body is JSON read with the package's one cattrs converter
(:data:`trio_supervisor.codec.converter`), into the small request classes below: a
missing field, a field of the wrong JSON type, an unknown field or a value its class
refuses is a 422 whose detail names the field by its path (``$.handle.generation``).
Answers are written with the same converter, so a record on the wire has exactly the
shape it has in storage (without the storage's ``version``).

Errors are ``application/problem+json`` (RFC 9457): one table, :data:`STATUS`, maps
each error class to its HTTP status, as docs/service.md section A says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Final, TypeVar

import attrs
import cattrs

from .. import _defaults as defaults
from .. import _fields as fields
from ..codec import converter, describe_error
from ..errors import (
    ExecutionError,
    ForbiddenError,
    LeaseExpiredError,
    PackageError,
    ProblemCode,
    QuotaExceededError,
    RecordFormatError,
    RunnerClosingError,
    RunnerDrainingError,
    RunnerFullError,
    RunnerLostError,
    RunnerRestartingError,
    SessionConflictError,
    SessionStoppedError,
    StaleSessionError,
    StateStorageError,
    StoreUnavailableError,
    SupervisorError,
    TerminationUnconfirmedError,
    ThrottledError,
)
from ..model import Handle, Key, Limits, Load, SessionRecord, StoppedRecord

__all__ = [
    "MAX_BODY",
    "REFINEMENTS",
    "STATUS",
    "AdminDisposeBody",
    "DrainBody",
    "HandleBody",
    "KeyBody",
    "LoadBody",
    "OpenBody",
    "Problem",
    "SignInBody",
    "public_record",
    "read_body",
    "status_for",
    "status_of",
]

_T = TypeVar("_T")

MAX_BODY: Final = defaults.MOST_BODY
# A drain's deadline: 0 stops at once; by default an hour, as Nomad's node drain.
DRAIN_DEADLINE: Final = fields.Seconds(inclusive=True, maximum=30 * 86400.0)
DEFAULT_DRAIN_DEADLINE: Final = defaults.DRAIN_DEADLINE


# -- request bodies -----------------------------------------------------------------------


# The bodies check what the supervisor would refuse (with the same checks), so that the
# OpenAPI document, which reads the checks, says what a body must be.


@attrs.frozen(kw_only=True)
class OpenBody:
    """``POST /v1/open``."""

    key: Key
    request_id: str = attrs.field(validator=fields.text)
    expected_generation: int | None = attrs.field(
        default=None, validator=fields.optional(fields.at_least(0))
    )
    lease: float | None = attrs.field(default=None, validator=fields.optional(fields.LEASE))
    limits: Limits | None = None


@attrs.frozen(kw_only=True)
class HandleBody:
    """``POST /v1/renew``, ``/v1/dispose`` and ``/v1/status``."""

    handle: Handle


@attrs.frozen(kw_only=True)
class LoadBody:
    """``POST /v1/load``."""

    handle: Handle
    load: Load


@attrs.frozen(kw_only=True)
class KeyBody:
    """``POST /v1/high-water``."""

    key: Key


@attrs.frozen(kw_only=True)
class DrainBody:
    """``POST /v1/admin/drain``: how long the runner's sessions may run on at most."""

    deadline: float = attrs.field(default=DEFAULT_DRAIN_DEADLINE, validator=DRAIN_DEADLINE)


@attrs.frozen(kw_only=True)
class SignInBody:
    """``POST /v1/dashboard/sign-in``: the code of a sign-in link (``sign_in.py``)."""

    code: str = attrs.field(validator=fields.key_text)  # 1 to 128 characters, as a key's


@attrs.frozen(kw_only=True)
class AdminDisposeBody:
    """``POST /v1/admin/dispose``: an operator names a session by key and generation."""

    key: Key
    generation: int = attrs.field(validator=fields.at_least(1))


def _no_nul(name: str, value: object) -> None:
    if isinstance(value, str) and "\0" in value:
        raise ValueError(f"{name} must not hold a NUL")


# A key goes into the child's environment (and file names), which cannot hold a NUL:
# such a key was opened, then its load was a 500 (ExecutionError). An embedder's key
# may hold one (an in-process child has no environment); a host's may not.
_key_on_the_wire: Final = fields.Check(_no_nul, pattern="^[^\\x00]*$")

REFINEMENTS: Final[Mapping[tuple[type, str], fields.Check]] = {
    (Key, "identity"): _key_on_the_wire,
    (Key, "instance"): _key_on_the_wire,
}
"""The checks the wire adds to a value class's own: ``(class, field) -> check``."""


class Problem(Exception):
    """A request the service refuses before it reaches the supervisor.

    Attributes:
        status: The HTTP status.
        code: The problem's code (``MalformedRequest``, ``InvalidRequest``, ...).
        detail: What is wrong, for the caller.
        fields: More members of the problem body (a 421's ``owner`` and ``location``).
    """

    def __init__(
        self, status: int, code: str, detail: str, *, fields: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.fields: Mapping[str, Any] = fields or {}


def read_body(raw: bytes, kind: type[_T]) -> _T:
    """Parse and check a request body.

    Raises:
        Problem: 400 when it is not JSON, 422 when it is not a valid ``kind``.
    """
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise Problem(400, ProblemCode.MALFORMED, f"the body is not JSON: {error}") from error
    except RecursionError:
        # ``[[[...]]]`` a thousand deep was a 500 (RecursionError).
        raise Problem(400, ProblemCode.MALFORMED, "the body is nested too deeply") from None
    if not isinstance(data, dict):
        raise Problem(
            422,
            ProblemCode.INVALID,
            f"the body must be a JSON object @ $, not {data!r:.40}",
        )
    unencodable = _lone_surrogate(data)
    if unencodable is not None:
        raise Problem(
            422,
            ProblemCode.INVALID,
            f"a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not "
            f"Unicode text @ {unencodable}",
        )
    try:
        body = converter.structure(data, kind)
    except Exception as error:
        problems = [
            _at_field(problem) for problem in cattrs.transform_error(error, "$", describe_error)
        ]
        raise Problem(422, ProblemCode.INVALID, "; ".join(problems)) from error
    for where, value in _keys(body):
        for (kind, name), check in REFINEMENTS.items():
            if isinstance(value, kind):
                try:
                    check.check(name, getattr(value, name))
                except ValueError as error:
                    raise Problem(422, ProblemCode.INVALID, f"{error} @ {where}.{name}") from None
    return body


# A validator names its field as "Class.field" (the class may be the wire's own, as
# OpenBody), and cattrs puts the path of the object it was building after "@".
_FIELD_PROBLEM: Final = re.compile(r"^[A-Za-z_]\w*\.(?P<field>\w+) (?P<rest>.*) @ (?P<path>\S+)$")


def _at_field(problem: str) -> str:
    """A problem as the caller wrote the body: ``lease must be ... @ $.lease``, not
    ``OpenBody.lease must be ... @ $``."""
    found = _FIELD_PROBLEM.match(problem)
    if found is None:
        return problem
    field = found["field"]
    return f"{field} {found['rest']} @ {found['path']}.{field}"


def _lone_surrogate(data: Any) -> str | None:
    """The path of a string (or member name) that is not UTF-8 encodable, if any.

    JSON's ``\\ud800`` escapes let a body carry lone surrogates, which no store can
    save: such a key reached SQLite and poisoned the runner.
    Iterative, as the body may be nested as deep as the parser allows; the paths are
    only spelled out once such a string is known to be there.
    """
    if not _any_lone_surrogate(data):
        return None
    stack: list[tuple[str, Any]] = [("$", data)]
    while stack:
        where, value = stack.pop()
        if _is_unencodable(value):
            return where
        if isinstance(value, dict):
            for name, item in value.items():
                # The name is looked at before its value, so no path spelled out holds a
                # name that cannot be written in the answer.
                stack.append((f"{where}.{name}", item))
                stack.append((f"{where} (a member's name)", name))
        elif isinstance(value, list):
            stack.extend((f"{where}[{index}]", item) for index, item in enumerate(value))
    return "$"


def _any_lone_surrogate(data: Any) -> bool:
    stack = [data]
    while stack:
        value = stack.pop()
        if _is_unencodable(value):
            return True
        if isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


def _is_unencodable(value: Any) -> bool:
    if not isinstance(value, str) or value.isascii():
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return True
    return False


def _keys(body: object) -> list[tuple[str, Key]]:
    """The keys a request body names, with their paths."""
    keys = []
    key = getattr(body, "key", None)
    if isinstance(key, Key):
        keys.append(("$.key", key))
    handle = getattr(body, "handle", None)
    if isinstance(handle, Handle):
        keys.append(("$.handle.key", handle.key))
    return keys


# -- answers ------------------------------------------------------------------------------


def public_record(record: SessionRecord) -> dict[str, Any]:
    """A record as an operator sees it: the session tokens are left out, and its
    termination, if it has one, is ``described`` in the words of
    :meth:`~trio_supervisor.model.Termination.describe` (null while it has none), so
    that the dashboard shows what the command line shows, and needs no copy of them."""
    data: dict[str, Any] = converter.unstructure(record, SessionRecord)
    _drop_tokens(data)
    if isinstance(record, StoppedRecord):
        data["described"] = record.termination.describe()
    else:
        data["described"] = None
    return data


def _drop_tokens(data: Any) -> None:
    if isinstance(data, dict):
        handle = data.get("handle")
        if isinstance(handle, dict):
            handle.pop("token", None)
        for value in data.values():
            _drop_tokens(value)


# -- errors -------------------------------------------------------------------------------

# The HTTP status of each error class; the first match wins (subclasses come first).
STATUS: Final[tuple[tuple[type[SupervisorError], int], ...]] = (
    (ForbiddenError, 403),
    (QuotaExceededError, 429),
    (ThrottledError, 429),
    (RunnerFullError, 503),
    (RunnerLostError, 503),
    (RunnerDrainingError, 503),
    (RunnerRestartingError, 503),
    (StoreUnavailableError, 503),
    (StaleSessionError, 404),
    (LeaseExpiredError, 410),
    (SessionStoppedError, 409),
    (SessionConflictError, 409),
    (PackageError, 422),
    (RunnerClosingError, 503),
    (RecordFormatError, 500),
    (StateStorageError, 503),
    (ExecutionError, 500),
    (TerminationUnconfirmedError, 500),
)

TITLES: Final[Mapping[int, str]] = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    410: "Gone",
    413: "Content Too Large",
    421: "Misdirected Request",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def status_for(kind: type[SupervisorError]) -> int | None:
    """The HTTP status of an error class in :data:`STATUS`, if it has one."""
    for known, status in STATUS:
        if issubclass(kind, known):
            return status
    return None


def status_of(error: SupervisorError, *, poisoned: bool) -> int:
    """The HTTP status of a supervisor error.

    A plain :class:`SupervisorError` is the poisoning error of a crashed background
    task: 503 while the supervisor is poisoned, 500 otherwise.
    """
    status = status_for(type(error))
    if status is not None:
        return status
    return 503 if poisoned else 500


def problem_body(status: int, code: str, detail: str) -> dict[str, Any]:
    """The RFC 9457 body of an error."""
    return {
        "type": f"urn:trio-supervisor:{code}",
        "title": TITLES.get(status, "Error"),
        "status": status,
        "detail": detail,
        "code": code,
    }
