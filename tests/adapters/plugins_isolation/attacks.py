"""Plugins that try what a hostile plugin would (test_isolation.py loads them).

Each attack prints ``ATTACK <name> refused <error>`` or ``ATTACK <name> SUCCEEDED
<what it got>``, so the test sees every one; ``done`` comes last.
"""

from __future__ import annotations

import functools
import os
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _try(name: str, attack: Callable[[], object]) -> None:
    try:
        got = attack()
    except (OSError, ValueError) as error:
        print(f"ATTACK {name} refused {error!r}", flush=True)
    else:
        print(f"ATTACK {name} SUCCEEDED {got!r}"[:300], flush=True)


def _read(path: str) -> str:
    with open(path) as file:
        return file.read()


def _write(path: str) -> int:
    with open(path, "a") as file:
        return file.write("attack\n")


def _raise_rlimit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard + 1, hard + 1))


def _parent() -> int:
    """The tracked process's pid as its /proc names it (1, in a PID namespace of its own)."""
    with open("/proc/self/stat") as file:
        return int(file.read().rsplit(")", 1)[1].split()[1])


def everything(context: Any) -> int:
    """Every attack on the runner's things the config names."""
    config = context.config
    state = config["state"]
    _try("list the state directory", lambda: os.listdir(state))
    _try("read hosts-token", lambda: _read(os.path.join(state, "hosts-token")))
    _try("read operator-token", lambda: _read(os.path.join(state, "operator-token")))
    _try("read the store", lambda: _read(os.path.join(state, "supervisor.db")))
    _try("write the store", lambda: _write(os.path.join(state, "supervisor.db")))
    _try("list the logs", lambda: os.listdir(os.path.join(state, "logs")))
    _try("read another session's log", lambda: _read(config["other_log"]))
    _try("list the children's directories", lambda: os.listdir(os.path.join(state, "children")))
    _try("list another child's directory", lambda: os.listdir(config["other_home"]))
    _try("read the runner's environment", lambda: _read(f"/proc/{config['runner']}/environ"))
    token = f"{state}/operator-token"
    _try(
        "read a token through the runner's /proc",
        lambda: _read(f"/proc/{config['runner']}/root{token}"),
    )
    _try("read a token through its parent's /proc", lambda: _read(f"/proc/{_parent()}/root{token}"))
    _try("signal the runner", lambda: os.kill(config["runner"], signal.SIGUSR2))
    _try("signal the tracked process", lambda: os.kill(os.getppid(), signal.SIGKILL))
    _try("raise an rlimit", _raise_rlimit)
    _try("setuid(0)", lambda: os.setuid(0))
    if not config.get("root_may_write"):  # a child that is root in a namespace may
        _try("write under /etc", lambda: _write("/etc/trio-supervisor-attack"))
    # The control: what it may do.
    _try("write in its TMPDIR", lambda: _write(os.path.join(os.environ["TMPDIR"], "mine")))
    print("done", flush=True)
    # It stays until its session stops: a plugin that returned at once could end before
    # its load was acknowledged, and the load would then fail (its session Exited).
    threading.Event().wait()
    return 0


def identity(context: Any) -> int:
    """Say who and where it is (once its scratch file is written), then wait to be
    stopped."""
    if os.getuid() != 0:  # isolated: its TMPDIR is its own
        _write(os.path.join(os.environ["TMPDIR"], "scratch"))
    with open("/proc/self/status") as file:
        status = dict(line.split(":\t", 1) for line in file.read().splitlines() if ":\t" in line)
    print(
        "IDENTITY",
        os.getresuid()[0],
        os.getresgid()[0],
        len(os.getgroups()),
        os.getcwd(),
        os.environ.get("TMPDIR"),
        status["NoNewPrivs"].strip(),
        status["CapEff"].strip(),
        flush=True,
    )
    time.sleep(3600)
    return 0


def connect(context: Any) -> int:
    """Try the port the config names on loopback."""

    def attempt() -> str:
        with socket.create_connection(("127.0.0.1", context.config["port"]), timeout=5):
            return "connected"

    _try("connect to the runner's port", attempt)
    print("done", flush=True)
    time.sleep(3600)  # until its session stops: see main()
    return 0


def private(context: Any) -> int:
    """Look at what is meant to be its own (``/proc``, ``/tmp``, ``/var/tmp``,
    ``/dev/shm``), leave a file (``mine``) in each, and wait to be stopped."""
    config = context.config
    runner = config["runner"]
    pids = sorted(int(entry) for entry in os.listdir("/proc") if entry.isdigit())
    print("PIDS", os.getpid(), *pids, flush=True)
    _try("read the runner's command line", lambda: _read(f"/proc/{runner}/cmdline"))
    _try("read the runner's environment", lambda: _read(f"/proc/{runner}/environ"))
    for directory in ("/tmp", "/var/tmp", "/dev/shm"):
        theirs = os.path.join(directory, config["other"])
        _try(f"read the other's file in {directory}", functools.partial(_read, theirs))
        _write(os.path.join(directory, config["mine"]))
        print("LISTED", directory, *sorted(os.listdir(directory)), flush=True)
    _try("write in its TMPDIR", lambda: _write(os.path.join(os.environ["TMPDIR"], "mine")))
    if config.get("entry"):  # mounted back read-only
        _try("write in its entry path", lambda: _write(os.path.join(_HERE, "mine")))
    print("done", flush=True)
    time.sleep(3600)
    return 0
