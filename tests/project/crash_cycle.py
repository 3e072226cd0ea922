"""A runner that dies on purpose: the helper of the crash-point sweep (test_runner.py).

python tests/project/crash_cycle.py STATE crash N before|after
    one open-load-dispose cycle; SIGKILL itself just before or after the Nth save
python tests/project/crash_cycle.py STATE recover
    start on the same store (recovery), open and dispose one more generation, and
    print every record as JSON
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import trio

from trio_supervisor import (
    Handle,
    Key,
    Limits,
    Load,
    SessionRecord,
    SqliteStore,
    SubprocessExecution,
    Unit,
    codec,
    open_supervisor,
)
from trio_supervisor.retention import Retention

PLUGINS = Path(__file__).parents[2] / "examples" / "plugins"
KEY = Key(identity="sweep", instance="a")


class CrashingStore(SqliteStore):
    """Kills its own process just before or after the Nth save."""

    def __init__(self, path: Path, at: int, when: str) -> None:
        super().__init__(path, retention=Retention(stopped_per_key=100))
        self.at = at
        self.when = when
        self.saves = 0

    async def save(self, record: SessionRecord) -> None:
        self.saves += 1
        if self.saves == self.at and self.when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        await super().save(record)
        if self.saves == self.at and self.when == "after":
            os.kill(os.getpid(), signal.SIGKILL)


class Reporting(SubprocessExecution):
    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> Unit:
        unit = await super().spawn(handle, load, limits)
        print(f"child {unit.identity.pid}", flush=True)
        return unit


async def crash(state: Path, at: int, when: str) -> None:
    async with (
        CrashingStore(state / "state.db", at, when) as store,
        Reporting(state, entry_paths=[PLUGINS]) as execution,
        open_supervisor(store, execution, lease=2.0, grace=1.0) as supervisor,
    ):
        high = await supervisor.high_water(KEY)
        record = await supervisor.open(KEY, "cycle", expected_generation=high)
        await supervisor.load(record.handle, Load(specifier="heartbeat:main"))
        await supervisor.dispose(record.handle)


async def recover(state: Path) -> None:
    store = SqliteStore(state / "state.db", retention=Retention(stopped_per_key=100))
    async with store, SubprocessExecution(state, entry_paths=[PLUGINS]) as execution:
        recovered = [codec.unstructure(record) for record in await store.list()]
        async with open_supervisor(store, execution, lease=2.0, grace=1.0) as supervisor:
            after_recovery = [codec.unstructure(record) for record in await store.list()]
            high = await supervisor.high_water(KEY)
            record = await supervisor.open(KEY, "after", expected_generation=high)
            await supervisor.dispose(record.handle)
        print(
            json.dumps(
                {
                    "before": recovered,
                    "after_recovery": after_recovery,
                    "high_water": high,
                    "next": record.handle.generation,
                }
            )
        )


if __name__ == "__main__":
    state = Path(sys.argv[1])
    if sys.argv[2] == "crash":
        trio.run(crash, state, int(sys.argv[3]), sys.argv[4])
    else:
        trio.run(recover, state)
