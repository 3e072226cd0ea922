"""The values of docs/design.md, "Public surface": keys, handles, loads, limits, records.

Every class here is frozen, slotted and keyword-only, and checks its fields when it is
built, so an invalid value never exists: an empty identity or one over
:data:`MAX_KEY_LENGTH` characters, a lease that is not a positive finite number of
seconds or a negative limit is refused with an error naming the field. (A lease a
caller *asks* for is also bounded by :data:`MIN_LEASE` and :data:`MAX_LEASE`; a record
holds whatever lease was granted.) Nothing here does I/O or knows about Trio.

Why a session stopped (the seven stop reasons, :data:`StopReason`) and how its child
ended (:class:`Termination`, :class:`ExitStatus`, :class:`Fault`) are defined in
``_termination.py`` and imported here, their public home.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final, Literal, TypeAlias

import attrs

from . import _fields as fields
from ._fields import JSON, MAX_KEY_LENGTH, MAX_LEASE, MIN_LEASE, thaw
from ._termination import (
    Disposed,
    Exited,
    ExitStatus,
    Expired,
    Fault,
    LoadFailed,
    Recovery,
    Shutdown,
    StopReason,
    Superseded,
    Termination,
)
from ._termination import signal_name as signal_name

__all__ = [
    "JSON",
    "LOG_FIELDS",
    "MAX_KEY_LENGTH",
    "MAX_LEASE",
    "MIN_LEASE",
    "ActiveRecord",
    "ChildIdentity",
    "CodeIdentity",
    "Disposed",
    "ExitStatus",
    "Exited",
    "Expired",
    "Fault",
    "FleetRecord",
    "Handle",
    "Key",
    "Limits",
    "Load",
    "LoadFailed",
    "LoadedRecord",
    "LoadingRecord",
    "OpenRecord",
    "Phase",
    "QuotaClaim",
    "Recovery",
    "RunnerInfo",
    "SessionRecord",
    "Shutdown",
    "StopReason",
    "StoppedRecord",
    "StoppingRecord",
    "Superseded",
    "Termination",
    "negotiate",
    "recovered",
    "thaw",
]


# -- identities -----------------------------------------------------------------------


@attrs.frozen(kw_only=True, cache_hash=True)  # a key is hashed at every index it meets
class Key:
    """What a session is for: an identity (say, a plugin) and an instance of it.

    Each is a non-empty string of at most ``MAX_KEY_LENGTH`` (128) characters.
    A key's sessions are numbered by generation, which fences out the older ones (O4).

    Attributes:
        identity: What runs (a plugin's name, say); a tenant's quota matches it.
        instance: Which one of it.

    Raises:
        TypeError, ValueError: A field is not a string, is empty or too long.
    """

    identity: str = attrs.field(validator=fields.key_text)
    instance: str = attrs.field(validator=fields.key_text)


@attrs.frozen(kw_only=True)
class Handle:
    """The capability to act on one session.

    Attributes:
        key: The session's key.
        token: A random UUID4; knowing it is what authorises a caller.
        generation: The fencing token of the key, 1, 2, 3, ...
    """

    key: Key = attrs.field(validator=attrs.validators.instance_of(Key))
    token: str = attrs.field(validator=fields.text, repr=lambda token: f"{token[:8]}...")
    generation: int = attrs.field(validator=fields.at_least(1))


@attrs.frozen(kw_only=True)
class Limits:
    """Resource ceilings for a child; None means no limit.

    A request can lower a ceiling, never raise it: see :func:`negotiate`. The subprocess
    execution enforces them (docs/design.md, "limits"); the in-process one cannot.

    Attributes:
        memory_bytes: Memory of the child's tree (a cgroup's memory plus swap; where
            no cgroup can be written, ``RLIMIT_AS``), >= 0.
        cpu_seconds: CPU time of the child (``RLIMIT_CPU``), >= 1: a child given no
            CPU time at all is killed before it can start.
        open_files: Open file descriptors (``RLIMIT_NOFILE``), >= 0.
        file_size_bytes: The size of any file the child writes (``RLIMIT_FSIZE``), >= 0.
        output_bytes: Bytes of the child's output kept in its log (the head), >= 0.
        processes: Processes and threads of the child's tree at once (a cgroup's
            ``pids.max``), >= 1.
        cpu_percent: CPU the child's tree may use, 100 being one core (a cgroup's
            CPU quota, as systemd's ``CPUQuota=``), >= 1.

    Raises:
        TypeError, ValueError: A field is not an int or None, or below its minimum.
    """

    memory_bytes: int | None = attrs.field(default=None, validator=fields.limit)
    # At least a second: a child given no CPU time at all is killed before it can start.
    cpu_seconds: int | None = attrs.field(default=None, validator=fields.cpu_limit)
    open_files: int | None = attrs.field(default=None, validator=fields.limit)
    file_size_bytes: int | None = attrs.field(default=None, validator=fields.limit)
    output_bytes: int | None = attrs.field(default=None, validator=fields.limit)
    # For the child's whole tree (a cgroup): how many processes and threads it may hold
    # at once, and how much CPU it may use, 100 being one core (systemd's CPUQuota=).
    # At least 1: a child with no process or no CPU at all cannot start.
    processes: int | None = attrs.field(default=None, validator=fields.tree_limit)
    cpu_percent: int | None = attrs.field(default=None, validator=fields.tree_limit)


def lowest(one: int | None, other: int | None) -> int | None:
    """The lower of two limits, None counting as no limit (so the other wins)."""
    if one is None:
        return other
    if other is None:
        return one
    return min(one, other)


def negotiate(supervisor: Limits, requested: Limits) -> Limits:
    """Return the field-wise minimum of two limits, None counting as infinite.

    A host may tighten a ceiling but never loosen it (docs/design.md, "limits"; O7).

    Args:
        supervisor: The ceilings the runner's owner configured.
        requested: What the host asks for.

    Returns:
        Limits no looser than ``supervisor`` in any field.
    """
    return Limits(
        memory_bytes=lowest(supervisor.memory_bytes, requested.memory_bytes),
        cpu_seconds=lowest(supervisor.cpu_seconds, requested.cpu_seconds),
        open_files=lowest(supervisor.open_files, requested.open_files),
        file_size_bytes=lowest(supervisor.file_size_bytes, requested.file_size_bytes),
        output_bytes=lowest(supervisor.output_bytes, requested.output_bytes),
        processes=lowest(supervisor.processes, requested.processes),
        cpu_percent=lowest(supervisor.cpu_percent, requested.cpu_percent),
    )


def _patterns(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"QuotaClaim.identities must be a sequence of str, not {value!r}")
    for pattern in value:
        fields.text.check("QuotaClaim.identities[]", pattern)
    return tuple(value)


@attrs.frozen(kw_only=True)
class QuotaClaim:
    """A tenant's quota, checked where a fleet's store saves an Open record, or a
    session's first Loading record, in the same transaction (docs/design.md, F9).

    A record counts for the claim when its key's identity matches any of ``identities``
    (``fnmatch.fnmatchcase``). A store that is not a fleet's ignores claims: a runner
    alone counts its own sessions exactly (``trio_supervisor.service.admission``).

    Attributes:
        tenant: Whose quota: the store serializes the claims of one tenant.
        identities: The tenant's identities, as fnmatch patterns.
        sessions: Live (not Stopped) sessions; None: no quota on that count.
        children: Children (sessions Loading or Loaded); None: no quota.
        memory_bytes: The children's summed ``Limits.memory_bytes``; None: no quota.
        cpu_percent: The children's summed ``Limits.cpu_percent``; None: no quota.
        unlimited_memory_bytes: What a child without a ``memory_bytes`` limit counts
            towards ``memory_bytes`` (0 by default: what it may take is unknown).
        unlimited_cpu_percent: What a child without a ``cpu_percent`` limit counts
            towards ``cpu_percent`` (0 by default).

    Raises:
        TypeError, ValueError: A field is of the wrong type or negative.
    """

    tenant: str = attrs.field(validator=fields.text)
    identities: tuple[str, ...] = attrs.field(converter=_patterns)
    sessions: int | None = attrs.field(default=None, validator=fields.optional(fields.count))
    children: int | None = attrs.field(default=None, validator=fields.optional(fields.count))
    memory_bytes: int | None = attrs.field(default=None, validator=fields.optional(fields.count))
    cpu_percent: int | None = attrs.field(default=None, validator=fields.optional(fields.count))
    unlimited_memory_bytes: int = attrs.field(default=0, validator=fields.count)
    unlimited_cpu_percent: int = attrs.field(default=0, validator=fields.count)


@attrs.frozen(kw_only=True)
class Load:
    """Which code to run in a session, and the configuration handed to it.

    ``config`` is copied into an immutable JSON value (read-only mappings, tuples).

    Attributes:
        specifier: The code, as the execution resolves it (``pkg.module:function``
            for the built-in executions).
        config: The plugin's configuration, a JSON object.

    Raises:
        TypeError, ValueError: The specifier is empty, or the config is not a JSON
            object.
    """

    specifier: str = attrs.field(validator=fields.text)
    config: Mapping[str, JSON] = attrs.field(
        factory=lambda: types.MappingProxyType({}), converter=fields.freeze_config, hash=False
    )


@attrs.frozen(kw_only=True)
class CodeIdentity:
    """What was actually loaded.

    Attributes:
        specifier: The load's specifier.
        origin: Where the code was resolved to (a module path, an executable).
        digest: A content digest of that code, e.g. ``sha256:...``.
        version: The version of the distribution that holds it, if any.
    """

    specifier: str = attrs.field(validator=fields.text)
    origin: str | None = attrs.field(default=None, validator=fields.optional_text)
    digest: str | None = attrs.field(default=None, validator=fields.optional_text)
    version: str | None = attrs.field(default=None, validator=fields.optional_text)


@attrs.frozen(kw_only=True)
class ChildIdentity:
    """What is persisted to find a child again after a crash.

    Attributes:
        adapter: Which execution made the child ("subprocess", "inprocess", ...).
        ref: The adapter's own name for the child, unique within the adapter.
        pid: The process id, for process children.
        pgid: The process group, signalled as a whole.
        start_time: The process start time in clock ticks since boot (field 22 of
            ``/proc/PID/stat``): a pid alone may have been reused.
        boot_id: The kernel's boot id; after a reboot no recorded pid is ours.
        cgroup: The cgroup that holds the child's whole tree, relative to the root of
            each hierarchy (``trio_supervisor/.../NAME``), where one was made.
        uid: The user id the child ran as, where it had one of its own (the runner's
            ``isolation_users``): recovery frees it once the child is gone.
    """

    adapter: str = attrs.field(validator=fields.text)
    ref: str = attrs.field(validator=fields.text)
    pid: int | None = attrs.field(default=None, validator=fields.optional_integer)
    pgid: int | None = attrs.field(default=None, validator=fields.optional_integer)
    start_time: int | None = attrs.field(default=None, validator=fields.optional_integer)
    boot_id: str | None = attrs.field(default=None, validator=fields.optional_text)
    cgroup: str | None = attrs.field(default=None, validator=fields.optional_text)
    uid: int | None = attrs.field(default=None, validator=fields.optional_integer)


# -- log fields -----------------------------------------------------------------------


LOG_FIELDS: Final = (
    # A session's (log_fields).
    "identity",
    "instance",
    "generation",
    # A child's tree killed at recovery (executions/_recovery.py).
    "pid",
    "pgid",
    "descendants_killed",
    # What an execution found at start: its containment, cgroups and isolation.
    "containment",
    "cgroups",
    "isolation",
    # A caller refused (service/app.py).
    "tenant",
    "status",
)
"""Every field the package's log records carry (``extra=``), in the order
``serve --log-format json`` prints them; a test holds every ``extra=`` to this list."""


def log_fields(key: Key, generation: int) -> dict[str, object]:
    """A session's key and generation as a log record's fields (``extra=``).

    Every log line about a session carries them; ``serve --log-format json`` prints
    them as fields of their own.
    """
    return {"identity": key.identity, "instance": key.instance, "generation": generation}


# -- records --------------------------------------------------------------------------


class Phase(enum.Enum):
    """The phase of a session, in the order a session moves through them."""

    OPEN = "Open"
    LOADING = "Loading"
    LOADED = "Loaded"
    STOPPING = "Stopping"
    STOPPED = "Stopped"


@attrs.frozen(kw_only=True)
class _Record:
    handle: Handle = attrs.field(validator=attrs.validators.instance_of(Handle))
    request_id: str = attrs.field(validator=fields.text)
    lease: float = attrs.field(converter=fields.as_float, validator=fields.RECORDED_LEASE)
    limits: Limits = attrs.field(validator=attrs.validators.instance_of(Limits))


@attrs.frozen(kw_only=True)
class OpenRecord(_Record):
    """A session that exists and runs nothing yet (O7).

    Attributes:
        handle: The session's handle.
        request_id: The id of the open that made it (O3).
        lease: Its lease, in seconds.
        limits: Its negotiated ceilings.
    """

    phase: ClassVar[Literal[Phase.OPEN]] = Phase.OPEN


@attrs.frozen(kw_only=True)
class LoadingRecord(_Record):
    """A session loading code; ``child`` is set once the child exists (write-ahead, L3, L4).

    Attributes:
        handle, request_id, lease, limits: As in :class:`OpenRecord`.
        load: What it loads.
        child: The child's identity, saved before the child starts; None before
            the child exists.
    """

    load: Load = attrs.field(validator=attrs.validators.instance_of(Load))
    child: ChildIdentity | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.instance_of(ChildIdentity)),
    )

    phase: ClassVar[Literal[Phase.LOADING]] = Phase.LOADING


@attrs.frozen(kw_only=True)
class LoadedRecord(_Record):
    """A session whose child runs the loaded code (L4).

    Attributes:
        handle, request_id, lease, limits: As in :class:`OpenRecord`.
        load: What it loaded.
        code: What was really loaded.
        child: The child's identity.
    """

    load: Load = attrs.field(validator=attrs.validators.instance_of(Load))
    code: CodeIdentity = attrs.field(validator=attrs.validators.instance_of(CodeIdentity))
    child: ChildIdentity = attrs.field(validator=attrs.validators.instance_of(ChildIdentity))

    phase: ClassVar[Literal[Phase.LOADED]] = Phase.LOADED


def carried(record: _Record) -> dict[str, Any]:
    """The fields a session's record carries into the record of its next phase.

    Every record of a session repeats its handle, request id, lease and limits; each
    next record is built from these and what the new phase adds.
    """
    return {
        "handle": record.handle,
        "request_id": record.request_id,
        "lease": record.lease,
        "limits": record.limits,
    }


#: A record of a session that has not begun to stop: Open, Loading or Loaded.
ActiveRecord: TypeAlias = OpenRecord | LoadingRecord | LoadedRecord
_ACTIVE = (OpenRecord, LoadingRecord, LoadedRecord)
_REASONS = (Expired, Disposed, Exited, LoadFailed, Superseded, Shutdown, Recovery)


def _previous(instance: _Record, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, _ACTIVE):
        raise TypeError(
            f"{fields.where(instance, attribute)} must be an Open, Loading or Loaded record, "
            f"not {type(value).__name__}"
        )
    if value.handle != instance.handle:
        raise ValueError(f"{fields.where(instance, attribute)} belongs to another session")


@attrs.frozen(kw_only=True)
class StoppingRecord(_Record):
    """A session being terminated; ``previous`` is the record it was in (P2).

    Attributes:
        handle, request_id, lease, limits: As in :class:`OpenRecord`.
        previous: The active record the session stopped from.
        reason: Why it stops: the first stop request's reason (P1).
    """

    previous: ActiveRecord = attrs.field(validator=_previous)
    reason: StopReason = attrs.field(validator=attrs.validators.instance_of(_REASONS))

    phase: ClassVar[Literal[Phase.STOPPING]] = Phase.STOPPING

    @classmethod
    def of(cls, previous: ActiveRecord, reason: StopReason) -> StoppingRecord:
        """The Stopping record of the session whose active record is ``previous``.

        Args:
            previous: The session's active record.
            reason: Why it stops.

        Returns:
            The record, carrying ``previous``'s handle, request id, lease and limits.
        """
        return cls(**carried(previous), previous=previous, reason=reason)


@attrs.frozen(kw_only=True)
class StoppedRecord(_Record):
    """A session that ended; ``termination`` says how its child ended (P5).

    Attributes:
        handle, request_id, lease, limits: As in :class:`OpenRecord`.
        previous: The active record the session stopped from.
        reason: Why it stopped.
        termination: How its child ended.
    """

    previous: ActiveRecord = attrs.field(validator=_previous)
    reason: StopReason = attrs.field(validator=attrs.validators.instance_of(_REASONS))
    termination: Termination = attrs.field(validator=attrs.validators.instance_of(Termination))

    phase: ClassVar[Literal[Phase.STOPPED]] = Phase.STOPPED

    @classmethod
    def of(
        cls, previous: ActiveRecord, reason: StopReason, termination: Termination
    ) -> StoppedRecord:
        """The Stopped record of the session whose active record is ``previous``.

        Args:
            previous: The session's active record.
            reason: Why it stopped.
            termination: How its child ended.

        Returns:
            The record, carrying ``previous``'s handle, request id, lease and limits.
        """
        return cls(**carried(previous), previous=previous, reason=reason, termination=termination)


#: Any record of a session, in any of the five phases.
SessionRecord: TypeAlias = (
    OpenRecord | LoadingRecord | LoadedRecord | StoppingRecord | StoppedRecord
)


def recovered(record: SessionRecord, termination: Termination) -> StoppedRecord:
    """The Stopped record, with reason Recovery, of a record left over from a crash (V3).

    Recovery writes it for the records of its own earlier run; a runner of a fleet
    writes it for the records of a dead runner it takes over.

    Args:
        record: A record that is not Stopped.
        termination: How its child ended, as far as is known.

    Returns:
        The Stopped record; its ``previous`` is ``record``, or for a Stopping record
        that record's own ``previous``.

    Raises:
        ValueError: ``record`` is Stopped already.
    """
    if isinstance(record, StoppedRecord):
        raise ValueError("a Stopped record needs no recovery")
    previous = record.previous if isinstance(record, StoppingRecord) else record
    return StoppedRecord.of(previous, Recovery(), termination)


# -- the fleet ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RunnerInfo:
    """One runner of a fleet, as the shared store sees it (docs/service.md section C).

    Attributes:
        runner_id: Its name in the fleet, stable across its restarts.
        epoch: Its incarnation: every start (and every takeover of its records) moves
            it on, and a write made under an older epoch is refused. A takeover moves
            it to fence the dead runner, not because it started again: then
            ``taken_over_at`` says so.
        advertise: Where hosts and other runners reach it (an URL), or "" if unknown.
        started_at: When this incarnation registered, seconds since the Unix epoch
            (the database's clock).
        lease_until: Until when its row is valid without a renewal, seconds since the
            Unix epoch (the database's clock).
        alive: Whether ``lease_until`` was still ahead when the row was read.
        sessions: How many of the fleet's unstopped records it holds.
        children: How many of those have a child (Loading or Loaded).
        memory_allocated: Their children's summed memory ceilings, in bytes.
        max_children, allocatable: Its capacity (docs/service.md D): children at once,
            and bytes its children's memory ceilings may sum to; None where unknown
            (another runner's, or a runner without capacity).
        stop_bound: How long past a session's lease its children may take to end (its
            grace, confirmation and the dead-man switch's slack): with the session's
            lease, the margin after ``lease_until`` before a takeover (0 where unknown).
        draining: Whether it drains: it takes no new sessions, and stops once its own
            have ended or its drain's deadline passed (docs/service.md section B).
        taken_over_at: When another runner took its records over (it was dead past its
            takeover margin) and moved its epoch on, seconds since the Unix epoch (the
            database's clock); None if it was not taken over since it last registered.
        taken_over_by: The runner that took it over; None likewise.
    """

    runner_id: str
    epoch: int
    advertise: str
    started_at: float
    lease_until: float
    alive: bool
    sessions: int
    children: int = 0
    memory_allocated: int = 0
    max_children: int | None = None
    allocatable: int | None = None
    stop_bound: float = 0.0
    draining: bool = False
    taken_over_at: float | None = None
    taken_over_by: str | None = None


@attrs.frozen(kw_only=True)
class FleetRecord:
    """A record of the fleet's store, with the runner that wrote it.

    Attributes:
        record: The record.
        runner_id: The runner that holds the session (wrote its last record).
        epoch: The incarnation of that runner that wrote it.
        age: How long the session has existed, in seconds, by the database's clock,
            while it is not Stopped and its runner has published its times (with each
            renewal of its row); else None. Not part of the record: left out of
            comparisons.
        lease_left: How long its lease has left, in seconds, likewise, as of its
            runner's last renewal: a renewal of the session since then makes it longer.
    """

    record: SessionRecord
    runner_id: str
    epoch: int
    age: float | None = attrs.field(default=None, eq=False)
    lease_left: float | None = attrs.field(default=None, eq=False)
