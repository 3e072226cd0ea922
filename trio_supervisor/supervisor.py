"""The Trio driver: sessions as tasks, their leases as cancel-scope deadlines.

Shape (docs/design.md, "Shape in Trio")::

    open_supervisor ── supervisor nursery (owns every session)
                        └─ session task ── session cancel scope (deadline = the lease)
                                             └─ session nursery (opened by the first load)
                                                  ├─ loader       (the session task itself)
                                                  └─ exit watcher (only while a child is registered)

A session without a child is one parked task: it needs no nursery, loader or watcher
until a load asks for them, and most sessions of a control plane never load.

A stop request of any kind (dispose, supersede, child exit, shutdown, a failed load)
goes through :meth:`Lifecycle.request_stop`, which fixes the reason once, and then
cancels the session scope. The lease timer is that same scope's deadline: when it
passes, the scope cancels itself. Either way the session task wakes up, and only the
session task terminates the child, in a shielded scope bounded by ``grace`` and
``confirmation_timeout``. So termination happens exactly once, at one place, whatever
asked for it; everyone else waits for the published outcome.

Persistence is write-ahead: a record is saved before the state it describes is acted
on, and the supervisor's view of what is durable (a :class:`RecordIndex`) is updated only
after the store acknowledged the save.
"""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Generic, TypeVar

import attrs
import trio

from .background import open_background_nursery
from .errors import (
    ExecutionError,
    RunnerClosingError,
    SessionStoppedError,
    StaleSessionError,
    StateStorageError,
    SupervisorError,
    TerminationUnconfirmedError,
)
from .executions.base import Execution, Unit
from .health import Health
from .lifecycle import Lifecycle, recovered, stop_error
from .model import (
    ChildIdentity,
    CodeIdentity,
    Disposed,
    Exited,
    ExitStatus,
    Expired,
    Fault,
    Handle,
    Key,
    Limits,
    Load,
    LoadedRecord,
    LoadFailed,
    LoadingRecord,
    OpenRecord,
    SessionRecord,
    Shutdown,
    StoppedRecord,
    StoppingRecord,
    StopReason,
    Superseded,
    Termination,
    negotiate,
)
from .retention import RecordIndex, Retention
from .stores.base import BatchStore, Store
from .termination import NO_CHILD, faults, release, terminate

__all__ = ["Supervisor", "open_supervisor"]

logger = logging.getLogger("trio_supervisor")

_T = TypeVar("_T")

# How many orphans recovery confirms at once.
_RECOVERY_CONCURRENCY = 64


class _Reply(Generic[_T]):
    """A result published once and read by any number of waiters."""

    __slots__ = ("_event", "error", "value")

    def __init__(self) -> None:
        self._event = trio.Event()
        self.value: _T | None = None
        self.error: SupervisorError | None = None

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def set(self, value: _T) -> None:
        if not self.done:
            self.value = value
            self._event.set()

    def fail(self, error: SupervisorError) -> None:
        if not self.done:
            self.error = error
            self._event.set()

    async def wait(self) -> _T:
        await self._event.wait()
        if self.error is not None:
            raise self.error.again()
        assert self.value is not None
        return self.value


class _Session:
    """The driver's side of one session: its lifecycle and its Trio machinery."""

    __slots__ = (
        "lifecycle",
        "load_failure",
        "load_reply",
        "nursery",
        "outcome",
        "parked",
        "problems",
        "scope",
        "spawned",
        "unit",
    )

    def __init__(self, record: OpenRecord, deadline: float) -> None:
        self.lifecycle = Lifecycle(record, deadline)
        # The lease timer: renew moves the deadline, a stop request cancels it.
        self.scope = trio.CancelScope(deadline=deadline)
        self.nursery: trio.Nursery | None = None
        # The session task while it waits for its first load (see Supervisor._park).
        self.parked: trio.lowlevel.Task | None = None
        # What spawn returned (released when the session ends), and the unit once its
        # identity is durable (terminated when the session ends).
        self.spawned: Unit | None = None
        self.unit: Unit | None = None
        self.load_reply: _Reply[CodeIdentity] | None = None
        self.load_failure: SupervisorError | None = None
        self.outcome: _Reply[Termination] = _Reply()
        # The exceptions behind the termination's cause, for the shutdown report (Z3).
        self.problems: list[Exception] = []

    @property
    def handle(self) -> Handle:
        return self.lifecycle.record.handle


class _KeyLocks:
    """One lock per key, held only while somebody uses it (O2 without a global lock)."""

    __slots__ = ("_locks",)

    def __init__(self) -> None:
        self._locks: dict[Key, tuple[trio.Lock, list[int]]] = {}

    async def acquire(self, key: Key) -> None:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = (trio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            # Uncontended (the usual case), taking the lock is no schedule point: the
            # caller's store write is one.
            lock.acquire_nowait()
        except trio.WouldBlock:
            try:
                await lock.acquire()
            except BaseException:
                self._forget(key, users)
                raise

    def release(self, key: Key) -> None:
        lock, users = self._locks[key]
        lock.release()
        self._forget(key, users)

    def _forget(self, key: Key, users: list[int]) -> None:
        users[0] -= 1
        if not users[0]:
            del self._locks[key]


def _adapter_error(error: Exception, what: str) -> SupervisorError:
    """An adapter's failure as one of the documented errors."""
    if isinstance(error, SupervisorError):
        return error
    wrapped = ExecutionError(f"{what} failed: {error!r}")
    wrapped.__cause__ = error
    return wrapped


def _seconds(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return seconds


class Supervisor:
    """Sessions for keys, their leases, their children. Made by :func:`open_supervisor`."""

    def __init__(
        self,
        store: Store,
        execution: Execution,
        *,
        lease: float,
        grace: float,
        confirmation_timeout: float,
        limits: Limits,
        retention: Retention,
    ) -> None:
        self._store = store
        self._execution = execution
        self._lease = lease
        self._grace = grace
        self._confirmation = confirmation_timeout
        self._limits = limits
        self._index = RecordIndex(retention)
        # Sessions by token, and the unfinished ones by key. A session leaves the first
        # once its Stopped record is durable, the second once its stop is over.
        self._sessions: dict[str, _Session] = {}
        self._by_key: dict[Key, dict[str, _Session]] = {}
        self._locks = _KeyLocks()
        self._health = Health()
        self._closing = False
        # Opens past their last check, whose session does not exist yet (see _shutdown).
        self._opening = 0
        self._opened = trio.lowlevel.ParkingLot()
        self._nursery: trio.Nursery | None = None

    # -- reading ----------------------------------------------------------------------

    @property
    def lease(self) -> float:
        """The default lease, in seconds."""
        return self._lease

    @property
    def limits(self) -> Limits:
        """The ceilings every session's limits are negotiated against."""
        return self._limits

    @property
    def poisoned(self) -> SupervisorError | None:
        """The error that poisoned the supervisor, or None while it is healthy."""
        return self._health.error

    async def status(self, handle: Handle) -> SessionRecord:
        """Return the session's last durable record (S1).

        Works while poisoned and while closing.

        Raises:
            StaleSessionError: No retained record has this token, key and generation.
        """
        await trio.lowlevel.checkpoint()
        return self._record_of(handle)

    async def high_water(self, key: Key) -> int | None:
        """Return the highest generation ever opened for ``key``, or None (S2)."""
        await trio.lowlevel.checkpoint()
        if not isinstance(key, Key):
            raise TypeError(f"key must be a Key, not {type(key).__name__}")
        return self._index.high_water(key) or None

    async def wait_failed(self) -> None:
        """Block until the supervisor is poisoned, then raise the poisoning error (H3)."""
        await self._health.wait_failed()

    # -- open -------------------------------------------------------------------------

    async def open(
        self,
        key: Key,
        request_id: str,
        *,
        expected_generation: int | None = None,
        lease: float | None = None,
        limits: Limits | None = None,
    ) -> SessionRecord:
        """Open a new generation of ``key``, stopping the one before (O1-O11).

        Args:
            key: What the session is for.
            request_id: The caller's id for this request; a retry with the same id
                returns the same record (O3).
            expected_generation: The key's high-water generation the caller saw; None
                means 0, "never opened" (O4).
            lease: Seconds; the supervisor's default when None.
            limits: Ceilings to ask for; they can only lower the supervisor's.

        Returns:
            The new session's Open record, or the retained record of ``request_id``.

        Raises:
            RunnerClosingError: The supervisor is shutting down.
            StaleSessionError: ``expected_generation`` is not the key's high-water.
            StateStorageError: The record could not be made durable; the supervisor is
                poisoned. Once poisoned, open raises the poisoning error.
        """
        if not isinstance(key, Key):
            raise TypeError(f"key must be a Key, not {type(key).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if expected_generation is not None and (
            isinstance(expected_generation, bool)
            or not isinstance(expected_generation, int)
            or expected_generation < 0
        ):
            raise ValueError(
                f"expected_generation must be None or an int >= 0, got {expected_generation!r}"
            )
        seconds = self._lease if lease is None else _seconds("lease", lease)
        if limits is not None and not isinstance(limits, Limits):
            raise TypeError(f"limits must be Limits, not {type(limits).__name__}")
        # No request: the supervisor's own limits, shared (records are immutable).
        negotiated = self._limits if limits is None else negotiate(self._limits, limits)

        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_usable()
        await self._locks.acquire(key)
        try:
            return await self._open_locked(
                key, request_id, expected_generation, seconds, negotiated
            )
        finally:
            self._locks.release(key)

    async def _open_locked(
        self,
        key: Key,
        request_id: str,
        expected_generation: int | None,
        seconds: float,
        negotiated: Limits,
    ) -> SessionRecord:
        """The part of :meth:`open` that runs holding the key's lock (O2)."""
        self._check_usable()
        prior = self._index.find_request(key, request_id)
        if prior is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return prior
        high = self._index.high_water(key)
        if (expected_generation or 0) != high:
            await trio.lowlevel.cancel_shielded_checkpoint()
            expected = (
                "a key never opened"
                if expected_generation is None
                else f"generation {expected_generation}"
            )
            raise StaleSessionError(
                f"{key.identity}/{key.instance}: expected {expected}, but its high-water "
                f"generation is {high}; pass expected_generation={high or None} to open "
                "the next one"
            )
        await self._supersede(key)
        self._check_usable()
        record = OpenRecord(
            handle=Handle(key=key, token=str(uuid.uuid4()), generation=high + 1),
            request_id=request_id,
            lease=seconds,
            limits=negotiated,
        )
        self._opening += 1
        try:
            await self._persist(record)
            # The record is durable: from here on nothing may stop the session from
            # coming to exist (O11), and its lease starts now (O9).
            session = _Session(record, trio.current_time() + seconds)
            self._sessions[record.handle.token] = session
            self._by_key.setdefault(key, {})[record.handle.token] = session
            self._start_session(session)
        finally:
            self._opening -= 1
            self._opened.unpark_all()
        return record

    async def _supersede(self, key: Key) -> None:
        """Stop every unfinished session of ``key`` and wait for their ends (O5)."""
        for session in list(self._by_key.get(key, {}).values()):
            self._request_stop(session, Superseded())
            generation = session.handle.generation
            extra = {"identity": key.identity, "instance": key.instance, "generation": generation}
            try:
                termination = await session.outcome.wait()
            except SupervisorError as error:
                logger.warning(
                    "the superseded generation %d of %s/%s did not terminate cleanly: %s",
                    generation,
                    key.identity,
                    key.instance,
                    error,
                    extra=extra,
                )
            else:
                if termination.cause:
                    logger.warning(
                        "terminating the superseded generation %d of %s/%s had problems: %s",
                        generation,
                        key.identity,
                        key.instance,
                        "; ".join(f"{fault.type}: {fault.message}" for fault in termination.cause),
                        extra=extra,
                    )

    def _start_session(self, session: _Session) -> None:
        nursery = self._nursery
        if nursery is None:
            raise RuntimeError("the supervisor's nursery is gone")
        # A task started this way always runs: if the supervisor is cancelled first, it
        # meets the cancellation inside and still runs its stop (O11).
        nursery.start_soon(self._run_session, session, name=_task_name("session", session.handle))
        if self._closing:
            # Opened while the shutdown began: it stops like every other (Z2).
            self._request_stop(session, Shutdown())

    # -- renew, load, dispose ---------------------------------------------------------

    async def renew(self, handle: Handle) -> float:
        """Extend the session's lease by its lease length from now (R1-R6).

        Returns:
            The lease, in seconds.

        Raises:
            RunnerClosingError: The supervisor is shutting down; or the poisoning error.
            StaleSessionError: The handle names no retained session.
            LeaseExpiredError: The lease ran out, even if the timer has not fired yet.
            SessionStoppedError: The session stops or stopped for another reason.
            ExecutionError: Forwarding the lease to the child failed.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_usable()
        session = self._session_of(handle)
        lifecycle = session.lifecycle
        session.scope.deadline = lifecycle.renew(trio.current_time())
        lease = lifecycle.record.lease
        unit = session.unit
        if unit is not None:
            # R5: the child enforces the lease too.
            await self._call(unit.renew(lease), "forwarding the lease to the child")
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return lease

    async def load(self, handle: Handle, load: Load) -> CodeIdentity:
        """Load code into the session's child (L1-L6).

        The load belongs to the session: a caller cancelled while waiting stops
        waiting, and the load goes on.

        Returns:
            What was loaded.

        Raises:
            RunnerClosingError, StaleSessionError, LeaseExpiredError,
            SessionStoppedError: As for :meth:`renew`; also when the session stops
                during the load.
            SessionConflictError: The session loads another specifier.
            PackageError, ExecutionError, StateStorageError: The load failed.
        """
        if not isinstance(load, Load):
            raise TypeError(f"load must be a Load, not {type(load).__name__}")
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_usable()
        session = self._session_of(handle)
        lifecycle = session.lifecycle
        if lifecycle.begin_load(load, trio.current_time()):
            # The session task runs the load: wake it if it is parked (it may not have
            # run yet, and then it finds the request when it does).
            session.load_reply = _Reply()
            parked, session.parked = session.parked, None
            if parked is not None:
                trio.lowlevel.reschedule(parked)
        elif lifecycle.code is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return lifecycle.code
        reply = session.load_reply
        assert reply is not None
        return await reply.wait()

    async def dispose(self, handle: Handle) -> Termination:
        """Stop the session and return how its child ended (D1-D5).

        Works while poisoned and while closing; disposing a stopped session returns
        its recorded termination again.

        Raises:
            StaleSessionError: The handle names no retained session.
            SessionStoppedError: The record is known but the session was retired.
            TerminationUnconfirmedError, StateStorageError: The stop failed.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        record = self._record_of(handle)
        if isinstance(record, StoppedRecord):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return record.termination
        session = self._sessions.get(handle.token)
        if session is None:
            raise SessionStoppedError("the session was retired by recovery or eviction")
        self._request_stop(session, Disposed())
        return await session.outcome.wait()

    # -- the session task and what runs in its nursery ------------------------------------

    async def _run_session(self, session: _Session) -> None:
        lifecycle = session.lifecycle
        try:
            with session.scope:
                if session.load_reply is None:
                    await self._park(session)
                async with trio.open_nursery() as nursery:
                    session.nursery = nursery
                    await self._run_loader(session)
                    await trio.sleep_forever()
        except Exception as error:
            self._health.poison(error)
        finally:
            session.nursery = None
            if lifecycle.live:
                # The scope's deadline is the lease, and renew moves it: reaching the
                # deadline is expiry (T1). Any other wake-up without a stop request is
                # the supervisor's nursery being cancelled from outside.
                expired = trio.current_time() >= lifecycle.deadline
                lifecycle.request_stop(Expired() if expired else Shutdown())
            # Shielded so that termination runs to its end even when the supervisor is
            # torn down by a cancellation; every wait inside is bounded (termination.py).
            with trio.CancelScope(shield=True):
                try:
                    outcome = await self._finish_stop(session)
                except Exception as error:
                    outcome = self._health.poison(error)
            # P6: the stop is over before anyone hears of it, so whoever waited (an open
            # superseding this session, the shutdown) finds the key free.
            self._end(session)
            if isinstance(outcome, Termination):
                session.outcome.set(outcome)
            else:
                session.outcome.fail(outcome)
            self._answer_load(session)

    @staticmethod
    async def _park(session: _Session) -> None:
        """Sleep until :meth:`load` wakes the session, or its scope is cancelled."""
        session.parked = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            session.parked = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def _answer_load(self, session: _Session) -> None:
        """Tell a load that did not succeed why, once its session stopped (L5, L6)."""
        reply = session.load_reply
        reason = session.lifecycle.reason
        if reply is None or reply.done or reason is None:
            return
        error = session.load_failure or stop_error(reason)
        poison = self._health.error
        if poison is not None and poison is not error:
            error.add_note(f"the supervisor is poisoned: {poison!r}")
        reply.fail(error)

    async def _run_loader(self, session: _Session) -> None:
        lifecycle = session.lifecycle
        reply = session.load_reply
        load = lifecycle.load
        assert reply is not None
        assert load is not None
        handle = lifecycle.record.handle
        try:
            # L3: Loading is durable before anything is spawned.
            await self._persist(lifecycle.active())
            unit = await self._call(
                self._execution.spawn(handle, load, lifecycle.record.limits), "spawning the child"
            )
            # The unit belongs to the session from here: it is released when the session ends.
            session.spawned = unit
            record = lifecycle.child_record(self._identity_of(unit), trio.current_time())
            await self._call(
                unit.renew(lifecycle.remaining(trio.current_time())),
                "forwarding the lease to the child",
            )
            # L4, write-ahead: a crash after this save can always find the child.
            await self._persist(record)
            assert record.child is not None
            lifecycle.register(record.child)
            session.unit = unit
            nursery = session.nursery
            assert nursery is not None
            nursery.start_soon(
                self._watch_exit, session, unit, name=_task_name("exit watcher", handle)
            )
            await self._call(unit.start(), "starting the child")
            code = self._code_of(unit)
            loaded = lifecycle.loaded_record(code, trio.current_time())
            await self._persist(loaded)
            lifecycle.loaded(code)
        except Exception as failure:
            # L5: the load's caller hears of the failure once the session stopped, so
            # by then the child it may have left is reaped (see _answer_load).
            error = _adapter_error(failure, "loading")
            session.load_failure = error
            if lifecycle.live:
                self._request_stop(session, LoadFailed(cause=(Fault.of(error),)))
        else:
            reply.set(code)

    async def _watch_exit(self, session: _Session, unit: Unit) -> None:
        try:
            status = await unit.wait()
        except Exception as error:
            self._health.poison(_adapter_error(error, "watching the child"))
            return
        # X1: it exited by itself; the stop sends no signal.
        self._request_stop(session, Exited(), status)

    def _request_stop(
        self, session: _Session, reason: StopReason, exit: ExitStatus | None = None
    ) -> None:
        """Ask a session to stop; the first request fixes the reason (P1)."""
        if session.lifecycle.request_stop(reason, exit):
            session.scope.cancel()

    async def _finish_stop(self, session: _Session) -> Termination | SupervisorError:
        """Persist Stopping, terminate, release, persist Stopped (P2-P5).

        Returns:
            The stop's outcome, for the caller to publish (P6).
        """
        lifecycle = session.lifecycle
        reason = lifecycle.reason
        assert reason is not None
        # P2: the session is fenced in memory already; if this save fails, termination
        # still runs and the storage error is the stop's outcome.
        fenced_error: StateStorageError | None = None
        try:
            await self._persist(lifecycle.stopping_record())
        except StateStorageError as error:
            fenced_error = error
        problems = session.problems
        try:
            termination = await terminate(
                session.unit,
                lifecycle.exit,
                grace=self._grace,
                confirmation=self._confirmation,
                problems=problems,
            )
        except TerminationUnconfirmedError as error:
            await release(session.spawned, confirmation=self._confirmation, problems=problems)
            error.causes = tuple(problems)
            # The child may still run: the supervisor can no longer vouch for it (H1).
            return self._health.poison(error)
        await release(session.spawned, confirmation=self._confirmation, problems=problems)
        if len(problems) > len(termination.cause):
            termination = attrs.evolve(termination, cause=faults(problems))
        stopped = lifecycle.stopped_record(termination)
        try:
            await self._persist(stopped)
        except StateStorageError as error:
            return fenced_error or error
        # P5: durable, so the session object can go; its record answers from now on.
        lifecycle.finish(stopped)
        self._sessions.pop(session.handle.token, None)
        return fenced_error or termination

    def _end(self, session: _Session) -> None:
        """The session's stop is over; it is no longer one of its key's sessions."""
        key = session.handle.key
        of_key = self._by_key.get(key)
        if of_key is not None:
            of_key.pop(session.handle.token, None)
            if not of_key:
                del self._by_key[key]

    # -- persistence, health, lookups -------------------------------------------------

    async def _persist(self, record: SessionRecord) -> None:
        """Make ``record`` durable, then update the view of what is durable (O8, O10, H1)."""
        try:
            await self._store.save(record)
        except StateStorageError as failure:
            self._health.poison(failure)
            raise
        except Exception as failure:
            error = StateStorageError(f"the store failed to save a record: {failure!r}")
            self._health.poison(error)
            raise error from failure
        for evicted in self._index.save(record):
            # O10: a session whose record is gone is retired.
            self._sessions.pop(evicted.handle.token, None)

    def _check_usable(self) -> None:
        """O1: refuse new work when poisoned or closing."""
        self._health.check()
        if self._closing:
            raise RunnerClosingError("the supervisor is shutting down")

    def _record_of(self, handle: Handle) -> SessionRecord:
        if not isinstance(handle, Handle):
            raise TypeError(f"handle must be a Handle, not {type(handle).__name__}")
        record = self._index.get(handle.token)
        if record is None or record.handle != handle:
            raise StaleSessionError("no retained session has this token, key and generation")
        return record

    def _session_of(self, handle: Handle) -> _Session:
        """R2 (and R3 for sessions whose object is gone)."""
        record = self._record_of(handle)
        session = self._sessions.get(handle.token)
        if session is not None:
            return session
        if isinstance(record, StoppingRecord | StoppedRecord):
            raise stop_error(record.reason)
        raise SessionStoppedError("the session was retired by recovery or eviction")

    @staticmethod
    async def _call(call: Awaitable[_T], what: str) -> _T:
        """Await an adapter call; its failures become documented errors."""
        try:
            return await call
        except Exception as error:
            raise _adapter_error(error, what) from error

    @staticmethod
    def _identity_of(unit: Unit) -> ChildIdentity:
        identity = unit.identity
        if not isinstance(identity, ChildIdentity):
            raise ExecutionError(
                f"the unit's identity is a {type(identity).__name__}, not a ChildIdentity"
            )
        return identity

    @staticmethod
    def _code_of(unit: Unit) -> CodeIdentity:
        code = unit.code
        if not isinstance(code, CodeIdentity):
            raise ExecutionError(f"the unit's code is a {type(code).__name__}, not a CodeIdentity")
        return code

    # -- recovery and shutdown --------------------------------------------------------

    async def _recover(self) -> None:
        """Read every record and stop what an earlier run left behind (V1-V5)."""
        try:
            records = await self._store.list()
            high_waters = await self._store.high_water()
        except StateStorageError:
            raise
        except Exception as failure:
            raise StateStorageError(f"the store could not be read: {failure!r}") from failure
        self._index.save_all(records)
        for key, generation in high_waters.items():
            self._index.raise_high_water(key, generation)

        pending = [record for record in records if not isinstance(record, StoppedRecord)]
        terminations: dict[str, Termination] = {}
        failures: list[Exception] = []
        limiter = trio.CapacityLimiter(_RECOVERY_CONCURRENCY)

        async def confirm(record: SessionRecord, child: ChildIdentity) -> None:
            async with limiter:
                with trio.move_on_after(self._confirmation) as scope:
                    try:
                        termination = await self._execution.recover(child)
                        if not isinstance(termination, Termination):
                            raise ExecutionError(
                                f"recover returned {termination!r}, not a Termination"
                            )
                    except Exception as error:
                        failures.append(error)
                    else:
                        terminations[record.handle.token] = termination
                if scope.cancelled_caught:
                    failures.append(
                        ExecutionError(
                            f"recovering {child} took longer than the confirmation timeout"
                        )
                    )

        async with trio.open_nursery() as nursery:
            for record in pending:
                child = _child_of(record)
                if child is None:
                    terminations[record.handle.token] = NO_CHILD
                else:
                    nursery.start_soon(confirm, record, child)

        stopped = [
            recovered(record, terminations[record.handle.token])
            for record in pending
            if record.handle.token in terminations
        ]
        if stopped:
            await self._persist_all(stopped)
            logger.info("recovered %d sessions left over from an earlier run", len(stopped))
        if failures:
            raise TerminationUnconfirmedError(
                f"{len(failures)} orphaned children could not be confirmed gone; "
                "the supervisor does not start",
                causes=tuple(failures),
            ) from failures[0]

    async def _persist_all(self, records: list[StoppedRecord]) -> None:
        try:
            if isinstance(self._store, BatchStore):
                await self._store.save_many(records)
            else:
                for record in records:
                    await self._store.save(record)
        except StateStorageError:
            raise
        except Exception as failure:
            raise StateStorageError(
                f"the store failed to save recovered records: {failure!r}"
            ) from failure
        self._index.save_all(records)

    async def _shutdown(self) -> list[Exception]:
        """Stop every session with reason Shutdown and wait for all (Z1-Z3).

        Returns:
            What went wrong: the poisoning failures, the stops that failed, and the
            problems behind any termination's cause.
        """
        self._closing = True
        reported: list[Exception] = []
        # Every session stops once; each is reported once, on the round it ended in.
        while self._by_key or self._opening:
            sessions = [session for of_key in self._by_key.values() for session in of_key.values()]
            if not sessions:
                # An open is saving its record; its session stops as soon as it exists.
                await self._opened.park()
                continue
            for session in sessions:
                self._request_stop(session, Shutdown())
            for session in sessions:
                with contextlib.suppress(SupervisorError):
                    await session.outcome.wait()
                if session.outcome.error is not None:
                    reported.append(session.outcome.error)
                reported.extend(session.problems)
        problems: list[Exception] = list(self._health.failures)
        for problem in reported:
            if all(problem is not known for known in problems):
                problems.append(problem)
        return problems


def _child_of(record: SessionRecord) -> ChildIdentity | None:
    active = record.previous if isinstance(record, StoppingRecord | StoppedRecord) else record
    if isinstance(active, LoadingRecord | LoadedRecord):
        return active.child
    return None


def _task_name(role: str, handle: Handle) -> str:
    """What a debugger or an instrument shows for a session's task: role, key, generation.

    Made for every session, so not from the handle's repr (which costs more).
    """
    return (
        f"trio_supervisor {role} {handle.key.identity}/{handle.key.instance} #{handle.generation}"
    )


@contextlib.asynccontextmanager
async def open_supervisor(
    store: Store,
    execution: Execution,
    *,
    lease: float = 15.0,
    grace: float = 5.0,
    confirmation_timeout: float = 5.0,
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
        lease=_seconds("lease", lease),
        grace=_seconds("grace", grace, allow_zero=True),
        confirmation_timeout=_seconds("confirmation_timeout", confirmation_timeout),
        limits=limits,
        retention=retention,
    )
    await supervisor._recover()

    async with open_background_nursery() as nursery:
        supervisor._nursery = nursery
        try:
            yield supervisor
        except BaseException as error:
            problems = await _shut_down(supervisor)
            if problems:
                raise BaseExceptionGroup(_PROBLEMS, [error, *problems]) from None
            raise
        else:
            problems = await _shut_down(supervisor)
            if problems:
                raise ExceptionGroup(_PROBLEMS, problems)
        finally:
            supervisor._nursery = None


_PROBLEMS = "the supervisor shut down with problems (Z3)"


async def _shut_down(supervisor: Supervisor) -> list[Exception]:
    # Shielded so that a cancelled block still reaps every child; bounded because each
    # session's termination is (grace + confirmation_timeout, plus its store writes).
    problems: list[Exception] = []
    with trio.CancelScope(shield=True):
        problems = await supervisor._shutdown()
    return problems
