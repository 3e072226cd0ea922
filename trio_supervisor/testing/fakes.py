"""Scriptable adapters for tests: an execution whose units do what they are told, and a
store that fails when told to.

Both record what was asked of them, so a test can assert on the exact calls (a child
interrupted once, killed once, released once) instead of on timing.
"""

from __future__ import annotations

import itertools
import math
import signal
from collections.abc import Callable, Mapping, Sequence

import attrs
import trio

from ..abc import Store
from ..errors import ExecutionError, StateStorageError, StoreUnavailableError, SupervisorError
from ..model import (
    ChildIdentity,
    CodeIdentity,
    ExitStatus,
    Handle,
    Key,
    Limits,
    Load,
    SessionRecord,
    Termination,
)
from ..retention import Retention

__all__ = ["Behaviour", "Call", "FakeExecution", "FakeUnit", "FaultyStore"]

ADAPTER = "fake"


@attrs.define(kw_only=True)
class Behaviour:
    """How the fake's units behave.

    Attributes:
        spawn_error: ``spawn`` raises this.
        start_error: ``start`` raises this.
        wait_error: ``wait`` raises this (an adapter that cannot watch its child).
        interrupt_error: ``interrupt`` raises this, and the signal is not delivered.
        aclose_error: ``aclose`` raises this.
        ignore_interrupt: The unit does not exit on interrupt.
        ignore_kill: The unit does not exit on kill either.
        exit_delay: Seconds between a signal the unit heeds and its exit.
        interrupt_code: The exit code of a unit that exits on interrupt; None means it
            reports the signal (``SIGTERM``) instead.
    """

    spawn_error: SupervisorError | None = None
    start_error: SupervisorError | None = None
    wait_error: Exception | None = None
    interrupt_error: Exception | None = None
    aclose_error: Exception | None = None
    ignore_interrupt: bool = False
    ignore_kill: bool = False
    exit_delay: float = 0.0
    interrupt_code: int | None = None


@attrs.frozen
class Call:
    """One call into the fake: its name, the unit's ref (or the specifier), arguments.

    Attributes:
        name: The method called (``spawn``, ``start``, ``renew``, ``interrupt``,
            ``kill``, ``wait``, ``aclose``, ``recover``).
        ref: The unit's ref; for ``spawn``, the load's specifier.
        args: The call's arguments (the handle of a spawn, the lease of a renew).
    """

    name: str
    ref: str
    args: tuple[object, ...] = ()


class FakeUnit:
    """A unit that exits when told to, or on the signals its behaviour heeds.

    Made by :meth:`FakeExecution.spawn`; its methods implement
    :class:`~trio_supervisor.abc.Unit` and record each call in the execution's ``calls``.

    Args:
        execution: The fake that made it.
        handle: The session it is for.
        load: What it runs.
        limits: The session's limits (kept, not enforced).
        behaviour: How it behaves.
        ref: Its ref, unique within the execution.
    """

    def __init__(
        self,
        execution: FakeExecution,
        handle: Handle,
        load: Load,
        limits: Limits,
        behaviour: Behaviour,
        ref: str,
    ) -> None:
        self.execution = execution
        self.handle = handle
        self.load = load
        self.limits = limits
        self.behaviour = behaviour
        self.identity = ChildIdentity(adapter=ADAPTER, ref=ref)
        self.code = CodeIdentity(specifier=load.specifier, origin=f"fake:{load.specifier}")
        self.started = False
        self.closed = 0
        self.leases: list[float] = []
        self.status: ExitStatus | None = None
        # An exit that has been asked for but takes ``exit_delay`` to happen.
        self._exit_at = math.inf
        self._pending: ExitStatus | None = None
        self._poke = trio.Event()

    @property
    def exited(self) -> bool:
        """True once the unit exited (a delayed exit counts once its time came)."""
        self._settle()
        return self.status is not None

    @property
    def signals(self) -> list[str]:
        """The interrupts and kills this unit received, in order."""
        return [
            call.name
            for call in self.execution.calls_of(self)
            if call.name in ("interrupt", "kill")
        ]

    def exit(self, code: int | None = 0, signal: int | None = None) -> None:
        """Exit now, by itself, with this status (what X1 watches for).

        Args:
            code: The exit code.
            signal: The signal number, if a signal ended it.
        """
        self._finish(ExitStatus(code=code, signal=signal))

    def _finish(self, status: ExitStatus) -> None:
        if self.status is None:
            self.status = status
            self.execution._live.pop(self.identity.ref, None)
            self._wake()

    def _wake(self) -> None:
        self._poke.set()
        self._poke = trio.Event()

    def _exit_later(self, status: ExitStatus) -> None:
        if self.behaviour.exit_delay <= 0:
            self._finish(status)
            return
        at = trio.current_time() + self.behaviour.exit_delay
        if at < self._exit_at:
            self._exit_at, self._pending = at, status
            self._wake()

    def _settle(self) -> None:
        if (
            self.status is None
            and self._pending is not None
            and trio.current_time() >= self._exit_at
        ):
            self._finish(self._pending)

    async def start(self) -> None:
        """Start, or raise the behaviour's ``start_error``.

        Raises:
            ExecutionError: The unit was started twice.
        """
        self.execution._record("start", self)
        await trio.lowlevel.checkpoint()
        if self.behaviour.start_error is not None:
            raise self.behaviour.start_error
        if self.started:
            raise ExecutionError("the unit was started twice")
        self.started = True

    async def renew(self, lease: float) -> None:
        """Note the lease in ``leases``.

        Implements :meth:`trio_supervisor.abc.Unit.renew`.
        """
        self.execution._record("renew", self, lease)
        await trio.lowlevel.checkpoint()
        self.leases.append(lease)

    async def interrupt(self) -> None:
        """Exit (after ``exit_delay``) unless the behaviour ignores interrupts; or raise
        its ``interrupt_error``."""
        self.execution._record("interrupt", self)
        await trio.lowlevel.checkpoint()
        if self.behaviour.interrupt_error is not None:
            raise self.behaviour.interrupt_error
        if not self.behaviour.ignore_interrupt:
            code = self.behaviour.interrupt_code
            self._exit_later(
                ExitStatus(code=code, signal=None if code is not None else signal.SIGTERM)
            )

    async def kill(self) -> None:
        """Exit with ``SIGKILL`` (after ``exit_delay``) unless the behaviour ignores kills."""
        self.execution._record("kill", self)
        await trio.lowlevel.checkpoint()
        if not self.behaviour.ignore_kill:
            self._exit_later(ExitStatus(code=None, signal=signal.SIGKILL))

    async def wait(self) -> ExitStatus:
        """Wait for the exit and return its status, or raise the behaviour's ``wait_error``.

        Returns:
            How the unit exited.
        """
        self.execution._record("wait", self)
        if self.behaviour.wait_error is not None:
            await trio.lowlevel.checkpoint()
            raise self.behaviour.wait_error
        while True:
            self._settle()
            if self.status is not None:
                await trio.lowlevel.checkpoint()
                return self.status
            poke = self._poke
            with trio.move_on_at(self._exit_at):
                await poke.wait()

    async def aclose(self) -> None:
        """Count the release; a unit never started exits with ``SIGKILL``. Raises the
        behaviour's ``aclose_error`` if it has one."""
        self.execution._record("aclose", self)
        await trio.lowlevel.checkpoint()
        self.closed += 1
        if not self.started:
            # Like a real child that was spawned but never started: releasing it ends it.
            self._finish(ExitStatus(code=None, signal=signal.SIGKILL))
        if self.behaviour.aclose_error is not None:
            raise self.behaviour.aclose_error


class FakeExecution:
    """An execution whose units are scripted.

    Behaviours are chosen per specifier (``behave``), falling back to ``default``;
    one-shot failures are queued with ``fail_next_spawn``. Every call is appended to
    ``calls``.

    Args:
        default: The behaviour of specifiers that have none of their own.
    """

    def __init__(self, default: Behaviour | None = None) -> None:
        self.default = default or Behaviour()
        self.behaviours: dict[str, Behaviour] = {}
        self.calls: list[Call] = []
        self.units: list[FakeUnit] = []
        self.recoveries: dict[str, Termination | Exception] = {}
        self._next_spawn_errors: list[SupervisorError] = []
        self._live: dict[str, FakeUnit] = {}
        self._refs = itertools.count(1)

    def behave(self, specifier: str, **behaviour: object) -> Behaviour:
        """Script the units of ``specifier``; see :class:`Behaviour` for the fields.

        Args:
            specifier: The load's specifier.
            **behaviour: The fields of its :class:`Behaviour`.

        Returns:
            The behaviour; each unit spawned later gets a copy of it.
        """
        scripted = Behaviour(**behaviour)  # type: ignore[arg-type]
        self.behaviours[specifier] = scripted
        return scripted

    def fail_next_spawn(self, error: SupervisorError) -> None:
        """Make the next spawn raise ``error``, whatever its specifier.

        Args:
            error: What the spawn raises (a ``PackageError``, say).
        """
        self._next_spawn_errors.append(error)

    def unit_of(self, handle: Handle) -> FakeUnit:
        """The unit spawned for a session.

        Args:
            handle: The session's handle.

        Returns:
            Its latest unit.

        Raises:
            LookupError: No unit was spawned for it.
        """
        for unit in reversed(self.units):
            if unit.handle == handle:
                return unit
        raise LookupError(f"no unit was spawned for {handle}")

    def unit_by_ref(self, ref: str) -> FakeUnit:
        """The unit whose identity has this ref.

        Args:
            ref: A :class:`~trio_supervisor.model.ChildIdentity`'s ``ref``.

        Returns:
            The unit.

        Raises:
            LookupError: No unit has this ref.
        """
        for unit in self.units:
            if unit.identity.ref == ref:
                return unit
        raise LookupError(f"no unit has the ref {ref!r}")

    def calls_of(self, unit: FakeUnit) -> list[Call]:
        """Every call made on one unit.

        Args:
            unit: A unit of this execution.

        Returns:
            Its calls, in order.
        """
        return [call for call in self.calls if call.ref == unit.identity.ref]

    @property
    def live(self) -> Mapping[str, FakeUnit]:
        """Units spawned and not exited, by ref."""
        for unit in list(self._live.values()):
            unit._settle()
        return dict(self._live)

    def _record(self, name: str, unit: FakeUnit, *args: object) -> None:
        self.calls.append(Call(name, unit.identity.ref, args))

    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> FakeUnit:
        """Make a unit behaving as its specifier's behaviour says.

        Implements :meth:`trio_supervisor.abc.Execution.spawn`; raises a queued
        :meth:`fail_next_spawn` error first, then the behaviour's ``spawn_error``.
        """
        self.calls.append(Call("spawn", load.specifier, (handle,)))
        await trio.lowlevel.checkpoint()
        if self._next_spawn_errors:
            raise self._next_spawn_errors.pop(0)
        # Each unit gets its own copy, so scripting one unit leaves the others alone.
        behaviour = attrs.evolve(self.behaviours.get(load.specifier, self.default))
        if behaviour.spawn_error is not None:
            raise behaviour.spawn_error
        unit = FakeUnit(self, handle, load, limits, behaviour, f"fake-{next(self._refs)}")
        self.units.append(unit)
        self._live[unit.identity.ref] = unit
        return unit

    async def recover(self, child: ChildIdentity) -> Termination:
        """Kill a live unit left over from an earlier supervisor; scripted by ``recoveries``.

        Implements :meth:`trio_supervisor.abc.Execution.recover`; a scripted exception
        is raised, a scripted termination returned.
        """
        self.calls.append(Call("recover", child.ref))
        await trio.lowlevel.checkpoint()
        scripted = self.recoveries.get(child.ref)
        if isinstance(scripted, Exception):
            raise scripted
        if scripted is not None:
            return scripted
        unit = self._live.get(child.ref)
        if unit is None:
            return Termination(kind="exited", exit=ExitStatus(code=None, signal=None))
        await unit.kill()
        return Termination(kind="killed", exit=await unit.wait())


class FaultyStore:
    """A store that fails its saves when told to, around a working one.

    Args:
        inner: The store that does the work.
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.failing = False
        self.unreachable = False
        self._fail_next = 0
        self._when: Callable[[SessionRecord], bool] | None = None
        self.saved: list[SessionRecord] = []
        self.refused: list[SessionRecord] = []

    @property
    def retention(self) -> Retention:
        """The inner store's retention policy."""
        return self.inner.retention

    def fail_next(self, count: int = 1) -> None:
        """Fail the next ``count`` saves with ``StateStorageError``.

        Args:
            count: How many.
        """
        self._fail_next += count

    def fail_always(self) -> None:
        """Fail every save from now on."""
        self.failing = True

    def fail_when(self, predicate: Callable[[SessionRecord], bool] | None) -> None:
        """Fail the saves of records ``predicate`` picks (None: stop failing those).

        Args:
            predicate: Called with each record saved; True fails its save.
        """
        self._when = predicate

    def out_of_reach(self) -> None:
        """Answer every save from now on as a store out of reach that wrote nothing
        (:class:`StoreUnavailableError`, B1), until :meth:`heal`."""
        self.unreachable = True

    def heal(self) -> None:
        """Stop failing, and be within reach again."""
        self.failing = False
        self.unreachable = False
        self._fail_next = 0
        self._when = None

    def _refuses(self, record: SessionRecord) -> bool:
        if self.failing or (self._when is not None and self._when(record)):
            return True
        if self._fail_next:
            self._fail_next -= 1
            return True
        return False

    async def save(self, record: SessionRecord) -> None:
        """Save through the inner store, unless told to fail.

        Implements :meth:`trio_supervisor.abc.Store.save`.

        Raises:
            StoreUnavailableError: After :meth:`out_of_reach`, until :meth:`heal`.
            StateStorageError: A failure asked for, or the inner store's.
        """
        if self.unreachable:
            await trio.lowlevel.checkpoint()
            self.refused.append(record)
            raise StoreUnavailableError(
                f"injected: the store is out of reach; the {record.phase.value} record "
                "was not written"
            )
        if self._refuses(record):
            await trio.lowlevel.checkpoint()
            self.refused.append(record)
            raise StateStorageError(f"injected failure saving a {record.phase.value} record")
        await self.inner.save(record)
        self.saved.append(record)

    async def list(self) -> Sequence[SessionRecord]:
        """The inner store's records (never fails)."""
        return await self.inner.list()

    async def high_water(self) -> Mapping[Key, int]:
        """The inner store's high-water marks (never fails)."""
        return await self.inner.high_water()
