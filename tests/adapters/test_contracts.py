"""The contract kits against the built-in adapters."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from trio_supervisor import (
    Handle,
    Key,
    Limits,
    MemoryStore,
    OpenRecord,
    Retention,
    SessionRecord,
    SqliteStore,
)
from trio_supervisor.abc import Store
from trio_supervisor.testing.contracts import ExecutionContract, StoreContract, StoreFactory
from trio_supervisor.testing.harnesses import (
    FakeHarness,
    Harness,
    InProcessHarness,
    SubprocessHarness,
)


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        def make(previous: Store | None, retention: Retention) -> Store:
            return previous or MemoryStore(retention=retention)

        return make


class TestSqliteStore(StoreContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> StoreFactory:
        def make(previous: Store | None, retention: Retention) -> Store:
            return SqliteStore(tmp_path / "state.db", retention=retention)

        return make


class TestFakeExecution(ExecutionContract):
    @pytest.fixture
    def harness_factory(self) -> type[Harness]:
        return FakeHarness


class TestInProcessExecution(ExecutionContract):
    @pytest.fixture
    def harness_factory(self) -> type[Harness]:
        return InProcessHarness


class TestSubprocessExecution(ExecutionContract):
    @pytest.fixture
    def harness_factory(self, tmp_path: Path) -> Callable[[], Harness]:
        return lambda: SubprocessHarness(tmp_path)


class TestSubprocessExecutionWithStandby(ExecutionContract):
    @pytest.fixture
    def harness_factory(self, tmp_path: Path) -> Callable[[], Harness]:
        return lambda: SubprocessHarness(tmp_path, standby=True)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_every_built_in_store_is_used_as_async_with(tmp_path: Path, kind: str) -> None:
    def make() -> MemoryStore | SqliteStore:
        return MemoryStore() if kind == "memory" else SqliteStore(tmp_path / "state.db")

    opened = make()
    async with opened as store:
        assert store is opened
        await store.save(record())
    # Leaving it keeps what was saved: the memory store as a file would.
    again = opened if kind == "memory" else make()
    async with again as store:
        assert [kept.handle.generation for kept in await store.list()] == [1]


def record() -> OpenRecord:
    handle = Handle(key=Key(identity="kit", instance="a"), token="t" * 32, generation=1)
    return OpenRecord(handle=handle, request_id="r1", lease=5.0, limits=Limits())


class _LateCheckpointStore(MemoryStore):
    """Writes, then checkpoints: a cancelled save has landed, yet raises Cancelled."""

    async def save(self, record: SessionRecord) -> None:
        self._index.save(record)
        await trio.lowlevel.checkpoint()


async def test_the_store_kit_names_the_promise_a_store_breaks() -> None:
    kit = StoreContract()
    with pytest.raises(AssertionError) as caught:
        await kit.test_a_cancelled_save_either_landed_or_never_happened(
            lambda previous, retention: _LateCheckpointStore(retention=retention)
        )
    assert str(caught.value).startswith(
        "a cancelled save either raises Cancelled and writes nothing, or writes and returns "
        "normally: the save of contract/a generation 1 raised Cancelled, yet its record landed"
    )


async def test_a_memory_store_s_copy_holds_what_it_held_then_goes_its_own_way() -> None:
    """MemoryStore.copy is the storage a crash leaves: the records and the retention as
    they are now, and no write of either store's shows in the other afterwards."""
    retention = Retention(stopped_per_key=1)
    store = MemoryStore(retention=retention)
    await store.save(record())
    twin = store.copy()
    assert twin.retention == retention
    assert await twin.list() == [record()]
    other = OpenRecord(
        handle=Handle(key=Key(identity="kit", instance="b"), token="u" * 32, generation=1),
        request_id="r1",
        lease=5.0,
        limits=Limits(),
    )
    await twin.save(other)
    assert await store.list() == [record()]
    assert await twin.list() == [record(), other]
