"""The example runner and crashes of a runner process: real processes, real time.

A runner is a separate process here, killed with SIGKILL. The test process is a child
subreaper (conftest.py), so the runner's orphans come back to it and the leak guard sees
any that survive. Waits are bounded polls, never timing assertions.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_supervisor.executions.limits._cgroups import PARENT, detect, execution_name
from trio_supervisor.executions.limits._cgroups import ROOT as CGROUP_ROOT
from trio_supervisor.executions.limits._claims import CGROUPS, Claims, claims_root

from ..support import ROOT
from ..support.processes import descendants, launched, reap_orphans, running, survivors
from ..support.waits import settled

RUNNER = ROOT / "examples" / "runner.py"
CYCLE = Path(__file__).parent / "crash_cycle.py"
SESSION_LEASE = 2.0


def run(*arguments: str, timeout: float = 60, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *arguments], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def rows(output: str) -> dict[str, str]:
    return {line.split()[0]: line for line in output.splitlines() if line.startswith("runner/")}


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], set[int]]]:
    """A runner holding its children, with the pids of everything it started."""
    command: list[str | Path] = [
        sys.executable,
        RUNNER,
        "--state",
        tmp_path,
        "--lease",
        str(SESSION_LEASE),
        "--hold",
    ]
    try:
        # The readiness handshake: the line saying it holds its children (after the lines
        # saying where its state lives and where its generations start).
        with launched(command, ready=lambda line: " holds " in line, stop=signal.SIGKILL) as runner:
            assert len(runner.lines) == 3, runner.lines
            assert "holds 7 children" in runner.lines[-1], runner.lines
            yield runner.process, runner.descendants()
    finally:
        survivors(descendants(os.getpid()) - {os.getpid()}, SESSION_LEASE + 2)
        reap_orphans()


def test_the_runner_shows_every_plugin_s_lifecycle(tmp_path: Path) -> None:
    # As the README's main job runs it: the default state directory, relative to here.
    done = run(str(RUNNER), "--lease", str(SESSION_LEASE), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "example-runner-state" / "runner.db").exists()
    table = rows(done.stdout)
    assert "Disposed  exited (code 0)" in table["runner/heartbeat"]
    assert "Expired   exited (code 0)" in table["runner/expiring"]
    assert "Disposed  killed (SIGKILL)" in table["runner/stubborn"]
    assert "Exited    exited (code 1)" in table["runner/crasher"]
    assert "the crasher crashed" in table["runner/crasher"]
    # Its grandchildren ignore SIGTERM: the child's bootstrap had to kill them.
    assert "Disposed  exited (SIGTERM; 2 descendants killed)" in table["runner/spawner"]
    # Its tree's cgroup here: the OOM killer ends it (RLIMIT_AS would: a MemoryError).
    assert "Exited    exited (out of memory, limit 256 MiB)" in table["runner/hungry"]
    assert "Disposed  exited (SIGTERM)" in table["runner/sleeper"]
    assert all(" 1 " in line for line in table.values())


def standby_of(runner: subprocess.Popen[bytes]) -> int:
    """The runner's standby interpreter: a bootstrap whose output goes nowhere yet."""

    def standby() -> int | None:
        for pid in descendants(runner.pid):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
                output = os.readlink(f"/proc/{pid}/fd/1")
            except OSError:
                continue
            if b"bootstrap" in command and output == "/dev/null":
                return pid
        return None

    found = settled(standby, 20)
    assert found is not None, "the runner has no standby interpreter"
    return found


def test_a_killed_runner_leaves_no_child_or_grandchild_behind(
    tmp_path: Path, held: tuple[subprocess.Popen[bytes], set[int]]
) -> None:
    runner, pids = held
    assert len(pids) >= 7 + 2, "seven children and the spawner's two grandchildren"
    assert all(running(pid) for pid in pids)
    pids = pids | {standby_of(runner)}  # it runs with standby=True: that one goes too
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    left = survivors(pids, SESSION_LEASE + 2)
    assert not left, f"outlived their runner: {sorted(left)}"
    # Killed between a child's end (the hungry one's OOM kill, say) and the removal of
    # its cgroup, the runner may leave that cgroup empty, and its claim of their parent:
    # now that it is gone, any runner's start takes them back. One on another state
    # directory does here (the next start on the same one would too: the test below).
    claims = Claims.of(CGROUPS) if os.geteuid() == 0 else None
    another = detect(CGROUP_ROOT, tmp_path / "another", claims)
    try:
        another.reclaim()
    finally:
        another.close()
        another.let_go()
    name = execution_name(tmp_path)
    assert not list(CGROUP_ROOT.glob(f"*/{PARENT}/{name}"))
    assert not (claims_root() / CGROUPS / name).is_symlink()


def test_a_restarted_runner_recovers_and_generations_continue(
    tmp_path: Path, held: tuple[subprocess.Popen[bytes], set[int]]
) -> None:
    runner, pids = held
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    again = run(str(RUNNER), "--state", str(tmp_path), "--lease", str(SESSION_LEASE))
    assert again.returncode == 0, again.stderr
    recovery, _, report = again.stdout.partition("\n\n")
    assert recovery.startswith(f"state: {tmp_path}"), recovery
    # Four run until killed; the crasher, the hungry one and the expiring one may or
    # may not have ended by themselves before the kill.
    found = re.search(r"^recovered (\d) sessions", recovery, flags=re.MULTILINE)
    assert found, recovery
    assert 4 <= int(found.group(1)) <= 7
    for name in ("heartbeat", "stubborn", "spawner", "sleeper"):
        # Their dead-man switch ended them with the runner: recovery finds them gone.
        [line] = [line for line in recovery.splitlines() if f"runner/{name} " in line]
        assert line.endswith("exited (already gone; exit status unknown)"), line
    assert "generations continue from the stored high-water: heartbeat 1->2" in report
    assert all(" 2 " in line for line in rows(report).values()), report
    assert not survivors(pids, SESSION_LEASE + 2)


SAVES = ["Open", "Loading", "Loading with its child", "Loaded", "Stopping", "Stopped"]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("at", range(1, len(SAVES) + 1), ids=SAVES)
def test_a_crash_at_any_write_leaves_no_orphan_and_no_lost_generation(
    tmp_path: Path, at: int, when: str
) -> None:
    crashed = run(str(CYCLE), str(tmp_path), "crash", str(at), when)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    children = {
        int(line.split()[1]) for line in crashed.stdout.splitlines() if line.startswith("child ")
    }
    # The dead-man switch: a child outlives its runner by no more than a moment.
    assert not survivors(children, SESSION_LEASE + 2)
    recovered = run(str(CYCLE), str(tmp_path), "recover")
    assert recovered.returncode == 0, recovered.stderr
    report = json.loads(recovered.stdout)
    assert all(record["phase"] == "Stopped" for record in report["after_recovery"])
    durable = [record["handle"]["generation"] for record in report["before"]]
    expected_high = max(durable, default=0)
    assert report["high_water"] == (expected_high or None)
    assert report["next"] == expected_high + 1, "the generation never goes down, nor repeats"
    # Crashing after the Open save (or later) left a record; before it, nothing.
    assert len(report["before"]) == (0 if (at, when) == (1, "before") else 1)
    reap_orphans()
