"""open: O1-O11 of docs/design.md, "Semantics"."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from trio_supervisor import (
    Handle,
    Limits,
    Load,
    MemoryStore,
    OpenRecord,
    Retention,
    RunnerClosingError,
    SessionRecord,
    StaleSessionError,
    StateStorageError,
    StoppedRecord,
    Superseded,
    SupervisorAPI,
    TerminationUnconfirmedError,
)
from trio_supervisor.testing import FakeExecution, FaultyStore

from ..support.sessions import KEY, OTHER, during_shutdown, embedded, opened, poisoning, supervise


class GatedStore(MemoryStore):
    """A memory store whose saves wait at a gate until the test opens it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = trio.Event()
        self.waiting: list[SessionRecord] = []

    async def save(self, record: SessionRecord) -> None:
        self.waiting.append(record)
        await self.gate.wait()
        await super().save(record)


async def test_o1_open_fails_with_runner_closing_once_shutdown_began(
    store: MemoryStore, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    refused: list[BaseException] = []

    async def open_late(supervisor: SupervisorAPI, handle: Handle) -> None:
        with pytest.raises(RunnerClosingError) as caught:
            await supervisor.open(OTHER, "late")
        refused.append(caught.value)

    await during_shutdown(store, fake, open_late)
    assert len(refused) == 1
    assert not [record for record in await store.list() if record.handle.key == OTHER]


async def test_o1_open_fails_with_the_poisoning_error_once_poisoned(fake: FakeExecution) -> None:
    store = FaultyStore(MemoryStore())
    with pytest.RaisesGroup(StateStorageError):
        async with supervise(store, fake) as sup:
            store.fail_next()
            with pytest.raises(StateStorageError) as first:
                await opened(sup)
            with pytest.raises(StateStorageError) as again:
                await sup.open(OTHER, "r2")
            if embedded():
                assert again.value.__cause__ is first.value
            assert again.value.detail == first.value.detail
            assert store.refused
            assert not store.saved


async def test_o2_opens_of_one_key_are_serialized_and_other_keys_proceed(
    fake: FakeExecution,
) -> None:
    store = GatedStore()
    outcomes: dict[str, object] = {}

    async def attempt(supervisor: SupervisorAPI, name: str, key: object) -> None:
        try:
            outcomes[name] = await supervisor.open(key, name)  # type: ignore[arg-type]
        except StaleSessionError as error:
            outcomes[name] = error

    async with supervise(store, fake) as sup, trio.open_nursery() as nursery:
        nursery.start_soon(attempt, sup, "a1", KEY)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(attempt, sup, "a2", KEY)
        nursery.start_soon(attempt, sup, "b1", OTHER)
        await trio.testing.wait_all_tasks_blocked()
        # a2 waits for the key's lock; b1 reached the store beside a1.
        assert [(record.handle.key, record.request_id) for record in store.waiting] == [
            (KEY, "a1"),
            (OTHER, "b1"),
        ]
        store.gate.set()
    assert isinstance(outcomes["a1"], OpenRecord)
    assert isinstance(outcomes["b1"], OpenRecord)
    # a2 ran after a1 and saw generation 1 already taken.
    assert isinstance(outcomes["a2"], StaleSessionError)


async def test_o3_open_is_idempotent_by_request_id(fake: FakeExecution) -> None:
    store = FaultyStore(MemoryStore())
    async with supervise(store, fake) as sup:
        first = await sup.open(KEY, "r1")
        again = await sup.open(KEY, "r1")
        assert again == first
        assert store.saved == [first], "the retry wrote nothing, not even the same record"
        assert await sup.high_water(KEY) == 1


async def test_o3_a_repeated_request_id_returns_the_record_in_whatever_phase(
    sup: SupervisorAPI,
) -> None:
    first = await sup.open(KEY, "r1")
    await sup.dispose(first.handle)
    again = await sup.open(KEY, "r1")
    assert isinstance(again, StoppedRecord)
    assert again.handle == first.handle
    assert await sup.high_water(KEY) == 1


async def test_o4_expected_generation_must_equal_the_high_water(sup: SupervisorAPI) -> None:
    with pytest.raises(
        StaleSessionError, match=r"expected generation 1, but its high-water generation is 0"
    ):
        await sup.open(KEY, "r1", expected_generation=1)
    first = await sup.open(KEY, "r1")  # None means 0
    assert first.handle.generation == 1
    with pytest.raises(StaleSessionError) as never:
        await sup.open(KEY, "r2")
    assert never.value.detail == (
        "plugin/a: expected a key never opened, but its high-water generation is 1; "
        "pass expected_generation=1 to open the next one"
    )
    with pytest.raises(StaleSessionError, match="expected generation 0, but"):
        await sup.open(KEY, "r2", expected_generation=0)
    second = await sup.open(KEY, "r2", expected_generation=1)
    assert second.handle.generation == 2


async def test_o5_open_stops_the_live_session_and_waits_for_its_termination(
    sup: SupervisorAPI, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("slow", exit_delay=0.7)
    old = await opened(sup)
    await sup.load(old, Load(specifier="slow"))
    unit = fake.unit_of(old)
    started = trio.current_time()
    new = await opened(sup, request_id="r2")
    assert trio.current_time() - started == pytest.approx(0.7)
    assert unit.exited
    assert unit.signals == ["interrupt"]
    record = await sup.status(old)
    assert isinstance(record, StoppedRecord)
    assert record.reason == Superseded()
    assert new.generation == 2


async def test_o5_a_termination_problem_is_logged_and_does_not_fail_the_open(
    sup: SupervisorAPI, fake: FakeExecution, caplog: pytest.LogCaptureFixture
) -> None:
    fake.behave("stubborn", interrupt_error=OSError("no such process"))
    old = await opened(sup)
    await sup.load(old, Load(specifier="stubborn"))
    with caplog.at_level(logging.WARNING, logger="trio_supervisor"):
        new = await opened(sup, request_id="r2")
    assert new.generation == 2
    [warning] = [entry for entry in caplog.records if entry.name == "trio_supervisor.supervisor"]
    assert warning.levelno == logging.WARNING
    assert (warning.identity, warning.instance, warning.generation) == ("plugin", "a", 1)  # type: ignore[attr-defined]
    assert "no such process" in warning.getMessage()
    record = await sup.status(old)
    assert isinstance(record, StoppedRecord)
    assert record.termination.kind == "killed"


async def test_o6_health_is_checked_again_after_superseding(
    store: MemoryStore,
    fake: FakeExecution,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake.behave("immortal", ignore_interrupt=True, ignore_kill=True)
    with pytest.RaisesGroup(TerminationUnconfirmedError):
        async with supervise(store, fake) as sup:
            old = await opened(sup)
            await sup.load(old, Load(specifier="immortal"))
            with pytest.raises(TerminationUnconfirmedError):
                await opened(sup, request_id="r2")
            assert await sup.high_water(KEY) == 1
            assert "did not terminate cleanly" in caplog.text
            fake.unit_of(old).exit(0)  # let the test end without a stray unit


async def test_o7_the_new_record_has_the_next_generation_a_fresh_token_and_negotiated_limits(
    store: MemoryStore, fake: FakeExecution
) -> None:
    async with supervise(
        store, fake, lease=9.0, limits=Limits(memory_bytes=100, open_files=8)
    ) as sup:
        first = await sup.open(KEY, "r1")
        assert isinstance(first, OpenRecord)
        assert first.lease == 9.0
        assert first.limits == Limits(memory_bytes=100, open_files=8)
        assert uuid.UUID(first.handle.token).version == 4
        second = await sup.open(
            KEY,
            "r2",
            expected_generation=1,
            lease=2.5,
            limits=Limits(memory_bytes=10**9, cpu_seconds=3),
        )
        assert second.handle.generation == 2
        assert second.handle.token != first.handle.token
        assert second.request_id == "r2"
        assert second.lease == 2.5
        assert second.limits == Limits(memory_bytes=100, cpu_seconds=3, open_files=8)


async def test_o7_bad_open_arguments_are_refused_and_change_nothing(
    sup: SupervisorAPI, store: MemoryStore
) -> None:
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: sup.open(KEY, ""),
        lambda: sup.open(KEY, "r", expected_generation=-1),
        lambda: sup.open(KEY, "r", lease=0),
        lambda: sup.open(KEY, "r", lease=float("inf")),
        lambda: sup.open(KEY, "r", limits={"memory_bytes": 1}),  # type: ignore[arg-type]
        lambda: sup.open(("plugin", "a"), "r"),  # type: ignore[arg-type]
    ]
    for bad in calls:
        with pytest.raises((ValueError, TypeError)):
            await bad()
    assert await store.list() == []
    assert await sup.high_water(KEY) is None


async def test_o8_a_failed_save_poisons_and_no_session_exists(fake: FakeExecution) -> None:
    inner = MemoryStore()
    store = FaultyStore(inner)
    with pytest.RaisesGroup(StateStorageError):
        async with supervise(store, fake) as sup:
            store.fail_next()
            with pytest.raises(StateStorageError):
                await sup.open(KEY, "r1")
            assert isinstance(await poisoning(sup), StateStorageError)
            assert await sup.high_water(KEY) is None
            assert await inner.list() == []


async def test_o8_a_store_failing_in_its_own_way_is_reported_as_a_storage_error(
    fake: FakeExecution,
) -> None:
    # A store adapter that raises something else than StateStorageError: the caller and
    # the health check see a StateStorageError that names what the store raised.
    class Broken(MemoryStore):
        async def save(self, record: SessionRecord) -> None:
            await trio.lowlevel.checkpoint()
            raise RuntimeError("disk full")

    with pytest.RaisesGroup(StateStorageError):
        async with supervise(Broken(), fake) as sup:
            with pytest.raises(StateStorageError) as caught:
                await sup.open(KEY, "r1")
            assert (
                str(caught.value) == "the store failed to save a record: RuntimeError('disk full')"
            )
            if embedded():  # the chain stays in the runner's process
                assert isinstance(caught.value.__cause__, RuntimeError)
            poison = await poisoning(sup)
            assert poison is not None
            assert poison.detail == caught.value.detail
            if embedded():
                assert poison is caught.value
            assert await sup.high_water(KEY) is None


async def test_o8_the_record_is_durable_when_open_returns(
    sup: SupervisorAPI, store: MemoryStore
) -> None:
    record = await sup.open(KEY, "r1")
    assert await store.list() == [record]


async def test_o9_the_lease_clock_starts_after_the_record_is_saved(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    class SlowStore(MemoryStore):
        async def save(self, record: SessionRecord) -> None:
            await trio.sleep(3.0)
            await super().save(record)

    async with supervise(SlowStore(), fake, lease=5.0) as sup:
        record = await sup.open(KEY, "r1")
        assert trio.current_time() == pytest.approx(3.0)
        await trio.sleep(4.9)  # 7.9: the lease has 0.1 s left, counted from the save
        assert await sup.renew(record.handle) == 5.0


async def test_o10_saving_applies_retention_and_evicted_sessions_are_retired(
    fake: FakeExecution,
) -> None:
    store = MemoryStore(retention=Retention(stopped_per_key=1, stopped_total=10))
    async with supervise(store, fake) as sup:
        first = await opened(sup)
        await sup.dispose(first)
        second = await opened(sup, request_id="r2")
        await sup.dispose(second)
        with pytest.raises(StaleSessionError):
            await sup.status(first)
        with pytest.raises(StaleSessionError):
            await sup.dispose(first)
        assert {record.handle for record in await store.list()} == {second}
        # Retired: the evicted session is unknown to renew and load too, where a kept
        # one would say "stopped (Disposed)".
        with pytest.raises(StaleSessionError):
            await sup.renew(first)
        with pytest.raises(StaleSessionError):
            await sup.load(first, Load(specifier="x"))
        # The request id of the evicted record is free again; the generation is not.
        with pytest.raises(StaleSessionError):
            await sup.open(KEY, "r1")


@pytest.mark.embedded_only  # over the wire, a cancelled caller only drops its connection
async def test_o11_a_caller_cancelled_while_saving_cannot_leave_a_half_made_session(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    class LandsAnywayStore(MemoryStore):
        """Like SqliteStore once the worker took the write: it lands, and is reported."""

        async def save(self, record: SessionRecord) -> None:
            with trio.CancelScope(shield=True):
                await trio.sleep(1.0)
                await super().save(record)

    store = LandsAnywayStore()
    async with supervise(store, fake, lease=5.0) as sup:
        with trio.move_on_after(0.5):
            await sup.open(KEY, "r1")
        [record] = await store.list()
        handle = record.handle
        # The record is durable, so the session exists: it renews, and later expires
        # (at 6.0; its Stopping and Stopped saves take a second each).
        assert await sup.renew(handle) == 5.0
        await trio.sleep(7.5)
        stopped = await sup.status(handle)
        assert isinstance(stopped, StoppedRecord)
        assert stopped.reason.kind == "Expired"
