"""recovery, entering open_supervisor: V1-V5; status, high_water: S1-S2 (docs/design.md)."""

from __future__ import annotations

import signal
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from trio_supervisor import (
    ChildIdentity,
    CodeIdentity,
    Disposed,
    ExecutionError,
    ExitStatus,
    Handle,
    Key,
    Limits,
    Load,
    LoadedRecord,
    LoadingRecord,
    MemoryStore,
    OpenRecord,
    RecordFormatError,
    Recovery,
    Retention,
    SessionRecord,
    SessionStoppedError,
    StaleSessionError,
    StateStorageError,
    StoppedRecord,
    StoppingRecord,
    SupervisorAPI,
    Termination,
    TerminationUnconfirmedError,
)
from trio_supervisor.testing import FakeExecution, FaultyStore

from ..support.sessions import KEY, OTHER, opened, supervise


def handle_of(instance: str, generation: int = 1) -> Handle:
    return Handle(
        key=Key(identity="p", instance=instance), token=f"{instance:0>32}", generation=generation
    )


def base(handle: Handle) -> dict[str, Any]:
    return {"handle": handle, "request_id": "r", "lease": 5.0, "limits": Limits()}


def child(ref: str) -> ChildIdentity:
    return ChildIdentity(adapter="fake", ref=ref)


LOAD = Load(specifier="x")
CODE = CodeIdentity(specifier="x")


async def left_behind(store: MemoryStore) -> dict[str, SessionRecord]:
    """What a crashed run might leave: one record of every phase."""
    records: dict[str, SessionRecord] = {
        "open": OpenRecord(**base(handle_of("open"))),
        "loading": LoadingRecord(load=LOAD, **base(handle_of("loading"))),
        "registered": LoadingRecord(load=LOAD, child=child("c1"), **base(handle_of("registered"))),
        "loaded": LoadedRecord(
            load=LOAD, code=CODE, child=child("c2"), **base(handle_of("loaded"))
        ),
    }
    loaded = LoadedRecord(load=LOAD, code=CODE, child=child("c3"), **base(handle_of("stopping")))
    records["stopping"] = StoppingRecord.of(loaded, Disposed())
    done = Termination(kind="exited", exit=ExitStatus(code=0))
    records["stopped"] = StoppedRecord.of(
        OpenRecord(**base(handle_of("stopped"))), Disposed(), done
    )
    await store.save_many(list(records.values()))
    return records


async def test_v1_every_stored_record_is_read_before_the_supervisor_is_usable(
    fake: FakeExecution,
) -> None:
    store = MemoryStore()
    records = await left_behind(store)
    async with supervise(store, fake) as sup:
        # What status answers is what the store holds after recovery, record by record.
        stored = {record.handle: record for record in await store.list()}
        assert set(stored) == {record.handle for record in records.values()}
        for handle, record in stored.items():
            assert await sup.status(handle) == record
            assert await sup.high_water(handle.key) == 1


async def test_v2_children_are_recovered_and_childless_records_end_with_no_child(
    fake: FakeExecution,
) -> None:
    store = MemoryStore()
    records = await left_behind(store)
    killed = Termination(kind="killed", exit=ExitStatus(signal=signal.SIGKILL))
    fake.recoveries.update({"c1": killed, "c2": killed, "c3": killed})
    async with supervise(store, fake) as sup:
        assert sorted(call.ref for call in fake.calls if call.name == "recover") == [
            "c1",
            "c2",
            "c3",
        ]
        for name in ("open", "loading"):
            record = await sup.status(records[name].handle)
            assert isinstance(record, StoppedRecord)
            assert record.termination == Termination(kind="none", exit=ExitStatus())
        for name in ("registered", "loaded", "stopping"):
            record = await sup.status(records[name].handle)
            assert isinstance(record, StoppedRecord)
            assert record.termination == killed


async def test_v2_a_failed_recovery_keeps_the_supervisor_from_starting(fake: FakeExecution) -> None:
    store = MemoryStore()
    records = await left_behind(store)
    fake.recoveries["c2"] = ExecutionError("cannot open a pidfd")
    entered = False
    with pytest.raises(TerminationUnconfirmedError) as caught:
        async with supervise(store, fake):
            entered = True
    assert not entered
    assert str(caught.value) == (
        "1 orphaned children could not be confirmed gone; the supervisor does not start"
    )
    assert [str(cause) for cause in caught.value.causes] == ["cannot open a pidfd"]
    after = {record.handle.token: record for record in await store.list()}
    # What could be confirmed is recorded; the one that could not stays for next time.
    assert isinstance(after[records["loaded"].handle.token], LoadedRecord)
    assert isinstance(after[records["registered"].handle.token], StoppedRecord)


async def test_v2_a_recovery_that_hangs_times_out_as_unconfirmed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Hanging(FakeExecution):
        async def recover(self, child: ChildIdentity) -> Termination:
            await trio.sleep_forever()
            raise AssertionError

    store = MemoryStore()
    await store.save(LoadedRecord(load=LOAD, code=CODE, child=child("c"), **base(handle_of("a"))))
    with pytest.raises(TerminationUnconfirmedError) as caught:
        async with supervise(store, Hanging(), confirmation_timeout=2.0):
            pass
    assert trio.current_time() == pytest.approx(2.0)
    assert "longer than the confirmation timeout" in str(caught.value.causes[0])


async def test_v3_recovered_records_are_stopped_with_reason_recovery(fake: FakeExecution) -> None:
    store = MemoryStore()
    records = await left_behind(store)
    async with supervise(store, fake):
        pass
    after = {record.handle.token: record for record in await store.list()}
    for name in ("open", "loading", "registered", "loaded"):
        record = after[records[name].handle.token]
        assert isinstance(record, StoppedRecord)
        assert record.reason == Recovery()
        assert record.previous == records[name]
    stopping = after[records["stopping"].handle.token]
    assert isinstance(stopping, StoppedRecord)
    assert stopping.previous == records["stopping"].previous  # type: ignore[union-attr]
    # A record that was already Stopped is left as it was.
    assert after[records["stopped"].handle.token] == records["stopped"]


async def test_v3_a_crashed_run_s_live_child_is_killed_by_the_next_run(fake: FakeExecution) -> None:
    store = MemoryStore()
    async with supervise(store, fake) as first:
        handle = await opened(first)
        await first.load(handle, Load(specifier="x"))
        unit = fake.unit_of(handle)
        crashed = store.copy()  # what a crash right now would leave on disk
        async with supervise(crashed, fake) as second:
            record = await second.status(handle)
            assert isinstance(record, StoppedRecord)
            assert record.reason == Recovery()
            assert record.termination.kind == "killed"
            assert unit.exited
            assert unit.signals == ["kill"]


async def test_v4_old_leases_are_not_resumed(fake: FakeExecution) -> None:
    store = MemoryStore()
    records = await left_behind(store)
    handle = records["loaded"].handle
    async with supervise(store, fake) as sup:
        with pytest.raises(SessionStoppedError):
            await sup.renew(handle)
        with pytest.raises(SessionStoppedError):
            await sup.load(handle, LOAD)
        record = await sup.status(handle)
        assert isinstance(record, StoppedRecord)
        assert await sup.dispose(handle) == record.termination
        assert not fake.units


async def test_v5_generations_continue_after_a_restart_even_when_records_were_evicted(
    fake: FakeExecution,
) -> None:
    store = MemoryStore(retention=Retention(stopped_per_key=1, stopped_total=1))
    async with supervise(store, fake) as sup:
        for _ in range(3):
            await sup.dispose(await opened(sup, request_id=f"r{await sup.high_water(KEY)}"))
        await sup.dispose(await opened(sup, key=OTHER))  # evicts every record of KEY
    assert [record.handle.key for record in await store.list()] == [OTHER]
    async with supervise(store, fake) as sup:
        assert await sup.high_water(KEY) == 3
        with pytest.raises(StaleSessionError):
            await sup.open(KEY, "fresh")
        record = await sup.open(KEY, "fresh", expected_generation=3)
        assert record.handle.generation == 4


async def test_v1_a_corrupt_store_keeps_the_supervisor_from_starting(fake: FakeExecution) -> None:
    class Corrupt(MemoryStore):
        async def list(self) -> list[SessionRecord]:
            raise RecordFormatError("unsupported record version 7 @ $.version")

    with pytest.raises(RecordFormatError, match="version 7"):
        async with supervise(Corrupt(), fake):
            pytest.fail("the supervisor started on a store it cannot read")


async def test_v3_a_store_that_cannot_save_recovered_records_keeps_it_from_starting(
    fake: FakeExecution,
) -> None:
    inner = MemoryStore()
    await left_behind(inner)
    store = FaultyStore(inner)
    store.fail_always()
    with pytest.raises(StateStorageError):
        async with supervise(store, fake):
            pytest.fail("started without recording the recovery")


async def test_s1_status_returns_the_record_only_for_a_matching_handle(sup: SupervisorAPI) -> None:
    opened_record = await sup.open(KEY, "r1")
    handle = opened_record.handle
    assert await sup.status(handle) == opened_record
    await sup.load(handle, Load(specifier="x"))
    loaded = await sup.status(handle)
    assert isinstance(loaded, LoadedRecord), "the last durable record, not the first"
    for stale in (
        attrs.evolve(handle, token="f" * 36),
        attrs.evolve(handle, generation=2),
        attrs.evolve(handle, key=OTHER),
    ):
        with pytest.raises(StaleSessionError):
            await sup.status(stale)
    with pytest.raises(TypeError, match="Handle"):
        await sup.status("token")  # type: ignore[arg-type]


async def test_s1_status_works_while_poisoned(fake: FakeExecution) -> None:
    store = FaultyStore(MemoryStore())
    with pytest.RaisesGroup(StateStorageError):
        async with supervise(store, fake) as sup:
            handle = await opened(sup)
            store.fail_next()
            with pytest.raises(StateStorageError):
                await sup.open(OTHER, "r")
            assert isinstance(await sup.status(handle), OpenRecord)


async def test_s2_high_water_is_the_highest_generation_or_none(sup: SupervisorAPI) -> None:
    assert await sup.high_water(KEY) is None
    await opened(sup)
    await opened(sup, request_id="r2")
    assert await sup.high_water(KEY) == 2
    assert await sup.high_water(OTHER) is None


async def test_v1_a_store_that_fails_to_read_in_its_own_way_is_a_storage_error(
    fake: FakeExecution,
) -> None:
    class Unreadable(MemoryStore):
        async def list(self) -> list[SessionRecord]:
            raise RuntimeError("disk on fire")

    with pytest.raises(StateStorageError) as caught:
        async with supervise(Unreadable(), fake):
            pytest.fail("the supervisor started on a store it could not read")
    assert str(caught.value) == "the store could not be read: RuntimeError('disk on fire')"
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert fake.calls == []  # nothing was recovered


async def test_v2_an_adapter_whose_recover_returns_no_termination_is_unconfirmed(
    fake: FakeExecution,
) -> None:
    class Vague(FakeExecution):
        async def recover(self, child: ChildIdentity) -> Termination:
            await trio.lowlevel.checkpoint()
            return "gone"  # type: ignore[return-value]

    store = MemoryStore()
    orphan = LoadedRecord(load=LOAD, code=CODE, child=child("c"), **base(handle_of("a")))
    await store.save(orphan)
    with pytest.raises(TerminationUnconfirmedError) as caught:
        async with supervise(store, Vague()):
            pytest.fail("the supervisor started with an orphan it could not vouch for")
    [cause] = caught.value.causes
    assert isinstance(cause, ExecutionError)
    assert str(cause) == "recover returned 'gone', not a Termination"
    assert await store.list() == [orphan]  # left for the next start to try again


async def test_v3_recovery_logs_how_many_sessions_it_stopped(
    fake: FakeExecution, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()
    await left_behind(store)  # five sessions that were not Stopped, one that was
    with caplog.at_level("INFO", logger="trio_supervisor"):
        async with supervise(store, fake):
            pass
    assert "recovered 5 sessions left over from an earlier run" in caplog.messages
