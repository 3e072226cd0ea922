"""``GET /v1/tenants``: the tenants, and what each uses (docs/service.md section D).

The operators see every tenant; a tenant sees itself. Usage is this runner's (calls under
way included), or in a fleet the fleet's unstopped records, wherever they run. The same
usage feeds the tenant gauges of ``/metrics`` (:func:`tally`). Its ``cpu_percent`` is a
sum of CPU ceilings, not of CPU used: a child without one counts as every core of the
runner's machine (``unlimited_cpu_percent``, said with the answer), and
``children_without_cpu_limit`` says how many did.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...codec import converter
from ..admission import Admission
from ..callers import Caller, Gate
from ..calls import by_name
from ..fleet import Fleet
from ..metrics import Tally
from ..served import ServedSupervisor
from ..tenants import Tenant
from ..tenants_file import Roster
from . import Endpoint

__all__ = ["TenantCalls", "tally"]

_TENANTS: Final = by_name("tenants")


@attrs.frozen(kw_only=True)
class TenantCalls:
    """The tenants' call, over the parts it uses.

    Attributes:
        supervisor: This runner's records, which a fleet's listing includes.
        gate: The caller's fairness.
        roster: The tenants in force.
        admission: What each tenant uses here.
        fleet: The fleet's records, when this runner is one of a fleet.
    """

    supervisor: ServedSupervisor
    gate: Gate
    roster: Roster
    admission: Admission
    fleet: Fleet

    def handlers(self) -> dict[str, Endpoint]:
        """The handler, by its call's name."""
        return {"tenants": self.tenants}

    async def tenants(self, request: Request) -> Response:
        caller: Caller = request.state.caller
        admission = self.admission
        with self.gate.admitted(request, _TENANTS, None):
            shown = list(self.roster.tenants) if not isinstance(caller, Tenant) else [caller]
            if self.fleet.store is None:
                used = {tenant.name: admission.usage(tenant) for tenant in shown}
            else:  # the fleet's unstopped records, wherever they run
                records = await self.fleet.records(self.supervisor.records())
                held = [one.record for one in records]
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
                ],
                "unlimited_cpu_percent": admission.unlimited_cpu_percent,
            }
        )


def tally(roster: Roster, admission: Admission) -> Tally:
    """Each tenant's quota and usage on this runner, read at every scrape of
    ``/metrics`` (:meth:`~trio_supervisor.service.metrics.Metrics.watch_tenants`)."""

    def tenants() -> Iterator[tuple[str, Mapping[str, int | None], Mapping[str, int]]]:
        for tenant in roster.tenants:
            quota = attrs.asdict(tenant.quota)
            used = attrs.asdict(admission.usage(tenant))
            # The resources a quota bounds: children_without_cpu_limit explains one.
            yield (tenant.name, quota, {name: used[name] for name in quota})

    return tenants
