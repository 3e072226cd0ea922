"""Every group of the benchmarks, by the name ``--only`` takes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from . import (
    availability,
    child,
    control,
    dbcost,
    durable,
    fleet,
    loop,
    memory,
    recovery,
    service,
    tenants,
)
from .measure import Result, Table

# Each group runs its scenarios (or counts, in tables); the order puts the cheap ones first.
GROUPS: dict[str, Callable[[bool, int], Sequence[Result | Table]]] = {
    "control": control.run,
    "memory": memory.run,
    "durable": durable.run,
    "fleet": fleet.run,  # durable.postgres and fleet.*: a PostgreSQL server
    "dbcost": dbcost.run,  # tables of what a session costs PostgreSQL: a server too
    "loop": loop.run,
    "recovery": recovery.run,
    "service": service.run,
    "tenants": tenants.run,  # service.cycle.tenants, service.flood: a real serve
    "child": child.run,
    # Real runners on PostgreSQL clusters of its own, restarted, stopped and failed over
    # (tests/support/clusters.py: the test packages); about four minutes.
    "availability": availability.run,
}
