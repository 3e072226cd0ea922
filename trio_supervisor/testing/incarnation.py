"""What one run of a supervisor sees of its store and execution, for the machine.

Each incarnation of the supervisor gets its store and execution through wrappers that

* write every save attempt and every call on a child into one shared :class:`Log`, in
  the order they happen, so the machine can check that a child is signalled only after
  its session began stopping, and exactly once;
* fail saves on demand (one save of one session, or every save from now on);
* can be *cut*: after :meth:`Incarnation.cut`, saves fail, signals go nowhere and
  waits return at once. That is what a crash does to a process: whatever it still
  tries reaches neither the disk nor the children, and the next incarnation finds the
  store and the children as the crash left them;
* hold the virtual clock still while the store does real I/O (:class:`ClockGuard`),
  so a save costs no virtual time even on a store backed by a thread;
* for a store that answers from outside the Trio run (a worker thread, a socket), make
  one store call at a time, and only once every other task waits. Hypothesis seeds
  Trio's scheduler, so an example replays the same way only if the run takes the same
  scheduling steps; a real thread finishing a little sooner or later would otherwise
  change how many steps run between two saves, and with that every later interleaving.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import TypeVar

import attrs
import trio
import trio.testing

from ..abc import BatchStore, Execution, Store, Unit
from ..errors import ExecutionError, StateStorageError
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
from .reference_store import Faults, SessionId

__all__ = ["ClockGuard", "Entry", "Incarnation", "Log"]

_T = TypeVar("_T")


class ClockGuard:
    """Autojump for a MockClock, but never while the store is doing I/O.

    Args:
        clock: The run's clock; its ``autojump_threshold`` is managed here.
    """

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self.clock = clock
        self.io = 0
        self._jumping = False
        self._idle = trio.Event()

    def _sync(self) -> None:
        self.clock.autojump_threshold = 0 if (self._jumping and self.io == 0) else math.inf

    @contextlib.contextmanager
    def jumping(self) -> Iterator[None]:
        """Let virtual time jump to the next deadline whenever everything waits."""
        self._jumping = True
        self._sync()
        try:
            yield
        finally:
            self._jumping = False
            self._sync()

    @contextlib.contextmanager
    def doing_io(self) -> Iterator[None]:
        self.io += 1
        self._sync()
        try:
            yield
        finally:
            self.io -= 1
            self._sync()
            if not self.io:
                self._idle.set()
                self._idle = trio.Event()

    async def settle(self) -> None:
        """Return once every task waits, and not for the store."""
        while True:
            await trio.testing.wait_all_tasks_blocked()
            if not self.io:
                return
            await self._idle.wait()


@attrs.frozen
class Entry:
    """One line of the log: a save attempt, or a call on a child."""

    kind: str  # "save" or "call"
    session: SessionId
    what: str  # the phase saved, or the call's name
    done: bool = True  # for saves: whether the store acknowledged it


class Log:
    """Everything the incarnations of one example did, in order."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.children: dict[SessionId, ChildIdentity] = {}
        self._sessions: dict[str, SessionId] = {}

    def child(self, handle: Handle, identity: ChildIdentity) -> None:
        ident = (handle.key, handle.generation)
        self.children[ident] = identity
        self._sessions[identity.ref] = ident

    def session_of(self, child: ChildIdentity) -> SessionId:
        return self._sessions[child.ref]

    def count(self, session: SessionId, what: str) -> int:
        return sum(1 for entry in self.entries if entry.session == session and entry.what == what)


class Incarnation:
    """The store and execution one supervisor run gets."""

    def __init__(
        self,
        store: Store,
        execution: Execution,
        log: Log,
        guard: ClockGuard,
        faults: Faults,
        *,
        store_answers_outside: bool = False,
    ) -> None:
        self.log = log
        self.guard = guard
        self.faults = faults
        self.cut_off = False
        self._waits: set[trio.CancelScope] = set()
        self.store = _Store(self, store, one_at_a_time=store_answers_outside)
        self.execution = _Execution(self, execution)

    def cut(self) -> None:
        """From now on nothing this incarnation does reaches the store or a child."""
        self.cut_off = True
        for scope in self._waits:
            scope.cancel()


class _Store:
    def __init__(self, incarnation: Incarnation, inner: Store, *, one_at_a_time: bool) -> None:
        self._incarnation = incarnation
        self._inner = inner
        self._turn: trio.Lock | None = trio.Lock() if one_at_a_time else None

    @property
    def retention(self) -> Retention:
        return self._inner.retention

    async def _io(self, call: Callable[[], Awaitable[_T]]) -> _T:
        with self._incarnation.guard.doing_io():
            if self._turn is None:
                return await call()
            async with self._turn:
                # Every other task parks first, so the answer reaches an idle run: when
                # it comes makes no difference to what runs next (see the module docs).
                await trio.testing.wait_all_tasks_blocked()
                return await call()

    async def save(self, record: SessionRecord) -> None:
        incarnation = self._incarnation
        session = (record.handle.key, record.handle.generation)
        phase = record.phase.value
        if incarnation.cut_off:
            await trio.lowlevel.checkpoint()
            raise StateStorageError("cut off: this supervisor has crashed")
        if incarnation.faults.refuses(session, phase):
            incarnation.log.entries.append(Entry("save", session, phase, done=False))
            await trio.lowlevel.checkpoint()
            raise StateStorageError(f"injected failure saving a {phase} record")
        await self._io(lambda: self._inner.save(record))
        incarnation.log.entries.append(Entry("save", session, phase))

    async def save_many(self, records: Sequence[SessionRecord]) -> None:
        """The records one after the other, as far as faults go: the first refused one
        fails the call, and those before it are saved (together, where the store can).

        A childless stop saves its Stopping and Stopped this way: a fault that refuses
        the session's next save refuses the first, so neither is saved.
        """
        incarnation = self._incarnation
        if incarnation.cut_off:
            await trio.lowlevel.checkpoint()
            raise StateStorageError("cut off: this supervisor has crashed")
        accepted: list[SessionRecord] = []
        refused: tuple[SessionId, str] | None = None
        for record in records:
            session = (record.handle.key, record.handle.generation)
            if incarnation.faults.refuses(session, record.phase.value):
                refused = (session, record.phase.value)
                break
            accepted.append(record)
        if accepted:
            inner = self._inner
            if isinstance(inner, BatchStore):
                await self._io(lambda: inner.save_many(accepted))
            else:
                for record in accepted:
                    await self._io(functools.partial(inner.save, record))
            for record in accepted:
                session = (record.handle.key, record.handle.generation)
                incarnation.log.entries.append(Entry("save", session, record.phase.value))
        if refused is not None:
            incarnation.log.entries.append(Entry("save", refused[0], refused[1], done=False))
            await trio.lowlevel.checkpoint()
            raise StateStorageError(f"injected failure saving a {refused[1]} record")

    async def list(self) -> Sequence[SessionRecord]:
        return await self._io(self._inner.list)

    async def high_water(self) -> Mapping[Key, int]:
        return await self._io(self._inner.high_water)


class _Execution:
    def __init__(self, incarnation: Incarnation, inner: Execution) -> None:
        self._incarnation = incarnation
        self._inner = inner

    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> Unit:
        incarnation = self._incarnation
        if incarnation.cut_off:
            await trio.lowlevel.checkpoint()
            raise ExecutionError("cut off: this supervisor has crashed")
        session = (handle.key, handle.generation)
        incarnation.log.entries.append(Entry("call", session, "spawn"))
        unit = await self._inner.spawn(handle, load, limits)
        incarnation.log.child(handle, unit.identity)
        return _Unit(incarnation, unit, session)

    async def recover(self, child: ChildIdentity) -> Termination:
        incarnation = self._incarnation
        if incarnation.cut_off:
            await trio.lowlevel.checkpoint()
            raise ExecutionError("cut off: this supervisor has crashed")
        incarnation.log.entries.append(Entry("call", incarnation.log.session_of(child), "recover"))
        return await self._inner.recover(child)


class _Unit:
    def __init__(self, incarnation: Incarnation, inner: Unit, session: SessionId) -> None:
        self._incarnation = incarnation
        self._inner = inner
        self._session = session

    @property
    def identity(self) -> ChildIdentity:
        return self._inner.identity

    @property
    def code(self) -> CodeIdentity:
        return self._inner.code

    async def _call(self, name: str, *args: float) -> None:
        incarnation = self._incarnation
        if incarnation.cut_off:
            await trio.lowlevel.checkpoint()
            return
        incarnation.log.entries.append(Entry("call", self._session, name))
        await getattr(self._inner, name)(*args)

    async def start(self) -> None:
        await self._call("start")

    async def renew(self, lease: float) -> None:
        await self._call("renew", lease)

    async def interrupt(self) -> None:
        await self._call("interrupt")

    async def kill(self) -> None:
        await self._call("kill")

    async def aclose(self) -> None:
        await self._call("aclose")

    async def wait(self) -> ExitStatus:
        incarnation = self._incarnation
        if not incarnation.cut_off:
            with trio.CancelScope() as scope:
                incarnation._waits.add(scope)
                try:
                    return await self._inner.wait()
                finally:
                    incarnation._waits.discard(scope)
        # Cut off: the dead supervisor would never have heard of the exit.
        await trio.lowlevel.checkpoint()
        return ExitStatus()
