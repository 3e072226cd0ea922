"""The supervisor's reads that never touch the store, for operators and a runner's
admission: records(), find(), times(), live_records(), retained_request(), holds_key(),
and listen() (docs/design.md, "Shape"; O3, O5, R6, P5)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_supervisor import (
    Handle,
    Key,
    Load,
    MemoryStore,
    Phase,
    SessionRecord,
    StoppedRecord,
    open_supervisor,
)
from trio_supervisor.testing import FakeExecution

KEY = Key(identity="reads", instance="one")
OTHER = Key(identity="reads", instance="two")


async def test_find_answers_live_and_stopped_generations_and_nothing_else(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_supervisor(MemoryStore(), FakeExecution(), lease=10.0) as sup:
        first = await sup.open(KEY, "r1")
        other = await sup.open(OTHER, "r2")
        assert sup.find(KEY, 1) == first  # live: found by its session
        assert sup.find(OTHER, 1) == other
        assert sup.find(KEY, 2) is None
        second = await sup.open(KEY, "r3", expected_generation=1)  # stops the first (O5)
        stopped = sup.find(KEY, 1)
        assert isinstance(stopped, StoppedRecord)  # found by a scan of the records
        assert stopped.handle == first.handle
        assert sup.find(KEY, 2) == second
        assert sup.find(Key(identity="reads", instance="none"), 1) is None


async def test_find_reads_the_live_sessions_latest_record(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_supervisor(MemoryStore(), FakeExecution(), lease=10.0) as sup:
        record = await sup.open(KEY, "r1")
        await sup.load(record.handle, Load(specifier="plugin:main"))
        found = sup.find(KEY, 1)
        assert found is not None
        assert found.phase is Phase.LOADED


async def test_times_are_the_age_and_the_lease_left_while_the_session_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_supervisor(MemoryStore(), FakeExecution(), lease=10.0) as sup:
        await trio.sleep(5.0)  # the age counts from the open, not from the clock's start
        record = await sup.open(KEY, "r1")
        await trio.sleep(3.0)
        assert sup.times(record.handle) == pytest.approx((3.0, 7.0))
        await sup.renew(record.handle)  # R6: only in memory
        await trio.sleep(1.0)
        assert sup.times(record.handle) == pytest.approx((4.0, 9.0))
        wrong = Handle(key=KEY, token=record.handle.token, generation=2)
        assert sup.times(wrong) is None  # not this session's handle
        await sup.dispose(record.handle)
        assert sup.times(record.handle) is None  # P5: its record answers now


async def test_live_records_are_the_sessions_running_here_and_not_the_stopped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_supervisor(MemoryStore(), FakeExecution(), lease=10.0) as sup:
        assert sup.live_records() == []
        first = await sup.open(KEY, "r1")
        other = await sup.open(OTHER, "r2")
        assert sorted(sup.live_records(), key=lambda record: record.handle.key.instance) == [
            first,
            other,
        ]
        await sup.dispose(first.handle)
        assert sup.live_records() == [other]
        assert len(sup.records()) == 2  # the stopped one is still retained


async def test_retained_request_is_what_a_repeated_open_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_supervisor(MemoryStore(), FakeExecution(), lease=10.0) as sup:
        assert sup.retained_request(KEY, "r1") is None
        record = await sup.open(KEY, "r1")
        assert sup.retained_request(KEY, "r1") == record
        assert sup.retained_request(KEY, "r2") is None
        assert sup.retained_request(OTHER, "r1") is None
        assert await sup.open(KEY, "r1") == record  # O3


async def test_holds_key_while_a_session_of_the_key_runs_here(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_supervisor(MemoryStore(), FakeExecution(), lease=10.0) as sup:
        assert not sup.holds_key(KEY)
        record = await sup.open(KEY, "r1")
        assert sup.holds_key(KEY)
        assert not sup.holds_key(OTHER)
        await sup.dispose(record.handle)
        assert not sup.holds_key(KEY)


async def test_a_listener_hears_every_durable_record_at_once_until_it_stops(
    autojump_clock: trio.testing.MockClock,
) -> None:
    heard: list[SessionRecord] = []
    async with open_supervisor(MemoryStore(), FakeExecution(), lease=10.0) as sup:
        stop = sup.listen(heard.append)
        record = await sup.open(KEY, "r1")
        assert heard == [record]  # at once: no task ran between
        await sup.dispose(record.handle)
        assert [heard_record.phase for heard_record in heard] == [
            Phase.OPEN,
            Phase.STOPPING,
            Phase.STOPPED,
        ]
        stop()
        await sup.open(OTHER, "r2")
        assert len(heard) == 3


async def test_a_listener_that_reads_the_live_records_never_sees_a_stopped_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A runner's admission counts from its listener: the Stopped record is heard while
    # its session is still found by its token (P5 comes right after), and counts no more.
    async with open_supervisor(MemoryStore(), FakeExecution(), lease=10.0) as sup:
        seen: list[tuple[Phase, list[SessionRecord]]] = []
        record = await sup.open(KEY, "r1")
        await sup.load(record.handle, Load(specifier="plugin:main"))
        sup.listen(lambda record: seen.append((record.phase, sup.live_records())))
        await sup.dispose(record.handle)  # a child: Stopping and Stopped, one by one
        assert [(phase, [live.phase for live in lives]) for phase, lives in seen] == [
            (Phase.STOPPING, [Phase.STOPPING]),
            (Phase.STOPPED, []),
        ]
