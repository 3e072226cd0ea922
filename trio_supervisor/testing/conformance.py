"""The conformance machine: random operation sequences against the reference model.

``conformance_machine(store_factory, harness_factory)`` returns a Hypothesis
``RuleBasedStateMachine`` that drives a real supervisor on your store and execution.
Each example runs one Trio run with a ``MockClock`` in a background thread; the rules
call into it with ``trio.from_thread``. Virtual time moves only in ``advance_time`` (and
in restarts, which wait for the shutdown), with autojump on only while that rule sleeps
to its target, so every deadline fires in the order it would in real life.

Operations start as tasks and the machine waits until everything in the run is blocked
(and no store I/O is under way). An operation that waits on virtual time (a dispose of a
child that ignores its interrupt) stays pending; the model says when it will end.

After every step the machine checks: the store holds exactly the records the model says
were acknowledged (phase, child, previous phase, reason, termination kind) and the
high-water of every key; at most one live session per key; every child is alive
exactly when the model says; each child was interrupted, killed, released and recovered
as often as the model says (at most once each), and never signalled before its session
began stopping; and the virtual clocks of model and run agree.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar, Final

import attrs
import trio
import trio.testing
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..errors import SupervisorError
from ..model import (
    CodeIdentity,
    Handle,
    Key,
    LoadedRecord,
    LoadingRecord,
    OpenRecord,
    SessionRecord,
    StoppedRecord,
    StoppingRecord,
    Termination,
)
from ..model import Load as LoadRequest
from ..stores.base import Store
from ..stores.memory import MemoryStore
from ..supervisor import Supervisor, open_supervisor
from .harnesses import FakeHarness, Harness
from .incarnation import ClockGuard, Faults, Incarnation, Log
from .model import Durable, Model, Outcome, Pending, SessionId, ok

__all__ = ["PROFILE", "StoreFactory", "conformance_machine"]

LEASE = 5.0
GRACE = 1.0
CONFIRMATION = 1.5
KEYS = tuple(Key(identity="conformance", instance=name) for name in "abc")
LEASES = (1.0, 2.5, 4.0, None)
STEPS = (0.5, 1.0, 2.0, 4.0, 8.0)

StoreFactory = Callable[[Store | None], Store]
_RECORDS = (OpenRecord, LoadingRecord, LoadedRecord, StoppingRecord, StoppedRecord)

settings.register_profile(
    "trio_supervisor-ci",
    max_examples=700,
    stateful_step_count=30,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "trio_supervisor-deep",
    max_examples=7000,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "trio_supervisor-quick",
    max_examples=20,
    stateful_step_count=20,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = os.environ.get("TRIO_SUPERVISOR_CONFORMANCE", "ci")


def _summary(value: object) -> object:
    """What of an operation's result the model predicts."""
    if isinstance(value, _RECORDS):
        return (value.handle.generation, value.phase.value)
    if isinstance(value, Termination):
        return value.kind
    if isinstance(value, CodeIdentity):
        return value.specifier
    return value


def durable(record: SessionRecord) -> Durable:
    """A stored record as the model describes it."""
    if isinstance(record, StoppingRecord | StoppedRecord):
        previous = record.previous
        return Durable(
            record.phase.value,
            False,
            record.request_id,
            previous=previous.phase.value,
            previous_child=getattr(previous, "child", None) is not None,
            reason=record.reason.kind,
            termination=record.termination.kind if isinstance(record, StoppedRecord) else None,
        )
    return Durable(
        record.phase.value, getattr(record, "child", None) is not None, record.request_id
    )


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


# The rules of docs/design.md section "Semantics" each operation is held to.
_RULES: Final = {
    "open": "O1-O11",
    "renew": "R1-R6",
    "load": "L1-L6, P1-P6",
    "dispose": "D1-D5, P1-P6",
    "status": "S1",
}


class World:
    """One example's Trio run, in its own thread."""

    def __init__(
        self,
        store_factory: StoreFactory,
        harness: Harness,
        store_answers_outside: bool | None = None,
    ) -> None:
        self.store_factory = store_factory
        self.harness = harness
        self.store = store_factory(None)
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
        self.store = self.store_factory(self.store)
        self.faults.broken = False
        self.faults.once.clear()

    # -- operations, time -------------------------------------------------------------

    async def begin(self, name: str, call: Callable[[Supervisor], Awaitable[object]]) -> Operation:
        operation = Operation(name)
        supervisor = self.supervisor
        assert supervisor is not None

        async def run() -> None:
            try:
                value = await call(supervisor)
            except SupervisorError as failure:
                operation.outcome = ("error", type(failure).__name__)
            except Exception as failure:
                operation.outcome = ("crash", f"{type(failure).__name__}: {failure}")
            else:
                operation.value = value
                operation.outcome = ok(_summary(value))

        self.nursery.start_soon(run)
        await self.guard.settle()
        return operation

    async def burst(
        self, calls: list[tuple[str, Callable[[Supervisor], Awaitable[object]]]]
    ) -> list[Operation]:
        operations = []
        supervisor = self.supervisor
        assert supervisor is not None
        for name, call in calls:
            operation = Operation(name)
            operations.append(operation)

            async def run(operation: Operation = operation, call: Any = call) -> None:
                try:
                    value = await call(supervisor)
                except SupervisorError as failure:
                    operation.outcome = ("error", type(failure).__name__)
                except Exception as failure:
                    operation.outcome = ("crash", f"{type(failure).__name__}: {failure}")
                else:
                    operation.value = value
                    operation.outcome = ok(_summary(value))

            self.nursery.start_soon(run)
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


class ConformanceMachine(RuleBasedStateMachine):
    """The rules and invariants; :func:`conformance_machine` binds it to adapters."""

    store_factory: ClassVar[StoreFactory]
    harness_factory: ClassVar[Callable[[], Harness]]
    restartable: ClassVar[bool] = True
    store_answers_outside: ClassVar[bool | None] = None

    def __init__(self) -> None:
        super().__init__()
        harness = type(self).harness_factory()
        self.harness = harness
        self.world = World(type(self).store_factory, harness, type(self).store_answers_outside)
        retention = self.world.store.retention
        if retention.stopped_total < 10_000:
            raise ValueError(
                "the machine needs a store whose retention keeps >= 10,000 Stopped records"
            )
        self.model = Model(
            lease=LEASE,
            grace=GRACE,
            confirmation=CONFIRMATION,
            stopped_per_key=retention.stopped_per_key,
            missing=harness.missing,
            broken=harness.broken,
        )
        self.handles: dict[SessionId, Handle] = {}
        self.pending: list[tuple[Pending, Operation]] = []
        self._requests = itertools.count(1)
        failure = self.world.call(self.world.enter)
        assert failure is None, f"the supervisor did not start on a fresh store: {failure!r}"

    def teardown(self) -> None:
        self.world.close()

    # -- how a step is checked --------------------------------------------------------------

    def _check(self, predicted: Pending, actual: Operation) -> None:
        event(f"{actual.name} -> {predicted.outcome[0] if predicted.outcome else 'waits'}")
        if predicted.outcome is not None and predicted.outcome[0] == "error":
            event(f"{actual.name} -> {predicted.outcome[1]}")
        if predicted.outcome is None:
            assert actual.outcome is None, (
                f"{actual.call}: the model says it still waits, it returned {actual.outcome}"
            )
            self.pending.append((predicted, actual))
            return
        assert actual.outcome == predicted.outcome, (
            f"{actual.call}: the model expects {predicted.outcome}, "
            f"the supervisor gave {actual.outcome}"
        )
        self._adopt(actual)

    def _adopt(self, actual: Operation) -> None:
        value = actual.value
        if actual.name == "open" and isinstance(value, _RECORDS):
            handle = value.handle
            self.handles[(handle.key, handle.generation)] = handle

    def _settle_pending(self) -> None:
        for predicted, actual in list(self.pending):
            if predicted.outcome is not None:
                event(f"{actual.name} waited, then -> {predicted.outcome}")
                self.pending.remove((predicted, actual))
                assert actual.outcome == predicted.outcome, (
                    f"{actual.call}, which waited: the model expects {predicted.outcome}, "
                    f"the supervisor gave {actual.outcome}"
                )
                self._adopt(actual)
            else:
                assert actual.outcome is None, (
                    f"{actual.call}: the model says it still waits, it returned {actual.outcome}"
                )

    def _run(
        self,
        name: str,
        predicted: Any,
        call: Callable[[Supervisor], Awaitable[object]],
        what: str,
    ) -> None:
        expected = self.model.start(name, predicted)
        actual = self.world.call(self.world.begin, name, call)
        actual.what = what
        self._check(expected, actual)

    # -- choosing sessions ------------------------------------------------------------------

    def _known(self) -> list[SessionId]:
        return sorted(self.handles, key=lambda ident: (ident[0].instance, ident[1]))

    def _pick(self, pick: int, among: list[SessionId]) -> SessionId | None:
        return among[pick % len(among)] if among else None

    def _running_children(self) -> list[SessionId]:
        model = self.model
        return [
            ident
            for ident, session in model.sessions.items()
            if session.registered
            and session.child is not None
            and session.child.started
            and session.child.alive
            and ident in self.handles
        ]

    def _busy_keys(self) -> set[Key]:
        """Keys with an operation waiting on one of their sessions.

        A second open of such a key would queue behind the first on the key's lock,
        which the model does not keep; the machine does not ask for it.
        """
        return {predicted.waiting.key for predicted, _ in self.pending if predicted.waiting}

    # -- rules: open, renew, load, dispose, status ------------------------------------------

    @rule(
        which=st.integers(0, 2),
        how=st.sampled_from(["next", "next", "next", "next", "wrong", "none", "repeat"]),
        lease=st.sampled_from(LEASES),
        offset=st.sampled_from([-1, 1, 2]),
    )
    def open(self, which: int, how: str, lease: float | None, offset: int) -> None:
        """Open a key: at its next generation, with a wrong or no expected generation,
        or again with a request id already used."""
        key = KEYS[which]
        if key in self._busy_keys():
            return
        high = self.model.high.get(key, 0)
        expected: int | None = high or None
        request = f"request-{next(self._requests)}"
        if how == "wrong":
            expected = max(high + offset, 0)
            expected = expected + 1 if expected == high else expected
        elif how == "none":
            expected = None
        elif how == "repeat":
            used = [ident for ident in self.model.store if ident[0] == key]
            if used:
                request = self.model.store[max(used, key=lambda ident: ident[1])].request_id
        self._run(
            "open",
            self.model.open(key, request, expected, lease),
            lambda sup: sup.open(key, request, expected_generation=expected, lease=lease),
            f"open({_name(key)}, {request!r}, expected_generation={expected}, lease={lease})",
        )

    def _choose(self, pick: int) -> SessionId | None:
        """A known session, live ones three times as likely."""
        known = self._known()
        live = [
            ident
            for ident in known
            if ident in self.model.sessions and self.model.sessions[ident].reason is None
        ]
        if live and pick % 4:
            return live[pick // 4 % len(live)]
        return self._pick(pick, known)

    @precondition(lambda self: bool(self.handles))
    @rule(pick=st.integers(0, 1000))
    def renew(self, pick: int) -> None:
        ident = self._choose(pick)
        assert ident is not None
        handle = self.handles[ident]
        self._run(
            "renew", self.model.renew(ident), lambda sup: sup.renew(handle), f"renew({_of(ident)})"
        )

    @precondition(lambda self: bool(self.handles))
    @rule(
        pick=st.integers(0, 1000),
        which=st.sampled_from(["first", "first", "other", "missing", "broken"]),
    )
    def load(self, pick: int, which: str) -> None:
        ident = self._choose(pick)
        assert ident is not None
        harness = self.harness
        specifier = {
            "first": harness.specifiers[0],
            "other": harness.specifiers[1],
            "missing": harness.missing,
            "broken": harness.broken or harness.specifiers[0],
        }[which]
        handle = self.handles[ident]
        self._run(
            "load",
            self.model.load(ident, specifier),
            lambda sup: sup.load(handle, LoadRequest(specifier=specifier)),
            f"load({_of(ident)}, {specifier!r})",
        )

    @precondition(lambda self: bool(self.handles))
    @rule(pick=st.integers(0, 1000))
    def dispose(self, pick: int) -> None:
        ident = self._choose(pick)
        assert ident is not None
        handle = self.handles[ident]
        self._run(
            "dispose",
            self.model.dispose(ident),
            lambda sup: sup.dispose(handle),
            f"dispose({_of(ident)})",
        )

    @precondition(lambda self: bool(self.handles))
    @rule(pick=st.integers(0, 1000))
    def status(self, pick: int) -> None:
        ident = self._pick(pick, self._known())
        assert ident is not None
        handle = self.handles[ident]
        self._run(
            "status",
            self.model.status(ident),
            lambda sup: sup.status(handle),
            f"status({_of(ident)})",
        )

    @precondition(lambda self: bool(self.handles))
    @rule(pick=st.integers(0, 1000), how=st.sampled_from(["generation", "token", "key"]))
    def stale_handles_are_refused(self, pick: int, how: str) -> None:
        ident = self._pick(pick, self._known())
        assert ident is not None
        handle = self.handles[ident]
        if how == "generation":
            stale = attrs.evolve(handle, generation=handle.generation + 100)
        elif how == "token":
            stale = attrs.evolve(handle, token="f" * 36)
        else:
            stale = attrs.evolve(handle, key=Key(identity="conformance", instance="elsewhere"))
        stale_error: Outcome = ("error", "StaleSessionError")
        for name in ("renew", "status", "dispose"):
            actual = self.world.call(
                self.world.begin, name, lambda sup, n=name: getattr(sup, n)(stale)
            )
            # Renew checks the supervisor's health first (R1); status and dispose do not.
            expected = (self.model._usable() if name == "renew" else None) or stale_error
            assert actual.outcome == expected, f"{name} of a stale handle: {actual.outcome}"

    # -- rules: children ------------------------------------------------------------------

    @precondition(lambda self: bool(self._running_children()))
    @rule(pick=st.integers(0, 1000), code=st.integers(0, 3))
    def child_exits_by_itself(self, pick: int, code: int) -> None:
        ident = self._pick(pick, self._running_children())
        assert ident is not None
        child = self.world.log.children[ident]
        handle = self.handles[ident]
        self.model.child_exits(ident, code)
        self.world.call(self.world.run_sync, lambda: self.harness.exit(handle, child, code))
        self._settle_pending()

    @precondition(lambda self: self.harness.scripted and bool(self._running_children()))
    @rule(pick=st.integers(0, 1000), kill_too=st.booleans())
    def child_ignores_signals(self, pick: int, kill_too: bool) -> None:
        ident = self._pick(pick, self._running_children())
        assert ident is not None
        child = self.world.log.children[ident]
        self.model.ignore(ident, interrupt=True, kill=kill_too)
        self.world.call(
            self.world.run_sync, lambda: self.harness.ignore(child, interrupt=True, kill=kill_too)
        )

    # -- rules: time --------------------------------------------------------------------

    @rule(step=st.sampled_from(STEPS))
    def advance_time(self, step: float) -> None:
        target = self.model.now + step
        self.model.advance(target)
        self.world.call(self.world.advance, target)
        self._settle_pending()

    @precondition(lambda self: bool(self.pending) and self.model.next_event() < math.inf)
    @rule()
    def advance_to_the_next_deadline(self) -> None:
        """While something waits, move time to the next deadline (often its end)."""
        target = self.model.next_event()
        self.model.advance(target)
        self.world.call(self.world.advance, target)
        self._settle_pending()

    # -- rules: storage faults ----------------------------------------------------------

    @rule(which=st.integers(0, 1000), dice=st.integers(0, 2))
    def fail_the_next_save_of_a_session(self, which: int, dice: int) -> None:
        """One save fails: the next of a session, or the next Open of a key (1 in 3)."""
        if dice:
            return
        candidates: list[SessionId | Key] = [*self._known(), *KEYS]
        target = candidates[which % len(candidates)]
        if isinstance(target, Key):
            key = target

            def refuse(ident: SessionId, phase: str) -> bool:
                return ident[0] == key and phase == "Open"
        else:
            session = target

            def refuse(ident: SessionId, phase: str) -> bool:
                return ident == session

        self.model.fail_once.append(refuse)
        self.world.faults.once.append(refuse)

    @precondition(lambda self: len(self.handles) >= 4)
    @rule(dice=st.integers(0, 4))
    def fail_every_save_from_now_on(self, dice: int) -> None:
        """The disk is gone (1 in 5, once a few sessions exist); restarts heal it."""
        if dice:
            return
        self.model.broken_store = True
        self.world.faults.broken = True

    # -- rules: restarts ------------------------------------------------------------------

    @precondition(lambda self: type(self).restartable)
    @rule(crash=st.booleans())
    def restart(self, crash: bool) -> None:
        world, model = self.world, self.model
        alive = sum(1 for child in model.children.values() if child.alive)
        event(f"restart ({'crash' if crash else 'clean'}) with {min(alive, 3)}+ children alive")
        if crash:
            model.crash()
            world.call(world.crash)
        else:
            _, raises = model.shutdown()
            failure = world.call(world.shutdown)
            if raises:
                assert isinstance(failure, BaseExceptionGroup), (
                    f"a poisoned supervisor must raise an error group on exit, got {failure!r}"
                )
            else:
                assert failure is None, f"a clean shutdown raised {failure!r}"
        if not crash:
            self._settle_pending()
        self.pending.clear()
        world.call(world.reopen_store)
        expected = model.recover()
        failure = world.call(world.enter)
        if expected != ok():
            assert failure is not None, f"recovery should fail with {expected}"
            assert type(failure).__name__ == expected[1], f"recovery failed with {failure!r}"
            event("recovery could not confirm an orphan")
            # An operator ends the children that would not die, and starts again.
            for ident in list(model.immortal_orphans()):
                model.children[ident].ignore_kill = False
                child = world.log.children[ident]
                world.call(world.run_sync, lambda child=child: self.harness.heal(child))
            expected = model.recover()
            failure = world.call(world.enter)
        assert expected == ok()
        assert failure is None, f"the supervisor did not start: {failure!r}"

    # -- rules: bursts --------------------------------------------------------------------

    @precondition(lambda self: not self.pending)
    @rule(
        ops=st.lists(
            st.tuples(
                st.integers(0, 2), st.sampled_from(["open", "renew", "dispose", "status", "load"])
            ),
            min_size=2,
            max_size=3,
            unique_by=lambda op: op[0],
        ),
        twin=st.booleans(),
    )
    def concurrent_burst(self, ops: list[tuple[int, str]], twin: bool) -> None:
        """Operations on different keys (and maybe two opens of one key) started at once.

        The outcomes and the store must be explained by some interleaving of the
        operations' atomic steps: an open checks the health (O1), takes the key's lock
        to check and supersede (O3-O5), and checks again and saves (O6-O8); every other
        operation is one step.
        """
        plan: list[_Planned] = []
        for which, name in ops:
            key = KEYS[which]
            latest = max((i for i in self.handles if i[0] == key), key=lambda i: i[1], default=None)
            session = self.model.sessions.get(latest) if latest else None
            if (
                session is not None
                and session.child is not None
                and (session.child.ignore_interrupt or session.stage != "live")
            ):
                return  # it would wait on virtual time; bursts stay instantaneous
            if name == "open" or latest is None:
                plan.append(self._planned_open(key))
                if twin and len(plan) == 1:
                    plan.append(self._planned_open(key))
                continue
            plan.append(self._planned_call(name, latest, self.handles[latest]))
        actual = self.world.call(self.world.burst, [(step.name, step.call) for step in plan])
        records, marks = self.world.call(self.world.contents)
        stored = {(r.handle.key, r.handle.generation): durable(r) for r in records}
        living = self.world.call(self._alive, dict(self.world.log.children))
        calls = self._calls()

        def matches(state: Model) -> bool:
            return (
                state.store == stored
                and state.high == marks
                and {ident: child.alive for ident, child in state.children.items()} == living
                and _counts(state) == calls
            )

        explained = _interleave(
            self.model, plan, [operation.outcome for operation in actual], matches
        )
        assert explained is not None, (
            "no interleaving of the burst explains what happened: "
            + ", ".join(f"{operation.name} -> {operation.outcome}" for operation in actual)
        )
        event(f"burst of {len(plan)} explained")
        self.model = explained
        for operation in actual:
            self._adopt(operation)

    def _planned_open(self, key: Key) -> _Planned:
        request = f"request-{next(self._requests)}"
        expected = self.model.high.get(key) or None
        return _Planned(
            "open",
            key,
            (
                lambda model: model.open_check(),
                lambda model: model.open_supersede(key, request, expected),
                lambda model: model.open_commit(key, request, None),
            ),
            lambda sup: sup.open(key, request, expected_generation=expected),
        )

    def _planned_call(self, name: str, ident: SessionId, handle: Handle) -> _Planned:
        specifier = self.harness.specifiers[0]
        if name == "load":
            return _Planned(
                name,
                None,
                (lambda model: _at_once(model.load(ident, specifier)),),
                lambda sup: sup.load(handle, LoadRequest(specifier=specifier)),
            )
        return _Planned(
            name,
            None,
            (lambda model: _at_once(getattr(model, name)(ident)),),
            lambda sup: getattr(sup, name)(handle),
        )

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def the_clocks_agree(self) -> None:
        now = self.world.call(self.world.settle)
        assert math.isclose(now, self.model.now), (
            f"the run's virtual time is {now}, the model's {self.model.now}: some wait of the "
            "supervisor did not end when the rules say (T1 leases, P3 grace and confirmation)"
        )

    @invariant()
    def the_store_holds_what_was_acknowledged(self) -> None:
        records, marks = self.world.call(self.world.contents)
        stored = {(r.handle.key, r.handle.generation): durable(r) for r in records}
        assert len(stored) == len(records), (
            "a save replaces its token's earlier record (docs/design.md, Adapters), but the "
            "store lists two records of one session: "
            + ", ".join(sorted(f"{_of(ident)}" for ident in stored))
        )
        assert stored == self.model.store, _difference(stored, self.model.store)
        assert marks == self.model.high, (
            "every key's high-water is kept apart from retention and never evicted (V5, "
            f"section Persistence): the store says {_marks(marks)}, the model "
            f"{_marks(self.model.high)}"
        )
        live = [r.handle.key for r in records if r.phase.value in ("Open", "Loading", "Loaded")]
        assert len(live) == len(set(live)), (
            "at most one live record per key (O5 supersedes the older): "
            + ", ".join(_name(key) for key in live)
        )

    @invariant()
    def children_live_and_die_as_the_model_says(self) -> None:
        log = self.world.log
        living = self.world.call(self._alive, dict(log.children))
        calls = self._calls()
        expected_calls = _counts(self.model)
        for ident, child in self.model.children.items():
            identity = log.children.get(ident)
            assert identity is not None, (
                f"the child of {_of(ident)}: the model has one (L4), the execution never spawned it"
            )
            alive = living[ident]
            assert alive == child.alive, (
                f"the child of {_of(ident)} is {'alive' if alive else 'gone'}, the model says "
                f"{'alive' if child.alive else 'gone'} (P3: every stop ends its child; X1, V2)"
            )
            counts = calls[ident]
            assert counts == expected_calls[ident], (
                f"the child of {_of(ident)} got the calls {counts}, the model says "
                f"{expected_calls[ident]} (P3 interrupt then kill, P4 one release, V2 recover)"
            )
            exactly_once = [name for name in ("interrupt", "kill", "aclose") if counts[name] > 1]
            assert not exactly_once, (
                f"the child of {_of(ident)} got more than one {exactly_once}: a session is "
                "terminated exactly once (P1, section Shape in Trio)"
            )
        for ident in log.children:
            assert ident in self.model.children, (
                f"the execution spawned a child for {_of(ident)} that the model never asked "
                "for (L3, L4)"
            )

    def _calls(self) -> dict[SessionId, dict[str, int]]:
        log = self.world.log
        return {ident: {name: log.count(ident, name) for name in _CALLS} for ident in log.children}

    async def _alive(self, children: dict[SessionId, Any]) -> dict[SessionId, bool]:
        await trio.lowlevel.checkpoint()
        return {ident: self.harness.alive(identity) for ident, identity in children.items()}

    @invariant()
    def children_are_signalled_only_once_their_session_stops(self) -> None:
        stopping: set[SessionId] = set()
        for entry in self.world.log.entries:
            if entry.kind == "save" and entry.what in ("Stopping", "Stopped"):
                stopping.add(entry.session)
            elif entry.what in ("interrupt", "kill"):
                assert entry.session in stopping, (
                    f"the child of {_of(entry.session)} was sent {entry.what} before its "
                    "Stopping record was saved (P2 persists Stopping before P3 signals)"
                )


@attrs.frozen
class _Planned:
    """One operation of a burst: its model steps, and the call on the real supervisor.

    ``key`` is set for an open: its second and third steps hold that key's lock.
    """

    name: str
    key: Key | None
    steps: tuple[Callable[[Model], Outcome | None], ...]
    call: Callable[[Supervisor], Awaitable[object]]


def _at_once(steps: Any) -> Outcome:
    """Run a model operation that must not wait."""
    if isinstance(steps, tuple):
        return steps
    try:
        waiting = next(steps)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    raise AssertionError(f"a burst operation waits for {waiting}")


_CALLS = ("interrupt", "kill", "aclose", "recover")


def _counts(model: Model) -> dict[SessionId, dict[str, int]]:
    return {
        ident: {
            "interrupt": child.interrupts,
            "kill": child.kills,
            "aclose": child.closes,
            "recover": child.recovers,
        }
        for ident, child in model.children.items()
    }


def _fingerprint(model: Model) -> str:
    """A text equal for two model states that behave the same from here on."""
    return repr(sorted(vars(model).items()))


def _interleave(
    model: Model,
    plan: list[_Planned],
    outcomes: list[Outcome | None],
    matches: Callable[[Model], bool],
) -> Model | None:
    """A model state reached by an interleaving of ``plan`` that gives ``outcomes``."""

    # Interleavings of independent steps often reach the same state by different orders;
    # remembering the (position, state) pairs already found to lead nowhere keeps the
    # search from exploring each of them again (without it, a burst that nothing
    # explains, which is what a broken adapter produces, takes exponential time).
    dead_ends: set[tuple[tuple[int, ...], tuple[tuple[Key, int], ...], str]] = set()

    def search(state: Model, positions: tuple[int, ...], lock: dict[Key, int]) -> Model | None:
        if all(position < 0 for position in positions):
            return state if matches(state) else None
        seen = (positions, tuple(sorted(lock.items(), key=repr)), _fingerprint(state))
        if seen in dead_ends:
            return None
        found = explore(state, positions, lock)
        if found is None:
            dead_ends.add(seen)
        return found

    def explore(state: Model, positions: tuple[int, ...], lock: dict[Key, int]) -> Model | None:
        for index, operation in enumerate(plan):
            position = positions[index]
            if position < 0:
                continue
            locked = operation.key is not None and position >= 1
            if locked and lock.get(operation.key, index) != index:  # type: ignore[arg-type]
                continue  # another open of this key holds its lock
            trial = copy.deepcopy(state)
            result = operation.steps[position](trial)
            last = result is not None or position == len(operation.steps) - 1
            if last and result != outcomes[index]:
                continue
            held = dict(lock)
            if operation.key is not None:
                if last:
                    held.pop(operation.key, None)
                elif position >= 1:
                    held[operation.key] = index
            moved = list(positions)
            moved[index] = -1 if last else position + 1
            found = search(trial, tuple(moved), held)
            if found is not None:
                return found
        return None

    return search(model, tuple(0 for _ in plan), {})


def _name(key: Key) -> str:
    return f"{key.identity}/{key.instance}"


def _of(ident: SessionId) -> str:
    """A session as messages name it: ``conformance/a#2``."""
    return f"{_name(ident[0])}#{ident[1]}"


def _marks(marks: Mapping[Key, int]) -> str:
    return (
        "{"
        + ", ".join(f"{_name(key)}: {mark}" for key, mark in sorted(marks.items(), key=repr))
        + "}"
    )


def _difference(stored: Mapping[SessionId, Durable], expected: Mapping[SessionId, Durable]) -> str:
    lines = [
        "the store must hold exactly the records the supervisor had acknowledged (O8, L3, "
        "L4, P2, P5, V3, with retention), and it differs:"
    ]
    for ident in sorted(set(stored) | set(expected), key=lambda i: (i[0].instance, i[1])):
        if stored.get(ident) != expected.get(ident):
            lines.append(
                f"  {ident[0].instance}#{ident[1]}: stored {stored.get(ident)}, "
                f"model {expected.get(ident)}"
            )
    return "\n".join(lines)


def conformance_machine(
    store_factory: StoreFactory,
    harness_factory: Callable[[], Harness] | None = None,
    *,
    restartable: bool = True,
    profile: str | None = None,
    store_answers_outside: bool | None = None,
) -> type[ConformanceMachine]:
    """Build the conformance machine for a store and an execution adapter.

    Args:
        store_factory: Called with None for a fresh store at the start of an example,
            and with the previous store (already closed, if it has ``aclose``) when the
            machine restarts the supervisor: return the same storage again (a
            ``MemoryStore`` returns itself; a file store reopens its file). Its
            retention must keep at least 10,000 Stopped records in all.
        harness_factory: Makes the execution adapter's harness, one per example; the
            scriptable fake by default.
        restartable: Whether the machine restarts (cleanly, and by crashing).
        profile: ``"ci"``, ``"deep"`` or ``"quick"`` (a smoke test); by default
            ``$TRIO_SUPERVISOR_CONFORMANCE``, else ``"ci"``.
        store_answers_outside: Whether the store's answers come from outside the Trio
            run (a worker thread, a socket). The machine then makes one store call at a
            time, once every other task waits, so that an example replays exactly
            (Hypothesis requires it) whatever the thread's timing. By default: True for
            any store but a ``MemoryStore``. Say False only for a store that answers
            within the run: the machine then explores more interleavings.

    Returns:
        A ``RuleBasedStateMachine`` subclass; pytest collects its ``TestCase``.
    """
    chosen = profile or PROFILE
    harness = harness_factory or FakeHarness

    class Conformance(ConformanceMachine):
        pass

    Conformance.store_factory = staticmethod(store_factory)
    Conformance.harness_factory = staticmethod(harness)
    Conformance.restartable = restartable
    Conformance.store_answers_outside = store_answers_outside
    Conformance.TestCase.settings = settings.get_profile(f"trio_supervisor-{chosen}")
    return Conformance
