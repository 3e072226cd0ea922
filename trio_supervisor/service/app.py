"""The runner service's HTTP app: the supervisor's calls as JSON over HTTP.

Theory of operation
-------------------
The app is a route per call of the table of calls (``calls.py``; Starlette, on AnyIO's
Trio backend, in the supervisor's own Trio run), its path and method from the route
table (``_routes.py``), as the OpenAPI document's are. :func:`create_app` only
assembles: it makes the parts (the gate of ``callers.py``, the admission, the drain, the
fleet, the metrics), hands each concern of ``routes/`` the parts it uses and no others,
and serves each concern's handler under its call, wrapped by the guard (``guard.py``):
the caller checked (401, 403), the errors answered in one place (``problems.py``), the
answer counted. The wire is a translation of the Python API, never a second
implementation of a rule: every rule of docs/design.md keeps its meaning here.

Who may call what (docs/service.md sections A and D): ``callers.py``; then fairness
(429) and the quotas and capacity (429, 503) of ``admission.py``, then the engine. The
operator calls (admin dispose, runners, metrics) answer 403 to a tenant's token.
``/healthz``, ``/readyz`` and ``/openapi.json`` need no token. In a fleet (docs/service.md
section C), a call on a session another runner holds is answered ``421`` naming that
runner (``fleet.py``), and the operators' listings are the fleet's.
"""

from __future__ import annotations

import socket

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import ProblemCode
from .admission import Admission
from .callers import Gate
from .calls import CALLS
from .drain import Drain
from .fleet import Fleet
from .guard import Guard
from .metrics import Metrics
from .problems import problem
from .routes import Concern, Endpoint
from .routes.dashboard import Dashboard, dashboard_page
from .routes.fleet import FleetCalls
from .routes.health import HealthCalls
from .routes.operators import Logs, OperatorCalls
from .routes.sessions import SessionCalls
from .routes.tenants import TenantCalls, tally
from .served import ServedSupervisor
from .sign_in import SignIns
from .tenants import Tenants, token_hash
from .tenants_file import Roster

__all__ = ["create_app"]


def create_app(
    supervisor: ServedSupervisor,
    *,
    operator_token: str,
    hosts_token: str | None = None,
    tenants: Roster | None = None,
    admission: Admission | None = None,
    logs: Logs | None = None,
    metrics: Metrics | None = None,
    fleet: Fleet | None = None,
    drain: Drain | None = None,
    sign_ins: SignIns | None = None,
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
        sign_ins: The dashboard's sign-in codes and the sign-ins they made, taken as
            the operators' (``sign_in.py``; the runner's outlive its incarnations);
            None: a set of the app's own.

    Returns:
        The Starlette app, to serve with any ASGI server under Trio (the runner uses
        hypercorn).

    Raises:
        ValueError: ``operator_token`` is empty, or not exactly one of ``hosts_token``
            and ``tenants`` is given.
    """
    if not operator_token:
        raise ValueError("the operators' token must be set")
    if (hosts_token is None) == (tenants is None):
        raise ValueError("give the hosts' token or the tenants, not both and not neither")
    roster = Roster(Tenants.single(hosts_token)) if hosts_token is not None else tenants
    assert roster is not None
    roster.reserve(token_hash(operator_token))  # no tenant's token may be the operators'
    # Every call of the table is served: /metrics too, with the calls' counts at least.
    metrics = metrics if metrics is not None else Metrics()
    fleet = fleet if fleet is not None else Fleet(socket.gethostname())
    admission = admission if admission is not None else Admission(supervisor)
    drain = drain if drain is not None else Drain(supervisor, fleet.store)
    metrics.watch_tenants(tally(roster, admission))

    sign_ins = sign_ins if sign_ins is not None else SignIns()
    gate = Gate(
        roster=roster,
        admission=admission,
        operators_secret=operator_token.encode(),
        sign_ins=sign_ins,
    )
    operators = OperatorCalls(supervisor=supervisor, gate=gate, fleet=fleet, drain=drain, logs=logs)
    concerns: tuple[Concern, ...] = (
        SessionCalls(supervisor=supervisor, gate=gate, admission=admission, drain=drain),
        operators,
        TenantCalls(
            supervisor=supervisor, gate=gate, roster=roster, admission=admission, fleet=fleet
        ),
        FleetCalls(supervisor=supervisor, fleet=fleet, capacity=admission.capacity, drain=drain),
        HealthCalls(supervisor=supervisor, drain=drain, metrics=metrics),
        Dashboard(page=dashboard_page(), sign_ins=sign_ins),
    )
    handlers: dict[str, Endpoint] = {}
    for concern in concerns:
        handlers.update(concern.handlers())
    # One handler per call of the table, and no other: each is served as its call says.
    assert set(handlers) == {call.name for call in CALLS}, set(handlers) ^ {c.name for c in CALLS}
    guard = Guard(gate=gate, supervisor=supervisor, fleet=fleet, metrics=metrics)
    routes = [
        Route(
            call.path,
            guard.endpoint(call, handlers[call.name]),
            methods=[call.method],
            name=call.name,
        )
        for call in CALLS
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _not_found})
    # A server that stops ends the event streams first: they would never end by themselves.
    app.state.end_event_streams = operators.end_streams
    return app


async def _not_found(request: Request, error: Exception) -> Response:
    """No route for the path (404), or not for its method (405), as a problem."""
    assert isinstance(error, HTTPException)
    return problem(
        error.status_code,
        ProblemCode.NOT_FOUND if error.status_code == 404 else ProblemCode.METHOD_NOT_ALLOWED,
        error.detail,
    )
