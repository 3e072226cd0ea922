"""The protocols: what a store and an execution must do (docs/design.md, "Adapters"), and
the calls every supervisor offers its hosts, embedded or remote (:class:`SupervisorAPI`).

A leaf module: it imports only values, so the core and every adapter can import it
without loading any adapter.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol, runtime_checkable

from .model import (
    ChildIdentity,
    CodeIdentity,
    ExitStatus,
    FleetRecord,
    Handle,
    Key,
    Limits,
    Load,
    QuotaClaim,
    RunnerInfo,
    SessionRecord,
    Termination,
)
from .retention import Retention

__all__ = [
    "BatchStore",
    "Execution",
    "FleetMember",
    "FleetStore",
    "Retaining",
    "Store",
    "SupervisorAPI",
    "Unit",
    "switch_slack",
]


@runtime_checkable
class Store(Protocol):
    """Where records are made durable.

    A store keeps, per token, the last record saved; applies its retention policy on
    every save; and keeps each key's high-water generation apart from retention, never
    evicting it.

    ``save`` must be safe to cancel: when its caller is cancelled, either the record is
    durable and ``save`` returns normally (the cancellation is seen at the caller's next
    checkpoint), or ``Cancelled`` is raised and nothing was written. It must return or
    raise in bounded time: the supervisor waits for it while terminating children.
    """

    @property
    def retention(self) -> Retention:
        """The retention policy this store applies."""
        ...

    async def save(self, record: SessionRecord) -> None:
        """Make ``record`` durable, replacing its token's earlier record (O8, P2, P5).

        Applies the retention policy in the same write (O10). Cancel-atomic (O11).

        Args:
            record: The record to save; it replaces the record saved last under its
                handle's token.

        Raises:
            StateStorageError: The record could not be made durable.
        """
        ...

    async def list(self) -> Sequence[SessionRecord]:
        """Every retained record, in the order they were last saved (read by recovery, V1).

        Returns:
            The last record of each retained token, oldest save first.

        Raises:
            StateStorageError: The store cannot be read, or holds a record that is
                malformed or of an unknown version (a ``RecordFormatError``).
        """
        ...

    async def high_water(self) -> Mapping[Key, int]:
        """Every key's highest generation ever saved, evicted keys included (V5).

        Returns:
            The high-water generation of every key ever opened.

        Raises:
            StateStorageError: The store cannot be read.
        """
        ...


@runtime_checkable
class BatchStore(Store, Protocol):
    """A store that can make several records durable at once (used by recovery)."""

    async def save_many(self, records: Sequence[SessionRecord]) -> None:
        """Make every record durable, as one atomic write where the store can.

        Recovery writes its Stopped records this way (V3), and a childless stop its
        Stopping and Stopped records (docs/design.md, deviation (k)).

        Args:
            records: The records to save, in order; a later record of a token
                replaces an earlier one.

        Raises:
            StateStorageError: The records could not be made durable.
        """
        ...


class FleetMember(Protocol):
    """What a supervisor tells the fleet's store about itself (:meth:`FleetStore.run_member`)."""

    @property
    def stop_bound(self) -> float:
        """Seconds a child may take to end once its lease ran out: grace plus confirmation.

        Another runner takes this one's records over only once its row expired more
        than a record's lease plus this ago (docs/service.md section C, "Takeover").
        """
        ...

    def live(self) -> Mapping[Key, int]:
        """The lowest generation of every key with an unfinished session here (F5, F7).

        Returns:
            By key, the lowest generation of its sessions that have not stopped.
        """
        ...

    def times(self) -> Mapping[str, tuple[float, float]]:
        """How long each session running here has existed and how long its lease has
        left, in seconds, by its token: what the fleet's other runners show operators
        (the store publishes them when a listing of the fleet's records asks, F2).

        Returns:
            By token, the session's age and its lease left, in seconds.
        """
        ...

    def shortest_lease(self) -> float | None:
        """The shortest lease of the sessions unfinished here, in seconds; None while
        there are none. The store checks their keys' high-water at least every third of
        it (F5), so that a lost notification costs at most one renew period."""
        ...

    def superseded(self, key: Key, high_water: int) -> None:
        """Stop, with reason Superseded, every session here of ``key`` below ``high_water``.

        Called from the supervisor's run (never from another thread); returns at once
        (F5).

        Args:
            key: The key another member opened a newer generation of.
            high_water: That newer generation; every session of ``key`` below it stops.
        """
        ...


@runtime_checkable
class FleetStore(BatchStore, Protocol):
    """A store several supervisors share, each a *member* under its own id: a fleet.

    Beyond a store's promises (docs/service.md section C):

    * **Global fencing.** Saving an Open record claims its generation for the whole
      fleet: unless the key's high-water in the store is the generation just before,
      the save writes nothing and raises ``StaleSessionError`` (which does not poison).
    * **Fenced writes.** Every write is checked, in its own transaction, against this
      member's epoch; once another member took this one's records over, every write
      raises ``StateStorageError`` and nothing lands.
    * **Quotas across the fleet.** :meth:`save_within` counts a tenant's quota in the
      transaction that saves the record, serialized with the tenant's other claims
      (docs/design.md, F9).
    * ``list()`` gives this member's records (those of its earlier epochs included,
      for recovery); ``high_water()`` the marks of the whole fleet.
    """

    @property
    def member(self) -> str:
        """This member's id in the fleet (a runner's ``--runner-id``)."""
        ...

    async def save_within(self, record: SessionRecord, quota: QuotaClaim) -> None:
        """Make ``record`` durable as ``save`` does, if ``quota``'s tenant stays within
        its quota with it counted, across the fleet.

        The count is made in the transaction that writes the record, after every other
        claim of the same tenant that committed before it (two members never both take
        the last slot). An Open record takes a session, unless a live older generation
        of its key counts already; a session's first Loading record takes a child and
        its ``memory_bytes`` and ``cpu_percent`` limits. Records count for the tenant
        when their identity matches one of its patterns (F9).

        Args:
            record: The record to save, as for :meth:`Store.save`.
            quota: The tenant's claim: its identity patterns and quotas.

        Raises:
            QuotaExceededError: The record would pass a quota; nothing was written (no
                generation claimed); it does not poison.
            StaleSessionError, StateStorageError: As for ``save``.
        """
        ...

    async def lookup(self, key: Key, request_id: str | None) -> tuple[int, SessionRecord | None]:
        """The key's high-water in the store now, and its retained record opened with
        ``request_id`` (whichever member holds it), if any (F3; O3 across the fleet).

        Args:
            key: The key to look up.
            request_id: The request id of an open to find again; None finds none.

        Returns:
            The key's high-water generation (0 if never opened) and the record
            opened with ``request_id``, or None.

        Raises:
            StoreUnavailableError: The store stayed out of reach for its
                ``store_wait`` (B1), or a failover is not yet settled (B6).
            StateStorageError: The store could not be read.
        """
        ...

    async def wait_older_stopped(self, handle: Handle) -> None:
        """Return once no record of ``handle.key`` below its generation is unstopped on
        another member (O5 across the fleet).

        A record whose member is dead past its takeover margin is taken over on the
        way. Bounded while that member lives by its ``stop_bound`` plus a check period
        (F6, F7).

        Args:
            handle: The new session, whose older generations must be stopped.

        Raises:
            TerminationUnconfirmedError: A live member did not stop its older
                generation within that bound.
        """
        ...

    async def run_member(self, member: FleetMember) -> None:
        """Keep this member in the fleet until cancelled.

        Renews its row, hears of opens that supersede its sessions (a notification as
        the wake-up, a periodic check as the guarantee, at least every third of
        ``member.shortest_lease()``) and tells ``member.superseded``, and takes over the
        records of dead members (F1, F2, F5, F7).

        Args:
            member: The supervisor this store serves, asked for its sessions.

        Raises:
            RunnerFencedError: The member lost its row (it could not renew it in time,
                or another member took its records over); the supervisor is poisoned.
        """
        ...

    async def runners(self) -> Sequence[RunnerInfo]:
        """Every runner of the fleet, by id (for operators).

        Returns:
            Each runner's id, advertised URL, epoch and state.
        """
        ...

    async def fleet_records(self) -> Sequence[FleetRecord]:
        """Every retained record of the fleet, in save order, each with its runner.

        Asks the members for their sessions' ages and leases first (F2).

        Returns:
            Each record with its runner, age and lease left.
        """
        ...

    async def held(self, token: str) -> FleetRecord | None:
        """The retained record of ``token``, whichever member holds it (F8).

        Args:
            token: A handle's token.

        Returns:
            The record with its runner, or None when none is retained.
        """
        ...

    async def owner(self, token: str) -> RunnerInfo | None:
        """The runner that holds the session of ``token``, if a record of it is retained.

        A runner asked about a session it does not hold answers with this one (F8).

        Args:
            token: A handle's token.

        Returns:
            The holding runner, or None when no record of ``token`` is retained.
        """
        ...

    async def drain(self) -> None:
        """Mark this member draining in :meth:`runners` until it starts again."""
        ...


@runtime_checkable
class Unit(Protocol):
    """The child of one session: an OS process, a Trio task, ...

    A unit is spawned not yet running; the supervisor persists its identity, then calls
    :meth:`start`. :meth:`interrupt` and :meth:`kill` are requests that return at once;
    only :meth:`wait` confirms an exit. Errors are reported as ``ExecutionError`` (or
    ``PackageError`` when the code itself is at fault).
    """

    @property
    def identity(self) -> ChildIdentity:
        """What finds the child again after a crash of the supervisor."""
        ...

    @property
    def code(self) -> CodeIdentity:
        """What code the child runs."""
        ...

    async def start(self) -> None:
        """Start the code; return once it began (L4).

        Raises:
            PackageError: The code could not be started.
            ExecutionError: The child could not be started.
        """
        ...

    async def renew(self, lease: float) -> None:
        """Tell the child its lease now ends ``lease`` seconds from now (R5).

        Args:
            lease: Seconds from now.

        Raises:
            ExecutionError: The lease could not be passed on.
        """
        ...

    async def interrupt(self) -> None:
        """Ask the child to stop (SIGTERM, or a cancellation it may handle); a request (P3)."""
        ...

    async def kill(self) -> None:
        """Stop the child outright (SIGKILL, or an outright cancellation); a request (P3)."""
        ...

    async def wait(self) -> ExitStatus:
        """Wait for the child to exit and return how; any number of tasks may wait.

        Only this confirms an exit (P3, X1).

        Returns:
            How the child exited.
        """
        ...

    async def aclose(self) -> None:
        """Release the unit's resources; called once, when its session ends (P4)."""
        ...


@runtime_checkable
class Execution(Protocol):
    """The adapter that spawns units, and finds them again after a crash."""

    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> Unit:
        """Make the unit that will run ``load`` for the session ``handle``, not yet started.

        The unit belongs to the session from then on (L4).

        Args:
            handle: The session the unit is for.
            load: The code to run.
            limits: The session's negotiated ceilings, to enforce where the
                execution can.

        Returns:
            The unit, not yet started.

        Raises:
            PackageError: The load's code cannot be resolved.
            ExecutionError: The unit could not be made.
        """
        ...

    async def recover(self, child: ChildIdentity) -> Termination:
        """Make sure a child left over from an earlier run is gone, and say how it ended.

        Never signals anything that is not the recorded child (V2).

        Args:
            child: The identity a Loading or Loaded record holds.

        Returns:
            How the child ended, or that it was already gone.

        Raises:
            ExecutionError: The child's end could not be confirmed.
        """
        ...


def switch_slack(execution: Execution) -> float:
    """Seconds past its lease a child of ``execution`` may go on by itself when its runner
    is gone: its ``switch_slack`` attribute, which an execution whose children outlive
    their runner (processes with a dead-man switch) sets; 0 for one whose children end
    with it (tasks). A fleet waits this much more before it takes a dead runner's
    sessions over (docs/design.md, F7).

    Args:
        execution: Any execution.

    Returns:
        Its ``switch_slack`` in seconds, or 0.0 when it has none.

    Raises:
        TypeError: Its ``switch_slack`` is not a number of seconds >= 0.
    """
    slack = getattr(execution, "switch_slack", 0.0)
    if isinstance(slack, bool) or not isinstance(slack, int | float) or not slack >= 0:
        raise TypeError(f"an execution's switch_slack must be seconds >= 0, not {slack!r}")
    return float(slack)


@runtime_checkable
class Retaining(Protocol):
    """An execution that keeps something of each session after its child is gone (the
    subprocess execution keeps its log) for exactly as long as the session's record is
    retained. Optional: the supervisor tells an execution that has these methods which
    records retention evicts, and which are retained once recovery is over.
    """

    def evicted(self, handles: Sequence[Handle]) -> None:
        """Retention evicted these sessions' records: let go of what is kept of them.

        Called in the supervisor's run once the store acknowledged the save that evicted
        them; returns at once (the work may end later) and raises nothing (O10).

        Args:
            handles: The handles of the evicted records.
        """
        ...

    async def retained(self, handles: Collection[Handle]) -> None:
        """Recovery is over, and these are the handles of every retained record: let go
        of what is kept of any other session (evicted while no supervisor ran, or kept
        by a store that held nothing across the restart, as a ``MemoryStore``).

        Args:
            handles: The handle of every retained record.

        Raises:
            ExecutionError: What is kept could not be looked at; the supervisor logs it
                and starts all the same.
        """
        ...


@runtime_checkable
class SupervisorAPI(Protocol):
    """The calls a host makes on a supervisor, wherever the supervisor runs.

    Both the embedded :class:`~trio_supervisor.Supervisor` and the runner's client,
    :class:`~trio_supervisor.client.RemoteSupervisor`, offer these methods with these
    signatures, the same values and the same errors (docs/design.md, "Public surface";
    on the wire, docs/service.md section A). Code written against this protocol runs on either:
    moving a host from an embedded supervisor to a remote runner changes only how the
    object is made.
    """

    async def open(
        self,
        key: Key,
        request_id: str,
        *,
        expected_generation: int | None = None,
        lease: float | None = None,
        limits: Limits | None = None,
    ) -> SessionRecord:
        """Open the next generation of ``key`` and return its Open record (O1-O11).

        A retry with the same ``request_id`` returns the record of the first open.

        Args:
            key: What the session is for.
            request_id: The caller's id of this request; a retry with the same id
                returns the same record (O3).
            expected_generation: The key's high-water generation the caller saw;
                None means 0, a key never opened (O4).
            lease: Seconds; the supervisor's default when None.
            limits: Ceilings to ask for; they can only lower the supervisor's.

        Returns:
            The new session's Open record, or the retained record of ``request_id``.

        Raises:
            StaleSessionError: ``expected_generation`` is not the key's high-water.
            RunnerClosingError: The supervisor is shutting down.
            StateStorageError: The supervisor is poisoned.
        """
        ...

    async def renew(self, handle: Handle) -> float:
        """Extend the session's lease from now and return its length in seconds (R1-R6).

        Args:
            handle: The session's handle.

        Returns:
            The lease, in seconds.

        Raises:
            StaleSessionError: The handle names no retained session.
            LeaseExpiredError: The lease already ran out.
            SessionStoppedError: The session stops or stopped for another reason.
        """
        ...

    async def load(self, handle: Handle, load: Load) -> CodeIdentity:
        """Load code into the session's child and return what was loaded (L1-L6).

        Args:
            handle: The session's handle.
            load: What to load.

        Returns:
            What was loaded.

        Raises:
            StaleSessionError, LeaseExpiredError, SessionStoppedError: As for
                :meth:`renew`; also when the session stops during the load.
            SessionConflictError: The session loads another specifier.
            PackageError: The specifier cannot be resolved or started.
            ExecutionError: The child could not be made or started.
        """
        ...

    async def dispose(self, handle: Handle) -> Termination:
        """Stop the session and return how its child ended (D1-D5).

        Disposing a stopped session returns its recorded termination again.

        Args:
            handle: The session's handle.

        Returns:
            How the session's child ended.

        Raises:
            StaleSessionError: The handle names no retained session.
            TerminationUnconfirmedError: The child was killed and not seen to exit.
        """
        ...

    async def status(self, handle: Handle) -> SessionRecord:
        """Return the session's last durable record (S1).

        Args:
            handle: The session's handle.

        Returns:
            The last record made durable.

        Raises:
            StaleSessionError: The handle names no retained session.
        """
        ...

    async def high_water(self, key: Key) -> int | None:
        """Return the highest generation ever opened for ``key``, or None (S2).

        Args:
            key: Any key.

        Returns:
            Its high-water generation, or None for a key never opened.
        """
        ...
