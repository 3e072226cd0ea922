"""Dispose, lease expiry, child exit, supersede and shutdown racing on one session.

In every order, the child is terminated exactly once, the first request fixes the
reason, and every caller sees the one outcome.
"""

from __future__ import annotations

import contextlib
import itertools
import random

import pytest
import trio
import trio.testing

from trio_supervisor import (
    Exited,
    ExitStatus,
    Load,
    MemoryStore,
    Retention,
    RunnerClosingError,
    StoppedRecord,
    SupervisorError,
    Termination,
)
from trio_supervisor.testing import FakeExecution

from .harness import KEY, supervise

TRIGGERS = ("dispose", "expiry", "exit", "supersede", "shutdown")
REASONS = {
    "dispose": "Disposed",
    "expiry": "Expired",
    "exit": "Exited",
    "supersede": "Superseded",
    "shutdown": "Shutdown",
}
STEP = 0.001  # between triggers; the child takes 0.01 to exit, so all land during the stop


async def race(
    order: tuple[str, ...], times: dict[str, float]
) -> tuple[StoppedRecord, FakeExecution, list[object]]:
    fake = FakeExecution()
    fake.behave("x", exit_delay=0.01)
    store = MemoryStore(retention=Retention(stopped_per_key=5))
    outcomes: list[object] = []

    async def dispose(sup: object, handle: object) -> None:
        await trio.sleep_until(times["dispose"])
        try:
            outcomes.append(await sup.dispose(handle))  # type: ignore[attr-defined]
        except SupervisorError as error:
            outcomes.append(error)

    async def supersede(sup: object) -> None:
        await trio.sleep_until(times["supersede"])
        with contextlib.suppress(RunnerClosingError):
            await sup.open(KEY, "r2", expected_generation=1)  # type: ignore[attr-defined]

    async def exit_(handle: object) -> None:
        await trio.sleep_until(times["exit"])
        fake.unit_of(handle).exit(code=7)  # type: ignore[arg-type]

    async with trio.open_nursery() as callers, supervise(store, fake, grace=1.0) as sup:
        record = await sup.open(KEY, "r1", lease=times["expiry"])
        handle = record.handle
        await sup.load(handle, Load(specifier="x"))
        callers.start_soon(dispose, sup, handle)
        callers.start_soon(supersede, sup)
        callers.start_soon(exit_, handle)
        await trio.sleep_until(times["shutdown"])
    [first] = [stored for stored in await store.list() if stored.handle == handle]
    assert isinstance(first, StoppedRecord)
    return first, fake, outcomes


def check_exactly_once(record: StoppedRecord, fake: FakeExecution, outcomes: list[object]) -> None:
    unit = fake.units[0]
    signals = unit.signals
    assert signals.count("interrupt") <= 1
    assert signals.count("kill") == 0
    assert unit.closed == 1
    assert [call.name for call in fake.calls_of(unit)].count("aclose") == 1
    for outcome in outcomes:
        assert outcome == record.termination
    if record.reason == Exited():
        assert signals == [], "X1: a child that exited by itself gets no signal"
        assert record.termination == Termination(kind="exited", exit=ExitStatus(code=7))
    else:
        assert signals == ["interrupt"]


@pytest.mark.parametrize("order", list(itertools.permutations(TRIGGERS)), ids="-".join)
async def test_every_order_terminates_the_child_once_and_the_first_request_wins(
    order: tuple[str, ...], autojump_clock: trio.testing.MockClock
) -> None:
    times = {trigger: 1.0 + STEP * index for index, trigger in enumerate(order)}
    record, fake, outcomes = await race(order, times)
    assert record.reason.kind == REASONS[order[0]]
    check_exactly_once(record, fake, outcomes)
    assert len(outcomes) == 1


@pytest.mark.parametrize("seed", range(20))
async def test_all_at_once_terminates_the_child_once(
    seed: int, autojump_clock: trio.testing.MockClock
) -> None:
    order = list(TRIGGERS)
    random.Random(seed).shuffle(order)
    times = dict.fromkeys(TRIGGERS, 1.0)
    record, fake, outcomes = await race(tuple(order), times)
    assert record.reason.kind in REASONS.values()
    check_exactly_once(record, fake, outcomes)
