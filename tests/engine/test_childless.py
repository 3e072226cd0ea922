"""Sessions without a child: no task until they load, one lease timer for all of them,
and a stop that saves Stopping and Stopped in one write (docs/design.md, "Shape in
Trio" and deviation (k); P2, P5, T1, H1)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import trio
import trio.testing

from trio_supervisor import (
    Disposed,
    Expired,
    Key,
    Load,
    MemoryStore,
    OpenRecord,
    Retention,
    SessionRecord,
    StateStorageError,
    StoppedRecord,
    open_supervisor,
)
from trio_supervisor._core.leases import _REBUILD_FLOOR
from trio_supervisor.testing import FakeExecution

KEY = Key(identity="childless", instance="one")


class CountingStore(MemoryStore):
    """A memory store that logs each call, and can refuse or hold its batched saves."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.refuse_batches = False
        self.hold: trio.Event | None = None

    async def save(self, record: SessionRecord) -> None:
        self.calls.append(("save", (type(record).__name__,)))
        await super().save(record)

    async def save_many(self, records: Sequence[SessionRecord]) -> None:
        self.calls.append(("save_many", tuple(type(record).__name__ for record in records)))
        if self.hold is not None:
            await self.hold.wait()
        if self.refuse_batches:
            await trio.lowlevel.checkpoint()
            raise OSError("the disk is full")
        await super().save_many(records)


class OneAtATimeStore:
    """A store with no save_many: a childless stop saves its records one by one."""

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.saved: list[str] = []

    @property
    def retention(self) -> Retention:
        return self.inner.retention

    async def save(self, record: SessionRecord) -> None:
        self.saved.append(type(record).__name__)
        await self.inner.save(record)

    async def list(self) -> Sequence[SessionRecord]:
        return await self.inner.list()

    async def high_water(self) -> Mapping[Key, int]:
        return await self.inner.high_water()


async def test_a_childless_dispose_saves_stopping_and_stopped_in_one_write() -> None:
    store = CountingStore()
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        record = await sup.open(KEY, "r1")
        termination = await sup.dispose(record.handle)
        assert termination.describe() == "no child"
        assert store.calls == [
            ("save", ("OpenRecord",)),
            ("save_many", ("StoppingRecord", "StoppedRecord")),
        ]
        stopped = await sup.status(record.handle)
        assert isinstance(stopped, StoppedRecord)
        assert stopped.reason == Disposed()


async def test_a_store_without_save_many_gets_stopping_then_stopped() -> None:
    store = OneAtATimeStore()
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        record = await sup.open(KEY, "r1")
        await sup.dispose(record.handle)
    assert store.saved == ["OpenRecord", "StoppingRecord", "StoppedRecord"]


async def test_a_refused_childless_stop_saves_neither_record_and_poisons() -> None:
    store = CountingStore()
    seen: dict[str, object] = {}

    async def run() -> None:
        async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
            record = await sup.open(KEY, "r1")
            store.refuse_batches = True
            try:
                await sup.dispose(record.handle)
            except StateStorageError as error:
                seen["error"] = error
            seen["stored"] = list(await store.list())
            seen["status"] = await sup.status(record.handle)
            seen["poisoned"] = sup.poisoned

    with pytest.raises(BaseExceptionGroup) as left:  # Z3: the poisoning is reported
        await run()
    assert left.group_contains(StateStorageError)
    error = seen["error"]
    assert isinstance(error, StateStorageError)
    assert "the disk is full" in str(error)
    poisoned = seen["poisoned"]
    assert isinstance(poisoned, StateStorageError)
    assert str(poisoned) == str(error)  # the stop's outcome is the poisoning, copied
    # Neither record is durable: the store holds the Open record alone.
    stored = seen["stored"]
    assert isinstance(stored, list)
    assert [type(record) for record in stored] == [OpenRecord]
    assert isinstance(seen["status"], OpenRecord)


async def test_a_dispose_cancelled_during_its_save_leaves_the_stop_to_the_supervisor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = CountingStore()
    async with open_supervisor(store, FakeExecution(), lease=100.0) as sup:
        record = await sup.open(KEY, "r1")
        store.hold = trio.Event()
        with trio.move_on_after(1.0) as scope:
            await sup.dispose(record.handle)
        assert scope.cancelled_caught
        # The held save was cancelled and wrote nothing; a task of the supervisor's
        # runs the stop again, and it lands once the store answers.
        assert isinstance(await sup.status(record.handle), OpenRecord)
        store.hold.set()
        store.hold = None
        termination = await sup.dispose(record.handle)  # joins the stop under way
        assert termination.describe() == "no child"
        stopped = await sup.status(record.handle)
        assert isinstance(stopped, StoppedRecord)
        assert stopped.reason == Disposed()


async def test_a_short_lease_opened_after_a_long_one_expires_on_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_supervisor(MemoryStore(), FakeExecution(), lease=100.0) as sup:
        long = await sup.open(Key(identity="childless", instance="long"), "r1")
        short = await sup.open(KEY, "r2", lease=1.0)
        opened = trio.current_time()
        await trio.sleep(1.0)
        await trio.testing.wait_all_tasks_blocked()
        expired = await sup.status(short.handle)
        assert isinstance(expired, StoppedRecord)
        assert expired.reason == Expired()
        assert trio.current_time() - opened == pytest.approx(1.0)
        assert isinstance(await sup.status(long.handle), OpenRecord)


async def test_a_renewed_session_outlives_its_first_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_supervisor(MemoryStore(), FakeExecution(), lease=2.0) as sup:
        record = await sup.open(KEY, "r1")
        for _ in range(5):
            await trio.sleep(1.5)
            await sup.renew(record.handle)
        assert isinstance(await sup.status(record.handle), OpenRecord)
        await trio.sleep(2.0)
        await trio.testing.wait_all_tasks_blocked()
        stopped = await sup.status(record.handle)
        assert isinstance(stopped, StoppedRecord)
        assert stopped.reason == Expired()


async def test_the_lease_heap_stays_bounded_over_many_short_sessions(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Sessions disposed long before their deadline leave stale entries behind; the heap
    # is rebuilt once they are half of it, so it never holds much more than that.
    cycles = 3 * _REBUILD_FLOOR
    async with open_supervisor(MemoryStore(), FakeExecution(), lease=1e6) as sup:
        generation = None
        largest = 0
        for cycle in range(cycles):
            record = await sup.open(KEY, f"r{cycle}", expected_generation=generation)
            generation = record.handle.generation
            await sup.dispose(record.handle)
            largest = max(largest, len(sup._leases))
        assert largest <= 2 * _REBUILD_FLOOR + 2
        assert generation == cycles


def _tasks() -> int:
    """Every task of this Trio run."""
    root = trio.lowlevel.current_root_task()
    assert root is not None
    count, pending = 0, [root]
    while pending:
        task = pending.pop()
        count += 1
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return count


async def test_an_idle_session_has_no_task_until_it_loads() -> None:
    async with open_supervisor(MemoryStore(), FakeExecution(), lease=10.0) as sup:
        await trio.testing.wait_all_tasks_blocked()
        before = _tasks()
        handles = [
            (await sup.open(Key(identity="childless", instance=str(n)), "r")).handle
            for n in range(20)
        ]
        await trio.testing.wait_all_tasks_blocked()
        assert _tasks() == before
        await sup.load(handles[0], Load(specifier="good:main"))
        await trio.testing.wait_all_tasks_blocked()
        assert _tasks() > before  # the loaded session's task (and its exit watcher)
        for handle in handles:
            await sup.dispose(handle)


class RefusingStore(CountingStore):
    """A counting store whose single saves fail too, when told to."""

    refuse_saves = False

    async def save(self, record: SessionRecord) -> None:
        if self.refuse_saves:
            await trio.lowlevel.checkpoint()
            raise OSError("the disk is full")
        await super().save(record)


@pytest.mark.parametrize(
    ("refuse", "logged"),
    [
        ("save", "the Open record of childless/one generation 1"),
        ("batch", "the Stopping and Stopped records of childless/one generation 1"),
    ],
)
async def test_h1_a_refused_save_is_logged_naming_its_records_and_session(
    caplog: pytest.LogCaptureFixture, refuse: str, logged: str
) -> None:
    store = RefusingStore()

    async def run() -> None:
        async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
            if refuse == "save":
                store.refuse_saves = True
                with pytest.raises(StateStorageError):
                    await sup.open(KEY, "r1")
                return
            record = await sup.open(KEY, "r1")
            store.refuse_batches = True
            with pytest.raises(StateStorageError):
                await sup.dispose(record.handle)

    with pytest.raises(BaseExceptionGroup):  # Z3: the poisoning is reported
        await run()
    [failed] = [entry for entry in caplog.records if "could not be saved" in entry.message]
    assert failed.levelname == "ERROR"
    assert failed.message == (
        f"{logged} could not be saved: "
        "the store failed to save a record: OSError('the disk is full')"
    )
    # The session's fields, for a JSON log (serve --log-format json).
    fields = vars(failed)  # a log record has its extra= fields as attributes
    assert (fields["identity"], fields["instance"], fields["generation"]) == ("childless", "one", 1)


def _task_names() -> set[str]:
    """The name of every task of this Trio run."""
    root = trio.lowlevel.current_root_task()
    assert root is not None
    names, pending = set(), [root]
    while pending:
        task = pending.pop()
        names.add(task.name)
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return names


async def test_a_sessions_tasks_are_named_by_role_key_and_generation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # What a debugger or an instrument shows, and tests/conftest.py's deadlock report.
    store = CountingStore()
    async with open_supervisor(store, FakeExecution(), lease=1.0) as sup:
        loaded = await sup.open(Key(identity="childless", instance="loaded"), "r1", lease=100.0)
        await sup.load(loaded.handle, Load(specifier="good:main"))
        await sup.open(KEY, "r2")
        store.hold = trio.Event()  # the expired session's stop waits in its save
        await trio.sleep(1.0)
        await trio.testing.wait_all_tasks_blocked()
        names = _task_names()
        assert "trio_supervisor session childless/loaded #1" in names
        assert "trio_supervisor stop childless/one #1" in names  # a task of its own
        store.hold.set()
        store.hold = None
