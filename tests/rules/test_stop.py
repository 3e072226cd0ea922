"""Child exit X1, lease expiry T1, dispose D1-D5 and the stop P1-P6 (docs/design.md)."""

from __future__ import annotations

import signal

import attrs
import pytest
import trio
import trio.testing

from trio_supervisor import (
    Disposed,
    Exited,
    ExitStatus,
    Expired,
    Handle,
    Load,
    LoadedRecord,
    LoadingRecord,
    MemoryStore,
    OpenRecord,
    SessionRecord,
    SessionStoppedError,
    StaleSessionError,
    StateStorageError,
    StoppedRecord,
    StoppingRecord,
    Supervisor,
    SupervisorAPI,
    Termination,
    TerminationUnconfirmedError,
)
from trio_supervisor.testing import FakeExecution, FaultyStore

from ..support.sessions import OTHER, during_shutdown, opened, supervise

SIGTERM = ExitStatus(code=None, signal=signal.SIGTERM)


class HeldStore(MemoryStore):
    """A memory store that holds every save of one record class until ``release`` is set."""

    def __init__(self, held: type[SessionRecord]) -> None:
        super().__init__()
        self.held = held
        self.release = trio.Event()

    async def save(self, record: SessionRecord) -> None:
        if isinstance(record, self.held):
            await self.release.wait()
        await super().save(record)


async def stopped(sup: SupervisorAPI, handle: object) -> StoppedRecord:
    record = await sup.status(handle)  # type: ignore[arg-type]
    assert isinstance(record, StoppedRecord), record
    return record


async def test_x1_a_child_that_exits_by_itself_stops_the_session_without_a_signal(
    sup: SupervisorAPI, fake: FakeExecution
) -> None:
    handle = await opened(sup)
    await sup.load(handle, Load(specifier="x"))
    unit = fake.unit_of(handle)
    unit.exit(code=3)
    await trio.testing.wait_all_tasks_blocked()
    record = await stopped(sup, handle)
    assert record.reason == Exited()
    assert record.termination == Termination(kind="exited", exit=ExitStatus(code=3))
    assert unit.signals == []
    assert unit.closed == 1


async def test_t1_at_the_deadline_the_session_expires_and_its_child_is_terminated(
    sup: SupervisorAPI, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    handle = await opened(sup, lease=3.0)
    await sup.load(handle, Load(specifier="x"))
    await trio.sleep(2.9)
    assert isinstance(await sup.status(handle), LoadedRecord)
    await trio.sleep(0.2)
    record = await stopped(sup, handle)
    assert record.reason == Expired()
    assert record.termination == Termination(kind="exited", exit=SIGTERM)
    assert fake.unit_of(handle).signals == ["interrupt"]


async def test_t1_a_renewed_lease_does_not_expire_at_the_old_deadline(
    sup: SupervisorAPI, autojump_clock: trio.testing.MockClock
) -> None:
    handle = await opened(sup, lease=3.0)
    await trio.sleep(2.0)
    await sup.renew(handle)
    await trio.sleep(2.0)  # past the first deadline
    assert isinstance(await sup.status(handle), OpenRecord)
    await trio.sleep(1.5)
    assert (await stopped(sup, handle)).reason == Expired()


async def test_d1_dispose_works_while_poisoned(fake: FakeExecution) -> None:
    store = FaultyStore(MemoryStore())
    with pytest.RaisesGroup(StateStorageError):
        async with supervise(store, fake) as sup:
            handle = await opened(sup)
            await sup.load(handle, Load(specifier="x"))
            store.fail_next()
            with pytest.raises(StateStorageError):
                await sup.open(OTHER, "poison")
            termination = await sup.dispose(handle)
            assert termination == Termination(kind="exited", exit=SIGTERM)
            assert fake.unit_of(handle).signals == ["interrupt"]
            assert (await stopped(sup, handle)).reason == Disposed()


async def test_d1_dispose_works_during_shutdown_and_joins_it(
    store: MemoryStore, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    joined: list[Termination] = []

    async def dispose_late(sup: SupervisorAPI, handle: Handle) -> None:
        joined.append(await sup.dispose(handle))

    await during_shutdown(store, fake, dispose_late)
    [record] = await store.list()
    assert isinstance(record, StoppedRecord)
    assert record.reason.kind == "Shutdown"
    assert joined == [record.termination]


async def test_d2_dispose_of_a_stale_handle_fails(sup: SupervisorAPI) -> None:
    handle = await opened(sup)
    with pytest.raises(StaleSessionError):
        await sup.dispose(attrs.evolve(handle, generation=2))
    assert isinstance(await sup.status(handle), OpenRecord)


async def test_d3_dispose_of_a_stopped_session_returns_its_termination_again(
    sup: SupervisorAPI, fake: FakeExecution
) -> None:
    handle = await opened(sup)
    await sup.load(handle, Load(specifier="x"))
    first = await sup.dispose(handle)
    calls = len(fake.calls)
    assert await sup.dispose(handle) == first
    assert len(fake.calls) == calls


@pytest.mark.embedded_only  # it removes the session object by hand
async def test_d4_dispose_of_a_known_record_without_a_session_object_is_stopped(
    sup: Supervisor, store: MemoryStore
) -> None:
    """Defensive: reachable only by removing the session object by hand.

    A retained record that is not Stopped always has its session object (docs/design.md,
    deviation (g)), so no public sequence of calls reaches D4; the test pops the object
    from ``sup._running._by_token`` and puts it back.
    """
    handle = await opened(sup)
    session = sup._running._by_token.pop(handle.token)
    try:
        with pytest.raises(SessionStoppedError, match="retired"):
            await sup.dispose(handle)
        # Refused, and nothing was stopped or written.
        assert isinstance(await sup.status(handle), OpenRecord)
        assert len(await store.list()) == 1
    finally:
        sup._running._by_token[handle.token] = session


async def test_d5_dispose_stops_the_session_or_joins_the_stop_in_progress(
    sup: SupervisorAPI, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("slow", exit_delay=0.8)  # within the grace of 1.0
    handle = await opened(sup)
    await sup.load(handle, Load(specifier="slow"))
    results: list[Termination] = []

    async def dispose() -> None:
        results.append(await sup.dispose(handle))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(dispose)
        await trio.sleep(0.4)
        nursery.start_soon(dispose)
    assert results == [Termination(kind="exited", exit=SIGTERM)] * 2
    assert fake.unit_of(handle).signals == ["interrupt"]
    assert (await stopped(sup, handle)).reason == Disposed()


async def test_p1_the_first_stop_request_wins_and_later_ones_join(fake: FakeExecution) -> None:
    store = HeldStore(StoppingRecord)  # keeps the first stop under way
    async with supervise(store, fake) as sup:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="x"))
        unit = fake.unit_of(handle)
        disposed: list[Termination] = []
        superseded: list[Handle] = []
        async with trio.open_nursery() as nursery:
            unit.exit(code=9)
            await trio.testing.wait_all_tasks_blocked()  # the watcher asked first
            assert isinstance(await sup.status(handle), LoadedRecord), "the stop is under way"

            async def dispose() -> None:
                disposed.append(await sup.dispose(handle))

            async def supersede() -> None:
                superseded.append(await opened(sup, request_id="r2"))

            nursery.start_soon(dispose)
            nursery.start_soon(supersede)
            await trio.testing.wait_all_tasks_blocked()
            assert (disposed, superseded) == ([], []), "both wait for the stop under way"
            store.release.set()
        exited = Termination(kind="exited", exit=ExitStatus(code=9))
        record = await stopped(sup, handle)
        assert record.reason == Exited()
        assert record.termination == exited
        assert disposed == [exited]
        assert [new.generation for new in superseded] == [2]
        assert unit.signals == [], "no later request sent a signal"


async def test_p2_stopping_is_persisted_with_the_active_snapshot(fake: FakeExecution) -> None:
    store = FaultyStore(MemoryStore())
    async with supervise(store, fake) as sup:
        await _stop_loaded(sup, store)


async def _stop_loaded(sup: SupervisorAPI, store: FaultyStore) -> None:
    handle = await opened(sup)
    await sup.load(handle, Load(specifier="x"))
    loaded = await sup.status(handle)
    await sup.dispose(handle)
    [stopping] = [record for record in store.saved if isinstance(record, StoppingRecord)]
    assert stopping.previous == loaded
    assert stopping.reason == Disposed()
    assert (await stopped(sup, handle)).previous == loaded


async def test_p2_a_failed_stopping_save_still_fences_terminates_and_reports_the_error(
    fake: FakeExecution,
) -> None:
    store = FaultyStore(MemoryStore())
    with pytest.RaisesGroup(StateStorageError):
        async with supervise(store, fake) as sup:
            handle = await opened(sup)
            await sup.load(handle, Load(specifier="x"))
            store.fail_when(lambda record: isinstance(record, StoppingRecord))
            with pytest.raises(StateStorageError, match="Stopping"):
                await sup.dispose(handle)
            unit = fake.unit_of(handle)
            assert unit.exited
            assert unit.closed == 1
            with pytest.raises(StateStorageError):  # poisoned now, so renew says so first
                await sup.renew(handle)
            # The Stopped save worked: the record tells the end.
            record = await stopped(sup, handle)
            assert record.reason == Disposed()
            # Later disposers get the record's termination (D3).
            assert await sup.dispose(handle) == record.termination


async def test_p3_no_child_ends_with_no_child(sup: SupervisorAPI) -> None:
    # docs/design.md, deviation (l): "no child", not the "exited, code 0" of a child.
    handle = await opened(sup)
    termination = await sup.dispose(handle)
    assert termination == Termination(kind="none", exit=ExitStatus())
    assert termination.describe() == "no child"


async def test_p3_a_cooperative_child_exits_on_interrupt(
    sup: SupervisorAPI, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("polite", exit_delay=0.4, interrupt_code=0)
    handle = await opened(sup)
    await sup.load(handle, Load(specifier="polite"))
    started = trio.current_time()
    assert await sup.dispose(handle) == Termination(kind="exited", exit=ExitStatus(code=0))
    assert trio.current_time() - started == pytest.approx(0.4)
    assert fake.unit_of(handle).signals == ["interrupt"]


async def test_p3_a_child_ignoring_interrupt_is_killed_after_the_grace(
    store: MemoryStore, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("deaf", ignore_interrupt=True)
    async with supervise(store, fake, grace=2.0, confirmation_timeout=3.0) as sup:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="deaf"))
        started = trio.current_time()
        termination = await sup.dispose(handle)
        assert termination == Termination(kind="killed", exit=ExitStatus(signal=signal.SIGKILL))
        assert trio.current_time() - started == pytest.approx(2.0)
        assert fake.unit_of(handle).signals == ["interrupt", "kill"]


async def test_p3_a_child_whose_exit_is_never_seen_is_unconfirmed(
    store: MemoryStore, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("immortal", ignore_interrupt=True, ignore_kill=True)
    with pytest.RaisesGroup(TerminationUnconfirmedError):
        async with supervise(store, fake, grace=2.0, confirmation_timeout=3.0) as sup:
            handle = await opened(sup)
            await sup.load(handle, Load(specifier="immortal"))
            started = trio.current_time()
            with pytest.raises(TerminationUnconfirmedError):
                await sup.dispose(handle)
            assert trio.current_time() - started == pytest.approx(5.0)
            # Unconfirmed is not stopped: the record stays Stopping for recovery to finish.
            assert isinstance(await sup.status(handle), StoppingRecord)
            with pytest.raises(TerminationUnconfirmedError):
                await sup.dispose(handle)
            assert fake.unit_of(handle).signals == ["interrupt", "kill"]
            fake.unit_of(handle).exit()


async def test_p4_the_unit_is_released_once_and_release_errors_join_the_cause(
    store: MemoryStore, fake: FakeExecution
) -> None:
    fake.behave("leaky", aclose_error=OSError("fd already closed"))
    async with supervise(store, fake) as sup:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="leaky"))
        termination = await sup.dispose(handle)
        assert [fault.message for fault in termination.cause] == ["fd already closed"]
        assert termination.kind == "exited"
        assert fake.unit_of(handle).closed == 1
    # The dispose's caller got the problem; the shutdown does not raise it again (Z3
    # reports the terminations the shutdown itself ran).


async def test_p5_stopped_is_durable_before_anyone_hears_of_it(fake: FakeExecution) -> None:
    store = HeldStore(StoppedRecord)
    async with supervise(store, fake) as sup:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="x"))
        heard: list[Termination] = []

        async def dispose() -> None:
            heard.append(await sup.dispose(handle))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(dispose)
            await trio.testing.wait_all_tasks_blocked()
            # The child is gone and released, but its Stopped record is not durable yet.
            assert fake.unit_of(handle).exited
            assert fake.unit_of(handle).closed == 1
            assert heard == []
            assert isinstance(await sup.status(handle), StoppingRecord)
            store.release.set()
        [record] = await store.list()
        assert isinstance(record, StoppedRecord)
        assert heard == [record.termination]


async def test_p5_records_are_written_in_lifecycle_order(fake: FakeExecution) -> None:
    store = FaultyStore(MemoryStore())
    async with supervise(store, fake) as sup:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="x"))
        await sup.dispose(handle)
    child = fake.unit_of(handle).identity
    phases = [(type(record), getattr(record, "child", None)) for record in store.saved]
    assert phases == [
        (OpenRecord, None),
        (LoadingRecord, None),
        (LoadingRecord, child),
        (LoadedRecord, child),
        (StoppingRecord, None),
        (StoppedRecord, None),
    ]


async def test_p6_everyone_waiting_gets_the_same_outcome(
    sup: SupervisorAPI, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("slow", exit_delay=0.5)
    handle = await opened(sup)
    await sup.load(handle, Load(specifier="slow"))
    results: list[Termination] = []

    async def dispose() -> None:
        results.append(await sup.dispose(handle))

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(dispose)
        nursery.start_soon(lambda: opened(sup, request_id="r2"))  # a supersede joins too
    record = await stopped(sup, handle)
    assert record.termination == Termination(kind="exited", exit=SIGTERM)
    assert results == [record.termination] * 5
    assert fake.unit_of(handle).signals == ["interrupt"]
