"""watch(): every durable record, in order, to every watcher; a slow one never slows us."""

from __future__ import annotations

import re

import pytest
import trio
import trio.testing

from trio_supervisor import Load, MemoryStore, Phase, SessionRecord, StoppedRecord, Supervisor
from trio_supervisor._core.events import Overflow
from trio_supervisor.testing import FakeExecution, FaultyStore

from ..support.sessions import OTHER, opened, supervise_embedded


def phase_of(event: SessionRecord | Overflow) -> Phase | None:
    return None if isinstance(event, Overflow) else event.phase


async def test_a_watcher_sees_every_durable_record_in_order(fake: FakeExecution) -> None:
    store = FaultyStore(MemoryStore())
    seen: list[SessionRecord | Overflow] = []
    async with supervise_embedded(store, fake) as sup, sup.watch() as events:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="plugin:main"))
        await sup.dispose(handle)
        async for event in events:
            seen.append(event)
            if isinstance(event, StoppedRecord):
                break
    # Exactly what the store acknowledged, in that order.
    assert seen == store.saved
    assert [record.phase for record in store.saved] == [
        Phase.OPEN,
        Phase.LOADING,
        Phase.LOADING,
        Phase.LOADED,
        Phase.STOPPING,
        Phase.STOPPED,
    ]


async def test_a_watcher_that_never_reads_does_not_slow_the_supervisor(
    fake: FakeExecution,
) -> None:
    async with supervise_embedded(MemoryStore(), fake) as sup:
        stuck = sup.watch(buffer=4)  # never read until the end
        async with stuck:
            first_handle = await opened(sup)
            for n in range(50):
                handle = await opened(sup, OTHER, request_id=f"o{n}")
                await sup.dispose(handle)
            # Nothing waited for the watcher: all 150 saves happened (1 + 50 x 3).
            assert len(sup.records()) >= 2
            first = [await anext(stuck) for _ in range(5)]
            assert all(isinstance(event, SessionRecord) for event in first[:4])
            assert first[4] == Overflow(lost=151 - 4)
            # After the overflow it hears of every record again.
            await sup.dispose(first_handle)
            again = [await anext(stuck) for _ in range(2)]
            assert [phase_of(event) for event in again] == [Phase.STOPPING, Phase.STOPPED]


async def test_watching_ends_when_the_supervisor_shuts_down(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    events: list[SessionRecord | Overflow] = []

    async def watch(sup: Supervisor, task_status: trio.TaskStatus[None]) -> None:
        async with sup.watch() as watched:
            task_status.started()
            async for event in watched:
                events.append(event)

    async with trio.open_nursery() as nursery, supervise_embedded(MemoryStore(), fake) as sup:
        await nursery.start(watch, sup)
        await opened(sup)
        # The watcher read the Open, and the shutdown's Stopping and Stopped, then ended.
    assert [phase_of(event) for event in events] == [
        Phase.OPEN,
        Phase.STOPPING,
        Phase.STOPPED,
    ]


@pytest.mark.parametrize("buffer", [0, -1, True, 1.5, "4"])
async def test_a_watch_needs_a_buffer_of_at_least_one_record(
    fake: FakeExecution, buffer: object
) -> None:
    async with supervise_embedded(MemoryStore(), fake) as sup:
        with pytest.raises(
            ValueError, match=re.escape(f"buffer must be an int >= 1, got {buffer!r}")
        ):
            sup.watch(buffer=buffer)  # type: ignore[arg-type]


async def test_a_watch_of_one_record_keeps_one_then_overflows(fake: FakeExecution) -> None:
    async with supervise_embedded(MemoryStore(), fake) as sup, sup.watch(buffer=1) as events:
        handle = await opened(sup)
        await sup.dispose(handle)
        kept = [await anext(events) for _ in range(2)]
        assert [phase_of(event) for event in kept] == [Phase.OPEN, None]
        assert kept[1] == Overflow(lost=2)


async def test_a_closed_watch_hears_of_no_more_records(fake: FakeExecution) -> None:
    async with supervise_embedded(MemoryStore(), fake) as sup:
        async with sup.watch() as closed:
            pass
        await opened(sup)  # published to the watchers left: none
        assert [event async for event in closed] == []
        # The next watcher hears of what is saved from its start on.
        async with sup.watch() as events:
            await opened(sup, OTHER)
            first = await anext(events)
            assert phase_of(first) == Phase.OPEN
