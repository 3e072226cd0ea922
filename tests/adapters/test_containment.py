"""Containment: nothing a plugin starts outlives its session, whatever way it ends.

Real processes and the real clock. The plugins of ``plugins_escape/escapes.py`` each
leave ``sleep 3600.<nonce>`` processes behind by a different escape (a double-forked setsid
daemon, a ``setpgid(0, 0)`` child, a storm of 60 children, a setsid daemon with a
cleared environment, a descendant that ignores SIGTERM and SIGHUP and keeps forking),
say their pids in their log (``left PID``), and then run until interrupted, or return
(``then: exit``). Every way out is run with both mechanisms, the PID namespace and the
forced subreaper sweep: dispose, lease expiry, the child's own exit, the runner killed
with no restart, and the runner killed and then restarted to recover.

Leftovers are found by the test's own marker, the nonce in ``/proc/PID/cmdline``, and a
test kills whatever has it as it ends, so a failure never leaks a process. The five
plugins of a case run side by side in one supervisor, to keep the file short.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_supervisor import (
    ExitStatus,
    Handle,
    Key,
    Limits,
    Load,
    LoadedRecord,
    MemoryStore,
    SubprocessExecution,
    Supervisor,
    Termination,
    open_supervisor,
)
from trio_supervisor.errors import ExecutionError, SessionStoppedError
from trio_supervisor.executions.limits import _cgroups
from trio_supervisor.executions.limits._claims import UIDS, Claim, ClaimError, claims_root
from trio_supervisor.executions.starting._unit import ProcessUnit
from trio_supervisor.executions.trees import _containment
from trio_supervisor.executions.trees._groups import read_stat

from ..support import ROOT
from ..support.processes import launched, reap_orphans, running, survivors
from ..support.waits import BOUND, settled, until, until_logged, until_stopped
from .children import MECHANISMS, NAMESPACES

ESCAPE = Path(__file__).parent / "plugins_escape"
RUNNER = ESCAPE / "runner.py"
SESSION_LEASE = 1.0  # the runner script's, and the expiring sessions'
# What each plugin leaves running (its "left" lines): the hydra is itself one, and its
# sleep another; while it forks, a child or two of it are running as well.
LEAVES = {"daemon": 1, "regroup": 1, "storm": 60, "vanish": 1, "hydra": 2}
SLEEP = shutil.which("sleep") or "/bin/sleep"


# -- the marker -----------------------------------------------------------------------


def marked(nonce: str) -> set[int]:
    """Running processes whose command line carries ``3600.<nonce>``."""
    marker = f"3600.{nonce}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if marker in command.split(b"\0") and running(int(entry.name)):
            found.add(int(entry.name))
    return found


def kill_marked(nonce: str) -> set[int]:
    """Kill and reap (if ours) whatever carries the marker; return what was found."""
    found: set[int] = set()
    for _ in range(50):  # a forking leftover may add more while we kill
        alive = marked(nonce)
        if not alive:
            break
        found |= alive
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    reap_orphans()
    return found


@contextlib.contextmanager
def reaping() -> Iterator[None]:
    """Reap, in the background, the zombies re-parented to us, as an init would.

    Only zombies: a child of ours still running (``subprocess.run``'s) is left alone.
    """
    done = threading.Event()

    def reap() -> None:
        me = os.getpid()
        while not done.wait(0.02):
            for entry in Path("/proc").iterdir():
                found = read_stat(int(entry.name)) if entry.name.isdigit() else None
                if found is not None and found.ppid == me and not found.running:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(int(entry.name), os.WNOHANG)

    reaper = threading.Thread(target=reap, daemon=True)
    reaper.start()
    try:
        yield
    finally:
        done.set()
        reaper.join()


def gone_within(nonce: str, seconds: float) -> set[int]:
    """Wait until nothing carries the marker; what still does after ``seconds``."""
    settled(lambda: not marked(nonce), seconds)
    return marked(nonce)


@pytest.fixture
def nonce() -> Iterator[str]:
    """The marker of this test's leftovers; whatever carries it is killed at the end."""
    value = str(random.randrange(10**8, 10**9))
    try:
        yield value
    finally:
        leaked = kill_marked(value)
        assert not leaked, f"left running by the test: {sorted(leaked)}"


# -- a supervisor in this process -------------------------------------------------------


@contextlib.asynccontextmanager
async def supervising(
    directory: Path, containment: str, *, fork_server: bool = False, **options: Any
) -> AsyncIterator[tuple[SubprocessExecution, Supervisor]]:
    settings: dict[str, Any] = {"lease": 30.0, "grace": 5.0, "confirmation_timeout": 5.0}
    settings.update(options)
    async with (
        SubprocessExecution(
            directory,
            entry_paths=[ESCAPE],
            containment=containment,  # type: ignore[arg-type]
            fork_server=fork_server,
        ) as execution,
        open_supervisor(MemoryStore(), execution, **settings) as supervisor,
    ):
        assert execution.mechanism.kind == containment
        yield execution, supervisor


def said_left(*logs: str) -> set[tuple[str, int, int]]:
    """What plugins said they left (``left NAMESPACE PID START`` lines of their logs)."""
    return {
        (line.split()[1], int(line.split()[2]), int(line.split()[3]))
        for log in logs
        for line in log.splitlines()
        if line.startswith("left ")
    }


def ours(named: set[tuple[str, int, int]]) -> set[int]:
    """Our pids of the processes ``named`` (by PID namespace, pid in it and start time)
    still running."""
    namespaces = {namespace for namespace, _, _ in named}
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            namespace = os.readlink(entry / "ns" / "pid") if entry.name.isdigit() else ""
            if namespace not in namespaces:
                continue
            status = (entry / "status").read_text()
        except OSError:
            continue  # gone meanwhile
        [line] = [line for line in status.splitlines() if line.startswith("NSpid:")]
        process = read_stat(int(entry.name))
        if process is None or not process.running:
            continue
        if (namespace, int(line.split()[-1]), process.start_time) in named:
            found.add(int(entry.name))
    return found


def left(execution: SubprocessExecution, handle: Handle) -> set[int]:
    """Our pids of what a plugin said it left that still runs."""
    return ours(said_left(execution.logs(handle)))


async def leave_all(
    execution: SubprocessExecution, supervisor: Supervisor, nonce: str, *, then: str = "wait"
) -> dict[str, Handle]:
    """Load every escape plugin; return once each has its leftovers in place."""
    handles = {}
    for name in LEAVES:
        record = await supervisor.open(Key(identity="escape", instance=name), name)
        load = Load(specifier=f"escapes:{name}", config={"nonce": nonce, "then": then})
        try:
            await supervisor.load(record.handle, load)
        except SessionStoppedError:
            # L6: a plugin that exits at once may be seen gone before its load is
            # answered (a busy machine); its session then stopped Exited, as the test
            # wants, and the load says so.
            if then != "exit":
                raise
        handles[name] = record.handle
    for handle in handles.values():
        await until_logged(execution, handle, "ready", bound=BOUND)
    return handles


def assert_left_running(
    execution: SubprocessExecution, handles: dict[str, Handle], nonce: str
) -> None:
    for name, handle in handles.items():
        pids = left(execution, handle)
        assert len(pids) == LEAVES[name], (name, execution.logs(handle))
        assert all(running(pid) for pid in pids), name
        assert pids <= marked(nonce), name


def assert_swept(name: str, termination: Termination) -> None:
    """The plugin ended by itself or by its interrupt (code 0), its leftovers killed."""
    assert termination.kind == "exited", (name, termination)
    assert termination.exit.code == 0, (name, termination)
    if name == "hydra":  # plus any of the children it forks all the time
        assert termination.exit.descendants_killed >= LEAVES[name], (name, termination)
    else:
        assert termination.exit.descendants_killed == LEAVES[name], (name, termination)


# -- ways out, in this process ----------------------------------------------------------


@pytest.mark.parametrize("fork_server", [False, True], ids=["started", "forked"])
@pytest.mark.parametrize("containment", MECHANISMS)
async def test_dispose_ends_everything_the_plugins_left(
    tmp_path: Path, containment: str, fork_server: bool, nonce: str
) -> None:
    async with supervising(tmp_path, containment, fork_server=fork_server) as (
        execution,
        supervisor,
    ):
        handles = await leave_all(execution, supervisor, nonce)
        if fork_server:  # every child came from the fork server, none was started
            assert execution.fork_server_forks == len(handles)
        assert_left_running(execution, handles, nonce)
        terminations: dict[str, Termination] = {}

        async def dispose(name: str, handle: Handle) -> None:
            terminations[name] = await supervisor.dispose(handle)

        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                for name, handle in handles.items():
                    nursery.start_soon(dispose, name, handle)
        # Confirmed means gone: nothing carries the marker once dispose returned.
        assert marked(nonce) == set()
        for name, termination in terminations.items():
            assert_swept(name, termination)
            # The interrupt reached the entry point as a KeyboardInterrupt.
            assert "interrupted" in execution.logs(handles[name]), name


@pytest.mark.parametrize("containment", MECHANISMS)
async def test_an_expired_lease_ends_everything_the_plugins_left(
    tmp_path: Path, containment: str, nonce: str
) -> None:
    async with supervising(tmp_path, containment, lease=SESSION_LEASE) as (execution, supervisor):
        with trio.CancelScope() as renewing:
            # Renewed until every plugin is ready, then left to expire.
            async with trio.open_nursery() as nursery:

                async def renew_all() -> None:
                    while True:
                        await trio.sleep(SESSION_LEASE / 4)
                        for handle in list(handles.values()):
                            with contextlib.suppress(Exception):
                                await supervisor.renew(handle)

                handles: dict[str, Handle] = {}
                nursery.start_soon(renew_all)
                for name in LEAVES:
                    record = await supervisor.open(Key(identity="escape", instance=name), name)
                    handles[name] = record.handle
                    await supervisor.load(
                        record.handle, Load(specifier=f"escapes:{name}", config={"nonce": nonce})
                    )
                for handle in handles.values():
                    await until_logged(execution, handle, "ready", bound=BOUND)
                assert_left_running(execution, handles, nonce)
                renewing.cancel()
        for name, handle in handles.items():
            record = await until_stopped(supervisor, handle)
            assert record.reason.kind == "Expired", name
            assert_swept(name, record.termination)
        assert marked(nonce) == set()


@pytest.mark.parametrize("containment", MECHANISMS)
async def test_a_plugin_s_own_exit_ends_what_it_left(
    tmp_path: Path, containment: str, nonce: str
) -> None:
    async with supervising(tmp_path, containment) as (execution, supervisor):
        handles = await leave_all(execution, supervisor, nonce, then="exit")
        for name, handle in handles.items():
            record = await until_stopped(supervisor, handle)
            assert record.reason.kind == "Exited", name
            assert_swept(name, record.termination)
            assert len(said_left(execution.logs(handle))) == LEAVES[name], name
            assert left(execution, handle) == set(), name
        assert marked(nonce) == set()


@pytest.mark.parametrize("containment", MECHANISMS)
async def test_a_tracked_process_killed_by_someone_else_takes_its_tree_along(
    tmp_path: Path, containment: str, nonce: str
) -> None:
    # Killed before it could do anything: with a namespace, the namespace dies with its
    # PID 1; swept,
    # what it left comes to us, found by its session (the regroup child) and by the
    # marker pipe it inherited (the daemon, which left the session).
    async with supervising(tmp_path, containment) as (execution, supervisor):
        handles = {}
        for name in ("daemon", "regroup"):
            record = await supervisor.open(Key(identity="escape", instance=name), name)
            await supervisor.load(
                record.handle, Load(specifier=f"escapes:{name}", config={"nonce": nonce})
            )
            await until_logged(execution, record.handle, "ready", bound=BOUND)
            handles[name] = record.handle
        for name, handle in handles.items():
            loaded = await supervisor.status(handle)
            assert isinstance(loaded, LoadedRecord)
            assert loaded.child.pid is not None
            os.kill(loaded.child.pid, signal.SIGKILL)
            record = await until_stopped(supervisor, handle)
            assert record.reason.kind == "Exited", name
            assert record.termination.exit.signal == signal.SIGKILL, name
            if containment == "sweep":  # in a namespace the kernel killed them, uncounted
                assert record.termination.exit.descendants_killed >= 1, name
            assert not any(running(pid) for pid in left(execution, handle)), name
        assert marked(nonce) == set()


@pytest.mark.parametrize("containment", MECHANISMS)
async def test_a_named_command_s_daemon_ends_with_it(
    tmp_path: Path, containment: str, nonce: str
) -> None:
    script = f"setsid {SLEEP} 3600.{nonce} & exec {SLEEP} 60"
    async with (
        SubprocessExecution(
            tmp_path,
            commands={"escaper": ["/bin/sh", "-c", script]},
            containment=containment,  # type: ignore[arg-type]
        ) as execution,
        open_supervisor(MemoryStore(), execution, grace=5.0) as supervisor,
    ):
        record = await supervisor.open(Key(identity="escape", instance="command"), "c")
        await supervisor.load(record.handle, Load(specifier="escaper"))

        def daemonized() -> bool:  # setsid has run (its argv carries the marker already)
            return any(getattr(read_stat(pid), "session", 0) == pid for pid in marked(nonce))

        await until(daemonized, "the command's daemon called setsid", bound=BOUND)
        with trio.fail_after(BOUND):
            termination = await supervisor.dispose(record.handle)
        assert termination == Termination(
            kind="exited", exit=ExitStatus(signal=signal.SIGTERM, descendants_killed=1)
        )
        assert marked(nonce) == set()


# -- ways out with the runner killed --------------------------------------------------


@contextlib.contextmanager
def held(
    state: Path, containment: str, nonce: str
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, int]]]:
    """A runner (``plugins_escape/runner.py``) holding every escape plugin; it and its
    children's pids by plugin (and the fork server's as "server", with a containment
    ending in "+fork"). Killed, if it still runs, at the end."""
    command: list[str | Path] = [sys.executable, RUNNER, state, containment, "hold", nonce]
    with launched(command, ready=lambda line: line == "holding\n", stop=signal.SIGKILL) as runner:
        children = {}
        for line in runner.lines[:-1]:  # "child NAME PID"
            _, name, pid = line.split()
            children[name] = int(pid)
        yield runner.process, children


def cgroups_of(state: Path) -> list[Path]:
    """The cgroups of the executions on ``state``: their parents and children, in every
    hierarchy."""
    parent = f"{_cgroups.PARENT}/{_cgroups.execution_name(state.absolute())}"
    return sorted(
        path
        for found in _cgroups.ROOT.glob(f"*/{parent}")
        for path in [found, *found.iterdir()]
        if path.is_dir()
    )


def claimed_by(state: Path) -> list[str]:
    """The uids the machine's claims give to children of the runners on ``state``."""
    mine = f"{state / 'children'}/"
    found = []
    for entry in (claims_root() / UIDS).iterdir():
        with contextlib.suppress(OSError, ClaimError):  # let go of meanwhile, or not ours
            if Claim.parse(os.readlink(entry), entry).holds.startswith(mine):
                found.append(entry.name)
    return sorted(found)


def left_in(state: Path) -> set[int]:
    """Our pids of what the plugins said they left, from their logs in the runner's state."""
    return ours(said_left(*(log.read_text() for log in (state / "logs").iterdir())))


@pytest.mark.parametrize("fork", ["", "+fork"], ids=["started", "forked"])
@pytest.mark.parametrize("containment", MECHANISMS)
def test_a_killed_runner_leaves_nothing_behind(
    tmp_path: Path, containment: str, fork: str, nonce: str
) -> None:
    with held(tmp_path, containment + fork, nonce) as (runner, children):
        assert ("server" in children) == bool(fork)
        pids = left_in(tmp_path)
        assert len(pids) == sum(LEAVES.values())
        assert pids <= marked(nonce)
        runner.send_signal(signal.SIGKILL)
        runner.wait()
        # The dead-man switch: every tree ends with its runner, within the lease + 2 s.
        # (A namespace's processes are gone a moment before its PID 1, whose exit ends
        # them, has finished exiting.)
        assert gone_within(nonce, SESSION_LEASE + 2) == set()
        assert not survivors(children.values(), SESSION_LEASE + 2)
    reap_orphans()
    # Each tracked process removed its cgroup as it ended, with nobody else to do it.
    assert cgroups_of(tmp_path) == []


@pytest.mark.parametrize("containment", MECHANISMS)
def test_a_restarted_runner_recovers_every_tree(
    tmp_path: Path, containment: str, nonce: str
) -> None:
    with held(tmp_path, containment, nonce) as (runner, children):
        # Each tracked process is stopped first, so its dead-man switch cannot act: the
        # restarted runner's recovery has to end every tree itself.
        for pid in children.values():
            os.kill(pid, signal.SIGSTOP)
        runner.send_signal(signal.SIGKILL)
        runner.wait()
        assert len(marked(nonce)) >= sum(LEAVES.values())
        # A cgroup per child, each still holding its (stopped) tree.
        held_cgroups = [
            path for path in cgroups_of(tmp_path) if path.parent.name != "trio_supervisor"
        ]
        assert held_cgroups
        assert all((path / "cgroup.procs").read_text() for path in held_cgroups)
        # A uid claimed per child, still held by its stopped tree.
        claimed = claimed_by(tmp_path)
        assert len(claimed) == len(LEAVES)
        with reaping():  # what the recovery kills was the dead runner's: we reap it
            recovered = subprocess.run(
                [sys.executable, str(RUNNER), str(tmp_path), containment, "recover"],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
            )
        assert recovered.returncode == 0, recovered.stderr
        # Recovery confirms what it killed: nothing is left once it returned.
        assert marked(nonce) == set()
        *said, free = recovered.stdout.splitlines()
        lines = {line.split()[1]: line for line in said}
        assert set(lines) == set(LEAVES)
        # Each uid is free again (for the runner that recovered them: it counts only
        # these, whatever other runners of the machine hold), and its claim gone.
        assert free.split()[2:] == sorted(claimed, key=int)
        assert claimed_by(tmp_path) == []
        for name, line in lines.items():
            assert " killed (SIGKILL; " in line, line
            killed = int(line.split("; ")[1].split()[0])
            assert killed >= LEAVES[name], line
        assert not any(running(pid) for pid in children.values())
        # Recovery removed each child's cgroup, and the run its own parent as it ended.
        assert cgroups_of(tmp_path) == []
    reap_orphans()


# -- the mechanism ------------------------------------------------------------------------


async def test_the_mechanism_in_use_is_logged_and_a_child_reports_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    handle = Handle(key=Key(identity="p", instance="a"), token="t" * 32, generation=1)
    for containment, words in (("auto", "PID namespace"), ("sweep", "subreaper sweep")):
        if containment == "auto" and not NAMESPACES:
            words = "subreaper sweep"
        caplog.clear()
        with caplog.at_level(logging.INFO, "trio_supervisor.executions.subprocess"):
            async with SubprocessExecution(
                tmp_path / containment,
                entry_paths=[ESCAPE],
                containment=containment,  # type: ignore[arg-type]
            ) as execution:
                unit = await execution.spawn(handle, Load(specifier="escapes:daemon"), Limits())
                assert isinstance(unit, ProcessUnit)
                assert unit.containment == execution.mechanism.kind
                await unit.aclose()
        [line] = [
            record.getMessage()
            for record in caplog.records
            if record.getMessage().startswith("subprocess children are contained by")
        ]
        assert words in line, line


async def test_where_no_namespace_is_allowed_auto_sweeps_and_namespace_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def refused(python: str, bootstrap: Path) -> tuple[bool, str]:
        await trio.lowlevel.checkpoint()
        return False, "pid: Operation not permitted; user: Operation not permitted"

    monkeypatch.setattr(_containment, "_probe", refused)
    with caplog.at_level(logging.INFO, "trio_supervisor.executions.subprocess"):
        async with SubprocessExecution(tmp_path / "auto", standby=True) as execution:
            assert execution.mechanism.kind == "sweep"
    [line] = [
        record.getMessage()
        for record in caplog.records
        if record.getMessage().startswith("subprocess children are contained by")
    ]
    assert "subreaper sweep (PID namespaces are not allowed here: pid: Operation" in line
    with pytest.raises(ExecutionError, match="PID namespaces are required, but not allowed"):
        async with SubprocessExecution(tmp_path / "required", containment="namespace"):
            pass  # pragma: no cover


def namespace_pids(pid: int) -> list[int]:
    """``pid``'s pid in each PID namespace it is in, ours first (``NSpid``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(number) for number in line.split()[1:]]
    raise AssertionError(f"no NSpid line for {pid}")


@pytest.mark.skipif(not NAMESPACES, reason="the kernel allows no PID namespace")
@pytest.mark.parametrize("fork_server", [False, True], ids=["started", "forked"])
async def test_in_a_namespace_the_tracked_process_is_its_pid_1_and_the_plugin_its_child(
    tmp_path: Path, fork_server: bool, nonce: str
) -> None:
    # Two processes hold a child: the tracked one, which the record names, is PID 1 of the
    # namespace (so the namespace ends with it, however it ends), and our child; the
    # plugin is its child, PID 2.
    async with supervising(tmp_path, "namespace", fork_server=fork_server) as (
        execution,
        supervisor,
    ):
        record = await supervisor.open(Key(identity="escape", instance="daemon"), "d")
        load = Load(specifier="escapes:daemon", config={"nonce": nonce})
        await supervisor.load(record.handle, load)
        await until_logged(execution, record.handle, "ready", bound=BOUND)
        loaded = await supervisor.status(record.handle)
        assert isinstance(loaded, LoadedRecord)
        tracked = loaded.child.pid
        assert tracked is not None
        assert namespace_pids(tracked) == [tracked, 1]
        stat = read_stat(tracked)
        assert stat is not None
        assert stat.ppid == os.getpid()
        assert loaded.child.pgid == tracked == stat.pgid
        namespace = os.readlink(f"/proc/{tracked}/ns/pid")
        inside = set()
        for name in os.listdir("/proc"):
            with contextlib.suppress(OSError):
                if name.isdigit() and os.readlink(f"/proc/{name}/ns/pid") == namespace:
                    inside.add(int(name))
        plugin = {pid for pid in inside if (found := read_stat(pid)) and found.ppid == tracked}
        plugin -= left(execution, record.handle)  # the daemon is T's too: an orphan
        assert len(plugin) == 1
        assert namespace_pids(plugin.pop())[-1] == 2
        with trio.fail_after(BOUND):
            termination = await supervisor.dispose(record.handle)
        assert termination == Termination(
            kind="exited", exit=ExitStatus(code=0, descendants_killed=1)
        )
        assert marked(nonce) == set()


def test_a_namespace_needs_the_runner_to_be_a_subreaper(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="containment='namespace' needs subreaper=True"):
        SubprocessExecution(tmp_path, containment="namespace", subreaper=False)


async def test_without_subreaper_auto_means_the_sweep(tmp_path: Path, nonce: str) -> None:
    handle = Handle(key=Key(identity="p", instance="a"), token="t" * 32, generation=1)
    async with SubprocessExecution(tmp_path, entry_paths=[ESCAPE], subreaper=False) as execution:
        assert execution.mechanism.kind == "sweep"
        assert "subreaper=False" in execution.mechanism.describe()
        load = Load(specifier="escapes:daemon", config={"nonce": nonce})
        unit = await execution.spawn(handle, load, Limits())
        assert isinstance(unit, ProcessUnit)
        assert unit.containment == "sweep"
        await unit.start()
        await until_logged(execution, handle, "ready", bound=BOUND)
        await unit.interrupt()
        with trio.fail_after(BOUND):
            status = await unit.wait()
        assert status == ExitStatus(code=0, descendants_killed=1)
        await unit.aclose()
    assert marked(nonce) == set()


def test_an_unknown_containment_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="containment must be one of"):
        SubprocessExecution(tmp_path, containment="cgroup")  # type: ignore[arg-type]


@pytest.fixture
def nobody_may_enter(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """tmp_path, which nobody may enter: the directories pytest made above it (0o700) let
    others pass through for the test's duration."""
    top = tmp_path_factory.getbasetemp().parent  # pytest-of-USER
    opened = []
    for directory in (above for above in tmp_path.parents if above.is_relative_to(top)):
        mode = stat.S_IMODE(directory.stat().st_mode)
        if not mode & stat.S_IXOTH:
            directory.chmod(mode | stat.S_IXOTH)
            opened.append((directory, mode))
    try:
        yield tmp_path
    finally:
        for directory, mode in opened:
            directory.chmod(mode)


NOBODY_PYTHON = Path("/usr/bin/python3")


def as_nobody(directory: Path) -> Path:
    """A ``python`` for the execution that runs the system Python as nobody."""
    directory.chmod(0o755)
    python = directory / "python-as-nobody"
    python.write_text(
        f'#!/bin/sh\nexec setpriv --reuid=65534 --regid=65534 --clear-groups {NOBODY_PYTHON} "$@"\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return python


@pytest.mark.skipif(
    os.geteuid() != 0
    or not NAMESPACES
    or not shutil.which("setpriv")
    or not NOBODY_PYTHON.exists(),
    reason="needs root (to start children as nobody), setpriv and a system Python",
)
async def test_an_unprivileged_child_gets_its_namespace_in_a_user_namespace(
    nobody_may_enter: Path, nonce: str
) -> None:
    # The children run as nobody, who may not unshare a PID namespace but may make a
    # user namespace and one inside it.
    python = as_nobody(nobody_may_enter)
    async with (
        SubprocessExecution(
            nobody_may_enter, entry_paths=[ESCAPE], python=str(python), isolation="none"
        ) as execution,
        open_supervisor(MemoryStore(), execution, grace=5.0) as supervisor,
    ):
        assert execution.mechanism.unshare == "user"
        record = await supervisor.open(Key(identity="escape", instance="daemon"), "d")
        await supervisor.load(
            record.handle, Load(specifier="escapes:daemon", config={"nonce": nonce})
        )
        await until_logged(execution, record.handle, "ready", bound=BOUND)
        [pid] = left(execution, record.handle)
        assert running(pid)
        assert os.stat(f"/proc/{pid}").st_uid == 65534
        with trio.fail_after(BOUND):
            termination = await supervisor.dispose(record.handle)
        assert termination == Termination(
            kind="exited", exit=ExitStatus(code=0, descendants_killed=1)
        )
        assert marked(nonce) == set()
