"""The values of docs/design.md, "Public surface": keys, handles, loads, limits, records.

Every class here is frozen, slotted and keyword-only, and checks its fields when it is
built, so an invalid value never exists: an empty identity, a lease that is not a
positive finite number of seconds or a negative limit is refused with an error naming
the field. Nothing here does I/O or knows about Trio.
"""

from __future__ import annotations

import enum
import math
import signal
import types
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, TypeAlias

import attrs

__all__ = [
    "JSON",
    "ActiveRecord",
    "ChildIdentity",
    "CodeIdentity",
    "Disposed",
    "ExitStatus",
    "Exited",
    "Expired",
    "Fault",
    "Handle",
    "Key",
    "Limits",
    "Load",
    "LoadFailed",
    "LoadedRecord",
    "LoadingRecord",
    "OpenRecord",
    "Phase",
    "Recovery",
    "SessionRecord",
    "Shutdown",
    "StopReason",
    "StoppedRecord",
    "StoppingRecord",
    "Superseded",
    "Termination",
    "negotiate",
    "thaw",
]

JSON: TypeAlias = bool | int | float | str | Sequence["JSON"] | Mapping[str, "JSON"] | None


# -- field checks ---------------------------------------------------------------------
# Each names the class and the field, so the error says exactly what was wrong.


def _where(instance: object, attribute: attrs.Attribute[Any]) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def _text(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{_where(instance, attribute)} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{_where(instance, attribute)} must not be empty")


def _optional_text(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"{_where(instance, attribute)} must be a str or None, not {type(value).__name__}"
        )


def _integer(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    # bool is an int to Python, never to us.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{_where(instance, attribute)} must be an int, not {type(value).__name__}")


def _optional_integer(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _integer(instance, attribute, value)


def _at_least(minimum: int) -> Any:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        _integer(instance, attribute, value)
        assert isinstance(value, int)
        if value < minimum:
            raise ValueError(f"{_where(instance, attribute)} must be >= {minimum}, got {value}")

    return check


def _limit(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    _integer(instance, attribute, value)
    assert isinstance(value, int)
    if value < 0:
        raise ValueError(
            f"{_where(instance, attribute)} must be None (no limit) or >= 0, got {value}"
        )


def _cpu_limit(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _limit(instance, attribute, value)
    if value == 0:
        raise ValueError(
            f"{_where(instance, attribute)} must be None (no limit) or >= 1, got 0: "
            "a child with no CPU time cannot start"
        )


def _as_float(value: object) -> object:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _lease(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, float):
        raise TypeError(
            f"{_where(instance, attribute)} must be a number of seconds, not {type(value).__name__}"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{_where(instance, attribute)} must be a positive finite number of seconds, "
            f"got {value!r}"
        )


def _freeze_json(value: object, where: str = "config") -> Any:
    """Copy a JSON value into an immutable one: mappings become read-only, lists tuples."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} holds {value!r}, which JSON cannot represent")
        return value
    if isinstance(value, Mapping):
        frozen: dict[str, Any] = {}
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{where} has a key {name!r}; JSON object keys are strings")
            frozen[name] = _freeze_json(item, f"{where}[{name!r}]")
        return types.MappingProxyType(frozen)
    if isinstance(value, list | tuple):
        return tuple(_freeze_json(item, f"{where}[{index}]") for index, item in enumerate(value))
    raise TypeError(f"{where} holds a {type(value).__name__}, which is not a JSON value")


def thaw(value: object) -> Any:
    """The plain JSON form of a frozen JSON value: read-only mappings become dicts,
    tuples (and lists) become lists. The inverse of what ``Load`` does to its config."""
    if isinstance(value, Mapping):
        return {name: thaw(item) for name, item in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(item) for item in value]
    return value


def _freeze_config(value: object) -> Mapping[str, JSON]:
    if not isinstance(value, Mapping):
        raise TypeError(f"Load.config must be a mapping, not {type(value).__name__}")
    frozen: Mapping[str, JSON] = _freeze_json(value, "Load.config")
    return frozen


# -- identities -----------------------------------------------------------------------


@attrs.frozen(kw_only=True, cache_hash=True)  # a key is hashed at every index it meets
class Key:
    """What a session is for: an identity (say, a plugin) and an instance of it."""

    identity: str = attrs.field(validator=_text)
    instance: str = attrs.field(validator=_text)


@attrs.frozen(kw_only=True)
class Handle:
    """The capability to act on one session.

    Attributes:
        key: The session's key.
        token: A random UUID4; knowing it is what authorises a caller.
        generation: The fencing token of the key, 1, 2, 3, ...
    """

    key: Key = attrs.field(validator=attrs.validators.instance_of(Key))
    token: str = attrs.field(validator=_text, repr=lambda token: f"{token[:8]}...")
    generation: int = attrs.field(validator=_at_least(1))


@attrs.frozen(kw_only=True)
class Limits:
    """Resource ceilings for a child; None means no limit.

    A request can lower a ceiling, never raise it: see :func:`negotiate`.
    """

    memory_bytes: int | None = attrs.field(default=None, validator=_limit)
    # At least a second: a child given no CPU time at all is killed before it can start.
    cpu_seconds: int | None = attrs.field(default=None, validator=_cpu_limit)
    open_files: int | None = attrs.field(default=None, validator=_limit)
    file_size_bytes: int | None = attrs.field(default=None, validator=_limit)
    output_bytes: int | None = attrs.field(default=None, validator=_limit)


def _lower(ceiling: int | None, request: int | None) -> int | None:
    if ceiling is None:
        return request
    if request is None:
        return ceiling
    return min(ceiling, request)


def negotiate(supervisor: Limits, requested: Limits) -> Limits:
    """Return the field-wise minimum of two limits, None counting as infinite.

    Args:
        supervisor: The ceilings the runner's owner configured.
        requested: What the host asks for.

    Returns:
        Limits no looser than ``supervisor`` in any field.
    """
    return Limits(
        memory_bytes=_lower(supervisor.memory_bytes, requested.memory_bytes),
        cpu_seconds=_lower(supervisor.cpu_seconds, requested.cpu_seconds),
        open_files=_lower(supervisor.open_files, requested.open_files),
        file_size_bytes=_lower(supervisor.file_size_bytes, requested.file_size_bytes),
        output_bytes=_lower(supervisor.output_bytes, requested.output_bytes),
    )


@attrs.frozen(kw_only=True)
class Load:
    """Which code to run in a session, and the configuration handed to it.

    ``config`` is copied into an immutable JSON value (read-only mappings, tuples).
    """

    specifier: str = attrs.field(validator=_text)
    config: Mapping[str, JSON] = attrs.field(
        factory=lambda: types.MappingProxyType({}), converter=_freeze_config, hash=False
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

    specifier: str = attrs.field(validator=_text)
    origin: str | None = attrs.field(default=None, validator=_optional_text)
    digest: str | None = attrs.field(default=None, validator=_optional_text)
    version: str | None = attrs.field(default=None, validator=_optional_text)


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
    """

    adapter: str = attrs.field(validator=_text)
    ref: str = attrs.field(validator=_text)
    pid: int | None = attrs.field(default=None, validator=_optional_integer)
    pgid: int | None = attrs.field(default=None, validator=_optional_integer)
    start_time: int | None = attrs.field(default=None, validator=_optional_integer)
    boot_id: str | None = attrs.field(default=None, validator=_optional_text)


# -- termination ----------------------------------------------------------------------


def _plain_integer(value: object) -> object:
    # A signal number is often a ``signal.Signals`` member; stored, it reads back as a
    # plain int, so it is one from the start (the same value before and after storage).
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _count(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _integer(instance, attribute, value)
    assert isinstance(value, int)
    if value < 0:
        raise ValueError(f"{_where(instance, attribute)} must be >= 0, got {value}")


def _flag(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{_where(instance, attribute)} must be a bool, not {type(value).__name__}")


@attrs.frozen(kw_only=True)
class ExitStatus:
    """How a child ended.

    Attributes:
        code: Its exit code, when it exited (or returned) with one.
        signal: The number of the signal that ended it, for a process.
        cancelled: True for an in-process task that ended by cancellation: no signal
            exists for a task, so ``signal`` stays None.
        descendants_killed: How many processes the child left behind had to be killed
            as it ended (grandchildren that ignored the interrupt, say).

    ``code`` and ``signal`` both None, and not ``cancelled``: the status is unknown (the
    child was already gone when recovery looked for it).
    """

    code: int | None = attrs.field(default=None, validator=_optional_integer)
    signal: int | None = attrs.field(
        default=None, converter=_plain_integer, validator=_optional_integer
    )
    cancelled: bool = attrs.field(default=False, validator=_flag)
    descendants_killed: int = attrs.field(default=0, validator=_count)

    @property
    def known(self) -> bool:
        """Whether anything is known of how the child ended."""
        return self.cancelled or self.code is not None or self.signal is not None


@attrs.frozen(kw_only=True)
class Fault:
    """An exception as a value: what is persisted of a problem."""

    type: str = attrs.field(validator=_text)
    message: str = attrs.field(validator=attrs.validators.instance_of(str))

    @classmethod
    def of(cls, error: BaseException) -> Fault:
        """Describe an exception by its qualified class name and its message."""
        kind = type(error)
        name = (
            kind.__qualname__
            if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}"
        )
        return cls(type=name, message=str(error))


def _faults(value: object) -> tuple[Fault, ...]:
    if not isinstance(value, tuple | list) or not all(isinstance(item, Fault) for item in value):
        raise TypeError("a cause must be a sequence of Fault")
    return tuple(value)


@attrs.frozen(kw_only=True)
class Termination:
    """How a session's child ended.

    Attributes:
        kind: ``"exited"`` when it ended by itself or on interrupt, ``"killed"`` when it
            had to be killed.
        exit: Its exit status.
        cause: The problems met while terminating it; empty when all went well.
    """

    kind: Literal["exited", "killed"] = attrs.field(
        validator=attrs.validators.in_(("exited", "killed"))
    )
    exit: ExitStatus = attrs.field(validator=attrs.validators.instance_of(ExitStatus))
    cause: tuple[Fault, ...] = attrs.field(default=(), converter=_faults)

    def describe(self) -> str:
        """One line for people: ``exited (code 0)``, ``killed (SIGKILL)``, ...

        In-process tasks read ``exited (cancelled)`` or ``killed (did not stop in time;
        cancelled)``; a child recovery found already dead reads ``exited (already gone;
        exit status unknown)``; descendants that had to be killed, and problems met on
        the way, are counted at the end.
        """
        status = self.exit
        if status.cancelled:
            details = ["did not stop in time; cancelled" if self.kind == "killed" else "cancelled"]
        elif status.code is not None:
            details = [f"code {status.code}"]
        elif status.signal is not None:
            details = [_signal_name(status.signal)]
        else:
            details = ["already gone; exit status unknown"]
        if status.descendants_killed:
            plural = "s" if status.descendants_killed != 1 else ""
            details.append(f"{status.descendants_killed} descendant{plural} killed")
        if self.cause:
            plural = "s" if len(self.cause) != 1 else ""
            details.append(f"{len(self.cause)} problem{plural}")
        return f"{self.kind} ({'; '.join(details)})"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# -- stop reasons ---------------------------------------------------------------------


class _Reason:
    __slots__ = ()

    @property
    def kind(self) -> str:
        """The reason's class name, which is also its tag in storage and on the wire."""
        return type(self).__name__


@attrs.frozen
class Expired(_Reason):
    """The lease ran out."""


@attrs.frozen
class Disposed(_Reason):
    """The host disposed the session."""


@attrs.frozen
class Exited(_Reason):
    """The child exited by itself."""


@attrs.frozen(kw_only=True)
class LoadFailed(_Reason):
    """The load failed; ``cause`` says how."""

    cause: tuple[Fault, ...] = attrs.field(default=(), converter=_faults)


@attrs.frozen
class Superseded(_Reason):
    """A newer generation of the key was opened."""


@attrs.frozen
class Shutdown(_Reason):
    """The supervisor shut down."""


@attrs.frozen
class Recovery(_Reason):
    """The supervisor found the session on start-up, left over from an earlier run."""


StopReason: TypeAlias = Expired | Disposed | Exited | LoadFailed | Superseded | Shutdown | Recovery

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
    request_id: str = attrs.field(validator=_text)
    lease: float = attrs.field(converter=_as_float, validator=_lease)
    limits: Limits = attrs.field(validator=attrs.validators.instance_of(Limits))


@attrs.frozen(kw_only=True)
class OpenRecord(_Record):
    """A session that exists and runs nothing yet."""

    phase: ClassVar[Literal[Phase.OPEN]] = Phase.OPEN


@attrs.frozen(kw_only=True)
class LoadingRecord(_Record):
    """A session loading code; ``child`` is set once the child exists (write-ahead)."""

    load: Load = attrs.field(validator=attrs.validators.instance_of(Load))
    child: ChildIdentity | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.instance_of(ChildIdentity)),
    )

    phase: ClassVar[Literal[Phase.LOADING]] = Phase.LOADING


@attrs.frozen(kw_only=True)
class LoadedRecord(_Record):
    """A session whose child runs the loaded code."""

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


ActiveRecord: TypeAlias = OpenRecord | LoadingRecord | LoadedRecord
_ACTIVE = (OpenRecord, LoadingRecord, LoadedRecord)
_REASONS = (Expired, Disposed, Exited, LoadFailed, Superseded, Shutdown, Recovery)


def _previous(instance: _Record, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, _ACTIVE):
        raise TypeError(
            f"{_where(instance, attribute)} must be an Open, Loading or Loaded record, "
            f"not {type(value).__name__}"
        )
    if value.handle != instance.handle:
        raise ValueError(f"{_where(instance, attribute)} belongs to another session")


@attrs.frozen(kw_only=True)
class StoppingRecord(_Record):
    """A session being terminated; ``previous`` is the record it was in."""

    previous: ActiveRecord = attrs.field(validator=_previous)
    reason: StopReason = attrs.field(validator=attrs.validators.instance_of(_REASONS))

    phase: ClassVar[Literal[Phase.STOPPING]] = Phase.STOPPING

    @classmethod
    def of(cls, previous: ActiveRecord, reason: StopReason) -> StoppingRecord:
        """The Stopping record of the session whose active record is ``previous``."""
        return cls(**carried(previous), previous=previous, reason=reason)


@attrs.frozen(kw_only=True)
class StoppedRecord(_Record):
    """A session that ended; ``termination`` says how its child ended."""

    previous: ActiveRecord = attrs.field(validator=_previous)
    reason: StopReason = attrs.field(validator=attrs.validators.instance_of(_REASONS))
    termination: Termination = attrs.field(validator=attrs.validators.instance_of(Termination))

    phase: ClassVar[Literal[Phase.STOPPED]] = Phase.STOPPED

    @classmethod
    def of(
        cls, previous: ActiveRecord, reason: StopReason, termination: Termination
    ) -> StoppedRecord:
        """The Stopped record of the session whose active record is ``previous``."""
        return cls(**carried(previous), previous=previous, reason=reason, termination=termination)


SessionRecord: TypeAlias = (
    OpenRecord | LoadingRecord | LoadedRecord | StoppingRecord | StoppedRecord
)
