"""How and why a session ended, as records and the wire hold it: why it stopped (its
stop reason, :data:`StopReason`: one of seven), how its child ended (its
:class:`Termination`, the child's :class:`ExitStatus`), and each problem met on the way
as a :class:`Fault`. Values only, re-exported by :mod:`trio_supervisor.model`, the
public home of their names (the act of terminating is ``_core/termination.py``)."""

from __future__ import annotations

import signal
from typing import Literal, TypeAlias

import attrs

from . import _fields as fields

__all__ = [
    "Disposed",
    "ExitStatus",
    "Exited",
    "Expired",
    "Fault",
    "LoadFailed",
    "Recovery",
    "Shutdown",
    "StopReason",
    "Superseded",
    "Termination",
    "as_cause",
    "signal_name",
]


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
        runner_lost: The runner that held the child died, and another runner of its
            fleet stopped the session once the child had surely ended by its lease
            (docs/service.md section C, "Takeover"); nothing else is known.
        oom_limit: The memory limit of the child's tree, in bytes, when the kernel
            killed a process of it for going over that limit; else None.

    ``code`` and ``signal`` both None, and not ``cancelled``: the status is unknown (the
    child was already gone when recovery looked for it, or its runner was lost).
    """

    code: int | None = attrs.field(default=None, validator=fields.optional_integer)
    signal: int | None = attrs.field(
        default=None, converter=fields.plain_integer, validator=fields.optional_integer
    )
    cancelled: bool = attrs.field(default=False, validator=fields.flag)
    descendants_killed: int = attrs.field(default=0, validator=fields.count)
    runner_lost: bool = attrs.field(default=False, validator=fields.flag)
    oom_limit: int | None = attrs.field(default=None, validator=fields.optional(fields.count))

    @property
    def known(self) -> bool:
        """Whether anything is known of how the child ended."""
        return self.cancelled or self.code is not None or self.signal is not None


@attrs.frozen(kw_only=True)
class Fault:
    """An exception as a value: what is persisted of a problem.

    Attributes:
        type: The exception's qualified class name (``trio_supervisor.errors.ExecutionError``).
        message: Its message (``str(error)``).
    """

    type: str = attrs.field(validator=fields.text)
    message: str = attrs.field(validator=attrs.validators.instance_of(str))

    @classmethod
    def of(cls, error: BaseException) -> Fault:
        """Describe an exception by its qualified class name and its message.

        Args:
            error: Any exception.

        Returns:
            The fault that stands for it in a record.
        """
        kind = type(error)
        name = (
            kind.__qualname__
            if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}"
        )
        return cls(type=name, message=str(error))


def as_cause(value: object) -> tuple[Fault, ...]:
    """A cause (of a termination, or a failed load) as the tuple of Faults it must be."""
    if not isinstance(value, tuple | list) or not all(isinstance(item, Fault) for item in value):
        raise TypeError("a cause must be a sequence of Fault")
    return tuple(value)


@attrs.frozen(kw_only=True)
class Termination:
    """How a session's child ended.

    Attributes:
        kind: ``"exited"`` when it ended by itself or on interrupt, ``"killed"`` when it
            had to be killed, ``"none"`` when the session's code never ran: it had no
            load, or its load failed before the code started (whatever the execution
            had prepared for it was ended all the same).
        exit: Its exit status (empty for ``"none"``).
        cause: The problems met while terminating it; empty when all went well.
    """

    kind: Literal["exited", "killed", "none"] = attrs.field(
        validator=attrs.validators.in_(("exited", "killed", "none"))
    )
    exit: ExitStatus = attrs.field(validator=attrs.validators.instance_of(ExitStatus))
    cause: tuple[Fault, ...] = attrs.field(default=(), converter=as_cause)

    def describe(self) -> str:
        """One line for people: ``exited (code 0)``, ``killed (SIGKILL)``, ``no child``, ...

        In-process tasks read ``exited (cancelled)`` or ``killed (did not stop in time;
        cancelled)``; a child recovery found already dead reads ``exited (already gone;
        exit status unknown)``; descendants that had to be killed, and problems met on
        the way, are counted at the end.
        """
        status = self.exit
        if self.kind == "none":
            details = []
        elif status.cancelled:
            details = ["did not stop in time; cancelled" if self.kind == "killed" else "cancelled"]
        elif status.code is not None:
            details = [f"code {status.code}"]
        elif status.signal == signal.SIGKILL and status.oom_limit is not None:
            details = []  # the kernel's OOM killer: said below instead of SIGKILL
        elif status.signal is not None:
            details = [signal_name(status.signal)]
        elif status.runner_lost:
            details = ["runner lost; exit status unknown"]
        else:
            details = ["already gone; exit status unknown"]
        if status.oom_limit is not None:
            details.append(f"out of memory, limit {_bytes(status.oom_limit)}")
        if status.descendants_killed:
            plural = "s" if status.descendants_killed != 1 else ""
            details.append(f"{status.descendants_killed} descendant{plural} killed")
        if self.cause:
            plural = "s" if len(self.cause) != 1 else ""
            details.append(f"{len(self.cause)} problem{plural}")
        if self.kind == "none":
            return f"no child ({'; '.join(details)})" if details else "no child"
        return f"{self.kind} ({'; '.join(details)})"


def _bytes(number: int) -> str:
    """``256 MiB``, ``1.5 GiB``, ``1000 bytes``: binary units, as limits are set."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if number >= size:
            return f"{number / size:g} {unit}"
    return f"{number} bytes"


def signal_name(number: int) -> str:
    """A signal's name (``SIGKILL``), or ``signal N`` for a number Python does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# -- why a session stopped ---------------------------------------------------------------------


class _Reason:
    __slots__ = ()

    @property
    def kind(self) -> str:
        """The reason's class name, which is also its tag in storage and on the wire."""
        return type(self).__name__


@attrs.frozen
class Expired(_Reason):
    """The lease ran out (T1)."""


@attrs.frozen
class Disposed(_Reason):
    """The host disposed the session (D5)."""


@attrs.frozen
class Exited(_Reason):
    """The child exited by itself (X1)."""


@attrs.frozen(kw_only=True)
class LoadFailed(_Reason):
    """The load failed; ``cause`` says how (L5).

    Attributes:
        cause: The load's errors, as values.
    """

    cause: tuple[Fault, ...] = attrs.field(default=(), converter=as_cause)


@attrs.frozen
class Superseded(_Reason):
    """A newer generation of the key was opened (O5, F5)."""


@attrs.frozen
class Shutdown(_Reason):
    """The supervisor shut down (Z2)."""


@attrs.frozen
class Recovery(_Reason):
    """The supervisor found the session on start-up, left over from an earlier run (V3).

    A runner of a fleet also stops with it the sessions of a dead runner it takes over (F7).
    """


#: Why a session stopped: one of the seven reasons, each tagged by its ``kind`` (P1).
StopReason: TypeAlias = Expired | Disposed | Exited | LoadFailed | Superseded | Shutdown | Recovery
