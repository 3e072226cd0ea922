"""health: H1-H3 of docs/design.md, "Semantics"."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_supervisor import (
    ExecutionError,
    ExitStatus,
    Key,
    Load,
    LoadedRecord,
    MemoryStore,
    StateStorageError,
    StoppedRecord,
    Supervisor,
    Termination,
)
from trio_supervisor.testing import FakeExecution, FaultyStore

from ..support.sessions import OTHER, opened, supervise_embedded


async def test_h1_a_failed_save_poisons_the_supervisor(fake: FakeExecution) -> None:
    store = FaultyStore(MemoryStore())
    with pytest.RaisesGroup(StateStorageError):
        async with supervise_embedded(store, fake) as sup:
            assert sup.poisoned is None
            store.fail_next()
            with pytest.raises(StateStorageError) as caught:
                await sup.open(OTHER, "r1")
            assert sup.poisoned is caught.value


async def test_h1_a_crashed_background_task_poisons_the_supervisor(fake: FakeExecution) -> None:
    fake.behave("blind", wait_error=RuntimeError("pidfd went away"))
    with pytest.RaisesGroup(ExecutionError):
        async with supervise_embedded(MemoryStore(), fake) as sup:
            handle = await opened(sup)
            await sup.load(handle, Load(specifier="blind"))
            await trio.testing.wait_all_tasks_blocked()
            assert isinstance(sup.poisoned, ExecutionError)
            assert "watching the child" in sup.poisoned.detail
            fake.unit_of(handle).behaviour.wait_error = None  # so the shutdown can confirm the exit


async def test_h2_poisoned_open_renew_load_fail_and_dispose_status_work(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    store = FaultyStore(MemoryStore())
    with pytest.RaisesGroup(StateStorageError):
        async with supervise_embedded(store, fake, lease=5.0) as sup:
            draining = await opened(sup)
            await sup.load(draining, Load(specifier="x"))
            disposed = await opened(sup, key=OTHER)
            store.fail_next()
            with pytest.raises(StateStorageError):
                await sup.open(Key(identity="plugin", instance="poison"), "r")
            for refused in (
                sup.open(OTHER, "r9", expected_generation=1),
                sup.renew(draining),
                sup.load(disposed, Load(specifier="x")),
            ):
                with pytest.raises(StateStorageError):
                    await refused
            assert isinstance(await sup.status(draining), LoadedRecord)
            assert await sup.dispose(disposed) == Termination(kind="none", exit=ExitStatus())
            assert isinstance(await sup.status(disposed), StoppedRecord)
            # Leases keep running: the loaded session drains and its child is reaped.
            await trio.sleep(6.0)
            record = await sup.status(draining)
            assert isinstance(record, StoppedRecord)
            assert record.reason.kind == "Expired"
            assert fake.unit_of(draining).exited


async def test_h3_wait_failed_blocks_until_poisoned_then_raises(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    store = FaultyStore(MemoryStore())
    raised: list[tuple[StateStorageError, float]] = []

    async def watch(sup: Supervisor) -> None:
        try:
            await sup.wait_failed()
        except StateStorageError as error:
            raised.append((error, trio.current_time()))

    with pytest.RaisesGroup(StateStorageError):
        async with supervise_embedded(store, fake) as sup, trio.open_nursery() as nursery:
            nursery.start_soon(watch, sup)
            await trio.sleep(3.0)
            assert raised == []
            store.fail_next()
            with pytest.raises(StateStorageError):
                await sup.open(OTHER, "r1")
    [(error, when)] = raised
    assert when == 3.0
    assert error.__cause__ is sup.poisoned
