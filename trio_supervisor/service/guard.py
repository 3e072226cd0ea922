"""Every call served as its entry in the table of calls says (``calls.py``): its caller
checked, its errors answered, its answers counted.

:meth:`Guard.endpoint` wraps a concern's handler (``routes/``) for its call: a call
with a role needs a valid token (401), and an operators' call the operators' (403,
unless tenants may make it and see their own keys); any error is answered by
:func:`~trio_supervisor.service.problems.problem_of` with the call's statuses; a routed
call whose session this runner does not know is looked for in the fleet (421, or 503
for a lost runner: ``fleet.py``); a metered call's answer is counted, by outcome and
tenant. A tenant refused for its rate or its quota gets its answer late, so that its
flood costs the runner (and every other tenant) little.
"""

from __future__ import annotations

from typing import Final

import attrs
import trio
from starlette.requests import Request
from starlette.responses import Response

from .. import _defaults as defaults
from ..errors import (
    OperatorsOnlyError,
    QuotaExceededError,
    RunnerAccessError,
    StaleSessionError,
    ThrottledError,
)
from ..model import Handle
from .callers import OPERATORS, UNAUTHORIZED, Caller, Gate, tenant_label
from .calls import Call
from .fleet import Fleet
from .metrics import Metrics
from .problems import outcome, problem_of
from .routes import Endpoint
from .routes.request import named
from .served import ServedSupervisor
from .wire import Problem

__all__ = ["THROTTLED_HOLD", "Guard"]

THROTTLED_HOLD: Final = defaults.THROTTLED_HOLD


@attrs.frozen(kw_only=True)
class Guard:
    """What every call passes through, whatever its concern.

    Attributes:
        gate: Who calls (``callers.py``).
        supervisor: Whether it is poisoned: a plain ``SupervisorError`` is then its
            crash (a 503).
        fleet: Where a routed call's unknown session is looked for.
        metrics: Where metered calls are counted.
    """

    gate: Gate
    supervisor: ServedSupervisor
    fleet: Fleet
    metrics: Metrics

    def endpoint(self, call: Call, handler: Endpoint) -> Endpoint:
        """``handler`` as ``call`` is served: its caller checked (401, 403), its errors
        answered with its statuses, its answers counted when it is metered."""
        counted = self.metrics if call.metered else None

        async def endpoint(request: Request) -> Response:
            caller: Caller | None = None
            try:
                if call.role is not None:
                    caller = self.gate.caller(request)
                    if caller is None:
                        raise Problem(401, RunnerAccessError.code, UNAUTHORIZED)
                    if call.role == "operators" and not (
                        caller is OPERATORS or call.tenants_see_own
                    ):
                        raise OperatorsOnlyError("this call is for the runner's operators")
                    request.state.caller = caller
                answer = await handler(request)
            except Exception as error:
                if call.routed and isinstance(error, StaleSessionError):
                    error = await self._holder_of(request, error)
                poisoned = self.supervisor.poisoned is not None
                answer = problem_of(error, request, call, caller, poisoned=poisoned)
                if counted is not None:
                    counted.called(call.name, outcome(answer), tenant_label(caller))
                if isinstance(error, ThrottledError | QuotaExceededError):
                    # Answered late: a tenant that floods gets its refusals at the pace
                    # of its own calls' slots (a quota's at most one a second), and its
                    # connections idle meanwhile, so its flood costs the runner (and
                    # every other tenant) little.
                    await trio.sleep(min(error.retry_after or THROTTLED_HOLD, THROTTLED_HOLD))
                return answer
            if counted is not None:
                counted.called(call.name, "ok", tenant_label(caller))
            return answer

        return endpoint

    async def _holder_of(self, request: Request, stale: StaleSessionError) -> Exception:
        """A routed call's session is unknown here (``Call.routed``): the 421 naming the
        runner of the fleet that holds it (or the 503 if that runner is lost); ``stale``
        when no other runner holds it. The handler named the session."""
        session = named(request)
        try:
            if isinstance(session, Handle):
                await self.fleet.route(session.token)
            elif session is not None:
                await self.fleet.route_key(*session)
        except Exception as error:
            return error
        return stale
