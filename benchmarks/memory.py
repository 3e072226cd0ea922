"""memory.idle_session: bytes per idle open session, by tracemalloc over many sessions."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Awaitable, Callable

import trio

from trio_supervisor import Key, MemoryStore, open_supervisor
from trio_supervisor.testing import FakeExecution

from .measure import Result
from .skeleton import LEASE, Skeleton

BASELINE = 12_000  # bytes: the budget the issue sets, from the skeleton's cost


def ours_bytes(sessions: int) -> float:
    async def build() -> int:
        async with open_supervisor(MemoryStore(), FakeExecution(), lease=LEASE) as supervisor:
            gc.collect()
            start = tracemalloc.get_traced_memory()[0]
            for number in range(sessions):
                await supervisor.open(Key(identity="idle", instance=str(number)), "r")
            gc.collect()
            used = tracemalloc.get_traced_memory()[0] - start
        return used

    return _measure(build, sessions)


def skeleton_bytes(sessions: int) -> float:
    async def build() -> int:
        async with trio.open_nursery() as nursery:
            skeleton = Skeleton(nursery)
            gc.collect()
            start = tracemalloc.get_traced_memory()[0]
            for number in range(sessions):
                await skeleton.open(("idle", str(number)))
            gc.collect()
            used = tracemalloc.get_traced_memory()[0] - start
            nursery.cancel_scope.cancel()
        return used

    return _measure(build, sessions)


def _measure(build: Callable[[], Awaitable[int]], sessions: int) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        used = trio.run(build)
    finally:
        tracemalloc.stop()
    return used / sessions


def run(quick: bool, rounds: int) -> list[Result]:
    sessions = 1000 if quick else 10_000
    ours = [ours_bytes(sessions) for _ in range(rounds)]
    skeleton = [skeleton_bytes(sessions) for _ in range(rounds)]
    return [
        Result(
            name="memory.idle_session",
            unit="bytes/session",
            better="lower",
            target=0.5,
            ours=ours,
            baseline=[float(BASELINE)] * rounds,
            note=(
                f"tracemalloc over {sessions:,} idle open sessions; "
                "the baseline is the fixed 12,000-byte budget"
            ),
            extra={"skeleton_measured": sorted(skeleton)[len(skeleton) // 2]},
        )
    ]
