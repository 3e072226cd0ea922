"""A Trio app embedding a supervisor: in-process plugins on a SQLite store.

It opens four sessions, loads a plugin into each, renews one, lets one expire, watches
one finish by itself and disposes the rest, then prints what happened to every session.
Run it again: the store remembers each key's high-water generation, so the new
sessions continue from there.

    python examples/embedded.py [--state DIR] [--lease SECONDS]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import trio
from reporting import Journal, describe, run_or_explain_lock, table

from trio_supervisor import (
    Handle,
    InProcessExecution,
    Key,
    Load,
    PluginContext,
    open_supervisor,
)
from trio_supervisor.retention import Retention

logger = logging.getLogger("example")

# -- the plugins: ordinary async functions ------------------------------------------------


async def heartbeat(context: PluginContext) -> None:
    """Beats until asked to stop."""
    beats = 0
    while True:
        await trio.sleep(0.25)
        beats += 1
        logger.debug("%s/%s beats (%d)", context.key.identity, context.key.instance, beats)


async def careful(context: PluginContext) -> int:
    """Takes a moment to clean up when interrupted, then reports success."""
    try:
        await trio.sleep_forever()
    except trio.Cancelled:
        with trio.CancelScope(shield=True):
            await trio.sleep(0.1)  # flush what it was doing
        return 0


async def stubborn(context: PluginContext) -> None:
    """Keeps going for a second after the interrupt: longer than the grace, so it is killed."""
    try:
        await trio.sleep_forever()
    except trio.Cancelled:
        with trio.CancelScope(shield=True):
            await trio.sleep(1.0)
        raise


async def batch(context: PluginContext) -> int:
    """Does its work and exits by itself, well within its lease."""
    await trio.sleep(float(str(context.config.get("seconds", 0.25))))
    return 0


PLUGINS = {"heartbeat": heartbeat, "careful": careful, "stubborn": stubborn, "batch": batch}


async def main(state: Path, lease: float) -> None:
    keys = {
        name: Key(identity="example", instance=name)
        for name in ("renewed", "expiring", "finishing", "stubborn")
    }
    journal = Journal(state / "embedded.db", retention=Retention(stopped_per_key=1))
    async with (
        journal,
        InProcessExecution(PLUGINS) as execution,
        open_supervisor(
            journal, execution, lease=lease, grace=0.5, confirmation_timeout=2.0
        ) as supervisor,
    ):
        handles: dict[str, Handle] = {}
        for name, key in keys.items():
            high = await supervisor.high_water(key)
            if high:
                print(f"{name}: continuing from the stored high-water generation {high}")
            record = await supervisor.open(
                key, f"{name}-{(high or 0) + 1}", expected_generation=high
            )
            handles[name] = record.handle
        plugins = {
            "renewed": "heartbeat",
            "expiring": "careful",
            "finishing": "batch",
            "stubborn": "stubborn",
        }
        for name, plugin in plugins.items():
            code = await supervisor.load(
                handles[name], Load(specifier=plugin, config={"seconds": lease / 4})
            )
            print(f"{name}: loaded {code.specifier} from {code.origin}")

        # Keep one alive past its first lease; let "expiring" run out. Renewed at once
        # too: the opens and loads took part of the first lease (durable saves).
        for _ in range(3):
            await supervisor.renew(handles["renewed"])
            await supervisor.renew(handles["stubborn"])
            await trio.sleep(lease * 0.6)
        for name in ("renewed", "stubborn"):
            await supervisor.dispose(handles[name])
        records = [await supervisor.status(handle) for handle in handles.values()]

    print()
    print(
        table(
            [["session", "gen", "phases", "reason", "termination"]]
            + [describe(r, journal.paths) for r in records]
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--state", type=Path, default=Path("example-state"), help="where the SQLite store lives"
    )
    parser.add_argument("--lease", type=float, default=1.0, help="the sessions' lease, in seconds")
    arguments = parser.parse_args()
    arguments.state.mkdir(parents=True, exist_ok=True)
    run_or_explain_lock(lambda: trio.run(main, arguments.state, arguments.lease), arguments.state)
