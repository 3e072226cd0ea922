"""Not a plugin: the runner test_containment.py starts in a process of its own, and kills.

python runner.py STATE CONTAINMENT hold NONCE
    load every escape plugin (each told the nonce) with a 1-s lease, print
    "child NAME PID" for each once it says its leftovers are in place, then "holding",
    and renew every lease until killed; with CONTAINMENT ending in "+fork", the children
    come from the fork server, whose pid is printed first as "child server PID"
python runner.py STATE CONTAINMENT recover
    start on the same store (which recovers what the killed runner left) and print each
    recovered session as "recovered NAME TERMINATION", then "free uids UID..." (those
    of the recovered children that are free again)
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

from trio_supervisor import (
    Handle,
    Key,
    Limits,
    Load,
    LoadedRecord,
    SqliteStore,
    StoppedRecord,
    SubprocessExecution,
    Supervisor,
    open_supervisor,
)

PLUGINS = Path(__file__).parent
LEASE = 1.0
NAMES = ("daemon", "regroup", "storm", "vanish", "hydra")


async def renew(supervisor: Supervisor, handles: list[Handle]) -> None:
    while True:
        for handle in handles:
            await supervisor.renew(handle)
        await trio.sleep(LEASE / 4)


async def hold(state: Path, containment: str, nonce: str) -> None:
    containment, fork, _ = containment.partition("+fork")
    async with (
        SqliteStore(state / "state.db") as store,
        SubprocessExecution(
            state,
            entry_paths=[PLUGINS],
            containment=containment,  # type: ignore[arg-type]
            fork_server=bool(fork),
        ) as execution,
        open_supervisor(store, execution, lease=LEASE, grace=1.0) as supervisor,
        trio.open_nursery() as nursery,
    ):
        if fork:
            print(f"child server {execution.fork_server_pid}", flush=True)
        handles = []
        for name in NAMES:
            # A tree limit gives each child a cgroup, which recovery must free as well.
            record = await supervisor.open(
                Key(identity="escape", instance=name), "hold", limits=Limits(processes=1000)
            )
            handles.append(record.handle)
            nursery.start_soon(renew, supervisor, [record.handle])
            load = Load(specifier=f"escapes:{name}", config={"nonce": nonce})
            await supervisor.load(record.handle, load)
        for handle in handles:
            while "ready" not in execution.logs(handle):  # noqa: ASYNC110  # a file
                await trio.sleep(0.02)
            loaded = await supervisor.status(handle)
            assert isinstance(loaded, LoadedRecord)
            print(f"child {handle.key.instance} {loaded.child.pid}", flush=True)
        print("holding", flush=True)
        await trio.sleep_forever()


async def recover(state: Path, containment: str) -> None:
    async with (
        SqliteStore(state / "state.db") as store,
        SubprocessExecution(
            state,
            entry_paths=[PLUGINS],
            containment=containment,  # type: ignore[arg-type]
        ) as execution,
        open_supervisor(store, execution, lease=LEASE) as _,
    ):
        uids = []
        for record in await store.list():
            assert isinstance(record, StoppedRecord)
            instance, termination = record.handle.key.instance, record.termination
            print(f"recovered {instance} {termination.describe()}", flush=True)
            if isinstance(record.previous, LoadedRecord) and record.previous.child.uid:
                uids.append(record.previous.child.uid)
        free = [str(uid) for uid in sorted(uids) if execution.isolated.is_free(uid)]
        print("free uids", *free, flush=True)


if __name__ == "__main__":
    state, containment, what = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if what == "hold":
        trio.run(hold, state, containment, sys.argv[4])
    else:
        trio.run(recover, state, containment)
