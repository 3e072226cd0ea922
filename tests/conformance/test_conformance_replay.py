"""The conformance machine replays an example exactly, even over a store with a thread.

Hypothesis requires that the same choices give the same run: it checks that rules'
preconditions come out the same whenever it replays a prefix, and reports
``FlakyStrategyDefinition`` otherwise (the deep profile met this once, over SQLite).
Hypothesis seeds Trio's scheduler, but a store answering from a real thread changes
how many scheduling steps run before its answer arrives, and so every interleaving
after it. Here a store answers each save from a thread after a random real delay, and
the same scenario runs several times with the scheduler seeded alike each time.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence

import trio
import trio._core._run

from trio_supervisor import Key, Load, MemoryStore, Retention, SessionRecord
from trio_supervisor.abc import Store
from trio_supervisor.testing import FakeHarness
from trio_supervisor.testing.conformance import KEYS
from trio_supervisor.testing.world import World

RETENTION = Retention(stopped_per_key=2, stopped_total=5)
JITTER = random.SystemRandom()  # real time, on purpose: not seeded by anything


class ThreadedStore:
    """A MemoryStore whose saves are answered from a worker thread, a little late."""

    def __init__(self, retention: Retention) -> None:
        self._inner = MemoryStore(retention=retention)

    @property
    def retention(self) -> Retention:
        return self._inner.retention

    async def save(self, record: SessionRecord) -> None:
        await trio.to_thread.run_sync(time.sleep, JITTER.uniform(0, 0.002))
        await self._inner.save(record)

    async def list(self) -> Sequence[SessionRecord]:
        return await self._inner.list()

    async def high_water(self) -> Mapping[Key, int]:
        return await self._inner.high_water()


def _same_store(previous: Store | None, retention: Retention) -> Store:
    return previous or ThreadedStore(retention)


def _scenario(store_answers_outside: bool) -> tuple[str, ...]:
    """Concurrent opens, loads, a dispose, a supersede and twin opens; the log of it."""
    trio._core._run._r.seed(0)  # what Hypothesis does before each example
    world = World(_same_store, FakeHarness(), RETENTION, store_answers_outside)
    try:
        world.call(world.enter)
        opened = world.call(world.burst, [("open", lambda s, k=k: s.open(k, "r")) for k in KEYS])
        handles = [operation.value.handle for operation in opened]
        world.call(
            world.burst,
            [("load", lambda s, h=h: s.load(h, Load(specifier="plugin:main"))) for h in handles],
        )
        world.call(
            world.burst,
            [
                ("dispose", lambda s: s.dispose(handles[0])),
                ("open", lambda s: s.open(KEYS[1], "r2", expected_generation=1)),
                ("open", lambda s: s.open(KEYS[2], "r3", expected_generation=1)),
                ("open", lambda s: s.open(KEYS[2], "r4", expected_generation=1)),
            ],
        )
        return tuple(
            f"{entry.kind} {entry.what} {entry.session[0].instance}/{entry.session[1]}"
            for entry in world.log.entries
        )
    finally:
        world.close()


def test_one_store_call_at_a_time_makes_a_threaded_store_replay_exactly() -> None:
    logs = {_scenario(store_answers_outside=True) for _ in range(6)}
    assert len(logs) == 1


def test_without_it_the_thread_s_timing_changes_the_run() -> None:
    # The scenario is sensitive: this is what the machine guards against (on this
    # machine, 10 runs gave 10 different logs).
    logs = {_scenario(store_answers_outside=False) for _ in range(6)}
    assert len(logs) > 1
