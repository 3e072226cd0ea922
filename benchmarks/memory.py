"""memory.idle_session: bytes per idle open session, by tracemalloc over many sessions."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Awaitable, Callable

import trio

from trio_supervisor import Key, MemoryStore, open_supervisor
from trio_supervisor.testing import FakeExecution

from .measure import Result, compare
from .skeleton import LEASE, Skeleton


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
    return [
        compare(
            "memory.idle_session",
            ours=lambda: ours_bytes(sessions),
            baseline=lambda: skeleton_bytes(sessions),
            baseline_name="raw Trio skeleton, measured in this run",
            unit="bytes/session",
            better="lower",
            target=0.4,
            rounds=rounds,
            note=f"tracemalloc over {sessions:,} idle open sessions, interleaved rounds",
        )
    ]
