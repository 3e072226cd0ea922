"""One session: its lifecycle, its task once it loads, and its stop.

Theory of operation
-------------------
A session that has not loaded anything is an object and nothing more: a lifecycle, an
entry in the supervisor's lease heap (``leases.py``) and a place in its dictionaries.
Most sessions of a control plane never load, so they cost no task, no cancel scope and
no wake-up. The first load gives the session its task, in the supervisor's nursery
(docs/design.md, "Shape in Trio")::

    session task ── session cancel scope (a stop request cancels it)
                      └─ session nursery
                           ├─ loader       (the session task itself)
                           └─ exit watcher (only while a child is registered)

The lease is not a cancel scope's deadline: the lease timer watches every session's
deadline and asks the expired ones to stop (T1), as any other stop request does.

**Where a stop happens.** Every stop request (dispose, supersede, the child's exit, a
failed load, expiry, shutdown) goes through the lifecycle, which fixes the reason once
(P1) and fences the session at once. The first request also decides who runs the stop
(:meth:`Session._stop`), which happens exactly once:

* a session with a task: the task, woken by the cancellation of its scope, in a
  shielded scope with a bound (:meth:`Session._stop_shielded`);
* a session without one, so without a child: a requester that waits for the outcome
  anyway (dispose, an open superseding it) runs it in its own task
  (:meth:`Session.stop`); any other requester (expiry, shutdown) starts a task of the
  supervisor's to run it (:meth:`Session.stop_soon`).

Everyone else waits for the published outcome (P6).

**A load refused for a quota.** In a fleet, a load may carry its tenant's quota claim:
its first Loading record is saved with it, and the store may refuse it, writing
nothing (F9). Nothing was spawned yet (L3 comes before L4), so the session goes back
to Open and its task ends without a stop, all in one step with no await: a stop request
from then on finds a session without a task, and a later load starts a task anew. A
stop requested before the refusal came wins: the session stops as asked.

A session that never had a child has nothing to terminate between its Stopping and its
Stopped record, so both are saved in one transaction (the project's decision on P2;
docs/design.md, deviations): a crash can leave it Open or Stopped, never running.

A requester's own task is cancellable. When it is cancelled during the save, the store
wrote nothing (``abc.Store.save``: a cancelled save either completes or writes nothing),
so a task of the supervisor's takes the stop over, and the cancellation goes on out.

The lifecycle (:class:`~trio_supervisor._core.lifecycle.Lifecycle`) decides which move is
legal; this module persists, signals, waits and publishes. What the supervisor gives a
session, and the replies it publishes through, are in ``services.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import trio

from ..abc import Unit
from ..errors import (
    QuotaExceededError,
    StateStorageError,
    StoreUnavailableError,
    SupervisorError,
    TerminationUnconfirmedError,
)
from ..model import (
    CodeIdentity,
    Exited,
    ExitStatus,
    Expired,
    Fault,
    Handle,
    Load,
    LoadFailed,
    OpenRecord,
    QuotaClaim,
    SessionRecord,
    Shutdown,
    StopReason,
    Termination,
    log_fields,
)
from ..realtime import bounded
from .lifecycle import Lifecycle, stop_error
from .services import (
    Reply,
    Services,
    adapter_call,
    adapter_error,
    code_of,
    identity_of,
    task_name,
)
from .termination import NO_CHILD, faults, release, terminate

__all__ = ["Session"]

# The public name, not the private module's.
logger = logging.getLogger("trio_supervisor.session")

# Seconds a store save may take before a stop gives up on it (it has two: Stopping and
# Stopped). Stores must answer in bounded time; this only keeps a broken one from
# holding a shutdown forever.
SAVE_BOUND = 30.0
# Seconds between two tries of a stop's save while the store is out of reach (B3); the
# store itself tries again within its own wait before it says so.
SAVE_RETRY = 0.5


def _fields(handle: Handle) -> dict[str, object]:
    return log_fields(handle.key, handle.generation)


class Session:
    """The driver's side of one session: its lifecycle and its Trio machinery."""

    __slots__ = (
        "_services",
        "lifecycle",
        "load_failure",
        "load_quota",
        "load_reply",
        "nursery",
        "opened_at",
        "outcome",
        "problems",
        "scope",
        "spawned",
        "started",
        "unit",
    )

    def __init__(self, record: OpenRecord, deadline: float, services: Services[Session]) -> None:
        self._services = services
        self.lifecycle = Lifecycle(record, deadline)
        self.opened_at = deadline - record.lease  # when its lease began (O9)
        # The session task's scope, made with the task at the first load; a stop
        # request cancels it. None while the session has no task.
        self.scope: trio.CancelScope | None = None
        self.nursery: trio.Nursery | None = None
        # What spawn returned (released when the session ends), and the unit once its
        # identity is durable (terminated when the session ends).
        self.spawned: Unit | None = None
        self.unit: Unit | None = None
        # Whether the unit's start returned: until then the session's code never ran,
        # and however the unit is ended, the session ends with no child (NO_CHILD).
        self.started = False
        self.load_reply: Reply[CodeIdentity] | None = None
        # The quota claim the load's first Loading record carries (F9); taken by the loader.
        self.load_quota: QuotaClaim | None = None
        self.load_failure: SupervisorError | None = None
        self.outcome: Reply[Termination] = Reply()
        # The exceptions behind the termination's cause, for the shutdown report (Z3).
        self.problems: list[Exception] = []

    @property
    def handle(self) -> Handle:
        return self.lifecycle.record.handle

    # -- what the supervisor's calls do here ------------------------------------------

    async def renew(self) -> float:
        """Move the lease (R4, R6), then forward it to the child (R5)."""
        lifecycle = self.lifecycle
        lifecycle.renew(trio.current_time())
        lease = lifecycle.record.lease
        unit = self.unit
        if unit is not None:
            await adapter_call(unit.renew(lease), "forwarding the lease to the child")
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return lease

    async def load(self, load: Load, quota: QuotaClaim | None = None) -> CodeIdentity:
        """Start the load, or join the one asked for before (L1-L3, L6).

        Args:
            load: What to load.
            quota: The tenant's quota the child counts against (F9); a load that joins
                one in flight joins it as it is.
        """
        lifecycle = self.lifecycle
        if lifecycle.begin_load(load, trio.current_time()):
            # The loader runs in the session's task, which starts now (L6: it belongs to
            # the session, not to this caller).
            self.load_quota = quota
            self.load_reply = Reply()
            self.scope = trio.CancelScope()
            self._services.spawn(self._run, task_name("session", self.handle))
        elif lifecycle.code is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return lifecycle.code
        reply = self.load_reply
        assert reply is not None
        return await reply.wait()

    def stop_soon(self, reason: StopReason, exit: ExitStatus | None = None) -> None:
        """Ask the session to stop, and return at once; the first request wins (P1).

        Args:
            reason: Why.
            exit: The child's exit status, when it exited by itself (X1).
        """
        if self._claim(reason, exit):
            self._services.spawn(self._run_stop, task_name("stop", self.handle))

    async def stop(self, reason: StopReason) -> Termination:
        """Ask the session to stop and wait for its outcome; the first request wins (P1).

        A session without a task is stopped here, in the caller's task.

        Raises:
            TerminationUnconfirmedError, StateStorageError: The stop failed.
        """
        if self._claim(reason, None):
            try:
                outcome = await self._stop_childless(bounded=False)
            except trio.Cancelled:
                # Nothing was saved (the store's promise for a cancelled save): a task of
                # the supervisor's runs the stop instead, and this caller leaves.
                self._services.spawn(self._run_stop, task_name("stop", self.handle))
                raise
            self._publish(outcome)
            # The save was this call's checkpoint; waiting again would add another.
            return self.outcome.result()
        return await self.outcome.wait()

    def _claim(self, reason: StopReason, exit: ExitStatus | None) -> bool:
        """Fix the reason if this request is the first (P1); the session is fenced.

        Returns:
            True when the caller must see the stop run: the request is the first and
            the session has no task to run it.
        """
        if not self.lifecycle.request_stop(reason, exit):
            return False
        scope = self.scope
        if scope is None:
            return True
        scope.cancel()  # the session task wakes up and runs the stop
        return False

    # -- the session task ---------------------------------------------------------------

    async def _run(self) -> None:
        """The session task, from the first load: load, wait; then stop, exactly once."""
        lifecycle = self.lifecycle
        services = self._services
        scope = self.scope
        assert scope is not None
        refused = False
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    self.nursery = nursery
                    refused = await self._run_loader()
                    if refused:
                        # Open again, with no task (F9): from this step on, a later
                        # load's task owns the session's fields.
                        self.nursery = None
                        return
                    await trio.sleep_forever()
        except* trio.Cancelled:
            # The supervisor's nursery is cancelled from outside (its block was): the
            # session stops as in a shutdown, and this task ends with it. Not re-raised:
            # the block's own Cancelled carries the cancellation out, and a copy from
            # every session would bury the block's errors in nested groups.
            pass
        except* Exception as group:
            # A bug in the driver (the loader catches the adapters' failures): H1.
            services.health.poison(group.exceptions[0] if len(group.exceptions) == 1 else group)
        finally:
            if not refused:
                self.nursery = None
                if lifecycle.live:
                    # Woken with no stop request: the supervisor's nursery was cancelled
                    # from outside. Past the deadline, the lease ran out first (T1).
                    expired = trio.current_time() >= lifecycle.deadline
                    lifecycle.request_stop(Expired() if expired else Shutdown())
                self._publish(await self._stop_shielded())

    async def _run_stop(self) -> None:
        """A task that only runs the stop of a session that has no task of its own."""
        self._publish(await self._stop_shielded())

    def _publish(self, outcome: Termination | SupervisorError) -> None:
        """P6: the stop is over before anyone hears of it, so whoever waited (an open
        superseding this session, the shutdown) finds the key free."""
        self._services.ended(self)
        if isinstance(outcome, Termination):
            self.outcome.set(outcome)
        else:
            self.outcome.fail(outcome)
        self._answer_load()

    async def _stop_shielded(self) -> Termination | SupervisorError:
        services = self._services
        # Shielded: termination must run to its end even when the supervisor is torn
        # down by a cancellation, or a child could outlive its session. Every wait inside
        # is bounded (grace, then confirmation for the kill and for the release, and
        # SAVE_BOUND for each of the two saves); this bound is their sum, a backstop.
        bound = services.grace + 2 * services.confirmation + 2 * SAVE_BOUND
        with bounded(bound, shield=True) as scope:
            try:
                return await self._stop()
            except Exception as error:
                return services.health.poison(error)
        assert scope.cancelled_caught
        return services.health.poison(
            TerminationUnconfirmedError(
                f"stopping {task_name('session', self.handle)} took longer than {bound:g} s"
            )
        )

    def _answer_load(self) -> None:
        """Tell a load that did not succeed why, once its session stopped (L5, L6)."""
        reply = self.load_reply
        reason = self.lifecycle.reason
        if reply is None or reply.done or reason is None:
            return
        error = self.load_failure or stop_error(reason, self.handle)
        poison = self._services.health.error
        if poison is not None and poison is not error:
            error.add_note(f"the supervisor is poisoned: {poison!r}")
        reply.fail(error)

    async def _run_loader(self) -> bool:
        """Load (L3, L4); on a failure, ask the session to stop (L5).

        Returns:
            True when the store refused the first Loading record over its quota claim
            and the session is Open again, its task to end without a stop (F9).
        """
        lifecycle = self.lifecycle
        services = self._services
        reply = self.load_reply
        load = lifecycle.load
        assert reply is not None
        assert load is not None
        handle = lifecycle.record.handle
        try:
            # L3: Loading is durable before anything is spawned; in a fleet, the load's
            # quota claim is counted with it (F9), so a refusal comes before any child.
            quota, self.load_quota = self.load_quota, None
            try:
                await services.persist(lifecycle.active(), quota)
            except (QuotaExceededError, StoreUnavailableError) as refusal:
                if not lifecycle.live:
                    raise  # a stop came first: the load fails, the session stops as asked
                # Nothing written, nothing spawned: the session is Open again and may
                # load later (F9; B1: the store was out of reach).
                self._refused(refusal)
                return True
            unit = await adapter_call(
                services.execution.spawn(handle, load, lifecycle.record.limits),
                "spawning the child",
            )
            # The unit belongs to the session from here: it is released when the session ends.
            self.spawned = unit
            record = lifecycle.child_record(identity_of(unit), trio.current_time())
            await adapter_call(
                unit.renew(lifecycle.remaining(trio.current_time())),
                "forwarding the lease to the child",
            )
            # L4, write-ahead: a crash after this save can always find the child.
            await services.persist(record)
            assert record.child is not None
            lifecycle.register(record.child)
            self.unit = unit
            nursery = self.nursery
            assert nursery is not None
            nursery.start_soon(self._watch_exit, unit, name=task_name("exit watcher", handle))
            await adapter_call(unit.start(), "starting the child")
            self.started = True
            code = code_of(unit)
            loaded = lifecycle.loaded_record(code, trio.current_time())
            await services.persist(loaded)
            lifecycle.loaded(code)
        except Exception as failure:
            # L5: the load's caller hears of the failure once the session stopped, so
            # by then the child it may have left is reaped (see _answer_load).
            error = adapter_error(failure, "loading")
            self.load_failure = error
            logger.warning(
                "loading %r into %s failed: %s",
                load.specifier,
                task_name("session", handle),
                error,
                extra=_fields(handle),
            )
            if lifecycle.live:
                self.stop_soon(LoadFailed(cause=(Fault.of(error),)))
        else:
            reply.set(code)
        return False

    def _refused(self, refusal: QuotaExceededError | StoreUnavailableError) -> None:
        """The first Loading record was refused over its quota, or not written because
        the store was out of reach: the session is Open again, without a task (see the
        module's docs). No await: a stop request either
        came before (and the caller does not get here) or finds no task after."""
        reply = self.load_reply
        assert reply is not None
        self.lifecycle.refused()
        self.scope = None
        self.load_reply = None
        logger.info(
            "loading into %s was refused: %s",
            task_name("session", self.handle),
            refusal,
            extra=_fields(self.handle),
        )
        reply.fail(refusal)

    async def _watch_exit(self, unit: Unit) -> None:
        try:
            status = await unit.wait()
        except Exception as error:
            self._services.health.poison(adapter_error(error, "watching the child"))
            return
        # X1: it exited by itself; the stop sends no signal.
        self.stop_soon(Exited(), status)

    async def _stop(self) -> Termination | SupervisorError:
        """Persist Stopping, terminate, release, persist Stopped (P2-P5).

        Returns:
            The stop's outcome, for the caller to publish (P6).
        """
        if self.spawned is None:
            return await self._stop_childless(bounded=True)
        lifecycle = self.lifecycle
        services = self._services
        # P2: the session is fenced in memory already; if this save fails, termination
        # still runs and the storage error is the stop's outcome.
        fenced_error: StateStorageError | None = None
        try:
            await self._save_within_bound((lifecycle.stopping_record(),), keep_trying=False)
        except StoreUnavailableError as error:
            # B3: the store is out of reach. The stop does not wait for it: the child is
            # terminated now (a restart would find it by its Loading or Loaded record,
            # V2), and the Stopped record keeps trying below.
            logger.warning(
                "stopping %s before its Stopping record could be saved: %s",
                task_name("session", self.handle),
                error,
                extra=_fields(self.handle),
            )
        except StateStorageError as error:
            fenced_error = error
        problems = self.problems
        try:
            termination = await terminate(
                self.unit,
                lifecycle.exit,
                grace=0.0 if services.hurried else services.grace,
                confirmation=services.confirmation,
                problems=problems,
                graces=services.graces,
            )
        except TerminationUnconfirmedError as error:
            await release(self.spawned, confirmation=services.confirmation, problems=problems)
            error.causes = tuple(problems)
            logger.error(
                "the child of %s was killed and its exit is still unconfirmed: %s",
                task_name("session", self.handle),
                error,
                extra=_fields(self.handle),
            )
            # The child may still run: the supervisor can no longer vouch for it (H1).
            return services.health.poison(error)
        await release(self.spawned, confirmation=services.confirmation, problems=problems)
        if not self.started:
            # What the execution prepared was ended, but the session's code never ran:
            # a failed load reads the same however far its unit got.
            termination = attrs.evolve(NO_CHILD, cause=termination.cause)
        if len(problems) > len(termination.cause):
            termination = attrs.evolve(termination, cause=faults(problems))
        stopped = lifecycle.stopped_record(termination)
        try:
            await self._save_within_bound((stopped,))
        except StateStorageError as error:
            return fenced_error or error
        # P5: durable, so the session object can go; its record answers from now on.
        lifecycle.finish(stopped)
        services.stopped(self)
        return fenced_error or termination

    async def _stop_childless(self, *, bounded: bool) -> Termination | SupervisorError:
        """The stop of a session that never had a child: Stopping and Stopped together.

        Nothing can run between the two records, so they are saved in one transaction
        (P2, P5; see the module's docs). ``bounded``: give up on a store that does not
        answer within SAVE_BOUND (a requester's own task is bounded by its caller).
        """
        lifecycle = self.lifecycle
        records = (lifecycle.stopping_record(), lifecycle.stopped_record(NO_CHILD))
        try:
            if bounded:
                await self._save_within_bound(records)
            else:
                try:
                    await self._services.persist_together(records)
                except StoreUnavailableError:
                    # Out of reach, nothing written (B3): tried again, as a bounded stop.
                    await self._save_within_bound(records)
        except StateStorageError as error:
            return error  # poisoned already; the session stays fenced in memory
        lifecycle.finish(records[1])
        self._services.stopped(self)
        return NO_CHILD

    async def _save_within_bound(
        self, records: Sequence[SessionRecord], *, keep_trying: bool = True
    ) -> None:
        """Save the records of a stop; a store that does not answer counts as failed.

        ``keep_trying``: a store out of reach (:class:`StoreUnavailableError`, B3) is
        tried again until SAVE_BOUND, unless the supervisor is poisoned meanwhile (no
        later save of it can land then); past the bound the supervisor is poisoned.
        Otherwise that error is raised at once, and poisons nothing.
        """
        services = self._services
        unavailable: StoreUnavailableError | None = None
        # Real time, also on a virtual clock; and the run's clock, so that a test's
        # virtual clock does not spin through a real-time bound.
        until = trio.current_time() + SAVE_BOUND
        with bounded(SAVE_BOUND) as scope:
            while True:
                try:
                    if len(records) == 1:
                        await services.persist(records[0])
                    else:
                        await services.persist_together(records)
                    return
                except StoreUnavailableError as error:
                    if not keep_trying or services.health.error is not None:
                        raise
                    if unavailable is None:
                        logger.warning(
                            "the store is out of reach; the stop of %s tries again for "
                            "up to %g s: %s",
                            task_name("session", self.handle),
                            SAVE_BOUND,
                            error,
                            extra=_fields(self.handle),
                        )
                    unavailable = error
                if trio.current_time() + SAVE_RETRY >= until:
                    break
                await trio.sleep(SAVE_RETRY)
        phases = " and ".join(record.phase.value for record in records)
        failure = StateStorageError(
            f"the store did not save the {phases} record of "
            f"{task_name('session', self.handle)} within {SAVE_BOUND:g} s"
            + (
                f" (out of reach: {unavailable.detail})"
                if unavailable is not None and not scope.cancelled_caught
                else ""
            )
        )
        failure.__cause__ = unavailable
        raise services.health.poison(failure)
