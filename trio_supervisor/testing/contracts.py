"""Contract kits: plain pytest-trio test classes for adapter authors (needs pytest).

Subclass :class:`StoreContract` and give it a ``store_factory`` fixture, or
:class:`ExecutionContract` and give it a ``harness_factory`` fixture; pytest then runs
every test of the kit against your adapter::

    class TestMyStore(StoreContract):
        @pytest.fixture
        def store_factory(self, tmp_path):
            return lambda previous, retention: MyStore(tmp_path / "db", retention=retention)

The kits use Trio's real clock: executions may run real processes. Every wait is
bounded by ``fail_after`` so a broken adapter fails instead of hanging.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
import trio
import trio.testing

from ..errors import PackageError
from ..model import (
    Disposed,
    ExitStatus,
    Handle,
    Key,
    Limits,
    Load,
    OpenRecord,
    SessionRecord,
    StoppedRecord,
    Termination,
)
from ..retention import Retention
from ..stores.base import Store
from .harnesses import Harness

__all__ = ["ExecutionContract", "StoreContract"]

StoreFactory = Callable[[Store | None, Retention], Store]
BOUND = 20.0  # seconds any single step may take before the kit calls it hung


def _record(instance: str, generation: int, *, stopped: bool = False) -> SessionRecord:
    handle = Handle(
        key=Key(identity="contract", instance=instance),
        token=f"{instance}-{generation:04d}".rjust(32, "0"),
        generation=generation,
    )
    opened = OpenRecord(handle=handle, request_id=f"r{generation}", lease=5.0, limits=Limits())
    if not stopped:
        return opened
    return StoppedRecord.of(opened, Disposed(), Termination(kind="exited", exit=ExitStatus(code=0)))


async def _close(store: Store) -> None:
    closer = getattr(store, "aclose", None)
    if closer is not None:
        await closer()


class StoreContract:
    """What every store must do (DESIGN.md sections 6 and 7).

    Provide a fixture ``store_factory`` returning ``factory(previous, retention)``:
    a fresh store when ``previous`` is None, else the same storage reopened (the
    previous store is closed first, if it has ``aclose``).
    """

    async def _reopen(self, factory: StoreFactory, store: Store, retention: Retention) -> Store:
        await _close(store)
        return factory(store, retention)

    async def test_saved_records_survive_a_reopen(self, store_factory: StoreFactory) -> None:
        retention = Retention()
        store = store_factory(None, retention)
        records = [_record("a", 1), _record("b", 1, stopped=True), _record("a", 2)]
        with trio.fail_after(BOUND):
            for record in records:
                await store.save(record)
            store = await self._reopen(store_factory, store, retention)
            assert list(await store.list()) == records
            assert dict(await store.high_water()) == {
                Key(identity="contract", instance="a"): 2,
                Key(identity="contract", instance="b"): 1,
            }
        await _close(store)

    async def test_a_record_replaces_its_token_s_earlier_record(
        self, store_factory: StoreFactory
    ) -> None:
        store = store_factory(None, Retention())
        with trio.fail_after(BOUND):
            await store.save(_record("a", 1))
            await store.save(_record("b", 1))
            await store.save(_record("a", 1, stopped=True))
            assert list(await store.list()) == [_record("b", 1), _record("a", 1, stopped=True)]
        await _close(store)

    async def test_retention_keeps_the_newest_stopped_records_per_key(
        self, store_factory: StoreFactory
    ) -> None:
        retention = Retention(stopped_per_key=2, stopped_total=1000)
        store = store_factory(None, retention)
        with trio.fail_after(BOUND):
            for generation in range(1, 6):
                await store.save(_record("a", generation, stopped=True))
            await store.save(_record("a", 6))
            store = await self._reopen(store_factory, store, retention)
            kept = [record.handle.generation for record in await store.list()]
            assert kept == [4, 5, 6], "the two newest Stopped records, and every live one"
        await _close(store)

    async def test_retention_caps_the_stopped_records_in_all(
        self, store_factory: StoreFactory
    ) -> None:
        retention = Retention(stopped_per_key=5, stopped_total=3)
        store = store_factory(None, retention)
        with trio.fail_after(BOUND):
            for instance in "abcde":
                await store.save(_record(instance, 1, stopped=True))
            kept = [record.handle.key.instance for record in await store.list()]
            assert kept == ["c", "d", "e"], "the oldest Stopped records go first"
        await _close(store)

    async def test_the_high_water_outlives_eviction_and_reopen(
        self, store_factory: StoreFactory
    ) -> None:
        retention = Retention(stopped_per_key=1, stopped_total=1)
        store = store_factory(None, retention)
        with trio.fail_after(BOUND):
            for generation in range(1, 4):
                await store.save(_record("a", generation, stopped=True))
            await store.save(_record("b", 1, stopped=True))  # evicts every record of "a"
            store = await self._reopen(store_factory, store, retention)
            assert [record.handle.key.instance for record in await store.list()] == ["b"]
            assert (await store.high_water())[Key(identity="contract", instance="a")] == 3
        await _close(store)

    async def test_concurrent_saves_all_land(self, store_factory: StoreFactory) -> None:
        retention = Retention()
        store = store_factory(None, retention)
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                for number in range(100):
                    nursery.start_soon(store.save, _record(f"k{number:03d}", 1))
            store = await self._reopen(store_factory, store, retention)
            assert len(await store.list()) == 100
        await _close(store)

    async def test_a_cancelled_save_either_landed_or_never_happened(
        self, store_factory: StoreFactory
    ) -> None:
        store = store_factory(None, Retention())
        with trio.fail_after(BOUND):
            for generation in range(1, 21):
                record = _record("a", generation)
                with trio.move_on_after(0) as scope:
                    await store.save(record)
                stored = {kept.handle.token for kept in await store.list()}
                assert (record.handle.token in stored) != scope.cancelled_caught
        await _close(store)


class ExecutionContract:
    """What every execution must do (DESIGN.md section 7).

    Provide a fixture ``harness_factory`` returning a new, not yet entered
    :class:`~trio_supervisor.testing.harnesses.Harness` for the adapter.
    """

    @pytest.fixture
    async def harness(self, harness_factory: Callable[[], Harness]) -> AsyncIterator[Harness]:
        async with harness_factory() as harness:
            yield harness

    def _handle(self, generation: int = 1) -> Handle:
        return Handle(
            key=Key(identity="contract", instance="x"), token="c" * 32, generation=generation
        )

    async def test_spawn_makes_a_unit_that_runs_only_once_started(self, harness: Harness) -> None:
        load = Load(specifier=harness.specifiers[0])
        with trio.fail_after(BOUND):
            unit = await harness.execution.spawn(self._handle(), load, Limits())
            assert unit.code.specifier == load.specifier
            identity = unit.identity
            await unit.renew(5.0)
            await unit.start()
            assert harness.alive(identity)
            await unit.renew(5.0)
            await unit.kill()
            await unit.wait()
            assert not harness.alive(identity)
            await unit.aclose()

    async def test_an_unresolvable_specifier_is_a_package_error(self, harness: Harness) -> None:
        with trio.fail_after(BOUND), pytest.raises(PackageError):
            await harness.execution.spawn(self._handle(), Load(specifier=harness.missing), Limits())

    async def test_interrupt_ends_a_running_child_and_many_waiters_see_it(
        self, harness: Harness
    ) -> None:
        with trio.fail_after(BOUND):
            unit = await harness.execution.spawn(
                self._handle(), Load(specifier=harness.specifiers[0]), Limits()
            )
            await unit.start()
            statuses: list[ExitStatus] = []

            async def wait() -> None:
                statuses.append(await unit.wait())

            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                assert statuses == [], "wait returned before the child exited"
                await unit.interrupt()
            assert len(statuses) == 3
            assert len(set(statuses)) == 1
            assert statuses[0].signal is not None or statuses[0].code is not None
            assert not harness.alive(unit.identity)
            await unit.aclose()

    async def test_a_child_that_exits_by_itself_reports_its_code(self, harness: Harness) -> None:
        handle = self._handle(2)
        with trio.fail_after(BOUND):
            unit = await harness.execution.spawn(
                handle, Load(specifier=harness.specifiers[0]), Limits()
            )
            await unit.start()
            harness.exit(handle, unit.identity, 3)
            assert await unit.wait() == ExitStatus(code=3)
            await unit.aclose()

    async def test_releasing_a_unit_that_never_started_ends_it(self, harness: Harness) -> None:
        with trio.fail_after(BOUND):
            unit = await harness.execution.spawn(
                self._handle(), Load(specifier=harness.specifiers[0]), Limits()
            )
            await unit.aclose()
            assert not harness.alive(unit.identity)

    async def test_recover_of_a_dead_child_signals_nothing(self, harness: Harness) -> None:
        with trio.fail_after(BOUND):
            unit = await harness.execution.spawn(
                self._handle(), Load(specifier=harness.specifiers[0]), Limits()
            )
            await unit.start()
            await unit.kill()
            await unit.wait()
            await unit.aclose()
            termination = await harness.execution.recover(unit.identity)
            assert termination.kind == "exited"

    async def test_recover_of_a_live_child_kills_it(self, harness: Harness) -> None:
        with trio.fail_after(BOUND):
            unit = await harness.execution.spawn(
                self._handle(), Load(specifier=harness.specifiers[0]), Limits()
            )
            await unit.start()
            # The supervisor that started it is gone; a new one finds it by its identity.
            termination = await harness.execution.recover(unit.identity)
            assert termination.kind == "killed"
            assert not harness.alive(unit.identity)
            assert termination.exit.signal is not None or termination.exit.code is not None
            await unit.aclose()
