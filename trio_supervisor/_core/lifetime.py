"""Entering and leaving a supervisor: ``open_supervisor``.

Theory of operation
-------------------
Entering checks the arguments, makes the :class:`~trio_supervisor.Supervisor`
and recovers what an earlier run left (``recovery.py``, V1-V5) before the caller gets
it. The supervisor's nursery (every session task) lives around the caller's block.
Leaving, however the block ends, stops every session with reason Shutdown and reaps
every child (Z1, Z2) in a shielded scope with a bound; what went wrong is raised after,
as one flat group (Z3).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from .. import _defaults as defaults
from .._background import open_background_nursery
from .._fields import GRACE, LEASE, TIMEOUT
from ..abc import Execution, FleetStore, Store
from ..model import Limits
from ..retention import Retention
from .supervisor import Lifetime, Supervisor

__all__ = ["open_supervisor"]


@contextlib.asynccontextmanager
async def open_supervisor(
    store: Store,
    execution: Execution,
    *,
    lease: float = defaults.LEASE,
    grace: float = defaults.GRACE,
    confirmation_timeout: float = defaults.CONFIRMATION,
    limits: Limits | None = None,
    retention: Retention | None = None,
) -> AsyncIterator[Supervisor]:
    """Run a supervisor for the duration of an ``async with`` block.

    On entry, every stored record is read and every session an earlier run left
    behind is stopped with reason Recovery (V1-V5). On exit, every session is stopped
    with reason Shutdown and every child is reaped (Z1-Z3).

    Args:
        store: Where records are made durable.
        execution: What spawns and recovers children.
        lease: The default lease, seconds.
        grace: How long a child may take to exit after an interrupt, seconds.
        confirmation_timeout: How long to wait for an exit after a kill, and for each
            orphan's recovery, seconds.
        limits: Ceilings for every session's limits.
        retention: Which Stopped records to keep; by default the store's own policy.

    Raises:
        TerminationUnconfirmedError: On entry, an orphan could not be confirmed gone.
        StateStorageError: On entry, the store could not be read or holds a bad record.
        ExceptionGroup: On exit, when the supervisor was poisoned or a termination had
            problems; it holds each of them (and the block's own exception, if any).
    """
    limits = Limits() if limits is None else limits
    if not isinstance(limits, Limits):
        raise TypeError(f"limits must be Limits, not {type(limits).__name__}")
    for name, adapter, protocol in (("store", store, Store), ("execution", execution, Execution)):
        if not isinstance(adapter, protocol):
            raise TypeError(
                f"{name} does not implement the {protocol.__name__} protocol: {adapter!r}"
            )
    if hasattr(store, "run_member") and not isinstance(store, FleetStore):
        # Half a fleet's store would run as a store of its own, fencing nothing across
        # the fleet: refuse it rather than let a missing method change the semantics.
        missing = sorted(
            name
            for name in dir(FleetStore)
            if not name.startswith("_") and not hasattr(store, name)
        )
        raise TypeError(
            f"store has run_member but does not implement the FleetStore protocol "
            f"(missing: {', '.join(missing)}): {store!r}"
        )
    stores_policy: Retention | None = getattr(store, "retention", None)
    if retention is None:
        retention = stores_policy or Retention()
    elif not isinstance(retention, Retention):
        raise TypeError(f"retention must be Retention, not {type(retention).__name__}")
    elif stores_policy is not None and stores_policy != retention:
        raise ValueError(
            f"retention {retention} differs from the store's {stores_policy}; "
            "the supervisor mirrors the store's policy, so configure it on the store"
        )
    supervisor = Supervisor(
        store,
        execution,
        lease=LEASE.seconds("lease", lease),
        grace=GRACE.seconds("grace", grace),
        confirmation_timeout=TIMEOUT.seconds("confirmation_timeout", confirmation_timeout),
        limits=limits,
        retention=retention,
    )
    lifetime = Lifetime(supervisor)
    async with open_background_nursery() as nursery:
        # A member of a fleet renews its row from here on, while it recovers too: a
        # recovery longer than its runner lease must not get it taken over (F1, F2).
        await lifetime.join(nursery)
        try:
            await lifetime.recover()
        except BaseException:
            lifetime.detach()
            raise
        await lifetime.start(nursery)
        try:
            yield supervisor
        except BaseException as error:
            problems = await lifetime.shut_down()
            if problems:
                raise BaseExceptionGroup(_PROBLEMS, [error, *problems]) from None
            raise
        else:
            problems = await lifetime.shut_down()
            if problems:
                raise ExceptionGroup(_PROBLEMS, problems)
        finally:
            # Every session has stopped: no lease is left to watch.
            lifetime.detach()


_PROBLEMS = "the supervisor shut down with problems (Z3)"
