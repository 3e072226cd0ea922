"""Not a plugin: a runner test_claims.py starts in a process of its own, and kills.

python holder.py STATE FIRST-LAST COUNT
    load COUNT children of ``attacks:identity``, each with a uid of FIRST-LAST and a
    tree limit (so a cgroup of its own), print "child PID UID" for each once it said who
    it is, then "holding", and wait until killed
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

from trio_supervisor import (
    Key,
    Limits,
    Load,
    LoadedRecord,
    MemoryStore,
    SubprocessExecution,
    open_supervisor,
)

PLUGINS = Path(__file__).parent


async def hold(state: Path, users: range, count: int) -> None:
    async with (
        SubprocessExecution(state, entry_paths=[PLUGINS], isolation_users=users) as execution,
        open_supervisor(MemoryStore(), execution, lease=600.0) as supervisor,
    ):
        for number in range(count):
            key = Key(identity="holder", instance=str(number))
            record = await supervisor.open(key, "hold", limits=Limits(processes=100))
            await supervisor.load(record.handle, Load(specifier="attacks:identity"))
            while "IDENTITY" not in execution.logs(record.handle):  # noqa: ASYNC110  # a file
                await trio.sleep(0.01)
            loaded = await supervisor.status(record.handle)
            assert isinstance(loaded, LoadedRecord)
            print(f"child {loaded.child.pid} {loaded.child.uid}", flush=True)
        print("holding", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    first, _, last = sys.argv[2].partition("-")
    trio.run(hold, Path(sys.argv[1]), range(int(first), int(last) + 1), int(sys.argv[3]))
