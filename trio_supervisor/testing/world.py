"""The world the conformance machine drives: one example's Trio run, in its own thread.

Hypothesis calls the machine's rules synchronously, one after the other; a supervisor
lives in a Trio run. A :class:`World` starts that run with a ``MockClock`` in a
background thread and keeps it alive for the whole example, across the supervisor's
restarts; the rules reach into it with ``trio.from_thread`` (:meth:`World.call`).

Time is virtual and moves only when the machine says: autojump is on only while
:meth:`World.advance` sleeps to its target (and while a shutdown or a start runs), so
every deadline fires in the order it would in real life, and a save never costs
virtual time (:class:`~.incarnation.ClockGuard`).

An operation is started as a task (:meth:`World.begin`, or several at once with
:meth:`World.burst`), and the call returns once everything in the run is blocked and
no store I/O is under way. An operation that waits on virtual time (a dispose of a
child that ignores its interrupt) is still running then; its :class:`Operation` gets
its outcome later, when time moves. An outcome is what the model predicts: the error
class, or a summary of the value (:func:`summary`).

Each supervisor runs in an :class:`~.incarnation.Incarnation`, which logs every save
and every call on a child, injects the save failures the machine asks for, and can be
cut off to simulate a crash.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, Final

import attrs
import trio
import trio.testing

from .._core.lifetime import open_supervisor
from .._core.supervisor import Supervisor
from ..abc import Store
from ..errors import SupervisorError
from ..model import (
    CodeIdentity,
    Key,
    LoadedRecord,
    LoadingRecord,
    OpenRecord,
    SessionRecord,
    StoppedRecord,
    StoppingRecord,
    Termination,
)
from ..retention import Retention
from ..stores.memory import MemoryStore
from .harnesses import Harness
from .incarnation import ClockGuard, Incarnation, Log
from .reference import Outcome, SessionId, ok
from .reference_store import Faults

__all__ = [
    "CALLS",
    "CONFIRMATION",
    "GRACE",
    "LEASE",
    "RECORDS",
    "Observation",
    "Operation",
    "StoreFactory",
    "World",
    "summary",
]

# The supervisor's settings in every example.
LEASE = 5.0
GRACE = 1.0
CONFIRMATION = 1.5

StoreFactory = Callable[[Store | None, Retention], Store]
RECORDS = (OpenRecord, LoadingRecord, LoadedRecord, StoppingRecord, StoppedRecord)
# The calls on a child whose number the machine checks.
CALLS = ("interrupt", "kill", "aclose", "recover")


def summary(value: object) -> object:
    """What of an operation's result the model predicts."""
    if isinstance(value, RECORDS):
        return (value.handle.generation, value.phase.value)
    if isinstance(value, Termination):
        return Termination(kind=value.kind, exit=value.exit)  # whole, but for the cause
    if isinstance(value, CodeIdentity):
        return value.specifier
    return value


# The rules of docs/design.md section "Semantics" each operation is held to.
_RULES: Final = {
    "open": "O1-O11",
    "renew": "R1-R6",
    "load": "L1-L6, P1-P6",
    "dispose": "D1-D5, P1-P6",
    "status": "S1",
}


@attrs.frozen
class Observation:
    """What the machine sees of the run between steps.

    Attributes:
        now: The run's virtual time.
        records: What the store lists, in save order.
        marks: What the store gives as high-water marks.
        living: For every child the execution spawned, whether it still runs.
        calls: For every child, how many of each of :data:`CALLS` it got.
    """

    now: float
    records: list[SessionRecord]
    marks: dict[Key, int]
    living: dict[SessionId, bool]
    calls: dict[SessionId, dict[str, int]]


@attrs.define(eq=False)
class Operation:
    """An operation running in the Trio thread."""

    name: str
    outcome: Outcome | None = None
    value: object = None
    what: str = ""  # the call with its arguments, for failure messages

    @property
    def call(self) -> str:
        """The call as a failure message names it, with the rules it is held to."""
        rules = _RULES.get(self.name)
        return f"{self.what or self.name}" + (f" ({rules} in docs/design.md)" if rules else "")

    async def run(self, call: Callable[[], Awaitable[object]]) -> None:
        """Run the call, and keep its outcome as the model describes outcomes."""
        try:
            value = await call()
        except SupervisorError as failure:
            self.outcome = ("error", type(failure).__name__)
        except Exception as failure:
            self.outcome = ("crash", f"{type(failure).__name__}: {failure}")
        else:
            self.value = value
            self.outcome = ok(summary(value))


class World:
    """One example's Trio run, in its own thread.

    Args:
        store_factory: ``factory(previous, retention)``: a fresh store, or the previous
            one's storage reopened.
        harness: The execution adapter's harness; entered for the whole run.
        retention: The retention every store of the example is made with.
        store_answers_outside: See :func:`~.conformance.conformance_machine`; by
            default, True for any store but a ``MemoryStore``.
    """

    def __init__(
        self,
        store_factory: StoreFactory,
        harness: Harness,
        retention: Retention,
        store_answers_outside: bool | None = None,
    ) -> None:
        self.store_factory = store_factory
        self.harness = harness
        self.retention = retention
        self.store = store_factory(None, retention)
        # A MemoryStore answers within the run; any other store is taken to do real I/O.
        self.store_answers_outside = (
            not isinstance(self.store, MemoryStore)
            if store_answers_outside is None
            else store_answers_outside
        )
        self.clock = trio.testing.MockClock()
        self.log = Log()
        self.faults = Faults()
        self.supervisor: Supervisor | None = None
        self.incarnation: Incarnation | None = None
        self.exit_error: BaseException | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="conformance world", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            trio.run(self._main, clock=self.clock)
        except BaseException as failure:
            self._failure = failure
            self._ready.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.guard = ClockGuard(self.clock)
        self._done = trio.Event()
        async with self.harness, trio.open_nursery() as nursery:
            self.nursery = nursery
            self._ready.set()
            await self._done.wait()
            with self.guard.jumping():
                await self._leave()
            nursery.cancel_scope.cancel()
        closer = getattr(self.store, "aclose", None)
        if closer is not None:
            await closer()

    def call(self, function: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``function`` in the Trio thread and return its result."""
        if self._failure is not None:
            raise self._failure
        return trio.from_thread.run(function, *args, trio_token=self.token)

    def close(self) -> None:
        if self._thread.is_alive():
            trio.from_thread.run_sync(self._done.set, trio_token=self.token)
            self._thread.join(timeout=60)

    # -- incarnations -------------------------------------------------------------------

    async def enter(self) -> BaseException | None:
        """Start a supervisor on the store; return what ``open_supervisor`` raised."""
        incarnation = Incarnation(
            self.store,
            self.harness.execution,
            self.log,
            self.guard,
            self.faults,
            store_answers_outside=self.store_answers_outside,
        )
        self.incarnation = incarnation
        self.exit_error = None
        started = trio.Event()
        self._leaving = trio.Event()
        self._ended = trio.Event()

        async def run() -> None:
            try:
                async with open_supervisor(
                    incarnation.store,
                    incarnation.execution,
                    lease=LEASE,
                    grace=GRACE,
                    confirmation_timeout=CONFIRMATION,
                ) as supervisor:
                    self.supervisor = supervisor
                    started.set()
                    await self._leaving.wait()
            except BaseException as failure:
                self.exit_error = failure
                if isinstance(failure, trio.Cancelled):
                    raise
            finally:
                self.supervisor = None
                started.set()
                self._ended.set()

        with self.guard.jumping():
            self.nursery.start_soon(run)
            await started.wait()
            await self.guard.settle()
        return self.exit_error if self.supervisor is None else None

    async def _leave(self) -> None:
        if self.supervisor is not None:
            self._leaving.set()
            await self._ended.wait()

    async def shutdown(self) -> BaseException | None:
        """Leave the supervisor's block; time runs until it is over."""
        with self.guard.jumping():
            await self._leave()
        await self.guard.settle()
        return self.exit_error

    async def crash(self) -> None:
        """Cut the supervisor off from its store and children, then let it go."""
        assert self.incarnation is not None
        self.incarnation.cut()
        await self._leave()
        await self.guard.settle()

    async def reopen_store(self) -> None:
        closer = getattr(self.store, "aclose", None)
        if closer is not None:
            with self.guard.doing_io():
                await closer()
        self.store = self.store_factory(self.store, self.retention)
        self.faults.broken = False
        self.faults.once.clear()

    # -- operations, time -------------------------------------------------------------

    async def begin(self, name: str, call: Callable[[Supervisor], Awaitable[object]]) -> Operation:
        """Start one operation; return it once the run is idle (it may still wait)."""
        [operation] = await self.burst([(name, call)])
        return operation

    async def burst(
        self, calls: list[tuple[str, Callable[[Supervisor], Awaitable[object]]]]
    ) -> list[Operation]:
        """Start several operations at once; return them once the run is idle."""
        supervisor = self.supervisor
        assert supervisor is not None
        operations = []
        for name, call in calls:
            operation = Operation(name)
            operations.append(operation)
            self.nursery.start_soon(operation.run, lambda call=call: call(supervisor))
        await self.guard.settle()
        return operations

    async def advance(self, target: float) -> None:
        with self.guard.jumping():
            await trio.sleep_until(target)
        await self.guard.settle()

    async def settle(self) -> float:
        await self.guard.settle()
        return trio.current_time()

    async def run_sync(self, function: Callable[[], None]) -> None:
        function()
        await self.guard.settle()

    async def contents(self) -> tuple[list[SessionRecord], dict[Key, int]]:
        with self.guard.doing_io():
            records = list(await self.store.list())
            marks = dict(await self.store.high_water())
        return records, marks

    async def observe(self) -> Observation:
        """Once the run is idle: the clock, the store, the children."""
        await self.guard.settle()
        now = trio.current_time()
        records, marks = await self.contents()
        log, alive = self.log, self.harness.alive
        return Observation(
            now=now,
            records=records,
            marks=marks,
            living={ident: alive(identity) for ident, identity in log.children.items()},
            calls={
                ident: {call: log.count(ident, call) for call in CALLS} for ident in log.children
            },
        )
