"""The record index: retention and O(1) lookups (docs/design.md, "Persistence...")."""

from __future__ import annotations

import pytest

from trio_supervisor import (
    Disposed,
    ExitStatus,
    Handle,
    Key,
    Limits,
    OpenRecord,
    Retention,
    StoppedRecord,
    Termination,
)
from trio_supervisor.retention import RecordIndex

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
