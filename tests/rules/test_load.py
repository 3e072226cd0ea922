"""load: L1-L6 of docs/design.md, "Semantics"."""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from trio_supervisor import (
    CodeIdentity,
    ExecutionError,
    ExitStatus,
    Handle,
    LeaseExpiredError,
    Limits,
    Load,
    LoadedRecord,
    LoadFailed,
    LoadingRecord,
    MemoryStore,
    OpenRecord,
    PackageError,
    RunnerClosingError,
    SessionConflictError,
    SessionRecord,
    SessionStoppedError,
    StaleSessionError,
    StateStorageError,
    StoppedRecord,
    SupervisorAPI,
    Termination,
)
from trio_supervisor.testing import FakeExecution, FakeUnit, FaultyStore

from ..support.sessions import KEY, OTHER, during_shutdown, opened, poisoning, supervise


class WatchedExecution(FakeExecution):
    """A fake that notes what the store held when spawn and start were called."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__()
        self.store = store
        self.at_spawn: list[SessionRecord] = []
        self.at_start: list[SessionRecord] = []
        self.gate: trio.Event | None = None

    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> FakeUnit:
        self.at_spawn = list(await self.store.list())
        if self.gate is not None:
            await self.gate.wait()
        unit = await super().spawn(handle, load, limits)
        execution = self
        original = unit.start

        async def start() -> None:
            execution.at_start = list(await execution.store.list())
            await original()

        unit.start = start  # type: ignore[method-assign]
        return unit


async def test_l1_load_is_refused_like_renew(
    store: MemoryStore, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    async with supervise(store, fake) as sup:
        handle = await opened(sup)
        with pytest.raises(StaleSessionError):
            await sup.load(attrs.evolve(handle, generation=9), Load(specifier="x"))
        expiring = await opened(sup, key=OTHER, lease=1.0)
        await trio.sleep(1.0)
        with pytest.raises(LeaseExpiredError):
            await sup.load(expiring, Load(specifier="x"))
    assert not fake.units

    late: list[BaseException] = []

    async def load_late(supervisor: SupervisorAPI, handle: Handle) -> None:
        with pytest.raises(RunnerClosingError) as caught:
            await supervisor.load(handle, Load(specifier="other"))
        late.append(caught.value)

    await during_shutdown(MemoryStore(), fake, load_late)
    assert len(late) == 1
    assert [call.name for call in fake.calls].count("spawn") == 1


async def test_l1_load_fails_with_the_poisoning_error(fake: FakeExecution) -> None:
    store = FaultyStore(MemoryStore())
    with pytest.RaisesGroup(StateStorageError):
        async with supervise(store, fake) as sup:
            handle = await opened(sup)
            store.fail_next()
            with pytest.raises(StateStorageError):
                await sup.open(OTHER, "poison")
            with pytest.raises(StateStorageError):
                await sup.load(handle, Load(specifier="x"))
    assert not fake.units


async def test_l2_a_load_of_the_same_specifier_joins_or_returns_the_recorded_code(
    sup: SupervisorAPI, fake: FakeExecution
) -> None:
    handle = await opened(sup)
    results: list[CodeIdentity] = []
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(lambda: _append(results, sup.load(handle, Load(specifier="x"))))
    # One spawn, and every caller got the code identity of its unit.
    assert results == [fake.unit_of(handle).code] * 3
    assert await sup.load(handle, Load(specifier="x", config={"ignored": True})) == results[0]
    assert [call.name for call in fake.calls].count("spawn") == 1


async def _append(results: list[CodeIdentity], call: object) -> None:
    results.append(await call)  # type: ignore[misc]


async def test_l2_another_specifier_conflicts(sup: SupervisorAPI, fake: FakeExecution) -> None:
    handle = await opened(sup)
    await sup.load(handle, Load(specifier="x"))
    with pytest.raises(SessionConflictError, match="'y'"):
        await sup.load(handle, Load(specifier="y"))
    assert isinstance(await sup.status(handle), LoadedRecord)


async def test_l3_loading_is_durable_before_the_spawn(store: MemoryStore) -> None:
    execution = WatchedExecution(store)
    async with supervise(store, execution) as sup:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="x"))
    [at_spawn] = execution.at_spawn
    assert isinstance(at_spawn, LoadingRecord)
    assert at_spawn.child is None
    assert at_spawn.load == Load(specifier="x")


async def test_l4_the_child_identity_is_durable_before_the_child_starts(
    store: MemoryStore, autojump_clock: trio.testing.MockClock
) -> None:
    execution = WatchedExecution(store)
    async with supervise(store, execution) as sup:
        handle = await opened(sup, lease=10.0)
        code = await sup.load(handle, Load(specifier="x"))
        unit = execution.unit_of(handle)
        [at_start] = execution.at_start
        assert isinstance(at_start, LoadingRecord)
        assert at_start.child == unit.identity
        # The remaining lease went to the unit before it started.
        names = [call.name for call in execution.calls_of(unit)]
        assert names.index("renew") < names.index("start")
        assert unit.leases == [10.0]  # no virtual time passed since the open
        record = await sup.status(handle)
        assert isinstance(record, LoadedRecord)
        assert (record.code, record.child) == (code, unit.identity)


async def test_l4_the_exit_watcher_runs_once_the_child_is_registered(
    sup: SupervisorAPI, fake: FakeExecution
) -> None:
    handle = await opened(sup)
    await sup.load(handle, Load(specifier="x"))
    unit = fake.unit_of(handle)
    unit.exit(code=4)
    await trio.testing.wait_all_tasks_blocked()
    record = await sup.status(handle)
    assert isinstance(record, StoppedRecord)
    assert record.reason.kind == "Exited"


async def test_l4_a_second_registration_is_an_execution_error() -> None:
    from trio_supervisor._core.lifecycle import Lifecycle

    record = OpenRecord(
        handle=Handle(key=KEY, token="t" * 32, generation=1),
        request_id="r",
        lease=5.0,
        limits=Limits(),
    )
    lifecycle = Lifecycle(record, deadline=5.0)
    lifecycle.begin_load(Load(specifier="x"), now=0.0)
    child = FakeExecution()
    unit = await child.spawn(record.handle, Load(specifier="x"), Limits())
    lifecycle.register(lifecycle.child_record(unit.identity, now=0.0).child)  # type: ignore[arg-type]
    with pytest.raises(ExecutionError):
        lifecycle.child_record(unit.identity, now=0.0)


async def test_l5_a_spawn_package_error_fails_the_load_and_stops_the_session(
    sup: SupervisorAPI, fake: FakeExecution
) -> None:
    fake.fail_next_spawn(PackageError("no module named 'missing'"))
    handle = await opened(sup)
    with pytest.raises(PackageError, match="missing"):
        await sup.load(handle, Load(specifier="missing:main"))
    record = await sup.status(handle)
    assert isinstance(record, StoppedRecord)
    assert isinstance(record.reason, LoadFailed)
    assert record.reason.cause[0].type == "trio_supervisor.errors.PackageError"
    assert record.termination == Termination(kind="none", exit=ExitStatus())
    with pytest.raises(SessionStoppedError):
        await sup.load(handle, Load(specifier="missing:main"))


async def test_l5_a_start_failure_stops_the_session_and_terminates_the_child(
    sup: SupervisorAPI, fake: FakeExecution
) -> None:
    fake.behave("broken", start_error=ExecutionError("exec format error"))
    handle = await opened(sup)
    with pytest.raises(ExecutionError, match="exec format error"):
        await sup.load(handle, Load(specifier="broken"))
    unit = fake.unit_of(handle)
    assert unit.signals == ["interrupt"]
    assert unit.closed == 1
    record = await sup.status(handle)
    assert isinstance(record, StoppedRecord)
    assert isinstance(record.reason, LoadFailed)
    assert record.previous.child == unit.identity  # type: ignore[union-attr]


async def test_l5_an_adapter_crash_is_reported_as_an_execution_error(
    sup: SupervisorAPI, fake: FakeExecution
) -> None:
    fake.behave("buggy", spawn_error=None, start_error=None)

    async def crash(handle: Handle, load: Load, limits: Limits) -> FakeUnit:
        raise ZeroDivisionError("adapter bug")

    fake.spawn = crash  # type: ignore[method-assign]
    handle = await opened(sup)
    with pytest.raises(ExecutionError, match="ZeroDivisionError"):
        await sup.load(handle, Load(specifier="buggy"))


async def test_l5_a_failed_save_fails_the_load_and_poisons(fake: FakeExecution) -> None:
    store = FaultyStore(MemoryStore())
    store.fail_when(lambda record: isinstance(record, LoadedRecord))
    with pytest.RaisesGroup(StateStorageError):
        async with supervise(store, fake) as sup:
            handle = await opened(sup)
            with pytest.raises(StateStorageError):
                await sup.load(handle, Load(specifier="x"))
            assert isinstance(await poisoning(sup), StateStorageError)
            record = await sup.status(handle)
            assert isinstance(record, StoppedRecord)
            assert isinstance(record.reason, LoadFailed)
            assert fake.unit_of(handle).exited


async def test_l5_the_load_error_mentions_the_poisoning(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    store = FaultyStore(MemoryStore())
    execution = WatchedExecution(store.inner)  # type: ignore[arg-type]
    execution.gate = trio.Event()
    execution.fail_next_spawn(PackageError("bad wheel"))
    with pytest.RaisesGroup(StateStorageError):
        async with supervise(store, execution) as sup, trio.open_nursery() as nursery:
            handle = await opened(sup)
            failures: list[BaseException] = []

            async def load() -> None:
                try:
                    await sup.load(handle, Load(specifier="x"))
                except PackageError as error:
                    failures.append(error)

            nursery.start_soon(load)
            await trio.testing.wait_all_tasks_blocked()
            store.fail_next()
            with pytest.raises(StateStorageError):
                await sup.open(OTHER, "poison")
            execution.gate.set()
    [failure] = failures
    assert any("poisoned" in note for note in getattr(failure, "__notes__", []))


async def test_l6_a_cancelled_caller_does_not_cancel_the_load(
    store: MemoryStore, autojump_clock: trio.testing.MockClock
) -> None:
    execution = WatchedExecution(store)
    execution.gate = trio.Event()
    async with supervise(store, execution) as sup:
        handle = await opened(sup)
        with trio.move_on_after(1.0) as scope:
            await sup.load(handle, Load(specifier="x"))
        assert scope.cancelled_caught
        execution.gate.set()
        code = await sup.load(handle, Load(specifier="x"))
        assert code.specifier == "x"
        assert isinstance(await sup.status(handle), LoadedRecord)


@pytest.mark.parametrize(
    ("stop", "error"),
    [("dispose", SessionStoppedError), ("expire", LeaseExpiredError)],
)
async def test_l6_a_session_stopping_during_the_load_fails_it_with_the_stop_error(
    store: MemoryStore, autojump_clock: trio.testing.MockClock, stop: str, error: type[Exception]
) -> None:
    execution = WatchedExecution(store)
    execution.gate = trio.Event()
    async with supervise(store, execution) as sup, trio.open_nursery() as nursery:
        handle = await opened(sup, lease=2.0)
        if stop == "dispose":
            nursery.start_soon(_dispose_later, sup, handle)
        with pytest.raises(error):
            await sup.load(handle, Load(specifier="x"))
        assert not execution.units, "the spawn was cancelled with the session"


async def _dispose_later(sup: SupervisorAPI, handle: Handle) -> None:
    await trio.sleep(1.0)
    await sup.dispose(handle)
