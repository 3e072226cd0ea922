"""A runner: real child processes on a SQLite store, and what happened to each.

It opens a session per example plugin (examples/plugins/), loads the plugin into a
child process, renews some leases, lets one expire, waits for the crasher and the
hungry one to end by themselves, disposes the rest, and prints each session's path:
phases, generation, child pid, termination and the last line of its log.

    python examples/runner.py [--state DIR] [--lease SECONDS] [--hold]

Its state directory is ``./example-runner-state`` unless ``--state`` says otherwise:
not ``./runner-state``, which ``trio-supervisor serve`` uses by default, so that the
example and a runner serving from the same folder never contend for one store.

With ``--hold`` it keeps its children running and renewed until it is killed. Kill it
with ``kill -9`` and start it again on the same state directory: the first thing it
prints is what recovery found and did. Its children never outlive it by more than a
moment: when it dies, each child's bootstrap sees its control socket close and kills
its own process group.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

import trio
from reporting import Journal, describe, run_or_explain_lock, table

from trio_supervisor import (
    Handle,
    Key,
    Limits,
    Load,
    LoadedRecord,
    LoadingRecord,
    SessionRecord,
    StoppedRecord,
    StoppingRecord,
    SubprocessExecution,
    Supervisor,
    SupervisorError,
    open_supervisor,
)
from trio_supervisor.retention import Retention

PLUGINS = Path(__file__).parent / "plugins"
COMMANDS = {"sleeper": ["sleep", "600"]}

# name: (specifier, config, limits, renewed)
SESSIONS: dict[str, tuple[str, dict[str, object], Limits, bool]] = {
    "heartbeat": ("heartbeat:main", {"period": 0.3}, Limits(), True),
    "expiring": ("heartbeat:main", {"period": 0.3}, Limits(), False),
    "stubborn": ("stubborn:main", {}, Limits(), True),
    "crasher": ("crasher:main", {"after": 0.6}, Limits(), True),
    "spawner": ("spawner:main", {"children": 2}, Limits(), True),
    "hungry": ("hungry:main", {}, Limits(memory_bytes=256 * 1024 * 1024), True),
    "sleeper": ("sleeper", {}, Limits(output_bytes=10_000), True),
}


def child_pid(record: SessionRecord) -> str:
    active = record.previous if isinstance(record, StoppingRecord | StoppedRecord) else record
    if isinstance(active, LoadingRecord | LoadedRecord) and active.child is not None:
        return str(active.child.pid)
    return "-"


async def report_recovery(supervisor: Supervisor, left: Sequence[SessionRecord]) -> None:
    if not left:
        return
    print(f"recovered {len(left)} sessions a previous run left behind:")
    rows = [["session", "gen", "was", "child pid", "recovery"]]
    for record in left:
        now = await supervisor.status(record.handle)
        outcome = now.termination.describe() if isinstance(now, StoppedRecord) else now.phase.value
        key = record.handle.key
        rows.append(
            [
                f"{key.identity}/{key.instance}",
                str(record.handle.generation),
                record.phase.value,
                child_pid(record),
                outcome,
            ]
        )
    print(table(rows))
    print()


async def main(state: Path, lease: float, hold: bool) -> None:
    store = Journal(state / "runner.db", retention=Retention(stopped_per_key=1))
    async with (
        store,
        SubprocessExecution(
            state, entry_paths=[PLUGINS], commands=COMMANDS, standby=True
        ) as execution,
    ):
        left = [record for record in await store.list() if not isinstance(record, StoppedRecord)]
        async with open_supervisor(
            store, execution, lease=lease, grace=1.0, confirmation_timeout=5.0
        ) as supervisor:
            print(f"state: {state} (the store runner.db, the children's logs/)")
            await report_recovery(supervisor, left)
            handles: dict[str, Handle] = {}
            continued: list[str] = []
            for name, (specifier, config, limits, _) in SESSIONS.items():
                key = Key(identity="runner", instance=name)
                high = await supervisor.high_water(key)
                if high is not None:
                    continued.append(f"{name} {high}->{high + 1}")
                record = await supervisor.open(
                    key, f"{name}-{(high or 0) + 1}", expected_generation=high, limits=limits
                )
                handles[name] = record.handle
                await supervisor.load(record.handle, Load(specifier=specifier, config=config))
            if continued:
                print("generations continue from the stored high-water:", ", ".join(continued))
            else:
                print("a fresh store: every key starts at generation 1")
            if hold:
                holding = f"runner {os.getpid()} holds {len(handles)} children"
                print(f"{holding}; kill -9 it, then run it again", flush=True)
                while True:
                    await trio.sleep(lease / 3)
                    for name, handle in handles.items():
                        if SESSIONS[name][3]:
                            # A session that ended by itself stays ended.
                            with trio.move_on_after(lease), contextlib.suppress(SupervisorError):
                                await supervisor.renew(handle)
            # Renew the renewed ones past the expiring one's lease; the crasher and the
            # hungry one end by themselves meanwhile.
            for _ in range(6):
                await trio.sleep(lease / 3)
                for name, handle in handles.items():
                    record = await supervisor.status(handle)
                    if SESSIONS[name][3] and not isinstance(record, StoppingRecord | StoppedRecord):
                        await supervisor.renew(handle)
            for handle in handles.values():
                await supervisor.dispose(handle)
            records = {name: await supervisor.status(handle) for name, handle in handles.items()}

    rows = [["session", "gen", "phases", "reason", "termination", "child pid", "log tail"]]
    for name, record in records.items():
        tail = execution.logs(handles[name], tail=300).strip().splitlines()
        rows.append(
            [*describe(record, store.paths), child_pid(record), tail[-1][:48] if tail else ""]
        )
    print(table(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--state",
        type=Path,
        default=Path("example-runner-state"),
        help="where the store and logs live",
    )
    parser.add_argument("--lease", type=float, default=2.0, help="the sessions' lease, in seconds")
    parser.add_argument(
        "--hold", action="store_true", help="keep the children running until killed"
    )
    arguments = parser.parse_args()
    arguments.state.mkdir(parents=True, exist_ok=True)
    state = arguments.state.absolute()
    run_or_explain_lock(lambda: trio.run(main, state, arguments.lease, arguments.hold), state)
