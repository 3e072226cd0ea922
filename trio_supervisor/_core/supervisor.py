"""The supervisor: the face of the engine, and what open, renew, load and dispose do.

Theory of operation
-------------------
A :class:`Supervisor` owns its sessions (``session.py``: an object each, with a task in
the supervisor's nursery once it loads), their leases (``leases.py``: one timer for
all), a view of what its store holds (``records.py``: every lookup is answered from
there in O(1)), its health (``health.py``) and one lock per key (``keylocks.py``). Its
methods check their arguments and the supervisor's state, find the session, and hand
the rest to it:

* ``open`` takes the key's lock, checks the request id and the expected generation,
  supersedes the live generation (waiting for its stop), saves the Open record and only
  then makes the session and starts its lease (O1-O11);
* ``renew``, ``load`` and ``dispose`` find the session by its handle and ask it to
  move its lease, load, or stop (R1-R6, L1-L6, D1-D5);
* entering ``open_supervisor`` (``lifetime.py``) recovers what an earlier run left
  (``recovery.py``, V1-V5); leaving it stops every session with reason Shutdown and
  reaps every child (Z1-Z3: ``lifetime.Lifetime``).

The rules are in docs/design.md, "Semantics"; the ids in comments cite them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import trio

from .._fields import LEASE
from ..errors import (
    RunnerClosingError,
    SessionStoppedError,
    StaleSessionError,
    SupervisorError,
    TerminationUnconfirmedError,
)
from ..model import (
    CodeIdentity,
    Disposed,
    Handle,
    Key,
    Limits,
    Load,
    OpenRecord,
    QuotaClaim,
    SessionRecord,
    Shutdown,
    StoppedRecord,
    StoppingRecord,
    Superseded,
    Termination,
    log_fields,
    negotiate,
)
from .keylocks import KeyLocks
from .lifecycle import stop_error, unexpected_generation
from .parts import Parts
from .reads import OperatorReads
from .services import Services
from .session import Session
from .tokens import TOKENS

__all__ = ["Supervisor"]

# The public name, not the private module's.
logger = logging.getLogger("trio_supervisor.supervisor")


class Supervisor(OperatorReads):
    """Sessions for keys, their leases, their children. Made by :func:`open_supervisor`.

    Not made directly: :func:`open_supervisor` builds it once recovery is over and
    shuts it down when its block ends. Its calls follow docs/design.md, "Semantics";
    the hosts' calls are those of :class:`~trio_supervisor.abc.SupervisorAPI`.

    Args:
        parts: What :func:`open_supervisor` assembled: the store's index, health,
            the running sessions, the lease timer, the execution and the fleet.
        spawn: Starts a task of the supervisor's own (a crash of it poisons, H1).
        lease: The default lease, in seconds.
        limits: The ceilings every session's limits are negotiated against.
    """

    def __init__(
        self,
        parts: Parts,
        *,
        spawn: Callable[[Callable[[], Awaitable[object]], str], None],
        lease: float,
        limits: Limits,
    ) -> None:
        self._lease = lease
        self._limits = limits
        self._health = parts.health
        self._records = parts.records
        self._running = parts.running
        self._leases = parts.leases
        self._fleet = parts.fleet  # alone, or a member of a fleet: chosen once
        self._retaining = parts.retaining
        self._locks = KeyLocks()
        self._services = Services(
            execution=parts.execution,
            health=parts.health,
            persist=self._persist,
            persist_together=self._persist_together,
            spawn=spawn,
            grace=parts.grace,
            confirmation=parts.confirmation,
            stopped=self._stopped,
            ended=self._ended,
        )

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

        Args:
            handle: The session's handle.

        Returns:
            Its last durable record; in a fleet, the Stopped record another runner
            wrote of it once its runner was taken over (F7).

        Raises:
            StaleSessionError: No retained record has this token, key and generation.
        """
        await trio.lowlevel.checkpoint()
        try:
            return self._record_of(handle)
        except StaleSessionError:
            elsewhere = await self._fleet.stopped_elsewhere(handle)
            if elsewhere is None:
                raise
            return elsewhere

    async def high_water(self, key: Key) -> int | None:
        """Return the highest generation ever opened for ``key``, or None (S2); in a
        fleet, as the store knows it, for another runner may have opened the key since.

        Args:
            key: Any key.

        Returns:
            Its high-water generation, or None for a key never opened.

        Raises:
            TypeError: ``key`` is not a :class:`~trio_supervisor.model.Key`.
        """
        await trio.lowlevel.checkpoint()
        if not isinstance(key, Key):
            raise TypeError(f"key must be a Key, not {type(key).__name__}")
        return await self._fleet.high_water(key) or None

    async def wait_failed(self) -> None:
        """Block until the supervisor is poisoned, then raise the poisoning error (H3)."""
        await self._health.wait_failed()

    @property
    def closing(self) -> bool:
        """True once the shutdown began (Z1)."""
        return self._running.closing

    def skip_grace(self) -> None:
        """Stop waiting for children to end by themselves: every stop kills at once.

        For an operator in a hurry (a second Ctrl-C): terminations under way skip the
        rest of their grace, and later ones have none. Children are still killed, and
        their exit confirmed, as P3 says.
        """
        self._services.skip_grace()

    # -- open -------------------------------------------------------------------------

    async def open(
        self,
        key: Key,
        request_id: str,
        *,
        expected_generation: int | None = None,
        lease: float | None = None,
        limits: Limits | None = None,
        quota: QuotaClaim | None = None,
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
            quota: In a fleet, the quota of the tenant whose session this is: the
                store counts its live sessions in the transaction that saves the Open
                record, serialized with the tenant's other opens on every runner (F9).
                A store that is not a fleet's ignores it: a runner alone counts its
                own sessions exactly (``trio_supervisor.service.admission``).

        Returns:
            The new session's Open record, or the retained record of ``request_id``.

        Raises:
            RunnerClosingError: The supervisor is shutting down.
            StaleSessionError: ``expected_generation`` is not the key's high-water.
            QuotaExceededError: In a fleet, the tenant's live sessions are at
                ``quota.sessions``: nothing was saved, no generation was claimed, and
                the supervisor is not poisoned (a live session of the key held here
                was stopped already, as O5 has it).
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
        seconds = self._lease if lease is None else LEASE.seconds("lease", lease)
        if limits is not None and not isinstance(limits, Limits):
            raise TypeError(f"limits must be Limits, not {type(limits).__name__}")
        if quota is not None and not isinstance(quota, QuotaClaim):
            raise TypeError(f"quota must be a QuotaClaim, not {type(quota).__name__}")
        # No request: the supervisor's own limits, shared (records are immutable).
        negotiated = self._limits if limits is None else negotiate(self._limits, limits)

        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_usable()
        await self._locks.acquire(key)
        try:
            return await self._open_locked(
                key, request_id, expected_generation, seconds, negotiated, quota
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
        quota: QuotaClaim | None,
    ) -> SessionRecord:
        """The part of :meth:`open` that runs holding the key's lock (O2)."""
        self._check_usable()
        prior = self._records.index.find_request(key, request_id)
        if prior is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return prior
        # In a fleet: its high-water, and a retry of an open another runner answered,
        # where the host expects another generation than this runner knows.
        prior = await self._fleet.before_open(key, request_id, expected_generation or 0)
        if prior is not None:
            return prior
        self._check_usable()
        high = self._records.high_water(key)
        if (expected_generation or 0) != high:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise unexpected_generation(key, expected_generation, high)
        await self._running.supersede(key)
        self._check_usable()
        record = OpenRecord(
            handle=Handle(key=key, token=TOKENS.next(), generation=high + 1),
            request_id=request_id,
            lease=seconds,
            limits=negotiated,
        )
        with self._running.opening():
            # In a fleet, the tenant's quota is counted with the save (F9); a refusal
            # wrote nothing, as a lost compare-and-set (F3) does.
            try:
                await self._persist(record, quota)
            except StaleSessionError:
                # Another runner holds a later generation: this is a retry it answered
                # (O3), or the host's expectation was stale there too (O4).
                prior = await self._fleet.after_lost_open(key, request_id)
                if prior is not None:
                    return prior
                high = self._records.high_water(key)
                if (expected_generation or 0) != high:
                    raise unexpected_generation(key, expected_generation, high) from None
                raise
            # The record is durable: from here on nothing may stop the session from
            # coming to exist (O11). In a fleet, an older generation held by another
            # runner was told to stop when the record landed, and the open waits for it
            # (F6; deviation (m)); whatever ends that wait, the session then exists.
            # No other checkpoint stands between here and its existence. Its lease starts
            # then, not during the wait, which may be long (O9).
            failure = await self._fleet.wait_older(record.handle)
            session = Session(record, trio.current_time() + seconds, self._services)
            self._running.add(session)
            self._leases.add(session)
            if self._running.closing:
                # Opened while the shutdown began: it stops like every other (Z2).
                session.stop_soon(Shutdown())
            elif self._records.high_water(key) > record.handle.generation:
                # Superseded by another runner while this open waited for the older
                # generations (the notification came before the session existed: F5).
                session.stop_soon(Superseded())
            elif isinstance(failure, TerminationUnconfirmedError):
                # The open fails, so its host never learns the handle: a session left
                # running would be held by nobody until its lease ran out (F6).
                logger.warning(
                    "generation %d of %s/%s is stopped: its open failed (%s)",
                    record.handle.generation,
                    key.identity,
                    key.instance,
                    failure.detail,
                    extra=log_fields(key, record.handle.generation),
                )
                session.stop_soon(Disposed())
        if failure is not None:
            raise failure
        return record

    # -- renew, load, dispose ---------------------------------------------------------

    async def renew(self, handle: Handle) -> float:
        """Extend the session's lease by its lease length from now (R1-R6).

        Args:
            handle: The session's handle.

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
        # A memory operation, in a fleet too: a later generation opened elsewhere stops
        # the session as the store tells of it (F5), not by a read per renew.
        return await (await self._fleet_session_of(handle)).renew()

    async def load(
        self, handle: Handle, load: Load, *, quota: QuotaClaim | None = None
    ) -> CodeIdentity:
        """Load code into the session's child (L1-L6).

        The load belongs to the session: a caller cancelled while waiting stops
        waiting, and the load goes on.

        Args:
            handle: The session's handle.
            load: What to load.
            quota: In a fleet, the quota of the tenant whose session this is: the
                store counts its children (and their ``memory_bytes`` and
                ``cpu_percent`` limits, this session's included) in the transaction
                that saves the load's first Loading record, before anything is
                spawned (F9). A store that is not a fleet's ignores it, as in
                :meth:`open`. A load that joins one in flight (L2) claims nothing.

        Returns:
            What was loaded.

        Raises:
            RunnerClosingError, StaleSessionError, LeaseExpiredError,
            SessionStoppedError: As for :meth:`renew`; also when the session stops
                during the load.
            SessionConflictError: The session loads another specifier.
            QuotaExceededError: In a fleet, the child would take the tenant past a
                quota: nothing was saved or spawned, the session stays Open and may
                load later, and the supervisor is not poisoned.
            PackageError, ExecutionError, StateStorageError: The load failed.
        """
        if not isinstance(load, Load):
            raise TypeError(f"load must be a Load, not {type(load).__name__}")
        if quota is not None and not isinstance(quota, QuotaClaim):
            raise TypeError(f"quota must be a QuotaClaim, not {type(quota).__name__}")
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_usable()
        return await (await self._fleet_session_of(handle)).load(load, quota)

    async def dispose(self, handle: Handle) -> Termination:
        """Stop the session and return how its child ended (D1-D5).

        Works while poisoned and while closing; disposing a stopped session returns
        its recorded termination again.

        Args:
            handle: The session's handle.

        Returns:
            How the session's child ended.

        Raises:
            StaleSessionError: The handle names no retained session.
            SessionStoppedError: The record is known but the session was retired.
            TerminationUnconfirmedError, StateStorageError: The stop failed.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            record = self._record_of(handle)
        except StaleSessionError:
            elsewhere = await self._fleet.stopped_elsewhere(handle)
            if elsewhere is None:
                raise
            record = elsewhere
        if isinstance(record, StoppedRecord):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return record.termination
        session = self._running.get(handle.token)
        if session is None:
            raise SessionStoppedError("the session was retired by recovery or eviction")
        return await session.stop(Disposed())

    # -- the fleet --------------------------------------------------------------------

    async def _fleet_session_of(self, handle: Handle) -> Session:
        """:meth:`_session_of`, and in a fleet, a session stopped elsewhere says why (R3)."""
        try:
            return self._session_of(handle)
        except StaleSessionError:
            elsewhere = await self._fleet.stopped_elsewhere(handle)
            if elsewhere is None:
                raise
            raise stop_error(elsewhere.reason, handle) from None

    # -- what the sessions tell the supervisor ------------------------------------------

    async def _persist(self, record: SessionRecord, quota: QuotaClaim | None = None) -> None:
        """Make ``record`` durable (O8, H1), counted against ``quota`` in a fleet (F9); a
        session whose record is evicted retires (O10)."""
        self._evicted(await self._records.save(record, quota))

    async def _persist_together(self, records: Sequence[SessionRecord]) -> None:
        """Make ``records`` durable at once where the store can (H1, O10)."""
        self._evicted(await self._records.save_together(records))

    def _evicted(self, records: Sequence[SessionRecord]) -> None:
        """Retention evicted ``records``: their sessions retire (O10), and the execution
        lets go of what it keeps of them."""
        if not records:
            return
        for gone in records:
            self._running.retire(gone.handle.token)
        if self._retaining is not None:
            self._retaining.evicted([gone.handle for gone in records])

    def _stopped(self, session: Session) -> None:
        """The session's Stopped record is durable: its record answers from now on (P5)."""
        self._running.retire(session.handle.token)

    def _ended(self, session: Session) -> None:
        """The session's stop is over; it is no longer one of its key's sessions."""
        self._running.ended(session)
        self._leases.stopped()

    # -- checks and lookups -----------------------------------------------------------

    def _check_usable(self) -> None:
        """O1: refuse new work when poisoned or closing."""
        self._health.check()
        if self._running.closing:
            raise RunnerClosingError("the supervisor is shutting down")

    def _record_of(self, handle: Handle) -> SessionRecord:
        if not isinstance(handle, Handle):
            raise TypeError(f"handle must be a Handle, not {type(handle).__name__}")
        record = self._records.index.get(handle.token)
        if record is None or record.handle != handle:
            raise StaleSessionError("no retained session has this token, key and generation")
        return record

    def _session_of(self, handle: Handle) -> Session:
        """R2 (and R3 for sessions whose object is gone)."""
        record = self._record_of(handle)
        session = self._running.get(handle.token)
        if session is not None:
            return session
        if isinstance(record, StoppingRecord | StoppedRecord):
            raise stop_error(record.reason, handle)
        raise SessionStoppedError("the session was retired by recovery or eviction")
