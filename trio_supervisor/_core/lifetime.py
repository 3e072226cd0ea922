"""Entering and leaving a supervisor: ``open_supervisor``.

Theory of operation
-------------------
Entering checks the arguments, makes the parts of the engine (:class:`~.parts.Parts`), the
:class:`~trio_supervisor.Supervisor` that keeps the rules over them and the
:class:`Lifetime` that runs their tasks, and recovers what an earlier run left
(``recovery.py``, V1-V5) before the caller gets the supervisor. The supervisor's
nursery (every session task, the lease timer, a fleet member's row) lives around the
caller's block. Leaving, however the block ends, stops every session with reason
Shutdown and reaps every child (Z1, Z2) in a shielded scope with a bound; what went
wrong is raised after, as one flat group (Z3).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import trio

from .. import _defaults as defaults
from .._background import open_background_nursery
from .._fields import GRACE, LEASE, TIMEOUT
from ..abc import Execution, FleetStore, Store
from ..errors import TerminationUnconfirmedError
from ..model import Limits
from ..realtime import bounded
from ..retention import Retention
from .parts import Parts
from .recovery import recover
from .session import SAVE_BOUND
from .supervisor import Supervisor

__all__ = ["open_supervisor"]

logger = logging.getLogger("trio_supervisor.supervisor")


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
        lease: The default lease, seconds: from ``MIN_LEASE`` (0.1) to ``MAX_LEASE``.
        grace: How long a child may take to exit after an interrupt, seconds: finite and
            at least 0 (0: the kill follows the interrupt at once).
        confirmation_timeout: How long to wait for an exit after a kill, and for each
            orphan's recovery, seconds: finite and above 0.
        limits: Ceilings for every session's limits.
        retention: Which Stopped records to keep; by default the store's own policy.

    Yields:
        The supervisor, usable until the block ends.

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
    parts = Parts.make(
        store,
        execution,
        retention,
        grace=GRACE.seconds("grace", grace),
        confirmation=TIMEOUT.seconds("confirmation_timeout", confirmation_timeout),
    )
    lifetime = Lifetime(parts)
    supervisor = Supervisor(
        parts, spawn=lifetime.spawn, lease=LEASE.seconds("lease", lease), limits=limits
    )
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


class Lifetime:
    """The tasks of a supervisor, and the rules of entering and leaving (V1-V5, Z1-Z3):
    all that :func:`open_supervisor` does with the parts beyond making them."""

    __slots__ = ("_nursery", "_parts", "_tasks")

    def __init__(self, parts: Parts) -> None:
        self._parts = parts
        self._nursery: trio.Nursery | None = None
        self._tasks: list[trio.CancelScope] = []

    def spawn(self, function: Callable[[], Awaitable[object]], name: str) -> None:
        """Start a task of the supervisor's: a session's, or a stop's."""
        if self._nursery is None:
            raise RuntimeError("the supervisor's nursery is gone")
        # A task started this way always runs: if the supervisor is cancelled first, it
        # meets the cancellation inside and still runs its stop, shielded (O11, Z2).
        self._nursery.start_soon(function, name=name)

    async def join(self, nursery: trio.Nursery) -> None:
        """Take ``nursery`` for the supervisor's tasks, and be a member of the fleet from
        now on, when the store is shared (F1, F2)."""
        self._nursery = nursery
        self._tasks.append(await nursery.start(self._parts.fleet.run))

    async def recover(self) -> None:
        """Stop every session an earlier run left behind, with reason Recovery (V1-V5)."""
        parts = self._parts
        await recover(parts.records, parts.execution, confirmation=parts.confirmation)
        if parts.retaining is not None:
            # What it keeps of sessions whose records are gone goes (what recovery's own
            # saves evicted, and what was evicted while no supervisor ran).
            handles = [record.handle for record in parts.records.index]
            try:
                await parts.retaining.retained(handles)
            except Exception as error:
                logger.warning("what the execution keeps of sessions is left as it is: %s", error)

    async def start(self, nursery: trio.Nursery) -> None:
        """Run the lease timer in ``nursery``: the supervisor is about to be used."""
        self._tasks.append(await nursery.start(self._run_leases))

    async def _run_leases(self, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        """The lease timer (T1), until the supervisor is done with it."""
        with trio.CancelScope() as scope:
            task_status.started(scope)
            try:
                await self._parts.leases.run()
            except trio.Cancelled:
                # The supervisor's nursery is cancelled from outside (its block was). Not
                # re-raised, as the session tasks do not: the block's own Cancelled
                # carries the cancellation out, and this copy would wrap its errors in a
                # group of the nursery's.
                return
            except Exception as error:  # a bug: the supervisor can vouch for no lease
                self._parts.health.poison(error)

    def detach(self) -> None:
        """Every session has stopped: end the supervisor's own tasks, forget the nursery.

        A fleet's member keeps its row until here, so that no other runner takes its
        sessions over while they stop.
        """
        for scope in self._tasks:
            scope.cancel()
        self._nursery = None

    async def shut_down(self) -> list[Exception]:
        """Stop every session with reason Shutdown, bounded; return what went wrong: the
        poisoning failures, the stops that failed, and the problems behind any
        termination's cause (Z1-Z3).

        Shielded, so that a cancelled block still reaps every child. Every session's stop
        is bounded by the same sum (session.py); they run concurrently, and an open
        caught in its save waits at most one save. Past that bound something broke a
        promise: it is reported, and the block is left rather than held forever.
        """
        parts = self._parts
        parts.running.closing = True
        parts.fleet.close()
        bound = parts.grace + 2 * parts.confirmation + 3 * SAVE_BOUND
        reported: list[Exception] = []
        with bounded(bound, shield=True) as scope:
            reported = await parts.running.stop_all()
        problems: list[Exception] = list(parts.health.failures)
        for problem in reported:
            if all(problem is not known for known in problems):
                problems.append(problem)
        if scope.cancelled_caught:
            problems.append(
                TerminationUnconfirmedError(
                    f"the shutdown took longer than {bound:g} s; some children may still run"
                )
            )
        parts.records.watchers.close()
        return problems
