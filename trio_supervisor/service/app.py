"""The runner service's HTTP app: the supervisor's calls as JSON over HTTP.

Theory of operation
-------------------
The app is a route per call of the table of calls (``calls.py``; Starlette, on AnyIO's
Trio backend, in the supervisor's own Trio run): a handler here is served under its
call's path and method, guarded by its call's role, and its errors get its call's
statuses; the OpenAPI document is made from the same table. Each session route reads
its body into a request class (``wire.py``), calls the one supervisor method it
mirrors, and writes the answer with the same converter; errors are mapped to
problem+json in one place, :func:`_problem_of`. The wire is a translation of the
Python API, never a second implementation of a rule: every rule of docs/design.md
keeps its meaning here.

Who may call what (docs/service.md sections A and D): every ``/v1`` request carries
``Authorization: Bearer <token>``. A tenant's token (``tenants.py``; without a tenants
file, the hosts' token is tenant ``default``) allows the session calls (open ...
high-water) on keys whose identity matches the tenant's patterns, where the session's own
token in the handle remains the capability for that session, and the listings (sessions,
events, logs) of those keys alone. A key outside the patterns is a 403 before any
lookup, the same whether it exists or not. Then fairness (429) and the quotas and
capacity (429, 503) of ``admission.py``, then the engine. The operators' token allows
everything, including the operator calls (admin dispose, runners, metrics), which answer
403 to a tenant's token. The operators' token is compared in constant time; a tenant's is
found by its SHA-256. ``/healthz``, ``/readyz`` and ``/openapi.json`` need no token.

In a fleet (docs/service.md section C), a call on a session another runner holds is
answered ``421`` naming that runner (``fleet.py``), and the operators' listings are the
fleet's.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar, runtime_checkable

import attrs
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .._core.supervisor import Supervisor
from ..codec import converter
from ..errors import (
    ForbiddenError,
    OperatorsOnlyError,
    ProblemCode,
    QuotaExceededError,
    RunnerAccessError,
    RunnerClosingError,
    RunnerDrainingError,
    RunnerLostError,
    RunnerRestartingError,
    StaleSessionError,
    StateStorageError,
    SupervisorError,
    ThrottledError,
)
from ..model import FleetRecord, Handle, Key, Phase, SessionRecord, log_fields
from .admission import Admission, holds_child, retry_after_header
from .calls import CALLS, Call, by_name
from .drain import Drain
from .fleet import Fleet
from .metrics import Metrics
from .openapi import document
from .operators import operator_handlers
from .tenants import Tenant, Tenants, token_hash
from .tenants_file import Roster
from .wire import (
    MAX_BODY,
    AdminDisposeBody,
    DrainBody,
    HandleBody,
    KeyBody,
    LoadBody,
    OpenBody,
    Problem,
    problem_body,
    public_record,
    read_body,
)

__all__ = ["MAX_BODY", "Logs", "create_app"]

logger = logging.getLogger(__name__)

DRAIN: Final = 8 << 20  # bytes of an oversized body read (and dropped) before the 413
RETRY_AFTER: Final = "5"  # seconds a client should wait before retrying a closing runner
THROTTLED_HOLD: Final = 1.0  # seconds a refused tenant's call waits for its 429, at most

_OPERATORS: Final = "operators"
Endpoint = Callable[[Request], Awaitable[Response]]


class Operators:
    """The caller holding the operators' token: every right, no quota, no fairness."""

    name: Final = _OPERATORS

    @staticmethod
    def may_use(identity: str) -> bool:
        return True


OPERATORS: Final = Operators()
Caller = Tenant | Operators


def bearer_caller(request: Request, operators_secret: bytes, roster: Roster) -> Caller | None:
    """Who the request's bearer token says called: the operators (compared in constant
    time), a tenant (found by its SHA-256), or None for no valid token."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return None
    token = given.strip()
    if hmac.compare_digest(token.encode(), operators_secret):
        return OPERATORS
    return roster.tenants.find(token)


@runtime_checkable
class Logs(Protocol):
    """An execution that keeps its children's output (``SubprocessExecution`` does)."""

    def logs(self, handle: Handle, *, tail: int | None = None) -> str: ...


def create_app(
    supervisor: Supervisor,
    *,
    operator_token: str,
    hosts_token: str | None = None,
    tenants: Roster | None = None,
    admission: Admission | None = None,
    logs: Logs | None = None,
    metrics: Metrics | None = None,
    fleet: Fleet | None = None,
    drain: Drain | None = None,
    operator_token_file: Path | None = None,
) -> Starlette:
    """The ASGI app serving ``supervisor``.

    Args:
        supervisor: The running supervisor the calls go to.
        operator_token: The bearer token of the operators (every call).
        hosts_token: The hosts' single token: tenant ``default``, every identity, no
            quota. Exactly one of it and ``tenants`` is given.
        tenants: The tenants in force (read again on SIGHUP by the runner).
        admission: Ceilings, quotas, capacity and fairness (``admission.py``); None:
            an admission of the app's own, with no ceilings and no capacity.
        logs: Where ``GET /v1/logs`` reads a child's output; None: no logs are kept.
        metrics: Where calls are counted, and what ``GET /metrics`` renders; None: a
            registry of the app's own, which counts the calls only (the runner passes
            one that it also feeds from the supervisor; see ``metrics.py``).
        fleet: The runner's fleet: where session calls it does not hold are routed,
            and what ``/v1/runners`` and ``/v1/sessions`` list. None: a fleet of one,
            named after the host (``fleet.py``).
        drain: The runner's drain (``drain.py``), begun by ``POST /v1/admin/drain``;
            None: one of the app's own, which nothing waits on.
        operator_token_file: Where the operators' token is kept, which the dashboard's
            sign-in names; None: the token was given otherwise.
    """
    if not operator_token:
        raise ValueError("the operators' token must be set")
    if (hosts_token is None) == (tenants is None):
        raise ValueError("give the hosts' token or the tenants, not both and not neither")
    if hosts_token is not None:
        tenants = Roster(Tenants.single(hosts_token))
    assert tenants is not None
    roster = tenants
    roster.reserve(token_hash(operator_token))  # no tenant's token may be the operators'
    # Every call of the table is served: /metrics too, with the calls' counts at least.
    metrics = metrics if metrics is not None else Metrics()
    fleet = fleet if fleet is not None else Fleet(socket.gethostname())
    admission = admission if admission is not None else Admission(supervisor)
    drain = drain if drain is not None else Drain(supervisor, fleet.store)
    metrics.watch_tenants(
        lambda: [
            (
                tenant.name,
                attrs.asdict(tenant.quota),
                attrs.asdict(admission.usage(tenant)),
            )
            for tenant in roster.tenants
        ]
    )
    operators_secret = operator_token.encode()

    def caller_of(request: Request) -> Caller | None:
        return bearer_caller(request, operators_secret, roster)

    def guarded(call: Call, handler: Endpoint) -> Endpoint:
        """``handler`` as ``call`` is served: its caller checked (401, 403), its errors
        answered with its statuses, its answers counted when it is metered."""
        counted = metrics if call.metered else None

        async def endpoint(request: Request) -> Response:
            caller: Caller | None = None
            try:
                if call.role is not None:
                    caller = caller_of(request)
                    if caller is None:
                        raise Problem(401, RunnerAccessError.code, UNAUTHORIZED)
                    if call.role == _OPERATORS and not (
                        caller is OPERATORS or call.tenants_see_own
                    ):
                        raise OperatorsOnlyError("this call is for the runner's operators")
                    request.state.caller = caller
                answer = await handler(request)
            except Exception as error:
                if call.routed and isinstance(error, StaleSessionError):
                    error = await holder_of(request, error)
                answer = _problem_of(error, request, supervisor, call, caller)
                if counted is not None:
                    counted.called(call.name, _outcome(answer), _tenant_label(caller))
                if isinstance(error, ThrottledError | QuotaExceededError):
                    # Answered late: a tenant that floods gets its refusals at the pace
                    # of its own calls' slots (a quota's at most one a second), and its
                    # connections idle meanwhile, so its flood costs the runner (and
                    # every other tenant) little.
                    await trio.sleep(min(error.retry_after or THROTTLED_HOLD, THROTTLED_HOLD))
                return answer
            if counted is not None:
                counted.called(call.name, "ok", _tenant_label(caller))
            return answer

        return endpoint

    @contextlib.contextmanager
    def admitted(request: Request, call: Call, key: Key | None) -> Iterator[Tenant | None]:
        """A call on ``key`` (None: on no key) by the request's caller: a key outside a
        tenant's identities is refused (403) before anything is looked up, then the
        tenant's fairness admits the call (429) for as long as the block runs. Yields
        the tenant, or None for the operators."""
        caller: Caller = request.state.caller
        if caller is OPERATORS:
            yield None
            return
        assert isinstance(caller, Tenant)
        if key is not None and not caller.may_use(key.identity):
            raise ForbiddenError(f"tenant {caller.name!r} may not use identity {key.identity!r}")
        with admission.calling(
            caller, bounded=call.fairness != "exempt", rated=call.fairness == "rated"
        ):
            yield caller

    def sees(request: Request) -> Callable[[str], bool]:
        """Whether the request's caller may see a key of an identity: the operators every
        one, a tenant its own, as long as it stays in force (a revoked tenant sees none)."""
        caller: Caller = request.state.caller
        if caller is OPERATORS:
            return Operators.may_use
        assert isinstance(caller, Tenant)
        tenant = caller

        def visible(identity: str) -> bool:
            return roster.tenants.by_name.get(tenant.name) == tenant and tenant.may_use(identity)

        return visible

    async def holder_of(request: Request, stale: StaleSessionError) -> Exception:
        """A routed call's session is unknown here (``Call.routed``): the 421 naming the
        runner of the fleet that holds it (or the 503 if that runner is lost); ``stale``
        when no other runner holds it. The handler named the session (:func:`names`)."""
        named: Handle | tuple[Key, int] | None = getattr(request.state, "session", None)
        try:
            if isinstance(named, Handle):
                await fleet.route(named.token)
            elif named is not None:
                await fleet.route_key(*named)
        except Exception as error:
            return error
        return stale

    # -- the session calls: one each per supervisor method -------------------------------

    open_call, load_call, renew_call = by_name("open"), by_name("load"), by_name("renew")
    dispose_call, status_call, high_call = (
        by_name("dispose"),
        by_name("status"),
        by_name("high_water"),
    )

    async def open_(request: Request) -> Response:
        body = read_body(await _body(request), OpenBody)
        with admitted(request, open_call, body.key) as tenant:
            # An open repeated (O3) creates nothing: a drain lets it through (looked up
            # only while draining: the common open pays nothing for it).
            repeated = (
                drain.draining
                and supervisor.retained_request(body.key, body.request_id) is not None
            )
            limits = admission.limits(tenant, body.limits)
            with (
                contextlib.nullcontext() if repeated else drain.admitted("sessions"),
                admission.opening(tenant, body.key, body.request_id),
            ):
                record = await supervisor.open(
                    body.key,
                    body.request_id,
                    expected_generation=body.expected_generation,
                    lease=body.lease,
                    limits=limits,
                    quota=admission.claim(tenant),  # a fleet's store counts the fleet's
                )
        return JSONResponse({"record": _record(record)})

    async def renew(request: Request) -> Response:
        body = read_body(await _body(request), HandleBody)
        with admitted(request, renew_call, body.handle.key):
            lease = await supervisor.renew(names(request, body.handle))
        return JSONResponse({"lease": lease})

    async def load(request: Request) -> Response:
        body = read_body(await _body(request), LoadBody)
        handle = body.handle
        with admitted(request, load_call, handle.key) as tenant, drain.admitted("children"):
            record = supervisor.find(handle.key, handle.generation)
            if record is not None and record.handle.token != handle.token:
                record = None  # not this caller's session: the supervisor says so
            with admission.loading(tenant, record):
                claim = admission.claim(tenant)
                code = await supervisor.load(names(request, handle), body.load, quota=claim)
        return JSONResponse({"code": converter.unstructure(code)})

    async def dispose(request: Request) -> Response:
        body = read_body(await _body(request), HandleBody)
        with admitted(request, dispose_call, body.handle.key):
            termination = await supervisor.dispose(names(request, body.handle))
        return JSONResponse({"termination": converter.unstructure(termination)})

    async def status(request: Request) -> Response:
        body = read_body(await _body(request), HandleBody)
        with admitted(request, status_call, body.handle.key):
            record = await supervisor.status(names(request, body.handle))
        return JSONResponse({"record": _record(record)})

    async def high_water(request: Request) -> Response:
        body = read_body(await _body(request), KeyBody)
        with admitted(request, high_call, body.key):
            generation = await supervisor.high_water(body.key)
        return JSONResponse({"generation": generation})

    # -- the operator calls -----------------------------------------------------------------

    def _listed(held: FleetRecord) -> dict[str, Any]:
        """A record as operators see it, with its runner, and its age and lease left
        while it runs: this runner's own, or as the fleet's store has them."""
        record = held.record
        times = supervisor.times(record.handle)
        age, lease_left = times if times is not None else (held.age, held.lease_left)
        return {
            **public_record(record),
            "runner": held.runner_id,
            "age": age,
            "lease_left": lease_left,
        }

    sessions_call, logs_call = by_name("sessions"), by_name("logs")

    async def sessions(request: Request) -> Response:
        query = request.query_params
        phase = _phase(sessions_call.param("phase").read(query))
        identity = sessions_call.param("identity").read(query)
        limit = sessions_call.param("limit").read(query)
        after = _cursor(sessions_call.param("after").read(query))
        visible = sees(request)
        with admitted(request, sessions_call, None):
            held = await fleet.records(supervisor.records())
        chosen = sorted(
            (
                one
                for one in held
                if (phase is None or one.record.phase is phase)
                and (identity is None or one.record.handle.key.identity == identity)
                and visible(one.record.handle.key.identity)
            ),
            key=_order,
        )
        if after is not None:
            chosen = [one for one in chosen if _order(one) > after]
        page = chosen[:limit]
        more = len(chosen) > limit
        return JSONResponse(
            {
                "sessions": [_listed(one) for one in page],
                "next": _encode_cursor(_order(page[-1])) if more else None,
                "runner": fleet.runner_id,  # who answers: the sessions it does not hold
            }
        )

    async def runners(request: Request) -> Response:
        here = supervisor.records()
        found = await fleet.runners(here)
        # Each runner's children and their memory ceilings, from the fleet's records.
        taken: dict[str, tuple[int, int]] = {}
        for held in await fleet.records(here):
            if holds_child(held.record):
                children, memory = taken.get(held.runner_id, (0, 0))
                ceiling = held.record.limits.memory_bytes or 0
                taken[held.runner_id] = (children + 1, memory + ceiling)
        capacity = admission.capacity
        answer = []
        for info in found:
            children, memory = taken.get(info.runner_id, (0, 0))
            own = capacity if info.runner_id == fleet.runner_id else None
            ours = info.runner_id == fleet.runner_id
            info = attrs.evolve(
                info,
                children=children,
                memory_allocated=memory,
                max_children=None if own is None else own.max_children,
                allocatable=None if own is None else own.allocatable,
                draining=info.draining or (ours and drain.draining),
            )
            answer.append(converter.unstructure(info))
        return JSONResponse({"runners": answer})

    tenants_call = by_name("tenants")

    async def tenants_(request: Request) -> Response:
        caller: Caller = request.state.caller
        with admitted(request, tenants_call, None):
            shown = list(roster.tenants) if not isinstance(caller, Tenant) else [caller]
            if fleet.store is None:
                used = {tenant.name: admission.usage(tenant) for tenant in shown}
            else:  # the fleet's unstopped records, wherever they run
                held = [one.record for one in await fleet.records(supervisor.records())]
                used = {tenant.name: admission.tally(held, tenant) for tenant in shown}
        return JSONResponse(
            {
                "tenants": [
                    {
                        "name": tenant.name,
                        "identities": list(tenant.identities),
                        "quota": converter.unstructure(tenant.quota),
                        "usage": converter.unstructure(used[tenant.name]),
                        "limits": converter.unstructure(tenant.limits),
                        "fairness": converter.unstructure(tenant.fairness),
                    }
                    for tenant in shown
                ]
            }
        )

    async def session_logs(request: Request) -> Response:
        query = request.query_params
        key = _key(logs_call.param("identity").read(query), logs_call.param("instance").read(query))
        generation = logs_call.param("generation").read(query)
        tail = logs_call.param("tail").read(query) or None
        with admitted(request, logs_call, key):
            record = supervisor.find(*names(request, (key, generation)))
            if record is None:
                raise StaleSessionError(
                    f"{key.identity}/{key.instance} has no retained generation {generation}"
                )
            if logs is None:
                return PlainTextResponse("")
            return PlainTextResponse(logs.logs(record.handle, tail=tail))

    async def admin_dispose(request: Request) -> Response:
        body = read_body(await _body(request), AdminDisposeBody)
        record = supervisor.find(*names(request, (body.key, body.generation)))
        if record is None:
            raise StaleSessionError(
                f"{body.key.identity}/{body.key.instance} has no retained generation "
                f"{body.generation}"
            )
        logger.info(
            "an operator disposes %s/%s generation %d",
            body.key.identity,
            body.key.instance,
            body.generation,
            extra=log_fields(body.key, body.generation),
        )
        termination = await supervisor.dispose(record.handle)
        return JSONResponse({"termination": converter.unstructure(termination)})

    async def admin_drain(request: Request) -> Response:
        body = read_body(await _body(request), DrainBody)
        logger.info("an operator drains the runner (deadline %g s)", body.deadline)
        until = await drain.begin(body.deadline)
        left = len(supervisor.live_records())
        return JSONResponse({"draining": True, "until": until, "sessions": left})

    # -- no token needed ----------------------------------------------------------------------

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        # Answered here, not raised: a poisoning error of any class is a 503 to readyz.
        if supervisor.poisoned is not None:
            return _problem(503, supervisor.poisoned.code, f"poisoned: {supervisor.poisoned}")
        if supervisor.closing:
            return _problem(503, RunnerClosingError.code, "the runner is shutting down")
        if drain.draining:
            return _problem(
                503, RunnerDrainingError.code, "the runner drains: it takes no new sessions"
            )
        return JSONResponse({"status": "ready"})

    openapi = document()

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(openapi)

    async def not_found(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        return _problem(
            error.status_code,
            ProblemCode.NOT_FOUND if error.status_code == 404 else ProblemCode.METHOD_NOT_ALLOWED,
            error.detail,
        )

    extra, end_streams = operator_handlers(
        supervisor, metrics, fleet.runner_id, sees, token_file=operator_token_file
    )
    handlers: dict[str, Endpoint] = {
        "open": open_,
        "renew": renew,
        "load": load,
        "dispose": dispose,
        "status": status,
        "high_water": high_water,
        "sessions": sessions,
        "runners": runners,
        "tenants": tenants_,
        "logs": session_logs,
        "admin_dispose": admin_dispose,
        "admin_drain": admin_drain,
        "healthz": healthz,
        "readyz": readyz,
        "openapi": openapi_json,
        **extra,
    }
    # One handler per call of the table, and no other: each is served as its call says.
    assert set(handlers) == {call.name for call in CALLS}, set(handlers) ^ {c.name for c in CALLS}
    routes = [
        Route(call.path, guarded(call, handlers[call.name]), methods=[call.method])
        for call in CALLS
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found})
    # A server that stops ends the event streams first: they would never end by themselves.
    app.state.end_event_streams = end_streams
    return app


def _outcome(answer: Response) -> str:
    """The error code of a problem answer, for the calls' metric."""
    try:
        return str(json.loads(bytes(answer.body))["code"])
    except (ValueError, KeyError, TypeError):
        return str(answer.status_code)


def _record(record: SessionRecord) -> Any:
    return converter.unstructure(record, SessionRecord)


_Named = TypeVar("_Named", Handle, tuple[Key, int])


def names(request: Request, session: _Named) -> _Named:
    """Say which session a routed call names (by handle, or by key and generation), so
    that one this runner does not know is looked for in the fleet; returns it."""
    request.state.session = session
    return session


async def _body(request: Request) -> bytes:
    """The request's body, refused past :data:`MAX_BODY` bytes.

    What is over the cap is read and dropped (up to :data:`DRAIN` bytes) before the 413,
    so that a client still sending its body reads the answer instead of a reset
    connection; past that, the connection is simply dropped.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise Problem(400, ProblemCode.MALFORMED, "Content-Length is not a number") from None
        if size > DRAIN:
            raise Problem(413, ProblemCode.TOO_LARGE, f"the body is over {MAX_BODY} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAIN:
                break
            if size <= MAX_BODY:
                chunks.append(chunk)
    except ClientDisconnect:
        # The client went away mid-body (it gave up, or retries on a new connection):
        # nothing was done, and the answer reaches no one. Not the runner's failure.
        raise Problem(
            400, ProblemCode.MALFORMED, "the client went away before its body was whole"
        ) from None
    if size > MAX_BODY:
        raise Problem(413, ProblemCode.TOO_LARGE, f"the body is over {MAX_BODY} bytes")
    return b"".join(chunks)


UNAUTHORIZED: Final = (
    "a valid bearer token is required (Authorization: Bearer TOKEN): a host's is its "
    "tenant's, or the runner's --token-file (STATE/token by default); an operator's is "
    "the runner's --operator-token-file (STATE/operator-token)"
)


def _problem(
    status: int, code: str, detail: str, fields: Mapping[str, Any] | None = None, **headers: str
) -> Response:
    return JSONResponse(
        {**problem_body(status, code, detail), **(fields or {})},
        status_code=status,
        media_type="application/problem+json",
        headers=headers or None,
    )


def _tenant_label(caller: Caller | None) -> str:
    """Who called, as the metrics and the log name it ("" before a token was accepted)."""
    return "" if caller is None else caller.name


def _problem_of(
    error: Exception, request: Request, supervisor: Supervisor, call: Call, caller: Caller | None
) -> Response:
    """The one place an error becomes an HTTP answer (with ``call``'s statuses); each
    refusal of a caller (401, 403, 429, RunnerFull) is logged, naming its tenant."""
    if isinstance(error, Problem):
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
        if error.status in (401, 403):
            _log_refusal(request, caller, error.status, error.detail)
        return _problem(error.status, error.code, error.detail, error.fields, **headers)
    restarting: str | None = getattr(request.app.state, "restarting", None)
    if restarting is not None and isinstance(error, RunnerClosingError | StateStorageError):
        # The runner makes a new incarnation (service/healing.py): this call, under way
        # as the old one was poisoned, may be made again of the next (B5).
        error = RunnerRestartingError(restarting)
    if isinstance(error, SupervisorError):
        status = call.status(error, poisoned=supervisor.poisoned is not None)
        headers = {"Retry-After": RETRY_AFTER} if isinstance(error, RunnerClosingError) else {}
        body = problem_body(status, error.code, error.detail)
        retry_after = getattr(error, "retry_after", None)
        if retry_after is not None:
            headers = {"Retry-After": retry_after_header(retry_after)}
        if isinstance(error, OperatorsOnlyError):
            body["operators_only"] = True  # the client tells it from a key refused
        if isinstance(error, QuotaExceededError):
            body.update(
                quota=error.quota, requested=error.requested, used=error.used, hard=error.hard
            )
        if isinstance(error, RunnerLostError):
            body.update(
                owner=error.owner,
                location=error.location,
                lease_until=error.lease_until,
                takeover_at=error.takeover_at,
            )
        if status in (401, 403, 429) or error.code == "RunnerFull":
            _log_refusal(request, caller, status, error.detail)
        notes = getattr(error, "__notes__", None)
        if notes:
            body["notes"] = [str(note) for note in notes]  # L5: "the supervisor is poisoned"
        return JSONResponse(
            body, status_code=status, media_type="application/problem+json", headers=headers
        )
    if isinstance(error, ValueError | TypeError):
        # The supervisor refused an argument; the message names it.
        return _problem(422, ProblemCode.INVALID, str(error))
    logger.exception("%s %s failed", request.method, request.url.path)
    return _problem(500, ProblemCode.INTERNAL, f"the runner failed: {type(error).__name__}")


def _log_refusal(request: Request, caller: Caller | None, status: int, detail: str) -> None:
    logger.warning(
        "refused %s %s (%d) for %s: %s",
        request.method,
        request.url.path,
        status,
        f"tenant {caller.name!r}"
        if isinstance(caller, Tenant)
        else caller.name
        if caller
        else "no valid token",
        detail,
        extra={"tenant": _tenant_label(caller), "status": status},
    )


# -- query parameters ---------------------------------------------------------------------


def _key(identity: str, instance: str) -> Key:
    try:
        return Key(identity=identity, instance=instance)
    except (ValueError, TypeError) as error:
        raise Problem(422, ProblemCode.INVALID, f"{error} (query parameters)") from None


def _phase(value: str | None) -> Phase | None:
    # Its call's parameter has checked that it names a phase.
    return None if value is None else Phase(value)


_Order = tuple[str, str, int]


def _order(held: FleetRecord) -> _Order:
    handle = held.record.handle
    return (handle.key.identity, handle.key.instance, handle.generation)


def _encode_cursor(order: _Order) -> str:
    return base64.urlsafe_b64encode(json.dumps(order).encode()).decode()


def _cursor(value: str | None) -> _Order | None:
    if not value:
        return None
    try:
        identity, instance, generation = json.loads(base64.urlsafe_b64decode(value.encode()))
        if not (
            isinstance(identity, str) and isinstance(instance, str) and isinstance(generation, int)
        ):
            raise ValueError(value)
    except (ValueError, TypeError, binascii.Error):
        raise Problem(
            422,
            ProblemCode.INVALID,
            "the query parameter 'after' is not a cursor this runner gave",
        ) from None
    return (identity, instance, generation)
