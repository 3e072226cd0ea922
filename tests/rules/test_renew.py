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
    Recovery,
    RunnerClosingError,
    SessionStoppedError,
    StaleSessionError,
    StateStorageError,
    StoppedRecord,
    StoppingRecord,
    Supervisor,
    SupervisorAPI,
)
from trio_supervisor.testing import FakeExecution, FaultyStore

from ..support.sessions import OTHER, during_shutdown, opened, supervise, supervise_embedded


async def test_r1_renew_fails_with_runner_closing_during_shutdown(
    store: MemoryStore, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    refused: list[BaseException] = []

    async def renew_late(supervisor: SupervisorAPI, handle: Handle) -> None:
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
            assert await sup.renew(handle) == 10.0  # healthy, the same renew works
            store.fail_next()
            with pytest.raises(StateStorageError):
                await sup.open(OTHER, "poison")
            with pytest.raises(StateStorageError) as caught:
                await sup.renew(handle)
            # The poisoning error itself (a copy chained to it), not a new failure; over
            # the wire, the same error with the same detail.
            if isinstance(sup, Supervisor):
                assert caught.value.__cause__ is sup.poisoned
            assert caught.value.detail == "injected failure saving a Open record"


async def test_r2_unknown_tokens_and_wrong_keys_or_generations_are_stale(
    sup: SupervisorAPI,
) -> None:
    handle = await opened(sup)
    for stale in (
        attrs.evolve(handle, token="0" * 36),
        attrs.evolve(handle, generation=2),
        attrs.evolve(handle, key=OTHER),
    ):
        with pytest.raises(StaleSessionError):
            await sup.renew(stale)
    assert await sup.renew(handle) == 10.0, "only the exact handle is accepted"


async def test_r2_a_session_retired_by_recovery_is_stopped(fake: FakeExecution) -> None:
    store = MemoryStore()
    async with supervise(store, fake) as sup:
        handle = await opened(sup)
        crashed = store.copy()  # what a crash now would leave: the record is Open
    # A second supervisor on that store retires the session: the record is kept (as
    # Stopped by recovery), the session object is not made (V4).
    async with supervise(crashed, fake) as sup:
        record = await sup.status(handle)
        assert isinstance(record, StoppedRecord)
        assert record.reason == Recovery()
        with pytest.raises(SessionStoppedError, match=r"\(Recovery\)"):
            await sup.renew(handle)


async def test_r2_a_retired_session_that_expired_says_so(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    store = MemoryStore()
    async with supervise(store, fake) as sup:
        handle = await opened(sup, lease=1.0)
        await trio.sleep(2.0)
    # No session object in the next supervisor: the record's reason picks the error.
    async with supervise(store, fake) as sup:
        record = await sup.status(handle)
        assert isinstance(record, StoppedRecord)
        assert record.reason == Expired()
        with pytest.raises(LeaseExpiredError):
            await sup.renew(handle)


async def test_r3_a_stopping_session_is_stopped_and_an_expired_one_expired(
    sup: SupervisorAPI, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("slow", exit_delay=0.8)
    disposed = await opened(sup)
    await sup.load(disposed, Load(specifier="slow"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sup.dispose, disposed)
        await trio.sleep(0.5)  # the child is still exiting
        assert isinstance(await sup.status(disposed), StoppingRecord)
        with pytest.raises(SessionStoppedError, match=r"\(Disposed\)"):
            await sup.renew(disposed)
    assert isinstance(await sup.status(disposed), StoppedRecord)
    with pytest.raises(SessionStoppedError, match=r"\(Disposed\)"):
        await sup.renew(disposed)
    assert fake.unit_of(disposed).leases == [pytest.approx(10.0)], "nothing was forwarded"

    expired = await opened(sup, key=OTHER, lease=2.0)
    await trio.sleep(3.0)
    with pytest.raises(LeaseExpiredError):
        await sup.renew(expired)


@pytest.mark.embedded_only  # it looks at whether the timer fired, inside the supervisor
async def test_r4_renew_at_the_deadline_fails_even_before_the_timer_fired(
    fake: FakeExecution, mock_clock: trio.testing.MockClock
) -> None:
    """The renew must be refused by the deadline check, not by the stop the timer starts.

    Defensive poke: that the timer has not fired yet (the session is still live in
    memory) is visible only through ``sup._running._by_token``; no public call can ask without a
    checkpoint, and a checkpoint would let the timer fire.
    """
    store = FaultyStore(MemoryStore())
    async with supervise_embedded(store, fake, lease=5.0) as sup:
        handle = await opened(sup)
        mock_clock.jump(5.0)
        # No checkpoint since the jump: the session task has not seen its deadline.
        assert sup._running._by_token[handle.token].lifecycle.live
        with pytest.raises(LeaseExpiredError):
            await sup.renew(handle)
        # The refused renew moved nothing: the timer (same clock, no autojump) fires at
        # once and the session expires at 5.0, not 10.0.
        await trio.testing.wait_all_tasks_blocked()
        record = await sup.status(handle)
        assert isinstance(record, StoppedRecord)
        assert record.reason == Expired()
        assert trio.current_time() == 5.0
        assert [type(saved) for saved in store.saved] == [
            OpenRecord,
            StoppingRecord,
            StoppedRecord,
        ]


async def test_r5_the_lease_is_forwarded_to_the_child(
    sup: SupervisorAPI, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    handle = await opened(sup, lease=4.0)
    await trio.sleep(1.0)
    await sup.load(handle, Load(specifier="plugin:main"))
    unit = fake.unit_of(handle)
    assert unit.leases == [pytest.approx(3.0)], "the remaining lease, before start"
    await trio.sleep(1.0)
    assert await sup.renew(handle) == 4.0
    assert unit.leases == [pytest.approx(3.0), 4.0], "each renew forwards the lease once"


async def test_r6_renew_moves_the_deadline_and_is_not_persisted(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    store = FaultyStore(MemoryStore())
    async with supervise(store, fake) as sup:
        handle = await opened(sup, lease=10.0)
        record = await sup.status(handle)
        assert isinstance(record, OpenRecord)
        await trio.sleep(8.0)
        assert await sup.renew(handle) == 10.0
        # Not a single save, and the durable record is the one open wrote.
        assert store.saved == [record]
        assert await sup.status(handle) == record
        await trio.sleep(9.9)  # t = 17.9: the old deadline (10) is long gone
        assert await sup.renew(handle) == 10.0
        await trio.sleep(10.0)  # t = 27.9: exactly the new deadline
        with pytest.raises(LeaseExpiredError):
            await sup.renew(handle)
        await trio.sleep(0.1)
        stopped = await sup.status(handle)
        assert isinstance(stopped, StoppedRecord)
        assert stopped.reason == Expired()
        assert store.saved == [record, StoppingRecord.of(record, Expired()), stopped]


async def test_r6_renew_returns_the_session_s_own_lease_not_the_supervisor_s(
    sup: SupervisorAPI, autojump_clock: trio.testing.MockClock
) -> None:
    default = await sup.open(OTHER, "default lease")
    assert default.lease == 10.0  # the supervisor's
    handle = await opened(sup, lease=3.0)
    await trio.sleep(2.0)
    assert await sup.renew(handle) == 3.0
    await trio.sleep(2.9)  # t = 4.9: alive only because the renew moved the deadline to 5
    assert await sup.renew(handle) == 3.0
