"""child.cycle and terminate.cooperative: real processes.

Baseline: raw Trio spawning ``sys.executable -I`` with the same minimal code, waiting
for its ready line, sending SIGTERM, and reaping it.

``child.cycle`` runs the execution as the example runner does, with ``standby=True``
(the next load's interpreter is started ahead); ``child.cycle.cold`` is the default,
which starts each child's interpreter during its load.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from trio_supervisor import Key, Load, MemoryStore, SubprocessExecution, open_supervisor

from .measure import Result, compare

PLUGINS = Path(__file__).parent / "plugins"
MINIMAL = (PLUGINS / "minimal.py").read_text() + "\nmain(None)\n"


async def _raw_cycle() -> tuple[float, float]:
    """One raw cycle; returns (the whole cycle, SIGTERM to reaped) in seconds."""
    started = time.perf_counter()
    process = await trio.lowlevel.open_process(
        [sys.executable, "-I", "-c", MINIMAL], stdout=subprocess.PIPE, start_new_session=True
    )
    assert process.stdout is not None
    buffer = b""
    while b"ready\n" not in buffer:
        chunk = await process.stdout.receive_some(1024)
        assert chunk, "the child exited before it was ready"
        buffer += chunk
    stopping = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    await process.wait()
    await process.stdout.aclose()
    ended = time.perf_counter()
    return ended - started, ended - stopping


def raw(cycles: int, which: int) -> float:
    async def main() -> float:
        times = [(await _raw_cycle())[which] for _ in range(cycles)]
        return sorted(times)[len(times) // 2]

    return trio.run(main)


def ours(cycles: int, which: int, *, standby: bool = False) -> float:
    async def main(directory: str) -> float:
        key = Key(identity="bench", instance="child")
        times = []
        async with (
            SubprocessExecution(directory, entry_paths=[PLUGINS], standby=standby) as execution,
            open_supervisor(MemoryStore(), execution, lease=60.0, grace=5.0) as supervisor,
        ):
            for cycle in range(cycles):
                started = time.perf_counter()
                record = await supervisor.open(
                    key, f"cycle-{cycle}", expected_generation=cycle or None
                )
                await supervisor.load(record.handle, Load(specifier="minimal:main"))
                stopping = time.perf_counter()
                await supervisor.dispose(record.handle)
                ended = time.perf_counter()
                times.append((ended - started, ended - stopping)[which])
        return sorted(times)[len(times) // 2]

    with tempfile.TemporaryDirectory() as directory:
        return trio.run(main, directory)


def run(quick: bool, rounds: int) -> list[Result]:
    cycles = 3 if quick else 10
    return [
        compare(
            "child.cycle",
            ours=lambda: ours(cycles, 0, standby=True),
            baseline=lambda: raw(cycles, 0),
            unit="s/cycle",
            better="lower",
            target=1.15,
            rounds=rounds,
            note="open+load+dispose of a minimal plugin (standby=True, as the runner runs) "
            "vs spawn, ready line, SIGTERM, reaped",
        ),
        compare(
            "child.cycle.cold",
            ours=lambda: ours(cycles, 0),
            baseline=lambda: raw(cycles, 0),
            unit="s/cycle",
            better="lower",
            target=1.15,
            rounds=rounds,
            note="as child.cycle, with the default standby=False: the interpreter starts "
            "during the load",
        ),
        compare(
            "terminate.cooperative",
            ours=lambda: ours(cycles, 1),
            baseline=lambda: raw(cycles, 1),
            unit="s",
            better="lower",
            target=1.2,
            rounds=rounds,
            note="dispose of a running child that exits on SIGTERM vs raw SIGTERM + wait",
        ),
    ]
