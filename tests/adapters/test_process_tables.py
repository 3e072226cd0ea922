"""The two walks of ``/proc`` agree: the child's (``child/_bootstrap.py``, which a sweeping
T freezes and kills its tree by) and the runner's (``trees/_trees.py``, which a kill and
recovery use).

The bootstrap runs as a script that may import nothing of the package (it would pull in
Trio and attrs, and cost every load its start-up), so it keeps a reading of its own;
this holds the two to the same answers on a real process tree: a root with a zombie
child and a child of its own that has a child.
"""

from __future__ import annotations

import sys

from trio_supervisor.executions.child import _bootstrap
from trio_supervisor.executions.trees import _trees

from ..support.processes import launched

# The root forks a child that exits at once (unreaped: a zombie, which the root waits
# for without reaping it) and a middle child, which forks a leaf; each waits on a pipe
# the root holds until the root is told to end (SIGTERM), then every one is reaped.
TREE = """
import os, signal, sys

hold, held = os.pipe()
said, say = os.pipe()
zombie = os.fork()
if zombie == 0:
    os._exit(0)
middle = os.fork()
if middle == 0:
    os.close(held)
    leaf = os.fork()
    if leaf == 0:
        os.read(hold, 1)  # until the root closes its end
        os._exit(0)
    os.write(say, str(leaf).encode())
    os.read(hold, 1)
    os.waitpid(leaf, 0)
    os._exit(0)
os.close(hold)
leaf = int(os.read(said, 64))
os.waitid(os.P_PID, zombie, os.WEXITED | os.WNOWAIT)  # exited, left unreaped


def end(number, frame):
    os.close(held)
    os.waitpid(middle, 0)
    os.waitpid(zombie, 0)
    sys.exit(0)


signal.signal(signal.SIGTERM, end)
print("ready", zombie, middle, leaf, flush=True)
while True:
    signal.pause()
"""


def test_the_bootstrap_and_the_runner_read_the_same_tree() -> None:
    with launched([sys.executable, "-I", "-c", TREE], ready=lambda line: "ready" in line) as root:
        zombie, middle, leaf = map(int, root.lines[-1].split()[1:])
        tree = root.process.pid
        # Each reads the whole table its own way; the tree holds still while both do.
        child_side = _bootstrap.process_table()
        runner_side = _trees.process_table()

        # What a sweep freezes and kills: every live descendant, a zombie's left out.
        live = _bootstrap.live_descendants(tree, child_side)
        running = [
            pid for pid in _trees.descendants([tree], runner_side) if runner_side[pid].running
        ]
        assert sorted(live) == sorted(running) == sorted([middle, leaf])
        # The runner's walk counts the zombie too, parents before their children.
        found = _trees.descendants([tree], runner_side)
        assert sorted(found) == sorted([zombie, middle, leaf])
        assert found.index(middle) < found.index(leaf)
        # Each process's parent, and what its state letter means to either walk (a
        # zombie, stopped, or neither: the letter itself may change between the two
        # reads, running or asleep), read by both.
        for pid in (tree, zombie, middle, leaf):
            ppid, state = child_side[pid]
            stat = runner_side[pid]
            assert ppid == stat.ppid, pid
            assert _meaning(state.decode()) == _meaning(stat.state), pid
        assert child_side[zombie][1] == b"Z"
        assert (child_side[middle][0], child_side[leaf][0]) == (tree, middle)
        assert root.stop() == 0


def _meaning(state: str) -> str:
    """What a state letter tells the walks: gone (a zombie), stopped, or running."""
    return "gone" if state in "ZX" else "stopped" if state in "Tt" else "running"
