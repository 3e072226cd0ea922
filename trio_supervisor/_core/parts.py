"""The parts of the engine a supervisor and its lifetime share (``Parts``), made once
by ``open_supervisor`` (``lifetime.py``) and handed to the :class:`Supervisor`
(``supervisor.py``), so that neither module needs the other to know them."""

from __future__ import annotations

import attrs

from ..abc import Execution, FleetStore, Retaining, Store, switch_slack
from ..retention import Retention
from .fleet import Alone, Fleet, Member
from .health import Health
from .leases import Leases
from .records import Records
from .running import Running

__all__ = ["Parts"]


@attrs.frozen
class Parts:
    """What the supervisor and its lifetime share; made once, by :func:`open_supervisor`.

    Attributes:
        execution: Spawns and recovers children.
        retaining: The execution, where it keeps something per session (its logs) and
            is told what retention evicts; else None.
        health: Poisoned by a failure the supervisor cannot vouch for (H1).
        records: What the store holds, indexed.
        running: The sessions, by token and (unfinished) by key.
        leases: The lease timer.
        fleet: Alone, or a member of the fleet that shares the store (``fleet.py``).
        grace: Seconds between the interrupt and the kill (P3).
        confirmation: Seconds to wait for an exit after the kill, and for each orphan.
    """

    execution: Execution
    retaining: Retaining | None
    health: Health
    records: Records
    running: Running
    leases: Leases
    fleet: Fleet
    grace: float
    confirmation: float

    @classmethod
    def make(
        cls,
        store: Store,
        execution: Execution,
        retention: Retention,
        *,
        grace: float,
        confirmation: float,
    ) -> Parts:
        health = Health()
        records = Records(store, retention, health)
        running = Running()
        fleet: Fleet = (
            Member(
                store,
                records,
                health,
                # F7's margin past a lease: a child's own dead-man switch ends it then.
                stop_bound=grace + confirmation + switch_slack(execution),
                running=running,
            )
            if isinstance(store, FleetStore)
            else Alone(records)
        )
        return cls(
            execution=execution,
            retaining=execution if isinstance(execution, Retaining) else None,
            health=health,
            records=records,
            running=running,
            leases=Leases(),
            fleet=fleet,
            grace=grace,
            confirmation=confirmation,
        )
