"""Plugins that take all they can of one resource, for the tree limits' tests.

Each says in the log when what the test measures is in place; none relies on time.

* ``bomb``: a fork bomb: every process forks as fast as it can, for ever; the plugin
  says ``held after N refusals`` once fork has been refused that many times.
* ``memory``: four children that each fill 100 MiB and wait; the plugin waits for the
  first to end, lets the others go, says how each ended, and exits 0.
* ``spinner``: says ``spinning``, then uses all the CPU it is given.
* ``gigabyte``: fills 1 GiB in one process, 64 MiB at a time, saying how much it holds.
"""

from __future__ import annotations

import os
import time
from typing import Any, NoReturn

REFUSALS = 50
HOGS = 4
HOG_BYTES = 100 * 1024 * 1024


def bomb(context: Any) -> NoReturn:
    refused = 0
    said = False
    while True:
        try:
            os.fork()  # parent and child alike go on forking
        except BlockingIOError:  # EAGAIN: pids.max
            refused += 1
            if not said and refused >= REFUSALS:
                print(f"held after {refused} refusals", flush=True)
                said = True
            time.sleep(0.01)  # the bomb stays held; this only spares the CPU


def memory(context: Any) -> int:
    go, let_go = os.pipe()
    children = []
    for number in range(HOGS):
        pid = os.fork()
        if pid == 0:
            os.close(let_go)
            hoard = b"\x01" * HOG_BYTES  # written, so every page is resident
            print(f"hog {number} holding {len(hoard) >> 20} MiB", flush=True)
            os.read(go, 1)  # until the plugin lets it go (EOF)
            os._exit(0)
        children.append(pid)
    os.close(go)
    ended = {}
    pid, status = os.wait()  # 400 MiB under 256 MiB: one of them cannot last
    ended[pid] = status
    os.close(let_go)
    for pid in children:
        if pid not in ended:
            ended[pid] = os.waitpid(pid, 0)[1]
    for number, pid in enumerate(children):
        status = ended[pid]
        if os.WIFSIGNALED(status):
            print(f"hog {number} signal {os.WTERMSIG(status)}", flush=True)
        else:
            print(f"hog {number} exit {os.WEXITSTATUS(status)}", flush=True)
    return 0


def spinner(context: Any) -> NoReturn:
    print("spinning", flush=True)
    while True:
        pass


def gigabyte(context: Any) -> int:
    """Fills 1 GiB, 64 MiB at a time, saying how much it holds: under a smaller memory
    ceiling it is killed on the way (its tree's OOM kill)."""
    hoard = []
    for held in range(64, 1025, 64):
        hoard.append(b"\x01" * (64 << 20))  # written, so every page is resident
        print(f"holding {held} MiB", flush=True)
    return 0
