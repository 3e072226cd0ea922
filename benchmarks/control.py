"""control.*: open + renew + dispose cycles with no child, on the memory store."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from trio_supervisor import Key, MemoryStore, Supervisor, open_supervisor
from trio_supervisor.testing import FakeExecution

from .measure import Result, compare
from .skeleton import LEASE, Lean, Skeleton

_R = TypeVar("_R", Skeleton, Lean)


async def _our_cycles(supervisor: Supervisor, client: int, cycles: int) -> None:
    key = Key(identity="bench", instance=str(client))
    generation = await supervisor.high_water(key)
    for cycle in range(cycles):
        record = await supervisor.open(key, f"{client}-{cycle}", expected_generation=generation)
        handle = record.handle
        generation = handle.generation
        await supervisor.renew(handle)
        await supervisor.dispose(handle)


async def _skeleton_cycles(skeleton: Skeleton, client: int, cycles: int) -> None:
    key = ("bench", str(client))
    for _ in range(cycles):
        token = await skeleton.open(key)
        await skeleton.renew(token)
        await skeleton.dispose(token)


async def _lean_cycles(lean: Lean, client: int, cycles: int) -> None:
    key = ("bench", str(client))
    generation: int | None = lean.generations.get(key)
    for _ in range(cycles):
        token, generation = await lean.open(key, generation)
        await lean.renew(token)
        await lean.dispose(token)


def ours_rate(clients: int, cycles: int, idle: int = 0) -> float:
    """Cycles per second of ``clients`` concurrent clients, with ``idle`` idle sessions."""

    async def main() -> float:
        async with open_supervisor(MemoryStore(), FakeExecution(), lease=LEASE) as supervisor:
            for number in range(idle):
                await supervisor.open(Key(identity="idle", instance=str(number)), "idle")
            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for client in range(clients):
                    nursery.start_soon(_our_cycles, supervisor, client, cycles)
            elapsed = time.perf_counter() - started
        return clients * cycles / elapsed

    return trio.run(main)


def _raw_rate(
    make: Callable[[trio.Nursery], _R],
    cycles_of: Callable[[_R, int, int], Awaitable[None]],
    clients: int,
    cycles: int,
) -> float:
    """Cycles per second of ``clients`` clients of a raw baseline made by ``make``."""

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            baseline = make(nursery)
            started = time.perf_counter()
            async with trio.open_nursery() as clients_nursery:
                for client in range(clients):
                    clients_nursery.start_soon(cycles_of, baseline, client, cycles)
            elapsed = time.perf_counter() - started
            nursery.cancel_scope.cancel()
        return clients * cycles / elapsed

    return trio.run(main)


def skeleton_rate(clients: int, cycles: int) -> float:
    return _raw_rate(Skeleton, _skeleton_cycles, clients, cycles)


def lean_rate(clients: int, cycles: int) -> float:
    return _raw_rate(Lean, _lean_cycles, clients, cycles)


def run(quick: bool, rounds: int) -> list[Result]:
    sequential = 200 if quick else 3000
    per_client = 5 if quick else 40
    idle = 1000 if quick else 100_000
    results = [
        compare(
            "control.sequential",
            ours=lambda: ours_rate(1, sequential),
            baseline=lambda: lean_rate(1, sequential),
            baseline_name="lean raw Trio (skeleton.Lean)",
            unit="cycles/s",
            better="higher",
            target=0.85,
            rounds=rounds,
        ),
        compare(
            "control.sequential.skeleton",
            ours=lambda: ours_rate(1, sequential),
            baseline=lambda: skeleton_rate(1, sequential),
            baseline_name="raw Trio skeleton (skeleton.Skeleton)",
            unit="cycles/s",
            better="higher",
            target=1.0,
            rounds=rounds,
            informational=True,
        ),
        compare(
            "control.concurrent",
            ours=lambda: ours_rate(100, per_client),
            baseline=lambda: lean_rate(100, per_client),
            baseline_name="lean raw Trio (skeleton.Lean)",
            unit="cycles/s",
            better="higher",
            target=0.85,
            rounds=rounds,
        ),
        compare(
            "control.concurrent.skeleton",
            ours=lambda: ours_rate(100, per_client),
            baseline=lambda: skeleton_rate(100, per_client),
            baseline_name="raw Trio skeleton (skeleton.Skeleton)",
            unit="cycles/s",
            better="higher",
            target=1.0,
            rounds=rounds,
            informational=True,
        ),
    ]
    # Cost per cycle (seconds), with many idle sessions alive and with none.
    results.append(
        compare(
            "control.scaling",
            ours=lambda: 1 / ours_rate(1, sequential, idle=idle),
            baseline=lambda: 1 / ours_rate(1, sequential),
            baseline_name="ours with no idle sessions",
            unit="s/cycle",
            better="lower",
            target=1.2,
            rounds=rounds,
            note=f"{idle:,} idle open sessions vs none",
        )
    )
    return results
