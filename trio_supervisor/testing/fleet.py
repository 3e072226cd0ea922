"""The fleet machine: supervisors sharing one fleet's store, driven at random.

``fleet_machine(backend)`` returns a Hypothesis ``RuleBasedStateMachine`` that runs two
or three supervisors ("runners") on stores of one fleet (docs/design.md, "the fleet",
F1-F8), each a member under its own id, and picks, step after step: opens on random
runners (one at a time, or the same key from every runner at once), renews, loads and
disposes through the runner that holds the session, crashes and restarts of a runner,
and a runner cut off from the storage past its takeover and then let through again.
After each step it holds what the fleet's store says (read through its own
``FleetStore`` methods, so any adapter can be checked) and what the calls returned
against the fleet's promises:

* F3: a key's generations strictly increase and none is handed out twice, and the
  store's high-water is the highest generation any open returned;
* F6: once an open of generation g returned, no record of its key below g is unstopped;
* F4: nothing a runner sent after it was taken over lands (its records stay as the
  takeover left them), and it poisons itself (H1);
* nothing acknowledged is lost: the record of every open and dispose that returned is
  retained, in that phase or a later one.

The supervisors run in one Trio run on a thread of the machine's, with real time (a
fleet judges leases by its storage's clock), on :class:`~.fakes.FakeExecution`.

What the machine needs of the storage is a :class:`FleetBackend`: a store per member,
a way to empty the storage between examples, and, to crash and cut off members, a way
to hold or reset a member's traffic (for a networked store, a proxy of the test's own).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, ClassVar, Literal, TypeVar

import attrs
import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from .._core.lifetime import open_supervisor
from .._core.supervisor import Supervisor
from ..abc import FleetStore
from ..errors import SupervisorError
from ..model import FleetRecord, Handle, Key, Load, StoppedRecord
from ..retention import Retention
from .fakes import FakeExecution

__all__ = ["FleetBackend", "FleetMachine", "fleet_machine"]

T = TypeVar("T")

RUNNERS = ("r1", "r2", "r3")
KEYS = tuple(Key(identity="fleet", instance=name) for name in "ab")
RUNNER_LEASE = 1.5  # each member's row: renewed every 0.5 s
LEASE = 1.0  # a session's
GRACE = 0.1
CONFIRMATION = 0.3
# A member's records are taken over once its row expired by a session's lease plus its
# stop bound (grace, confirmation and 2 s of switch slack): with the checks' periods,
# at most this long after it stopped renewing.
TAKEOVER = RUNNER_LEASE + LEASE + GRACE + CONFIRMATION + 2.0 + 3.0
CALL_BOUND = 30.0  # seconds any one call may take before the machine calls it stuck
# Large enough that nothing is evicted during an example: every record stays checkable.
RETENTION = Retention(stopped_per_key=1000, stopped_total=100_000)
RANKS = {"Open": 0, "Loading": 1, "Loaded": 2, "Stopping": 3, "Stopped": 4}


@attrs.frozen(kw_only=True)
class FleetBackend:
    """A fleet's storage, as the fleet machine uses it.

    Attributes:
        member: ``member(member_id, runner_lease, retention)``: a new store of the fleet
            for the member ``member_id``, as an async context manager (entering opens
            it, leaving closes it). Called again with the same id when the machine
            restarts that member.
        reset: Empties the storage; called before each example.
        cut_off: ``cut_off(member_id, how)``: from now on, ``"hold"``: nothing the
            member sends reaches the storage and nothing comes back, but nothing fails
            either (a frozen member, or a network that swallows its traffic); or
            ``"reset"``: its connections fail and new ones are refused (a dead
            network). Until ``let_through(member_id)``, which delivers what was held.
            None: the machine neither crashes members nor cuts them off.
        let_through: Undoes ``cut_off``.
    """

    member: Callable[[str, float, Retention], AbstractAsyncContextManager[FleetStore]]
    reset: Callable[[], None]
    cut_off: Callable[[str, Literal["hold", "reset"]], None] | None = None
    let_through: Callable[[str], None] | None = None


class _FleetWorld:
    """One Trio run on a thread; the machine's rules call into it and wait."""

    def __init__(self) -> None:
        self.token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._nursery: trio.Nursery | None = None
        self._done: trio.Event | None = None
        self._thread = threading.Thread(
            target=trio.run, args=(self._main,), name="fleet machine", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fleet machine's Trio run did not start")

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._ready.set()
            await self._done.wait()
            nursery.cancel_scope.cancel()

    def call(self, function: Callable[[], Awaitable[T]], bound: float = CALL_BOUND) -> T:
        """Run ``function()`` in the run; fail the example if it takes over ``bound`` s."""

        async def bounded() -> T:
            with trio.fail_after(bound):
                return await function()

        return trio.from_thread.run(bounded, trio_token=self.token)

    def start(self, function: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Start a task in the run; what it passes to ``task_status.started``."""

        async def starting() -> Any:
            assert self._nursery is not None
            return await self._nursery.start(function, *args)

        return trio.from_thread.run(starting, trio_token=self.token)

    def close(self) -> None:
        if self._done is not None:
            trio.from_thread.run_sync(self._done.set, trio_token=self.token)
        self._thread.join(CALL_BOUND)


@attrs.define
class _Runner:
    """One member of the fleet: its supervisor and store while it is up."""

    name: str
    execution: FakeExecution = attrs.Factory(FakeExecution)
    supervisor: Supervisor | None = None
    store: FleetStore | None = None
    stop: trio.Event | None = None
    stopped: threading.Event | None = None
    cut_off: bool = False  # its traffic is held


async def _run(
    runner: _Runner,
    backend: FleetBackend,
    *,
    task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A supervisor on the member's store, until its stop event is set.

    A failure to start is raised (the example fails with it); once it serves, how its
    supervisor ends (poisoned, with problems) is the machine's to judge, not an error.
    """
    runner.stop = trio.Event()
    runner.stopped = threading.Event()
    started = False
    try:
        async with (
            backend.member(runner.name, RUNNER_LEASE, RETENTION) as store,
            open_supervisor(
                store, runner.execution, lease=LEASE, grace=GRACE, confirmation_timeout=CONFIRMATION
            ) as supervisor,
        ):
            runner.store = store
            task_status.started(supervisor)
            started = True
            await runner.stop.wait()
    except (Exception, BaseExceptionGroup):
        if not started:
            raise
    finally:
        runner.store = None
        runner.stopped.set()


class FleetMachine(RuleBasedStateMachine):
    """The rules and invariants; :func:`fleet_machine` binds them to a backend."""

    backend: ClassVar[FleetBackend]

    def __init__(self) -> None:
        super().__init__()
        type(self).backend.reset()
        self.world = _FleetWorld()
        self.runners: dict[str, _Runner] = {}
        self.requests = itertools.count(1)
        # What the calls returned: every generation handed out, by key, with its token.
        self.handed: dict[tuple[Key, int], str] = {}
        # Sessions by token, with the runner that holds them.
        self.sessions: dict[str, tuple[Handle, str]] = {}
        # The last phase each session's calls acknowledged, as its rank.
        self.acknowledged: dict[str, int] = {}
        # Runners taken over while cut off: their records as the takeover left them.
        self.fenced: dict[str, dict[str, FleetRecord]] = {}

    @initialize(count=st.sampled_from((2, 3)))
    def start(self, count: int) -> None:
        """Start two or three runners on the one store (F1)."""
        for name in RUNNERS[:count]:
            self.runners[name] = _Runner(name)
            self._up(self.runners[name])

    def teardown(self) -> None:
        let_through = type(self).backend.let_through
        for runner in self.runners.values():
            if runner.cut_off and let_through is not None:
                let_through(runner.name)
            self._down(runner)
        self.world.close()

    # -- runners up and down ----------------------------------------------------------

    def _up(self, runner: _Runner) -> None:
        runner.supervisor = self.world.start(_run, runner, type(self).backend)

    def _down(self, runner: _Runner) -> None:
        if runner.supervisor is None:
            return
        assert runner.stop is not None
        assert runner.stopped is not None
        trio.from_thread.run_sync(runner.stop.set, trio_token=self.world.token)
        assert runner.stopped.wait(CALL_BOUND), f"runner {runner.name} did not stop"
        runner.supervisor = None

    def _usable(self) -> list[_Runner]:
        """The runners that are up and reach the storage: what the machine did, never
        what it observes (Hypothesis needs the same choices on a replay)."""
        return [r for r in self.runners.values() if r.supervisor is not None and not r.cut_off]

    def _can_fault(self) -> bool:
        return type(self).backend.cut_off is not None and len(self._usable()) > 1

    # -- what the fleet's store says ------------------------------------------------------

    def _read(self, function: Callable[[FleetStore], Awaitable[T]]) -> T:
        """Ask the fleet's store, through a runner that reaches it."""
        store = next(r.store for r in self._usable() if r.store is not None)
        return self.world.call(lambda: function(store))

    def _records(self) -> dict[str, FleetRecord]:
        held = self._read(lambda store: store.fleet_records())
        return {one.record.handle.token: one for one in held}

    def _mark(self, key: Key) -> int:
        async def read(store: FleetStore) -> int:
            mark, _ = await store.lookup(key, None)
            return mark

        return self._read(read)

    def _epochs(self) -> dict[str, int]:
        return {info.runner_id: info.epoch for info in self._read(lambda s: s.runners())}

    # -- host calls -------------------------------------------------------------------

    def _opened(self, record: Any, runner: str) -> None:
        handle: Handle = record.handle
        earlier = self.handed.setdefault((handle.key, handle.generation), handle.token)
        assert earlier == handle.token, (
            f"F3: generation {handle.generation} of {handle.key} was handed out twice "
            f"(tokens {earlier[:8]} and {handle.token[:8]})"
        )
        self.sessions[handle.token] = (handle, runner)
        self.acknowledged.setdefault(handle.token, RANKS["Open"])
        # F6: the open returned, so every older generation of its key is stopped.
        for one in self._records().values():
            older = one.record.handle
            if older.key == handle.key and older.generation < handle.generation:
                assert isinstance(one.record, StoppedRecord), (
                    f"F6: the open of generation {handle.generation} of {handle.key} "
                    f"returned while generation {older.generation} on {one.runner_id} is "
                    f"{one.record.phase.value}"
                )

    @precondition(lambda self: self._usable())
    @rule(pick=st.integers(0, 2), key=st.sampled_from(KEYS))
    def open(self, pick: int, key: Key) -> None:
        """Open a key on a runner that reaches the store: no generation twice (F3, F6)."""
        usable = self._usable()
        runner = usable[pick % len(usable)]
        supervisor = runner.supervisor
        assert supervisor is not None
        request = f"request-{next(self.requests)}"

        async def call() -> Any:
            expected = await supervisor.high_water(key)
            try:
                return await supervisor.open(key, request, expected_generation=expected)
            except SupervisorError as error:
                return error

        outcome = self.world.call(call)
        if not isinstance(outcome, SupervisorError):
            self._opened(outcome, runner.name)

    @precondition(lambda self: len(self._usable()) > 1)
    @rule(key=st.sampled_from(KEYS))
    def racing_opens(self, key: Key) -> None:
        """Every usable runner opens the same key at once, with the same expectation."""
        usable = self._usable()
        results: list[Any] = []

        async def one(runner: _Runner, expected: int | None) -> None:
            assert runner.supervisor is not None
            try:
                record = await runner.supervisor.open(
                    key, f"request-{next(self.requests)}", expected_generation=expected
                )
            except SupervisorError as error:
                results.append(error)
            else:
                results.append((record, runner.name))

        async def race() -> None:
            assert usable[0].supervisor is not None
            expected = await usable[0].supervisor.high_water(key)
            async with trio.open_nursery() as nursery:
                for runner in usable:
                    nursery.start_soon(one, runner, expected)

        self.world.call(race)
        won = [result for result in results if isinstance(result, tuple)]
        assert len(won) <= 1, f"F3: {len(won)} runners won the same generation of {key}"
        for record, name in won:
            self._opened(record, name)

    def _on_a_session(
        self, pick: int, call: Callable[[Handle, Supervisor], Awaitable[None]]
    ) -> None:
        """Make ``call`` on a session that ``pick`` chooses, through the runner that opened
        it, if that runner is usable. What the supervisor refuses is an outcome too."""
        usable = {runner.name: runner for runner in self._usable()}
        candidates = [
            (handle, usable[name].supervisor)
            for handle, name in self.sessions.values()
            if name in usable
        ]
        if not candidates:
            return
        handle, supervisor = candidates[pick % len(candidates)]
        assert supervisor is not None

        async def made() -> None:
            with contextlib.suppress(SupervisorError):
                await call(handle, supervisor)

        self.world.call(made)

    @rule(pick=st.integers(0, 20))
    def renew(self, pick: int) -> None:
        """Renew a session on its runner (R1-R6, F5)."""

        async def renew(handle: Handle, supervisor: Supervisor) -> None:
            await supervisor.renew(handle)

        self._on_a_session(pick, renew)

    @rule(pick=st.integers(0, 20))
    def load(self, pick: int) -> None:
        """Load a session on its runner (L1-L6)."""

        async def load(handle: Handle, supervisor: Supervisor) -> None:
            await supervisor.load(handle, Load(specifier="fleet:child"))
            self.acknowledged[handle.token] = max(self.acknowledged[handle.token], RANKS["Loaded"])

        self._on_a_session(pick, load)

    @rule(pick=st.integers(0, 20))
    def dispose(self, pick: int) -> None:
        """Dispose a session on its runner (D1-D5)."""

        async def dispose(handle: Handle, supervisor: Supervisor) -> None:
            await supervisor.dispose(handle)
            self.acknowledged[handle.token] = RANKS["Stopped"]

        self._on_a_session(pick, dispose)

    # -- faults -----------------------------------------------------------------------

    @precondition(lambda self: self._can_fault())
    @rule(pick=st.integers(0, 2))
    def crash_and_restart(self, pick: int) -> None:
        """A runner dies (its traffic reset first, so that its shutdown writes nothing),
        then starts again under the same id: a new epoch, which recovers its records."""
        backend = type(self).backend
        assert backend.cut_off is not None
        assert backend.let_through is not None
        usable = self._usable()
        runner = usable[pick % len(usable)]
        backend.cut_off(runner.name, "reset")
        self._down(runner)
        backend.let_through(runner.name)
        self._up(runner)

    @precondition(lambda self: self._can_fault())
    @rule(pick=st.integers(0, 2))
    def cut_off_past_takeover(self, pick: int) -> None:
        """A runner's traffic is held (to the fleet it is frozen) until the others have
        taken its records over; then what it sent arrives, and must all be refused."""
        backend = type(self).backend
        assert backend.cut_off is not None
        assert backend.let_through is not None
        usable = self._usable()
        runner = usable[pick % len(usable)]
        before = self._epochs()[runner.name]
        backend.cut_off(runner.name, "hold")
        runner.cut_off = True

        def unstopped() -> bool:
            return any(
                one.runner_id == runner.name and not isinstance(one.record, StoppedRecord)
                for one in self._records().values()
            )

        # A runner that held sessions is taken over (its epoch moves on); one that held
        # none has nothing to take: the machine waits about as long, then lets it through.
        held = unstopped()
        started = time.monotonic()

        def taken() -> bool:
            if not held:
                return time.monotonic() - started > TAKEOVER - 3.0
            return self._epochs()[runner.name] > before and not unstopped()

        # Real time: the takeover is judged by the storage's clock.
        limit = time.monotonic() + TAKEOVER + 10
        while not taken():
            assert time.monotonic() < limit, f"F7: {runner.name} was not taken over in time"
            time.sleep(0.1)
        self.fenced[runner.name] = {
            token: one for token, one in self._records().items() if one.runner_id == runner.name
        }
        backend.let_through(runner.name)
        # It finds itself fenced: poisoned by its next write, or renewal of its row.
        limit = time.monotonic() + CALL_BOUND
        while runner.supervisor is not None and runner.supervisor.poisoned is None:
            assert time.monotonic() < limit, f"H1: {runner.name} was not poisoned once fenced"
            time.sleep(0.05)
        self._down(runner)
        runner.cut_off = False
        self._up(runner)

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def the_fleet_keeps_its_promises(self) -> None:
        """Generations are unique, acknowledged records are kept, takeovers fence (F3, F4, F7)."""
        if not self._usable():
            return
        stored = self._records()
        # F3: the high-water is the highest generation handed out.
        highest: dict[Key, int] = {}
        for key, generation in self.handed:
            highest[key] = max(highest.get(key, 0), generation)
        for key, generation in highest.items():
            mark = self._mark(key)
            assert mark == generation, (
                f"F3: the high-water of {key} is {mark}, but generation {generation} was handed out"
            )
        # Nothing acknowledged is lost.
        for token, rank in self.acknowledged.items():
            one = stored.get(token)
            assert one is not None, f"an acknowledged record ({token[:8]}) is gone"
            phase = one.record.phase.value
            assert RANKS[phase] >= rank, f"the record of {token[:8]} went back to {phase}"
        # F4: a runner taken over wrote nothing after.
        for name, then in self.fenced.items():
            for token, one in then.items():
                now = stored.get(token)
                if now is not None and now.runner_id == name and now.epoch <= one.epoch:
                    assert now == one, f"F4: {name}, taken over, still wrote {token[:8]}"


def fleet_machine(
    backend: FleetBackend, *, examples: int | None = None, steps: int = 12
) -> type[FleetMachine]:
    """Build the fleet machine for a fleet's storage.

    Args:
        backend: The stores of the fleet's members, and what the machine may do to them.
        examples: Hypothesis examples; by default ``$TRIO_SUPERVISOR_FLEET_EXAMPLES``,
            else 6 (each takes seconds of real time: a takeover is waited for).
        steps: Rules an example runs at most.

    Returns:
        A ``RuleBasedStateMachine`` subclass; pytest collects its ``TestCase``.
    """

    class Fleet(FleetMachine):
        pass

    Fleet.backend = backend
    chosen = examples or int(os.environ.get("TRIO_SUPERVISOR_FLEET_EXAMPLES", "6"))
    Fleet.TestCase.settings = settings(
        max_examples=chosen,
        stateful_step_count=steps,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    return Fleet
