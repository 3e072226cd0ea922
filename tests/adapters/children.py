"""What the tests that run real children share: the containment mechanisms this kernel
allows, how to find the interpreters an execution keeps waiting, the ways a child is
started, and the isolation tests' loads and attack reports."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from trio_supervisor import Key, Load, LoadedRecord, Supervisor
from trio_supervisor.executions.trees._groups import read_stat


def _namespaces_allowed() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "true"], check=False).returncode == 0
    except OSError:
        return False


NAMESPACES = _namespaces_allowed()


MECHANISMS = [
    pytest.param(
        "namespace",
        marks=pytest.mark.skipif(not NAMESPACES, reason="the kernel allows no PID namespace"),
    ),
    "sweep",
]


def bootstraps() -> set[int]:
    """Our live child processes that run the bootstrap."""
    found = set()
    for entry in Path("/proc").iterdir():
        stat = read_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is None or stat.ppid != os.getpid() or not stat.running:
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # it exited meanwhile
        arguments = command.rstrip(b"\0").split(b"\0")
        # Not the containment probe (``_bootstrap.py probe``), which runs as the
        # execution starts, at the same time as the first standby.
        if b"bootstrap" in command and arguments[-1] != b"probe":
            found.add(int(entry.name))
    return found


def attacks(log: str) -> dict[str, str]:
    """Each attack's outcome: "refused ..." or "SUCCEEDED ..."."""
    found = {}
    for line in log.splitlines():
        if line.startswith("ATTACK "):
            rest = line.removeprefix("ATTACK ")
            for outcome in (" refused ", " SUCCEEDED "):
                name, said, detail = rest.partition(outcome)
                if said:
                    found[name] = said.strip() + " " + detail
    return found


STARTS = {
    "started": {"fork_server": False, "standby": False},
    "forked": {"fork_server": True, "standby": False},
    "standby": {"fork_server": False, "standby": True},
}


async def loaded(sup: Supervisor, instance: str, specifier: str, **config: object) -> LoadedRecord:
    record = await sup.open(Key(identity="tenant", instance=instance), instance)
    await sup.load(record.handle, Load(specifier=specifier, config=config))
    loaded = await sup.status(record.handle)
    assert isinstance(loaded, LoadedRecord)
    return loaded
