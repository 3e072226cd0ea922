"""Plugins that each try to leave processes behind, each by a different escape.

Every leftover is ``sleep 3600.<nonce>`` (or, for the hydra, a Python whose command
line carries ``3600.<nonce>``), the nonce the test passed in the config: the marker in
/proc/PID/cmdline the test finds its leftovers by, in whatever PID namespace they are.
Each says ``left NAMESPACE PID START`` in the log before it becomes the sleep: its PID
namespace, its pid there and its start time, which is all it can know of itself (an
isolated child's ``/proc`` is its namespace's), and all the test needs to find it (a
gone namespace's number is soon another's, and its pids too). Then the plugin says
``ready`` and returns (config ``then: exit``) or runs until interrupted.

* ``daemon``: a daemon the classic way: fork, setsid, fork again (the sleep is an orphan);
* ``regroup``: a child that moves to a process group of its own (``setpgid(0, 0)``);
* ``storm``: 60 children, all in the plugin's process group, deaf to SIGTERM;
* ``vanish``: a setsid daemon that also clears its environment;
* ``hydra``: a descendant that ignores SIGTERM and SIGHUP, leaves a sleep, and keeps
  forking.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, NoReturn

SLEEP = shutil.which("sleep") or "/bin/sleep"
STORM = 60


def daemon(context: Any) -> int:
    _leave(context.config["nonce"], setsid=True, double=True)
    return _carry_on(context)


def regroup(context: Any) -> int:
    _leave(context.config["nonce"], setpgid=True)
    return _carry_on(context)


def storm(context: Any) -> int:
    for _ in range(STORM):
        _leave(context.config["nonce"], ignore_sigterm=True)
    return _carry_on(context)


def vanish(context: Any) -> int:
    _leave(context.config["nonce"], setsid=True, double=True, clear_environment=True)
    return _carry_on(context)


# The hydra is a Python of its own (``python -c HYDRA 3600.NONCE DIRECTORY FD``), so the
# marker is in its command line and in that of every child it forks.
HYDRA = """
import os, signal, sys, time
sys.path[:0] = [sys.argv[2]]
from escapes import _leave, _named
os.set_inheritable(int(sys.argv[3]), False)  # its sleep must not hold the plugin's pipe
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
os.setsid()
_leave(sys.argv[1].removeprefix("3600."))
os.write(1, f"left {_named()}\\n".encode())
os.close(int(sys.argv[3]))  # ready: the plugin may say so
while True:
    if os.fork() == 0:
        time.sleep(0.02)
        os._exit(0)
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    time.sleep(0.01)
"""


def hydra(context: Any) -> int:
    ready, readying = os.pipe()
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.Popen(
        [sys.executable, "-c", HYDRA, f"3600.{context.config['nonce']}", here, str(readying)],
        pass_fds=(readying,),
    )
    os.close(readying)
    os.read(ready, 1)  # EOF: the hydra has left its sleep
    os.close(ready)
    return _carry_on(context)


def _named() -> str:
    """This process as the runner finds it: its PID namespace, its pid in there, and its
    start time (clock ticks since boot, the same in every PID namespace)."""
    with open("/proc/self/stat") as file:
        started = file.read().rsplit(")", 1)[1].split()[19]
    return f"{os.readlink('/proc/self/ns/pid')} {os.getpid()} {started}"


def _become_sleep(nonce: str, *, environment: dict[str, str] | None = None) -> NoReturn:
    os.write(1, f"left {_named()}\n".encode())
    argv = [SLEEP, f"3600.{nonce}"]
    os.execve(SLEEP, argv, dict(os.environ) if environment is None else environment)


def _leave(
    nonce: str,
    *,
    setsid: bool = False,
    setpgid: bool = False,
    double: bool = False,
    clear_environment: bool = False,
    ignore_sigterm: bool = False,
) -> None:
    """Leave one sleep behind; return once it runs (its exec closed our pipe)."""
    ready, readying = os.pipe()  # close-on-exec: the sleep's exec closes it
    child = os.fork()
    if child == 0:
        try:
            os.close(ready)
            if setsid:
                os.setsid()
            if setpgid:
                os.setpgid(0, 0)
            if double and os.fork() != 0:
                os._exit(0)  # the middle one goes: the sleep is an orphan from now on
            if clear_environment:
                os.environ.clear()
            if ignore_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an exec keeps it ignored
            _become_sleep(nonce, environment={} if clear_environment else None)
        finally:
            os._exit(1)
    os.close(readying)
    if double:
        os.waitpid(child, 0)
    os.read(ready, 1)  # EOF once every holder exec'd or exited
    os.close(ready)


def _carry_on(context: Any) -> int:
    """Say the leftovers are in place; then return (``then: exit``) or run until
    interrupted (a KeyboardInterrupt, as the bootstrap delivers SIGTERM)."""
    print("ready", flush=True)
    if context.config.get("then") == "exit":
        return 0
    try:
        while True:
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        return 0
