"""Contract kits: plain pytest-trio test classes for adapter authors (needs pytest).

Subclass :class:`StoreContract` and give it a ``store_factory`` fixture, or
:class:`ExecutionContract` and give it a ``harness_factory`` fixture; pytest then runs
every test of the kit against your adapter::

    class TestMyStore(StoreContract):
        @pytest.fixture
        def store_factory(self, tmp_path):
            return lambda previous, retention: MyStore(tmp_path / "db", retention=retention)

The kits carry pytest-trio's ``trio`` marker, so they run in any project that has
pytest-trio installed, with or without ``trio_mode``. They use Trio's real clock:
executions may run real processes. Every wait is bounded by ``fail_after`` so a broken
adapter fails instead of hanging, and every failure says which promise broke and with
which record or call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
import trio
import trio.testing

from ..abc import Store
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


def _differ(promise: str, expected: list[SessionRecord], got: list[SessionRecord]) -> str:
    def short(records: list[SessionRecord]) -> list[str]:
        return [f"{r.handle.key.instance}#{r.handle.generation} {r.phase.value}" for r in records]

    return f"{promise}: expected {short(expected)}, got {short(got)}"


async def _close(store: Store) -> None:
    closer = getattr(store, "aclose", None)
    if closer is not None:
        await closer()


class StoreContract:
    """What every store must do (docs/design.md, "Persistence and retention" and "Adapters").

    Provide a fixture ``store_factory`` returning ``factory(previous, retention)``:
    a fresh store when ``previous`` is None, else the same storage reopened (the
    previous store is closed first, if it has ``aclose``).
    """

    pytestmark = pytest.mark.trio

    async def _reopen(self, factory: StoreFactory, store: Store, retention: Retention) -> Store:
        await _close(store)
        return factory(store, retention)

    async def test_saved_records_survive_a_reopen(self, store_factory: StoreFactory) -> None:
        """Records and high-water marks survive a reopen, in save order (V1, V5)."""
        retention = Retention()
        store = store_factory(None, retention)
        records = [_record("a", 1), _record("b", 1, stopped=True), _record("a", 2)]
        with trio.fail_after(BOUND):
            for record in records:
                await store.save(record)
            store = await self._reopen(store_factory, store, retention)
            listed = list(await store.list())
            assert listed == records, _differ(
                "a saved record survives a reopen, and list() gives records in save order",
                records,
                listed,
            )
            marks = dict(await store.high_water())
            expected = {
                Key(identity="contract", instance="a"): 2,
                Key(identity="contract", instance="b"): 1,
            }
            assert marks == expected, (
                f"high_water() after a reopen must give every key's highest generation "
                f"saved: expected {expected}, got {marks}"
            )
        await _close(store)

    async def test_a_record_replaces_its_token_s_earlier_record(
        self, store_factory: StoreFactory
    ) -> None:
        """A save replaces its token's earlier record and moves it to the end of the order."""
        store = store_factory(None, Retention())
        with trio.fail_after(BOUND):
            await store.save(_record("a", 1))
            await store.save(_record("b", 1))
            await store.save(_record("a", 1, stopped=True))
            listed = list(await store.list())
            assert listed == [_record("b", 1), _record("a", 1, stopped=True)], _differ(
                "a save replaces the earlier record of its token (and moves it to the end "
                "of the save order)",
                [_record("b", 1), _record("a", 1, stopped=True)],
                listed,
            )
        await _close(store)

    async def test_retention_keeps_the_newest_stopped_records_per_key(
        self, store_factory: StoreFactory
    ) -> None:
        """Retention keeps a key's newest ``stopped_per_key`` Stopped records, all live (O10)."""
        retention = Retention(stopped_per_key=2, stopped_total=1000)
        store = store_factory(None, retention)
        with trio.fail_after(BOUND):
            for generation in range(1, 6):
                await store.save(_record("a", generation, stopped=True))
            await store.save(_record("a", 6))
            store = await self._reopen(store_factory, store, retention)
            kept = [record.handle.generation for record in await store.list()]
            assert kept == [4, 5, 6], (
                "retention with stopped_per_key=2 keeps the two newest Stopped records of a "
                f"key and every live one: expected generations [4, 5, 6], got {kept}"
            )
        await _close(store)

    async def test_retention_caps_the_stopped_records_in_all(
        self, store_factory: StoreFactory
    ) -> None:
        """Retention keeps at most ``stopped_total`` Stopped records, dropping the oldest (O10)."""
        retention = Retention(stopped_per_key=5, stopped_total=3)
        store = store_factory(None, retention)
        with trio.fail_after(BOUND):
            for instance in "abcde":
                await store.save(_record(instance, 1, stopped=True))
            kept = [record.handle.key.instance for record in await store.list()]
            assert kept == ["c", "d", "e"], (
                "retention with stopped_total=3 drops the oldest Stopped records first: "
                f"expected the records of keys ['c', 'd', 'e'], got {kept}"
            )
        await _close(store)

    async def test_retention_keeps_young_stopped_records_past_the_count_per_key(
        self, store_factory: StoreFactory
    ) -> None:
        """Stopped records younger than ``stopped_for`` outlive the count per key, not the total."""
        # An hour: by the store's own clock (wall or database), the test takes far less.
        retention = Retention(stopped_per_key=1, stopped_total=4, stopped_for=3600.0)
        store = store_factory(None, retention)
        with trio.fail_after(BOUND):
            for generation in range(1, 4):
                await store.save(_record("a", generation, stopped=True))
            store = await self._reopen(store_factory, store, retention)
            await store.save(_record("a", 4, stopped=True))
            kept = [record.handle.generation for record in await store.list()]
            assert kept == [1, 2, 3, 4], (
                "retention with stopped_for=3600 keeps a key's Stopped records younger "
                f"than an hour past stopped_per_key=1: expected generations [1, 2, 3, 4], "
                f"got {kept}"
            )
            await store.save(_record("b", 1, stopped=True))
            kept = [record.handle.generation for record in await store.list()]
            assert kept == [2, 3, 4, 1], (
                "stopped_total=4 evicts the oldest Stopped record even while it is young: "
                f"expected generations [2, 3, 4, 1] (the last of key b), got {kept}"
            )
        await _close(store)

    async def test_the_high_water_outlives_eviction_and_reopen(
        self, store_factory: StoreFactory
    ) -> None:
        """A key's high-water outlives the eviction of all its records, and a reopen (V5)."""
        retention = Retention(stopped_per_key=1, stopped_total=1)
        store = store_factory(None, retention)
        with trio.fail_after(BOUND):
            for generation in range(1, 4):
                await store.save(_record("a", generation, stopped=True))
            await store.save(_record("b", 1, stopped=True))  # evicts every record of "a"
            store = await self._reopen(store_factory, store, retention)
            kept = [record.handle.key.instance for record in await store.list()]
            assert kept == ["b"], (
                f"with stopped_total=1 only the newest Stopped record stays: got {kept}"
            )
            mark = (await store.high_water()).get(Key(identity="contract", instance="a"))
            assert mark == 3, (
                "a key's high-water outlives the eviction of all its records and a reopen "
                f"(never derived from retained records): expected 3 for contract/a, got {mark}"
            )
        await _close(store)

    async def test_concurrent_saves_all_land(self, store_factory: StoreFactory) -> None:
        """Saves made at once all land, each durable when it returns."""
        retention = Retention()
        store = store_factory(None, retention)
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                for number in range(100):
                    nursery.start_soon(store.save, _record(f"k{number:03d}", 1))
            store = await self._reopen(store_factory, store, retention)
            landed = len(await store.list())
            assert landed == 100, (
                f"100 concurrent saves each returned, so all 100 must be durable: {landed} are"
            )
        await _close(store)

    async def test_a_cancelled_save_either_landed_or_never_happened(
        self, store_factory: StoreFactory
    ) -> None:
        """A cancelled save raised ``Cancelled`` having written nothing, or wrote (O11)."""
        store = store_factory(None, Retention())
        with trio.fail_after(BOUND):
            for generation in range(1, 21):
                record = _record("a", generation)
                with trio.move_on_after(0) as scope:
                    await store.save(record)
                stored = {kept.handle.token for kept in await store.list()}
                landed = record.handle.token in stored
                assert landed != scope.cancelled_caught, (
                    f"a cancelled save either raises Cancelled and writes nothing, or writes "
                    f"and returns normally: the save of contract/a generation {generation} "
                    + (
                        "raised Cancelled, yet its record landed (does save checkpoint "
                        "after writing?)"
                        if landed
                        else "returned normally, yet its record is not in the store"
                    )
                )
        await _close(store)


class ExecutionContract:
    """What every execution must do (docs/design.md, "Adapters").

    Provide a fixture ``harness_factory`` returning a new, not yet entered
    :class:`~trio_supervisor.testing.harnesses.Harness` for the adapter.
    """

    pytestmark = pytest.mark.trio

    @pytest.fixture
    async def harness(self, harness_factory: Callable[[], Harness]) -> AsyncIterator[Harness]:
        async with harness_factory() as harness:
            yield harness

    def _handle(self, generation: int = 1) -> Handle:
        return Handle(
            key=Key(identity="contract", instance="x"), token="c" * 32, generation=generation
        )

    async def test_spawn_makes_a_unit_that_runs_only_once_started(self, harness: Harness) -> None:
        """A spawned unit names its code, takes a lease unstarted, and runs once started (L4)."""
        load = Load(specifier=harness.specifiers[0])
        with trio.fail_after(BOUND):
            unit = await harness.execution.spawn(self._handle(), load, Limits())
            assert unit.code.specifier == load.specifier, (
                f"unit.code.specifier must be the load's specifier {load.specifier!r}, "
                f"got {unit.code.specifier!r}"
            )
            identity = unit.identity
            await unit.renew(5.0)
            await unit.start()
            assert harness.alive(identity), f"after start() the child {identity} must run"
            await unit.renew(5.0)
            await unit.kill()
            await unit.wait()
            assert not harness.alive(identity), (
                f"once wait() returned after kill(), the child {identity} must be gone"
            )
            await unit.aclose()

    async def test_an_unresolvable_specifier_is_a_package_error(self, harness: Harness) -> None:
        """A spawn of a specifier that cannot be resolved raises ``PackageError`` (L5)."""
        with trio.fail_after(BOUND), pytest.raises(PackageError):
            await harness.execution.spawn(self._handle(), Load(specifier=harness.missing), Limits())

    async def test_interrupt_ends_a_running_child_and_many_waiters_see_it(
        self, harness: Harness
    ) -> None:
        """An interrupt ends a running child, and every waiter sees the one exit status (P3)."""
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
                assert statuses == [], (
                    f"wait() returned {statuses} before the child {unit.identity} exited"
                )
                await unit.interrupt()
            assert len(set(statuses)) == 1, (
                f"three waiters of one exit must see one status, got {statuses}"
            )
            assert statuses[0].known, (
                f"an interrupted child's status must say how it ended, got {statuses[0]}"
            )
            assert not harness.alive(unit.identity), (
                f"once wait() returned, the child {unit.identity} must be gone"
            )
            await unit.aclose()

    async def test_a_child_that_exits_by_itself_reports_its_code(self, harness: Harness) -> None:
        """A child that exits by itself reports its exit code (X1)."""
        handle = self._handle(2)
        with trio.fail_after(BOUND):
            unit = await harness.execution.spawn(
                handle, Load(specifier=harness.specifiers[0]), Limits()
            )
            await unit.start()
            harness.exit(handle, unit.identity, 3)
            status = await unit.wait()
            assert status.code == 3, (
                f"a child that exits by itself with code 3 must report code 3, got {status}"
            )
            await unit.aclose()

    async def test_releasing_a_unit_that_never_started_ends_it(self, harness: Harness) -> None:
        """Releasing a unit that never started ends its child (P4)."""
        with trio.fail_after(BOUND):
            unit = await harness.execution.spawn(
                self._handle(), Load(specifier=harness.specifiers[0]), Limits()
            )
            await unit.aclose()
            assert not harness.alive(unit.identity), (
                f"aclose() of a unit never started must end its child {unit.identity}"
            )

    async def test_recover_of_a_dead_child_signals_nothing(self, harness: Harness) -> None:
        """Recovering a child that is gone signals nothing and says it exited (V2)."""
        with trio.fail_after(BOUND):
            unit = await harness.execution.spawn(
                self._handle(), Load(specifier=harness.specifiers[0]), Limits()
            )
            await unit.start()
            await unit.kill()
            await unit.wait()
            await unit.aclose()
            termination = await harness.execution.recover(unit.identity)
            assert termination.kind == "exited", (
                f"recover() of a child that is gone must signal nothing and say 'exited': "
                f"recover({unit.identity}) gave {termination}"
            )

    async def test_recover_of_a_live_child_kills_it(self, harness: Harness) -> None:
        """Recovering a child that still runs kills it and confirms its end (V2)."""
        with trio.fail_after(BOUND):
            unit = await harness.execution.spawn(
                self._handle(), Load(specifier=harness.specifiers[0]), Limits()
            )
            await unit.start()
            # The supervisor that started it is gone; a new one finds it by its identity.
            termination = await harness.execution.recover(unit.identity)
            assert termination.kind == "killed", (
                f"recover() of a live child must kill it and say 'killed': "
                f"recover({unit.identity}) gave {termination}"
            )
            assert not harness.alive(unit.identity), (
                f"once recover() returned, the child {unit.identity} must be gone"
            )
            assert termination.exit.known, (
                f"recover() of a child it killed must say how it ended, got {termination}"
            )
            await unit.aclose()
