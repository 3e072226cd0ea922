"""renew: R1-R6 of docs/design.md, "Semantics"."""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from trio_supervisor import (
    Expired,
    Handle,
    LeaseExpiredError,
    Load,
    MemoryStore,
    OpenRecord,
    RunnerClosingError,
    SessionStoppedError,
    StaleSessionError,
    StateStorageError,
    StoppedRecord,
    StoppingRecord,
    Supervisor,
)
from trio_supervisor.testing import FakeExecution, FaultyStore

from .harness import KEY, OTHER, during_shutdown, opened, supervise


async def test_r1_renew_fails_with_runner_closing_during_shutdown(
    store: MemoryStore, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    refused: list[BaseException] = []

    async def renew_late(supervisor: Supervisor, handle: Handle) -> None:
        with pytest.raises(RunnerClosingError) as caught:
            await supervisor.renew(handle)
        refused.append(caught.value)

    await during_shutdown(store, fake, renew_late)
    assert len(refused) == 1


async def test_r1_renew_fails_with_the_poisoning_error(fake: FakeExecution) -> None:
    store = FaultyStore(MemoryStore())
    with pytest.RaisesGroup(StateStorageError):
        async with supervise(store, fake) as sup:
            handle = await opened(sup)
            store.fail_next()
            with pytest.raises(StateStorageError):
                await sup.open(OTHER, "poison")
            with pytest.raises(StateStorageError):
                await sup.renew(handle)


async def test_r2_unknown_tokens_and_wrong_keys_or_generations_are_stale(sup: Supervisor) -> None:
    handle = await opened(sup)
    for stale in (
        attrs.evolve(handle, token="0" * 36),
        attrs.evolve(handle, generation=2),
        attrs.evolve(handle, key=OTHER),
    ):
        with pytest.raises(StaleSessionError):
            await sup.renew(stale)


async def test_r2_a_retired_session_is_stopped(fake: FakeExecution) -> None:
    store = MemoryStore()
    async with supervise(store, fake) as sup:
        handle = await opened(sup)
    # A second supervisor on the same store keeps the record but has no session object.
    async with supervise(store, fake) as sup:
        await sup.status(handle)
        with pytest.raises(SessionStoppedError):
            await sup.renew(handle)


async def test_r3_a_stopping_session_is_stopped_and_an_expired_one_expired(
    sup: Supervisor, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("slow", exit_delay=0.8)
    disposed = await opened(sup)
    await sup.load(disposed, Load(specifier="slow"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sup.dispose, disposed)
        await trio.sleep(0.5)  # the child is still exiting
        with pytest.raises(SessionStoppedError):
            await sup.renew(disposed)
    with pytest.raises(SessionStoppedError):
        await sup.renew(disposed)

    expired = await opened(sup, key=OTHER, lease=2.0)
    await trio.sleep(3.0)
    with pytest.raises(LeaseExpiredError):
        await sup.renew(expired)


async def test_r4_renew_at_the_deadline_fails_even_before_the_timer_fired(
    store: MemoryStore, fake: FakeExecution, mock_clock: trio.testing.MockClock
) -> None:
    async with supervise(store, fake, lease=5.0) as sup:
        handle = await opened(sup)
        mock_clock.jump(5.0)
        # No checkpoint since the jump: the session task has not seen its deadline.
        assert sup._sessions[handle.token].lifecycle.live
        with pytest.raises(LeaseExpiredError):
            await sup.renew(handle)
        assert isinstance(await sup.status(handle), OpenRecord | StoppingRecord | StoppedRecord)
        await trio.testing.wait_all_tasks_blocked()
        record = await sup.status(handle)
        assert isinstance(record, StoppedRecord)
        assert record.reason == Expired()


async def test_r5_the_lease_is_forwarded_to_the_child(
    sup: Supervisor, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    handle = await opened(sup, lease=4.0)
    await trio.sleep(1.0)
    await sup.load(handle, Load(specifier="plugin:main"))
    unit = fake.unit_of(handle)
    assert unit.leases == [pytest.approx(3.0)], "the remaining lease, before start"
    await trio.sleep(1.0)
    await sup.renew(handle)
    assert unit.leases[-1] == 4.0


async def test_r6_renew_moves_the_deadline_and_is_not_persisted(
    sup: Supervisor, store: MemoryStore, autojump_clock: trio.testing.MockClock
) -> None:
    handle = await opened(sup, lease=10.0)
    before = await store.list()
    await trio.sleep(8.0)
    assert await sup.renew(handle) == 10.0
    assert await store.list() == before
    await trio.sleep(9.9)  # t = 17.9: the old deadline (10) is long gone
    assert await sup.renew(handle) == 10.0
    await trio.sleep(10.0)  # t = 27.9: exactly the new deadline
    with pytest.raises(LeaseExpiredError):
        await sup.renew(handle)
    await trio.sleep(0.1)
    record = await sup.status(handle)
    assert isinstance(record, StoppedRecord)
    assert record.reason == Expired()


async def test_r6_status_of_key_is_unchanged_by_renew(sup: Supervisor) -> None:
    handle = await opened(sup)
    record = await sup.status(handle)
    await sup.renew(handle)
    assert await sup.status(handle) == record
    assert record.handle.key == KEY
