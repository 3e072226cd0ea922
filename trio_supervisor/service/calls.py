"""Every call the runner answers, in one table: :data:`CALLS`.

The app's routes (``app.py``), the OpenAPI document's paths (``openapi.py``) and the
statuses each call may answer are all made from this table, so a call cannot be served
without being documented, nor documented with statuses it never answers. What a call
refuses is said once: its error classes here, their statuses in ``wire.STATUS``; its
query parameters' bounds are read and documented from the same :class:`Param`.

One call answers an error with a status of its own: ``open``'s ``StaleSession`` (its
``expected_generation`` is not the key's high-water: another open got in first) is a
409 Conflict, as a stale write is in HTTP; everywhere else ``StaleSession`` means the
handle names no retained session, a 404. ``open`` takes no handle, so the call alone
tells the two apart, and the error keeps its class and code (a client raises
``StaleSessionError`` for both).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

import attrs

from .. import _defaults as defaults
from .. import _fields as fields
from .._routes import ROUTES
from ..errors import (
    ExecutionError,
    ForbiddenError,
    LeaseExpiredError,
    PackageError,
    ProblemCode,
    QuotaExceededError,
    RunnerAccessError,
    RunnerClosingError,
    RunnerDrainingError,
    RunnerFullError,
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
from ..model import CodeIdentity, Phase, RunnerInfo, SessionRecord, Termination
from .wire import (
    AdminDisposeBody,
    DrainBody,
    HandleBody,
    KeyBody,
    LoadBody,
    OpenBody,
    Problem,
    SignInBody,
    status_of,
)

__all__ = ["CALLS", "PAGE", "Call", "Param", "by_name"]

PAGE: Final = defaults.PAGE
MAX_PAGE: Final = defaults.MOST_PAGE

Role = Literal["hosts", "operators"]
# How a tenant's call meets its fairness (docs/service.md D): "rated" calls (opens,
# loads) take a token from its bucket and count in flight; "bounded" ones count in flight;
# "exempt" ones neither (renew and dispose: refusing them would cost the tenant its
# sessions; the events stream: it lasts as long as its reader).
Fairness = Literal["rated", "bounded", "exempt"]


@attrs.frozen(kw_only=True)
class Param:
    """A query parameter: its JSON Schema, which is also how it is read.

    Attributes:
        name: The parameter's name.
        schema: What it accepts (``type``, ``minimum``, ``maximum``, ``enum``, ...).
        required: Whether a call without it is refused.
        default: Its value when it is absent (or empty).
        description: What it means, for the document.
    """

    name: str
    schema: Mapping[str, Any]
    required: bool = False
    default: int | bool | None = None
    description: str | None = None

    def read(self, query: Mapping[str, str]) -> Any:
        """The parameter's value in ``query``, checked against :attr:`schema`.

        Raises:
            Problem: 422, naming the parameter and what it must be.
        """
        text = query.get(self.name) or None
        if text is None:
            if self.required:
                raise self._refused("is required")
            return self.default
        if "enum" in self.schema and text not in self.schema["enum"]:
            raise self._refused(f"must be one of {', '.join(self.schema['enum'])}")
        if self.schema.get("type") == "boolean":
            if text not in ("true", "false"):
                raise self._refused("must be true or false")
            return text == "true"
        if self.schema.get("type") != "integer":
            return text
        try:
            number = int(text)
        except ValueError:
            raise self._refused("must be an integer") from None
        low, high = self.schema.get("minimum"), self.schema.get("maximum")
        if (low is not None and number < low) or (high is not None and number > high):
            raise self._refused(
                f"must be {low}..{high}" if high is not None else f"must be >= {low}"
            )
        return number

    def _refused(self, must: str) -> Problem:
        return Problem(422, ProblemCode.INVALID, f"the query parameter {self.name!r} {must}")


# Every /v1 call may meet a runner that is poisoned, shutting down, restarting by
# itself, or whose store is out of reach for the moment.
_RUNNER: Final = (
    StateStorageError,
    StoreUnavailableError,
    RunnerClosingError,
    RunnerRestartingError,
)
# A tenant's call on a key outside its identities, or over its fairness.
_TENANT: Final = (ForbiddenError, ThrottledError)
_HANDLE: Final = (
    StaleSessionError,
    LeaseExpiredError,
    SessionStoppedError,
    SessionConflictError,
    ExecutionError,
    TerminationUnconfirmedError,
)


@attrs.frozen(kw_only=True)
class Call:
    """One call of the runner (SERVICE.md section A).

    Attributes:
        name: The app's name for its handler, and its route's (``_routes.ROUTES``: its
            method and path); also its label in the calls metric, when ``metered``.
        summary: One line for the document.
        role: Who may call it: the hosts (and the operators), the operators only, or
            anyone (None: no token needed).
        body: The request body's class, if it takes one.
        answer: The 200 answer: its fields and their types (or JSON Schemas) for a JSON
            object; None for text.
        media: The 200 answer's content type.
        params: Its query parameters.
        errors: The supervisor errors it may answer; their statuses are ``wire.STATUS``'s.
        overrides: An error whose status is this call's own, with what it means here.
        metered: Whether its answers are counted in the calls metric.
        routed: Whether it names one session, which in a fleet another runner may hold:
            then it answers 421 with that runner's id and URL (docs/service.md C).
        tenants_see_own: For an operators' call: whether a tenant may make it too, and
            sees its own keys alone (docs/service.md D).
        fairness: How a tenant's call meets its fairness (:data:`Fairness`).
    """

    name: str
    summary: str
    role: Role | None
    body: type | None = None
    answer: Mapping[str, Any] | None = None
    media: str = "application/json"
    params: tuple[Param, ...] = ()
    errors: tuple[type[SupervisorError], ...] = ()
    overrides: Mapping[type[SupervisorError], tuple[int, str]] = attrs.field(factory=dict)
    metered: bool = False
    routed: bool = False
    tenants_see_own: bool = False
    fairness: Fairness = "bounded"

    @property
    def method(self) -> Literal["GET", "POST"]:
        """Its HTTP method (``_routes.py``)."""
        return ROUTES[self.name].method

    @property
    def path(self) -> str:
        """Where it is served (``_routes.py``)."""
        return ROUTES[self.name].path

    def status(self, error: SupervisorError, *, poisoned: bool) -> int:
        """The HTTP status of ``error`` answered by this call."""
        for kind, (status, _) in self.overrides.items():
            if isinstance(error, kind):
                return status
        return status_of(error, poisoned=poisoned)

    def param(self, name: str) -> Param:
        """The query parameter called ``name``."""
        for param in self.params:
            if param.name == name:
                return param
        raise KeyError(name)


def _key_param(name: str) -> Param:
    return Param(name=name, schema={"type": "string", **fields.key_text.schema}, required=True)


_PHASES: Final = [phase.value for phase in Phase]

_COUNT: Final = {"type": "integer", "minimum": 0}
# A tenant as GET /v1/tenants lists it; its usage is described field by field, for what
# it counts is not what a reader guesses (a sum of ceilings, not a measure of use).
_TENANT_ENTRY: Final = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "identities": {"type": "array", "items": {"type": "string"}},
        "quota": {"type": "object", "description": "Its quota by resource (null: no quota)."},
        "usage": {
            "type": "object",
            "description": "What it holds now, by the resources its quota bounds.",
            "properties": {
                "sessions": {**_COUNT, "description": "Live (not Stopped) sessions."},
                "children": {
                    **_COUNT,
                    "description": "Children, from their load's first record until Stopped.",
                },
                "memory_bytes": {
                    **_COUNT,
                    "description": "The children's summed memory ceilings; one without "
                    "counts as the runner's allocatable memory.",
                },
                "cpu_percent": {
                    **_COUNT,
                    "description": "The children's summed CPU ceilings (100 is one core), "
                    "not the CPU they use; one without a ceiling counts as every core "
                    "(unlimited_cpu_percent).",
                },
                "children_without_cpu_limit": {
                    **_COUNT,
                    "description": "How many of the children have no CPU ceiling.",
                },
            },
            "required": [
                "sessions",
                "children",
                "memory_bytes",
                "cpu_percent",
                "children_without_cpu_limit",
            ],
        },
        "limits": {"type": "object"},
        "fairness": {"type": "object"},
    },
    "required": ["name", "identities", "quota", "usage", "limits", "fairness"],
}

CALLS: Final[tuple[Call, ...]] = (
    # -- the session calls: one each per supervisor method --------------------------------
    Call(
        name="open",
        summary="Open the next generation of a key (O1-O11).",
        role="hosts",
        body=OpenBody,
        answer={"record": SessionRecord},
        errors=(*_TENANT, QuotaExceededError, RunnerDrainingError, *_RUNNER),
        fairness="rated",
        overrides={
            StaleSessionError: (
                409,
                "expected_generation is not the key's high-water: another open got in first",
            )
        },
        metered=True,
    ),
    Call(
        name="renew",
        summary="Renew a session's lease (R1-R6).",
        role="hosts",
        body=HandleBody,
        answer={"lease": float},
        errors=(ForbiddenError, *_HANDLE, *_RUNNER),
        fairness="exempt",
        metered=True,
        routed=True,
    ),
    Call(
        name="load",
        summary="Load code into a session (L1-L6).",
        role="hosts",
        body=LoadBody,
        answer={"code": CodeIdentity},
        errors=(
            *_TENANT,
            QuotaExceededError,
            RunnerFullError,
            RunnerDrainingError,
            *_HANDLE,
            PackageError,
            *_RUNNER,
        ),
        fairness="rated",
        metered=True,
        routed=True,
    ),
    Call(
        name="dispose",
        summary="Stop a session and say how its child ended (D1-D5).",
        role="hosts",
        body=HandleBody,
        answer={"termination": Termination},
        errors=(ForbiddenError, *_HANDLE, *_RUNNER),
        fairness="exempt",
        metered=True,
        routed=True,
    ),
    Call(
        name="status",
        summary="A session's last durable record (S1).",
        role="hosts",
        body=HandleBody,
        answer={"record": SessionRecord},
        errors=(*_TENANT, StaleSessionError, *_RUNNER),
        metered=True,
        routed=True,
    ),
    Call(
        name="high_water",
        summary="The highest generation ever opened for a key, or null (S2).",
        role="hosts",
        body=KeyBody,
        answer={"generation": int | None},
        errors=(*_TENANT, *_RUNNER),
        metered=True,
    ),
    # -- the operator calls -------------------------------------------------------------
    Call(
        name="sessions",
        summary="The fleet's sessions, the newest retained generation of each key (or every "
        "retained record), with their runners, tokens left out, in pages (operators; a "
        "tenant sees its own keys).",
        role="operators",
        answer={
            "sessions": {"type": "array", "items": {"$ref": "#/components/schemas/PublicRecord"}},
            "next": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "runner": {"type": "string", "description": "The id of the runner answering."},
        },
        params=(
            Param(
                name="phase",
                schema={"enum": _PHASES},
                description="Only the records in this phase (of those listed: without "
                "all_generations, a key whose newest generation is in another phase is not "
                "listed).",
            ),
            Param(
                name="identity",
                schema={"type": "string"},
                description="Only the keys of this identity.",
            ),
            Param(
                name="instance",
                schema={"type": "string"},
                description="Only the keys of this instance.",
            ),
            Param(
                name="all_generations",
                schema={"type": "boolean"},
                default=False,
                description="Every retained generation of each key (how many stopped ones "
                "are retained is the runner's retention), not only its newest.",
            ),
            Param(
                name="limit",
                schema={"type": "integer", "minimum": 1, "maximum": MAX_PAGE},
                default=PAGE,
                description="Records per page.",
            ),
            Param(
                name="after",
                schema={"type": "string"},
                description="The cursor the last page gave as its next.",
            ),
        ),
        errors=(*_TENANT, *_RUNNER),
        tenants_see_own=True,
    ),
    Call(
        name="logs",
        summary="A child's log, or its last lines or bytes (operators; a tenant, of its own keys).",
        role="operators",
        media="text/plain",
        params=(
            _key_param("identity"),
            _key_param("instance"),
            Param(name="generation", schema={"type": "integer", "minimum": 1}, required=True),
            Param(
                name="tail",
                schema={"type": "integer", "minimum": 1},
                description="Only the log's last TAIL lines (a last line without a newline "
                "counts). Not with tail_bytes; without either, the whole log.",
            ),
            Param(
                name="tail_bytes",
                schema={"type": "integer", "minimum": 1},
                description="Only the log's last TAIL_BYTES bytes (a character they cut reads "
                "as U+FFFD). Not with tail.",
            ),
        ),
        errors=(*_TENANT, StaleSessionError, *_RUNNER),
        tenants_see_own=True,
        routed=True,
    ),
    Call(
        name="events",
        summary="Each record the runner makes durable, as server-sent events (operators; a "
        "tenant sees its own keys).",
        role="operators",
        media="text/event-stream",
        errors=(ForbiddenError, *_RUNNER),
        tenants_see_own=True,
        fairness="exempt",
    ),
    Call(
        name="admin_dispose",
        summary="Dispose a session by key and generation, with no session token (operators).",
        role="operators",
        body=AdminDisposeBody,
        answer={"termination": Termination},
        errors=(StaleSessionError, ExecutionError, TerminationUnconfirmedError, *_RUNNER),
        routed=True,
    ),
    Call(
        name="admin_drain",
        summary="Drain the runner: no new sessions or children; it stops once its sessions "
        "ended, or at the deadline (operators).",
        role="operators",
        body=DrainBody,
        answer={
            "draining": {"const": True},
            "until": {"type": "number", "description": "the deadline, in Unix seconds"},
            "sessions": {"type": "integer", "description": "the sessions left"},
        },
        errors=_RUNNER,
    ),
    Call(
        name="runners",
        summary="The fleet's runners; this one alone when it has no fleet (operators).",
        role="operators",
        answer={"runners": tuple[RunnerInfo, ...]},
        errors=_RUNNER,
    ),
    Call(
        name="tenants",
        summary="Each tenant's identities, quota, ceilings and fairness, and what it uses "
        "(operators; a tenant sees itself).",
        role="operators",
        answer={
            "tenants": {"type": "array", "items": _TENANT_ENTRY},
            "unlimited_cpu_percent": {
                "type": "integer",
                "description": "What one child without a CPU ceiling counts as in "
                "usage.cpu_percent: every core of this runner's machine, 100 a core.",
            },
        },
        errors=(*_TENANT, *_RUNNER),
        tenants_see_own=True,
    ),
    Call(
        name="metrics",
        summary="The runner's metrics in Prometheus' text format (operators).",
        role="operators",
        media="text/plain",
        errors=_RUNNER,
    ),
    # -- no token needed ----------------------------------------------------------------
    Call(
        name="healthz",
        summary="The process answers.",
        role=None,
        answer={"status": {"const": "ok"}},
    ),
    Call(
        name="readyz",
        summary="The runner takes work.",
        role=None,
        answer={"status": {"const": "ready"}},
        errors=_RUNNER,
    ),
    Call(
        name="openapi",
        summary="This document.",
        role=None,
        answer={},
    ),
    Call(
        name="dashboard",
        summary="The dashboard: a page for operators. It asks for their token, or, opened "
        "as a sign-in link (/?code=CODE, POST /v1/dashboard/codes), trades the code once "
        "for a sign-in (POST /v1/dashboard/sign-in).",
        role=None,
        media="text/html",
    ),
    Call(
        name="dashboard_codes",
        summary="A one-time code for a dashboard sign-in link, URL/?code=CODE (operators).",
        role="operators",
        answer={
            "code": {"type": "string"},
            "path": {"type": "string", "description": "The link's path: /?code=CODE."},
            "expires_in": {
                "type": "number",
                "description": "Seconds the code may be used in, once.",
            },
        },
        errors=_RUNNER,
    ),
    Call(
        name="dashboard_sign_in",
        summary="Trade a sign-in link's code, once, for a sign-in token the runner takes as "
        "the operators' for a while (the dashboard does this).",
        role=None,
        body=SignInBody,
        answer={
            "token": {"type": "string", "description": "A bearer token, as the operators'."},
            "expires_in": {"type": "number", "description": "Seconds the sign-in lasts."},
        },
        overrides={
            RunnerAccessError: (401, "the code is wrong, was used already, or expired"),
        },
    ),
)


def by_name(name: str) -> Call:
    """The call called ``name``."""
    for call in CALLS:
        if call.name == name:
            return call
    raise KeyError(name)


# One call per route, and no other.
assert {call.name for call in CALLS} == set(ROUTES), {call.name for call in CALLS} ^ set(ROUTES)
