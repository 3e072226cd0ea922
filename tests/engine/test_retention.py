"""The record index: retention and O(1) lookups (docs/design.md, "Persistence..."), and
what an execution that keeps something per session hears of it (``abc.Retaining``)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from trio_supervisor import (
    Disposed,
    ExecutionError,
    ExitStatus,
    Handle,
    Key,
    Limits,
    MemoryStore,
    OpenRecord,
    Retention,
    StoppedRecord,
    Termination,
    open_supervisor,
)
from trio_supervisor.abc import Retaining
from trio_supervisor.retention import RecordIndex, StopOrder
from trio_supervisor.testing import FakeExecution

DONE = Termination(kind="exited", exit=ExitStatus(code=0))


def record(instance: str, generation: int, *, stopped: bool = False) -> OpenRecord | StoppedRecord:
    handle = Handle(
        key=Key(identity="p", instance=instance),
        token=f"{instance}{generation}",
        generation=generation,
    )
    opened = OpenRecord(handle=handle, request_id=f"r{generation}", lease=1.0, limits=Limits())
    return StoppedRecord.of(opened, Disposed(), DONE) if stopped else opened


def test_live_records_are_never_evicted() -> None:
    index = RecordIndex(Retention(stopped_per_key=1, stopped_total=1))
    for generation in range(1, 50):
        index.save(record("a", generation))
    assert len(index) == 49


def test_the_newest_stopped_records_of_a_key_are_kept() -> None:
    index = RecordIndex(Retention(stopped_per_key=2, stopped_total=100))
    evicted = [
        gone.handle.generation
        for n in range(1, 5)
        for gone in index.save(record("a", n, stopped=True))
    ]
    assert evicted == [1, 2]
    assert [kept.handle.generation for kept in index] == [3, 4]


def test_the_total_cap_evicts_the_oldest_stopped_record_of_any_key() -> None:
    index = RecordIndex(Retention(stopped_per_key=5, stopped_total=2))
    index.save(record("a", 1, stopped=True))
    index.save(record("b", 1, stopped=True))
    [gone] = index.save(record("c", 1, stopped=True))
    assert gone.handle.key.instance == "a"


def test_lookups_by_request_id_and_high_water_survive_as_they_should() -> None:
    index = RecordIndex(Retention(stopped_per_key=1, stopped_total=10))
    first = record("a", 1, stopped=True)
    index.save(first)
    assert index.find_request(first.handle.key, "r1") == first
    index.save(record("a", 2, stopped=True))  # evicts generation 1
    assert index.find_request(first.handle.key, "r1") is None
    assert index.get(first.handle.token) is None
    assert index.high_water(first.handle.key) == 2


def test_a_record_replaces_its_token_and_moves_to_the_end() -> None:
    index = RecordIndex(Retention())
    index.save(record("a", 1))
    index.save(record("b", 1))
    index.save(record("a", 1, stopped=True))
    assert [(kept.handle.key.instance, type(kept).__name__) for kept in index] == [
        ("b", "OpenRecord"),
        ("a", "StoppedRecord"),
    ]


@pytest.mark.parametrize("field", ["stopped_per_key", "stopped_total"])
def test_retention_needs_positive_bounds(field: str) -> None:
    with pytest.raises(ValueError, match=f"Retention.{field} must be >= 1"):
        Retention(**{field: 0})


@pytest.mark.parametrize(
    ("value", "error", "said"),
    [
        (-1.0, ValueError, "must be a finite number of seconds >= 0, got -1.0"),
        (float("inf"), ValueError, "must be a finite number of seconds >= 0, got inf"),
        (float("nan"), ValueError, "must be a finite number of seconds >= 0, got nan"),
        ("1h", TypeError, "must be a number of seconds, not str"),
        (True, TypeError, "must be a number of seconds, not bool"),
    ],
)
def test_retention_keeps_for_a_finite_duration_that_is_not_negative(
    value: object, error: type[Exception], said: str
) -> None:
    with pytest.raises(error, match=f"^Retention.stopped_for {said}$"):
        Retention(stopped_for=value)
    assert Retention(stopped_for=90).stopped_for == 90.0


class Clock:
    """A wall clock the test moves itself."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_young_stopped_record_is_kept_past_the_count_until_a_later_stop_of_its_key() -> None:
    clock = Clock()
    index = RecordIndex(Retention(stopped_per_key=1, stopped_for=60.0), clock=clock)
    for generation in (1, 2, 3):
        assert index.save(record("a", generation, stopped=True)) == []
        clock.now += 25.0
    # 75 s: generation 1 is old; generation 2 (50 s) is young; 3 is kept by the count.
    assert index.save(record("b", 1, stopped=True)) == []  # another key's stop: no eviction
    assert [gone.handle.generation for gone in index.save(record("a", 4, stopped=True))] == [1]
    clock.now += 10.0
    assert [gone.handle.generation for gone in index.save(record("a", 5, stopped=True))] == [2]


# One step of the model test: a record saved (instance, generation, stopped?), after the
# clock moved on by some seconds.
steps = st.lists(
    st.tuples(
        st.sampled_from("abc"),
        st.integers(1, 6),
        st.booleans(),
        st.sampled_from([0.0, 1.0, 5.0, 30.0]),
    ),
    max_size=40,
)


@given(
    steps=steps,
    per_key=st.integers(1, 3),
    total=st.integers(1, 6),
    kept_for=st.sampled_from([0.0, 5.0, 20.0, 10_000.0]),
)
def test_the_index_keeps_exactly_what_the_model_of_retention_says(
    steps: list[tuple[str, int, bool, float]], per_key: int, total: int, kept_for: float
) -> None:
    """The model, written plainly: every record not Stopped is kept; a new stop of a key
    evicts its Stopped records beyond the newest ``per_key`` that stopped ``kept_for`` or
    more ago (all of them when ``kept_for`` is 0), then the oldest Stopped records of all
    beyond ``total``, however young; a record saved Stopped again keeps its stop."""
    clock = Clock()
    index = RecordIndex(
        Retention(stopped_per_key=per_key, stopped_total=total, stopped_for=kept_for),
        clock=clock,
    )
    live: set[str] = set()
    stops: list[tuple[str, str, float]] = []  # token, instance, when: in stop order
    for instance, generation, stop, moved in steps:
        clock.now += moved
        saved = record(instance, generation, stopped=stop)
        token = saved.handle.token
        index.save(saved)
        known = [each for each in stops if each[0] == token]
        if not stop:
            live.add(token)
            stops = [each for each in stops if each[0] != token]
            continue
        live.discard(token)
        if known:
            continue  # only a new stop evicts
        stops.append((token, instance, clock.now))
        of_key = [each for each in stops if each[1] == instance]
        extras = of_key[: max(len(of_key) - per_key, 0)]
        gone = {each[0] for each in extras if kept_for == 0 or clock.now - each[2] >= kept_for}
        stops = [each for each in stops if each[0] not in gone]
        stops = stops[max(len(stops) - total, 0) :]
        assert {kept.handle.token for kept in index} == live | {each[0] for each in stops}


def test_a_stop_keeps_its_place_and_number_when_the_token_stops_again() -> None:
    stops: StopOrder[str] = StopOrder()
    assert [stops.stop("t1", "a"), stops.stop("t2", "a"), stops.stop("t1", "a")] == [1, 2, 1]
    assert stops.evict("a", Retention(stopped_per_key=1)) == ["t1"]


def test_stops_read_back_from_storage_keep_their_order_and_numbering_goes_on() -> None:
    stops: StopOrder[str] = StopOrder()
    stops.restore("old", "a", 4)
    stops.restore("older-of-b", "b", 9)
    assert stops.stop("new", "a") == 10
    assert stops.evict("a", Retention(stopped_per_key=1, stopped_total=10)) == ["old"]
    assert stops.evict("b", Retention(stopped_per_key=1, stopped_total=1)) == ["older-of-b"]
    assert "new" in stops
    assert len(stops) == 1


def test_eviction_takes_a_keys_oldest_first_then_the_oldest_of_all() -> None:
    stops: StopOrder[str] = StopOrder()
    for token, key in [("a1", "a"), ("b1", "b"), ("a2", "a"), ("a3", "a")]:
        stops.stop(token, key)
    assert stops.evict("a", Retention(stopped_per_key=2, stopped_total=2)) == ["a1", "b1"]
    assert [token in stops for token in ("a1", "b1", "a2", "a3")] == [False, False, True, True]


def test_forgetting_a_token_that_never_stopped_changes_nothing() -> None:
    stops: StopOrder[str] = StopOrder()
    stops.stop("a1", "a")
    stops.forget("x")
    stops.forget("a1")
    stops.forget("a1")
    assert len(stops) == 0
    assert stops.evict("a", Retention(stopped_per_key=1, stopped_total=1)) == []


# -- an execution that keeps something per session (abc.Retaining) ----------------------


class Keeping(FakeExecution):
    """A fake that keeps something of each session, and hears what retention evicts and,
    once recovery is over, what is retained."""

    def __init__(self, *, failing: bool = False) -> None:
        super().__init__()
        self.evictions: list[list[Handle]] = []
        self.retained_at_start: list[set[Handle]] = []
        self.failing = failing

    def evicted(self, handles: Sequence[Handle]) -> None:
        self.evictions.append(list(handles))

    async def retained(self, handles: Collection[Handle]) -> None:
        await trio.lowlevel.checkpoint()
        self.retained_at_start.append(set(handles))
        if self.failing:
            raise ExecutionError("the logs' directory is gone")


KEPT = Key(identity="p", instance="kept")


async def test_the_execution_hears_which_records_retention_evicts_and_which_it_retains(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(retention=Retention(stopped_per_key=1, stopped_total=100))
    execution = Keeping()
    assert isinstance(execution, Retaining)
    async with open_supervisor(store, execution, grace=1.0) as supervisor:
        assert execution.retained_at_start == [set()]
        first = await supervisor.open(KEPT, "1")
        await supervisor.dispose(first.handle)
        second = await supervisor.open(KEPT, "2", expected_generation=1)
        await supervisor.dispose(second.handle)  # generation 1's record goes now
        assert execution.evictions == [[first.handle]]
        third = await supervisor.open(KEPT, "3", expected_generation=2)
    # A restart on what the store retained (generation 3 stopped by the shutdown; it
    # evicted generation 2): the execution hears what is retained, once recovered.
    again = Keeping()
    async with open_supervisor(store, again, grace=1.0):
        assert again.retained_at_start == [{third.handle}]
        assert again.evictions == []
    assert execution.evictions == [[first.handle], [second.handle]]


async def test_an_execution_that_cannot_look_at_what_it_keeps_does_not_stop_the_start(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    execution = Keeping(failing=True)
    with caplog.at_level(logging.WARNING, "trio_supervisor.supervisor"):
        async with open_supervisor(MemoryStore(), execution) as supervisor:
            record = await supervisor.open(KEPT, "1")
            assert record.handle.generation == 1
    [said] = [record.getMessage() for record in caplog.records]
    assert said == (
        "what the execution keeps of sessions is left as it is: the logs' directory is gone"
    )
