"""``GET /v1/runners``: the fleet's runners, each with its children and their memory
ceilings as the fleet's records have them (docs/service.md section C); this runner's own
capacity, and whether it drains, as it knows them.
"""

from __future__ import annotations

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...codec import converter
from ..admission import Capacity
from ..drain import Drain
from ..fleet import Fleet
from ..ledger import holds_child
from ..served import ServedSupervisor
from . import Endpoint

__all__ = ["FleetCalls"]


@attrs.frozen(kw_only=True)
class FleetCalls:
    """The runners' call, over the parts it uses.

    Attributes:
        supervisor: This runner's records (a fleet of one lists them as its own).
        fleet: The fleet's runners and records.
        capacity: This runner's capacity; None: bounded by quotas only.
        drain: Whether this runner drains.
    """

    supervisor: ServedSupervisor
    fleet: Fleet
    capacity: Capacity | None
    drain: Drain

    def handlers(self) -> dict[str, Endpoint]:
        """The handler, by its call's name."""
        return {"runners": self.runners}

    async def runners(self, request: Request) -> Response:
        fleet = self.fleet
        here = self.supervisor.records()
        found = await fleet.runners(here)
        # Each runner's children and their memory ceilings, from the fleet's records.
        taken: dict[str, tuple[int, int]] = {}
        for held in await fleet.records(here):
            if holds_child(held.record):
                children, memory = taken.get(held.runner_id, (0, 0))
                ceiling = held.record.limits.memory_bytes or 0
                taken[held.runner_id] = (children + 1, memory + ceiling)
        capacity = self.capacity
        answer = []
        for info in found:
            children, memory = taken.get(info.runner_id, (0, 0))
            ours = info.runner_id == fleet.runner_id
            own = capacity if ours else None
            info = attrs.evolve(
                info,
                children=children,
                memory_allocated=memory,
                max_children=None if own is None else own.max_children,
                allocatable=None if own is None else own.allocatable,
                draining=info.draining or (ours and self.drain.draining),
            )
            answer.append(converter.unstructure(info))
        return JSONResponse({"runners": answer})
