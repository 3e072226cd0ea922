"""The session task's stop cannot be held forever (docs/design.md, "Shape in Trio")."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_supervisor import (
    Key,
    Load,
    MemoryStore,
    Phase,
    SessionRecord,
    StateStorageError,
    StoppingRecord,
    open_supervisor,
)
from trio_supervisor._core.session import SAVE_BOUND
from trio_supervisor.testing import FakeExecution, FaultyStore

from ..support.sessions import opened, supervise_embedded


class StoreThatHangsOnStopping(MemoryStore):
    """Never answers a Stopping save: a store breaking its promise of bounded saves."""

    async def save(self, record: SessionRecord) -> None:
        if record.phase is Phase.STOPPING:
            await trio.sleep_forever()
        await super().save(record)


async def test_a_store_that_never_answers_poisons_but_the_child_still_ends(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    store = StoreThatHangsOnStopping()

    async def dispose_on_a_hanging_store() -> None:
        async with supervise_embedded(store, fake) as sup:
            handle = await opened(sup)
            await sup.load(handle, Load(specifier="plugin:main"))
            started = trio.current_time()
            with pytest.raises(StateStorageError, match="did not save the Stopping record"):
                await sup.dispose(handle)
            # The save was given SAVE_BOUND seconds; then the child was terminated anyway.
            assert trio.current_time() - started == pytest.approx(SAVE_BOUND)
            [unit] = fake.units
            assert unit.exited
            assert isinstance(sup.poisoned, StateStorageError)
            # P2: the Stopping record never landed; the Stopped one did.
            record = await sup.status(handle)
            assert not isinstance(record, StoppingRecord)
            assert record.phase is Phase.STOPPED

    with pytest.raises(ExceptionGroup) as shutdown:  # Z3: the poisoning is reported
        await dispose_on_a_hanging_store()
    assert all(isinstance(error, StateStorageError) for error in shutdown.value.exceptions)


async def test_a_cancelled_block_raises_its_problems_as_one_flat_group(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    store = FaultyStore(MemoryStore())

    async def cancelled_while_the_store_fails() -> None:
        with trio.move_on_after(10):
            async with supervise_embedded(store, fake) as sup:
                for instance in ("a", "b"):
                    handle = await opened(sup, Key(identity="plugin", instance=instance))
                    await sup.load(handle, Load(specifier="plugin:main"))
                store.fail_always()
                await trio.sleep_forever()  # cancelled at 10 s: every session stops

    with pytest.raises(ExceptionGroup) as caught:
        await cancelled_while_the_store_fails()
    # Z3: the cancellation is gone (the scope caught it), and what went wrong comes as
    # leaves of one group: no group of Cancelled per session, no nursery wrappers.
    group = caught.value
    assert group.message == "the supervisor shut down with problems (Z3)"
    assert all(isinstance(error, StateStorageError) for error in group.exceptions)
    assert len(group.exceptions) == 4  # two sessions, each a Stopping and a Stopped save
    assert all(unit.exited for unit in fake.units)


async def test_skip_grace_cuts_every_termination_short(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("stubborn:main", ignore_interrupt=True)
    async with supervise_embedded(MemoryStore(), fake, grace=5.0) as sup:
        first = await opened(sup)
        await sup.load(first, Load(specifier="stubborn:main"))
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sup.dispose, first)
            await trio.sleep(1.0)  # one second into a grace of five
            sup.skip_grace()
        assert trio.current_time() - started == pytest.approx(1.0)  # killed at once
        assert (await sup.dispose(first)).kind == "killed"
        # A stop that starts later has no grace at all.
        second = await opened(sup, Key(identity="plugin", instance="b"))
        await sup.load(second, Load(specifier="stubborn:main"))
        started = trio.current_time()
        assert (await sup.dispose(second)).kind == "killed"
        assert trio.current_time() == pytest.approx(started)


class SlowStopStore(MemoryStore):
    """Takes just under SAVE_BOUND to save each record of a stop: slow, but in time."""

    async def save(self, record: SessionRecord) -> None:
        if record.phase in (Phase.STOPPING, Phase.STOPPED):
            await trio.sleep(SAVE_BOUND - 1.0)
        await super().save(record)


async def test_a_stop_whose_every_step_keeps_its_bound_is_not_cut_short(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    # The session task's own bound is the sum of its steps' bounds (grace, confirmation
    # for the kill and for the release, SAVE_BOUND for each save): a stop that is slow
    # at every step, but in time at each, ends as usual (P2-P5).
    async with open_supervisor(
        SlowStopStore(), fake, lease=100.0, grace=1.0, confirmation_timeout=5.0
    ) as sup:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="plugin:main"))
        started = trio.current_time()
        termination = await sup.dispose(handle)
        assert trio.current_time() - started == pytest.approx(2 * (SAVE_BOUND - 1.0))
        assert termination.kind == "exited"
        assert sup.poisoned is None
        stopped = await sup.status(handle)
        assert stopped.phase is Phase.STOPPED
