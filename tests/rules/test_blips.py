"""A store out of reach for a while (docs/design.md, "Availability": B1 and B3): what
the engine does with a save the store says it did not write."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_supervisor import (
    Disposed,
    Load,
    MemoryStore,
    OpenRecord,
    Phase,
    StateStorageError,
    StoppedRecord,
    StoreUnavailableError,
)
from trio_supervisor._core.session import SAVE_BOUND
from trio_supervisor.testing import FakeExecution, FaultyStore

from ..support.sessions import KEY, supervise_embedded


async def test_b1_an_open_the_store_could_not_write_fails_and_poisons_nothing(
    fake: FakeExecution,
) -> None:
    store = FaultyStore(MemoryStore())
    async with supervise_embedded(store, fake) as sup:
        store.out_of_reach()
        with pytest.raises(StoreUnavailableError, match="out of reach"):
            await sup.open(KEY, "r1")
        assert sup.poisoned is None
        assert await sup.high_water(KEY) is None  # no generation was handed out
        store.heal()
        record = await sup.open(KEY, "r1")  # the host's retry, with the same request id
        assert record.handle.generation == 1
        assert await sup.renew(record.handle) == record.lease


async def test_b1_a_load_the_store_could_not_write_leaves_the_session_open_to_load_later(
    fake: FakeExecution,
) -> None:
    store = FaultyStore(MemoryStore())
    async with supervise_embedded(store, fake) as sup:
        handle = (await sup.open(KEY, "r1")).handle
        store.out_of_reach()
        with pytest.raises(StoreUnavailableError):
            await sup.load(handle, Load(specifier="plugin"))
        assert fake.units == []  # nothing was spawned (L3 comes first)
        assert isinstance(await sup.status(handle), OpenRecord)
        assert sup.poisoned is None
        await sup.renew(handle)  # renew needs no store
        store.heal()
        code = await sup.load(handle, Load(specifier="plugin"))
        assert code.specifier == "plugin"
        assert (await sup.status(handle)).phase is Phase.LOADED


async def test_b3_a_dispose_while_out_of_reach_stops_the_child_and_keeps_trying_its_record(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    store = FaultyStore(MemoryStore())
    async with supervise_embedded(store, fake) as sup:
        handle = (await sup.open(KEY, "r1")).handle
        await sup.load(handle, Load(specifier="plugin"))
        unit = fake.unit_of(handle)
        store.out_of_reach()
        outcome: list[object] = []

        async def dispose() -> None:
            outcome.append(await sup.dispose(handle))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(dispose)
            # The child is stopped without waiting for the Stopping record (P2, B3)...
            await trio.testing.wait_all_tasks_blocked()
            assert unit.exited
            assert unit.signals == ["interrupt"]
            # ... and the stop keeps trying its Stopped record while the store is away.
            await trio.sleep(SAVE_BOUND / 2)
            assert outcome == []
            assert sup.poisoned is None
            store.heal()
        [termination] = outcome
        stopped = await sup.status(handle)
        assert isinstance(stopped, StoppedRecord)
        assert isinstance(stopped.reason, Disposed)
        assert stopped.termination == termination
        assert sup.poisoned is None


async def test_b3_a_stop_whose_record_cannot_be_saved_within_its_bound_poisons(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    store = FaultyStore(MemoryStore())
    with pytest.RaisesGroup(StateStorageError, allow_unwrapped=True, flatten_subgroups=True):
        async with supervise_embedded(store, fake) as sup:
            handle = (await sup.open(KEY, "r1")).handle
            await sup.load(handle, Load(specifier="plugin"))
            store.out_of_reach()
            with pytest.raises(StateStorageError, match=f"within {SAVE_BOUND:g} s"):
                await sup.dispose(handle)
            assert fake.unit_of(handle).exited  # the child is gone all the same
            assert isinstance(sup.poisoned, StateStorageError)
            assert not isinstance(sup.poisoned, StoreUnavailableError)
            store.heal()
