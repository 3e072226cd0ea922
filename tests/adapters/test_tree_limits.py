"""Hard limits for a child's whole tree: its cgroup (``executions/limits/_tree_cgroup.py``).

Real processes and the real clock; each test runs with children started and again
forked by the fork server. Every wait is bounded and answered by the plugin saying
what it did (``plugins_limits/hogs.py``); the one measurement of time, the spinner's
share of a core, is a behaviour (limited or not), with a band far wider than any timing.
Recovery after the runner's ``kill -9`` removing the dead run's cgroups is proved in
test_containment.py (``test_a_restarted_runner_recovers_every_tree`` and
``test_a_killed_runner_leaves_nothing_behind``), whose runner holds plugins that escape.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from trio_supervisor import (
    Limits,
    Load,
    LoadedRecord,
    MemoryStore,
    PackageError,
    StoppedRecord,
    SubprocessExecution,
    Supervisor,
    open_supervisor,
)
from trio_supervisor.executions.child._protocol import Command
from trio_supervisor.executions.limits import _pool
from trio_supervisor.executions.limits._cgroups import ROOT, detect
from trio_supervisor.executions.limits._tree_cgroup import TreeCgroup
from trio_supervisor.executions.starting._standby import Interpreter, frame
from trio_supervisor.executions.starting._unit import ProcessUnit

from ..support.plugins import LIMITS, PLUGINS
from ..support.processes import descendants, reap_orphans
from ..support.sessions import opened
from ..support.waits import BOUND, until, until_logged, until_stopped

MiB = 1024 * 1024
# Joins the cgroup whose cgroup.procs files it is given, then leaves five daemons (each
# in a session of its own, re-parented away from it) and says so.
DAEMONS = """
import os, sys, time
for procs in sys.argv[1:]:
    with open(procs, "w") as file:
        file.write("0")
for _ in range(5):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(3600)
        os._exit(0)
    os.wait()
print("ready", flush=True)
time.sleep(3600)
"""

pytestmark = pytest.mark.skipif(
    not (ROOT / "pids" / "cgroup.procs").exists(), reason="needs writable cgroup hierarchies"
)


@pytest.fixture(params=[False, True], ids=["started", "forked"])
async def execution(
    tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[SubprocessExecution]:
    async with SubprocessExecution(
        tmp_path, entry_paths=[LIMITS, PLUGINS], fork_server=request.param
    ) as subprocess_execution:
        if not {"memory", "pids", "cpu", "cpuacct"} <= set(subprocess_execution.cgroups.limits):
            pytest.skip(f"cgroups here: {subprocess_execution.cgroups.describe()}")
        yield subprocess_execution
        assert (subprocess_execution.fork_server_forks > 0) == request.param


@pytest.fixture
async def sup(execution: SubprocessExecution) -> AsyncIterator[Supervisor]:
    async with open_supervisor(MemoryStore(), execution, lease=30.0, grace=1.0) as supervisor:
        yield supervisor


async def loaded(
    sup: Supervisor, specifier: str, limits: Limits, request_id: str = "r1"
) -> LoadedRecord:
    handle = await opened(sup, limits=limits, request_id=request_id)
    await sup.load(handle, Load(specifier=specifier))
    record = await sup.status(handle)
    assert isinstance(record, LoadedRecord)
    return record


def cgroup_file(execution: SubprocessExecution, record: LoadedRecord, controller: str) -> Path:
    assert record.child.cgroup is not None
    return execution.cgroups.limits[controller] / record.child.cgroup


async def given_back(execution: SubprocessExecution, path: str) -> None:
    """Wait until a gone child's cgroup is kept for the next child, empty (or given to the
    next standby already), or removed: once it is confirmed empty, after the exit is
    reported (in a worker thread)."""
    directories = [root / path for root in execution.cgroups.roots()]

    def back() -> bool:
        ready = execution._standby.ready  # white-box: what the next load takes
        if ready is not None and ready.cgroup is not None and ready.cgroup.path == path:
            return True
        if path in execution._pool.paths():  # white-box: what the next child may take
            return not any(
                (directory / "cgroup.procs").read_text()
                for directory in directories
                if directory.exists()
            )
        return not any(directory.exists() for directory in directories)

    await until(back, f"{path} kept or removed")


async def test_a_fork_bomb_never_holds_more_processes_than_its_limit(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    record = await loaded(sup, "hogs:bomb", Limits(processes=20))
    await until_logged(execution, record.handle, "held after", bound=BOUND)
    pids = cgroup_file(execution, record, "pids")
    # The tracked process counts too, as machinery: 20 of the plugin's, and T.
    assert (pids / "pids.max").read_text().strip() == "21"
    assert int((pids / "pids.peak").read_text()) == 21
    assert int((pids / "pids.events").read_text().split()[1]) > 0  # forks refused
    with trio.fail_after(BOUND):
        termination = await sup.dispose(record.handle)
    # Its processes die of the interrupt, or are killed as it ends: none is left.
    assert termination.exit.signal == signal.SIGTERM, termination.describe()
    assert record.child.cgroup is not None
    await given_back(execution, record.child.cgroup)


async def test_four_children_of_100_mib_under_256_mib_are_never_all_alive(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    record = await loaded(sup, "hogs:memory", Limits(memory_bytes=256 * MiB))
    stopped = await until_stopped(sup, record.handle, bound=BOUND)
    log = execution.logs(record.handle)
    # The plugin survives (the OOM killer takes the biggest: a hog), and says which ended.
    assert log.count(" signal 9") >= 1, log
    assert stopped.termination.exit.code == 0
    assert stopped.termination.exit.oom_limit == 256 * MiB
    assert stopped.termination.describe() == "exited (code 0; out of memory, limit 256 MiB)"
    assert record.child.cgroup is not None
    await given_back(execution, record.child.cgroup)


async def test_a_spinner_under_cpu_percent_50_gets_about_half_a_core(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    record = await loaded(sup, "hogs:spinner", Limits(cpu_percent=50))
    await until_logged(execution, record.handle, "spinning", bound=BOUND)
    usage = cgroup_file(execution, record, "cpuacct") / "cpuacct.usage"  # ns, whole tree
    assert (cgroup_file(execution, record, "cpu") / "cpu.cfs_quota_us").read_text() == "50000\n"
    # Not a timing target: a spinner without the quota takes a whole core of the two
    # (about 1.0), with it about 0.5. Ten quota periods; the band only tells the two apart.
    used, began = int(usage.read_text()), trio.current_time()
    await trio.sleep(1.0)
    share = (int(usage.read_text()) - used) / 1e9 / (trio.current_time() - began)
    assert 0.3 <= share <= 0.7, share
    with trio.fail_after(BOUND):
        await sup.dispose(record.handle)


async def test_without_cgroups_memory_is_rlimit_as_and_other_tree_limits_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An empty directory as the cgroup root: no hierarchy is found, as on a machine
    # where none is mounted or writable.
    nothing = tmp_path / "no-cgroups"
    nothing.mkdir()
    with caplog.at_level(logging.INFO, "trio_supervisor.executions.subprocess"):
        async with (
            SubprocessExecution(
                tmp_path / "state", entry_paths=[PLUGINS], cgroup_root=nothing
            ) as execution,
            open_supervisor(MemoryStore(), execution, lease=30.0, grace=1.0) as sup,
        ):
            assert not execution.cgroups.used
            for limits, named in (
                (Limits(processes=5), "processes=5"),
                (Limits(cpu_percent=50, memory_bytes=300 * MiB), "cpu_percent=50"),
            ):
                handle = await opened(sup, limits=limits, request_id=named)
                with trio.fail_after(BOUND), pytest.raises(PackageError, match=named):
                    await sup.load(handle, Load(specifier="heartbeat:main"))
            handle = await opened(sup, limits=Limits(memory_bytes=300 * MiB), request_id="m")
            await sup.load(handle, Load(specifier="hungry:main"))
            stopped = await until_stopped(sup, handle, bound=BOUND)
            assert isinstance(stopped, StoppedRecord)
            assert stopped.termination.exit.code == 1
            assert stopped.termination.exit.oom_limit is None
            assert isinstance(stopped.previous, LoadedRecord)
            assert stopped.previous.child.cgroup is None
            assert "MemoryError" in execution.logs(handle)
    [line] = [m for m in caplog.messages if m.startswith("subprocess children's trees")]
    assert "no cgroup (no cgroup hierarchy under" in line
    assert "memory_bytes is RLIMIT_AS per process" in line


def test_without_cgroup_kill_every_member_is_killed_until_none_is_left(tmp_path: Path) -> None:
    # cgroup v1 alone, as on a kernel without cgroup.kill: a SIGKILL per member, in passes.
    found = detect(ROOT, tmp_path)
    hierarchies = attrs.evolve(found, kill=None)
    assert "pids" in hierarchies.limits
    cgroup = hierarchies.child("daemons", Limits(processes=10))
    cgroup.create()
    try:
        with subprocess.Popen(
            [sys.executable, "-c", DAEMONS, *cgroup.procs], stdout=subprocess.PIPE, text=True
        ) as joined:
            assert joined.stdout is not None
            assert joined.stdout.readline() == "ready\n"
            assert len(cgroup.members()) == 6  # setsid'd double forks included
            assert trio.run(cgroup.emptied) == 6
            assert cgroup.members() == set()
            assert joined.wait(timeout=BOUND) == -signal.SIGKILL
    finally:
        reap_orphans()  # the daemons, re-parented to us (a child subreaper)
        trio.run(cgroup.remove)
        found.close()
    assert not any(
        directory.exists()
        for directory in found.child("daemons", Limits(processes=10)).directories()
    )


async def test_an_execution_starts_by_removing_the_empty_cgroups_its_state_s_last_run_left(
    tmp_path: Path,
) -> None:
    left = await trio.to_thread.run_sync(detect, ROOT, tmp_path)
    every = Limits(memory_bytes=256 * MiB, processes=10, cpu_percent=100)  # every hierarchy
    for name in ("empty-1", "empty-2"):
        left.child(name, every).create()  # as a run killed between spawn and join
    leftovers = sorted(left.leftovers())
    assert len(leftovers) == 2 * len(left.roots())
    async with SubprocessExecution(tmp_path, entry_paths=[PLUGINS]) as execution:
        assert list(execution.cgroups.leftovers()) == []
    assert not any(path.exists() for path in leftovers)
    assert not any((root / left.parent).exists() for root in left.roots())  # its own too


async def test_a_load_that_cannot_start_leaves_no_cgroup_behind(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    # Started: its cgroup was made, and its interpreter moved in, while Python booted.
    for specifier, limits, named in (
        ("missing:main", Limits(processes=5), "no module 'missing'"),
        ("heartbeat:main", Limits(memory_bytes=1), "memory_bytes=1"),
    ):
        handle = await opened(sup, limits=limits, request_id=named)
        with trio.fail_after(BOUND), pytest.raises(PackageError, match=named):
            await sup.load(handle, Load(specifier=specifier))

    # Kept for the next child, or removed, once confirmed empty (in a worker thread, as
    # the load fails): none holds anything.
    def empty() -> bool:
        return not any(
            (path / "cgroup.procs").read_text() for path in execution.cgroups.leftovers()
        )

    await until(empty, "no cgroup holds anything")


async def prepared_standby(execution: SubprocessExecution) -> tuple[Interpreter, TreeCgroup]:
    """The standby and its cgroup, once it waits in it."""

    def prepared() -> tuple[Interpreter, TreeCgroup] | None:
        ready = execution._standby.ready  # white-box: what the next load takes
        if ready is None or ready.cgroup is None:
            return None
        # It joins by itself, once it is told to; isolated, its plugin is forked ahead
        # in it (and is its one other member).
        pid = ready.process.pid
        members = ready.cgroup.members(everywhere=False)
        if pid not in members or not all(member in (pid, *descendants(pid)) for member in members):
            return None
        return ready, ready.cgroup

    return await until(prepared, "a standby in a cgroup of its own", bound=BOUND)


async def test_a_standby_waits_in_its_cgroup_and_the_load_that_takes_it_writes_its_limits(
    tmp_path: Path,
) -> None:
    async with (
        SubprocessExecution(tmp_path, entry_paths=[PLUGINS], standby=True) as execution,
        open_supervisor(MemoryStore(), execution, lease=30.0, grace=1.0) as sup,
    ):
        hierarchies = execution.cgroups.limits
        if not {"memory", "pids"} <= set(hierarchies):
            pytest.skip(f"cgroups here: {execution.cgroups.describe()}")
        # Standbys wait in a cgroup once a load resolved under a tree limit: the one
        # started as the second load takes its own is the first to. (Each load
        # supersedes the one before.)
        for request in ("first", "second"):
            await loaded(sup, "heartbeat:main", Limits(processes=10), request)
        standby, cgroup = await prepared_standby(execution)
        pids = hierarchies["pids"] / cgroup.path
        memory = hierarchies["memory"] / cgroup.path
        waiting = {int(pid) for pid in (pids / "cgroup.procs").read_text().split()}
        assert waiting == {standby.process.pid, *descendants(standby.process.pid)}
        assert (pids / "pids.max").read_text() == "max\n"  # written by the load
        assert not memory.exists()  # only where the last load's limits needed one
        record = await loaded(
            sup, "heartbeat:main", Limits(processes=5, memory_bytes=256 * MiB), "third"
        )
        assert record.child.cgroup == cgroup.path
        assert record.child.pid == standby.process.pid
        assert (pids / "pids.max").read_text() == "6\n"
        assert int((memory / "memory.limit_in_bytes").read_text()) == 256 * MiB
        # T joined the hierarchy the load added before it forked the plugin.
        assert len((memory / "cgroup.procs").read_text().split()) == 2
        with trio.fail_after(BOUND):
            await sup.dispose(record.handle)
        await given_back(execution, cgroup.path)


async def test_a_prepared_cgroup_goes_with_its_standby(tmp_path: Path) -> None:
    async with (
        SubprocessExecution(tmp_path, entry_paths=[PLUGINS], standby=True) as execution,
        open_supervisor(MemoryStore(), execution, lease=30.0, grace=1.0) as sup,
    ):
        if "pids" not in execution.cgroups.limits:
            pytest.skip(f"cgroups here: {execution.cgroups.describe()}")
        for request in ("first", "second"):  # each supersedes the one before
            await loaded(sup, "heartbeat:main", Limits(processes=10), request)
        # Killed while it waits: the load that finds it dead removes its cgroup.
        dead, cgroup = await prepared_standby(execution)
        os.kill(dead.process.pid, signal.SIGKILL)
        await until(lambda: dead.process.poll() is not None, "the standby is dead", bound=BOUND)
        third = await loaded(sup, "heartbeat:main", Limits(processes=10), "third")
        assert third.child.pid != dead.process.pid
        await until(lambda: not cgroup.directories()[0].exists(), "its cgroup removed")
        # Discarded as the execution exits: its cgroup goes with it, and then the parents.
        _, waiting = await prepared_standby(execution)
        directories = waiting.directories()
        with trio.fail_after(BOUND):
            await sup.dispose(third.handle)
    assert not any(directory.exists() for directory in directories)
    assert not any(directory.parent.exists() for directory in directories)


def outrun(interpreter: Interpreter, cgroup: TreeCgroup) -> None:
    """The load's making gets to the first directory before the standby reads "join"."""
    cgroup.directories()[0].mkdir(parents=True)
    interpreter.control.sendall(
        frame({"command": "join", "make": cgroup.made_by_member(), "cgroups": cgroup.procs})
    )
    interpreter.cgroup = cgroup


def failed(interpreter: Interpreter, cgroup: TreeCgroup) -> None:
    """The standby makes none of it (its mkdir failed: no memory, a parent removed under
    it meanwhile), so its join fails too."""
    cgroup.made_by_member()
    interpreter.control.sendall(frame({"command": "join", "make": [], "cgroups": cgroup.procs}))
    interpreter.cgroup = cgroup


@pytest.mark.parametrize("join_ahead", [outrun, failed])
async def test_a_spawn_message_names_only_cgroups_that_are_made(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    join_ahead: Callable[[Interpreter, TreeCgroup], None],
) -> None:
    # The race of a loaded machine: a load takes the standby before it has read its
    # "join", and makes what it finds missing of its cgroup, a directory per hierarchy;
    # the standby then finds the first made already. Or the standby could not make it.
    # Either way T joins each hierarchy as soon as it reads its spawn message, which
    # must name none that is not made. Here the load's own making is slow: its thread
    # is preempted after the spawn message went out, as on 2 cores under load.
    configure = TreeCgroup.configure

    def preempted(cgroup: TreeCgroup) -> None:
        time.sleep(0.5)
        configure(cgroup)

    send = ProcessUnit._send
    missing: list[str] = []

    async def sent(unit: ProcessUnit, *messages: Command, **options: Any) -> None:
        for message in messages:
            if message["command"] == "spawn":
                # Looked at as it goes (a few stats), not after: that is the moment T reads.
                procs = message.get("cgroups", [])
                missing.extend(path for path in procs if not os.path.exists(path))  # noqa: ASYNC240
        await send(unit, *messages, **options)

    # Cgroups made for the standby: one the pool kept is made already, so the race
    # cannot arise with it.
    monkeypatch.setattr(_pool, "POOL", 0)
    monkeypatch.setattr(Interpreter, "join_ahead", join_ahead)
    monkeypatch.setattr(TreeCgroup, "configure", preempted)
    monkeypatch.setattr(ProcessUnit, "_send", sent)
    limits = Limits(processes=10, memory_bytes=256 * MiB)  # two hierarchies, and the kill's
    async with (
        SubprocessExecution(tmp_path, entry_paths=[PLUGINS], standby=True) as execution,
        open_supervisor(MemoryStore(), execution, lease=30.0, grace=1.0) as sup,
    ):
        if not {"memory", "pids"} <= set(execution.cgroups.limits):
            pytest.skip(f"cgroups here: {execution.cgroups.describe()}")
        # Standbys are told to join a cgroup once a load resolved under a tree limit:
        # the one started as the second load takes its own is the first to.
        for request in ("first", "second"):
            await loaded(sup, "heartbeat:main", limits, request)

        def told_to_join() -> Interpreter | None:
            ready = execution._standby.ready  # white-box: what the next load takes
            return ready if ready is not None and ready.cgroup is not None else None

        standby = await until(told_to_join, "a standby told to join a cgroup", bound=BOUND)
        assert standby.cgroup is not None
        if join_ahead is outrun:
            # What it finds made is its own cgroup: it joins it while it waits all the
            # same (the move stays off the load's path).
            assert await prepared_standby(execution) == (standby, standby.cgroup)
        directories = standby.cgroup.directories()
        with trio.fail_after(BOUND):
            record = await loaded(sup, "heartbeat:main", limits, "third")
        assert missing == []
        assert record.child.pid == standby.process.pid
        assert record.child.cgroup == standby.cgroup.path
        for directory in directories:
            assert str(standby.process.pid) in (directory / "cgroup.procs").read_text().split()
