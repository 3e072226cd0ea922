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
    hundred,
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
    # A hundred runners of 10,000 sessions on a cluster of its own, with pgbench's TPC-B
    # beside them: about ten minutes, a million rows; run only when asked (ON_REQUEST).
    "hundred": hundred.run,
    "loop": loop.run,
    "recovery": recovery.run,
    "service": service.run,
    "tenants": tenants.run,  # service.cycle.tenants, service.flood: a real serve
    "child": child.run,
    # Real runners on PostgreSQL clusters of its own, restarted, stopped and failed over
    # (tests/support/clusters.py: the test packages); about four minutes.
    "availability": availability.run,
}

# The groups a run without ``--only`` leaves out (so does ``--quick``'s smoke test,
# tests/project/test_benchmarks.py): ``--only hundred``, or ``nox -s bench-hundred``.
ON_REQUEST: frozenset[str] = frozenset({"hundred"})
