"""Emptied cgroups kept for the next children (``executions/limits/_pool.py``).

Real processes, real cgroups and the real clock. A gone child's cgroup is kept in a
worker thread once the loop is idle, so a test waits for the pool to hold it (polled,
bounded: nothing else says so) before the load that should get it. The crash is a runner
of its own (a script below) killed with SIGKILL, as test_containment.py's are.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from trio_supervisor import (
    Key,
    Limits,
    Load,
    LoadedRecord,
    MemoryStore,
    SqliteStore,
    StoppedRecord,
    SubprocessExecution,
    Supervisor,
    open_supervisor,
)
from trio_supervisor.executions.limits._cgroups import ROOT

from ..support.plugins import LIMITS, PLUGINS
from ..support.processes import launched, reap_orphans, running
from ..support.waits import BOUND, until, until_stopped

MiB = 1024 * 1024
# Below what a v1 memory limit, or a memory plus swap one, reads when there is none
# (9223372036854771712 with 4 KiB pages).
UNLIMITED = 2**62

pytestmark = pytest.mark.skipif(
    not (ROOT / "pids" / "cgroup.procs").exists(), reason="needs writable cgroup hierarchies"
)


@pytest.fixture
async def execution(tmp_path: Path) -> AsyncIterator[SubprocessExecution]:
    """Children started cold: each load's interpreter is moved into its cgroup as it
    boots, one the pool keeps where it has one."""
    async with SubprocessExecution(tmp_path, entry_paths=[LIMITS, PLUGINS]) as started:
        if not {"memory", "pids"} <= set(started.cgroups.limits):
            pytest.skip(f"cgroups here: {started.cgroups.describe()}")
        yield started


@pytest.fixture
async def sup(execution: SubprocessExecution) -> AsyncIterator[Supervisor]:
    async with open_supervisor(MemoryStore(), execution, lease=30.0, grace=1.0) as supervisor:
        yield supervisor


async def loaded(sup: Supervisor, name: str, specifier: str, limits: Limits) -> LoadedRecord:
    """A child of its own key ``name``, loaded."""
    opened = await sup.open(Key(identity="pool", instance=name), "r1", limits=limits)
    await sup.load(opened.handle, Load(specifier=specifier))
    record = await sup.status(opened.handle)
    assert isinstance(record, LoadedRecord)
    return record


async def kept(execution: SubprocessExecution, record: LoadedRecord) -> str:
    """The cgroup of ``record``'s gone child, once the pool keeps it (or gave it on to the
    standby, which may take it as soon as it is kept)."""
    path = record.child.cgroup
    assert path is not None

    def back() -> bool:
        ready = execution._standby.ready  # white-box: what the next load takes
        if ready is not None and ready.cgroup is not None and ready.cgroup.path == path:
            return True
        return path in execution._pool.paths()

    await until(back, f"{path} kept", bound=BOUND)
    return path


def read(execution: SubprocessExecution, path: str, controller: str, name: str) -> str:
    return (execution.cgroups.limits[controller] / path / name).read_text().strip()


async def test_the_next_child_gets_the_cgroup_its_own_limits_and_nothing_of_the_first(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    # The first child's four hogs of 100 MiB meet its 256 MiB: the kernel kills one
    # (an OOM kill in its cgroup's counter, which cannot be reset).
    first = await loaded(sup, "first", "hogs:memory", Limits(memory_bytes=256 * MiB))
    stopped = await until_stopped(sup, first.handle, bound=BOUND)
    assert stopped.termination.exit.oom_limit == 256 * MiB
    path = await kept(execution, first)
    assert int(read(execution, path, "memory", "memory.limit_in_bytes")) >= UNLIMITED
    # The second, in the hierarchies the first's limits needed, takes the cgroup, with a
    # limit of its own, and nothing of the first's use of it.
    second = await loaded(sup, "second", "heartbeat:main", Limits(memory_bytes=128 * MiB))
    assert second.child.cgroup == path
    assert str(second.child.pid) in read(execution, path, "memory", "cgroup.procs").split()
    assert int(read(execution, path, "memory", "memory.limit_in_bytes")) == 128 * MiB
    if execution.cgroups.memsw:
        assert int(read(execution, path, "memory", "memory.memsw.limit_in_bytes")) == 128 * MiB
    assert read(execution, path, "memory", "memory.failcnt") == "0"
    assert int(read(execution, path, "memory", "memory.max_usage_in_bytes")) < 100 * MiB
    oom_control = read(execution, path, "memory", "memory.oom_control").split()
    assert int(oom_control[oom_control.index("oom_kill") + 1]) > 0  # the first's, for good
    with trio.fail_after(BOUND):
        termination = await sup.dispose(second.handle)
    # Its end is not the first's OOM kill.
    assert termination.kind == "exited", termination.describe()
    assert termination.exit.oom_limit is None, termination.describe()
    assert "out of memory" not in termination.describe()


async def test_a_cgroup_is_kept_only_for_the_hierarchies_it_is_in(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    both = Limits(memory_bytes=256 * MiB, processes=10)
    first = await loaded(sup, "first", "heartbeat:main", both)
    with trio.fail_after(BOUND):
        await sup.dispose(first.handle)
    path = await kept(execution, first)
    assert read(execution, path, "pids", "pids.max") == "max"  # reset as it was kept
    # Processes alone: no memory hierarchy, so a cgroup of its own.
    alone = await loaded(sup, "alone", "heartbeat:main", Limits(processes=5))
    assert alone.child.cgroup != path
    assert path in execution._pool.paths()
    # The same two: the kept one, with its own limits.
    again = await loaded(
        sup, "again", "heartbeat:main", Limits(memory_bytes=192 * MiB, processes=3)
    )
    assert again.child.cgroup == path
    assert read(execution, path, "pids", "pids.max") == "4"  # and T, as machinery
    assert int(read(execution, path, "memory", "memory.limit_in_bytes")) == 192 * MiB
    with trio.fail_after(BOUND):
        await sup.dispose(alone.handle)
        await sup.dispose(again.handle)


async def test_a_standby_waits_in_a_kept_cgroup_and_a_load_without_limits_gets_none(
    tmp_path: Path,
) -> None:
    limits = Limits(memory_bytes=256 * MiB, processes=10)
    async with (
        SubprocessExecution(tmp_path, entry_paths=[PLUGINS], standby=True) as execution,
        open_supervisor(MemoryStore(), execution, lease=30.0, grace=1.0) as sup,
    ):
        if not {"memory", "pids"} <= set(execution.cgroups.limits):
            pytest.skip(f"cgroups here: {execution.cgroups.describe()}")
        standby = execution._standby  # white-box: what the next load takes

        def waiting(path: str) -> bool:
            ready = standby.ready
            if ready is None or ready.cgroup is None or ready.cgroup.path != path:
                return False
            return str(ready.process.pid) in read(execution, path, "pids", "cgroup.procs").split()

        # A standby is told which cgroup to join once it has booted: a kept one, or one
        # of its own where it was told before a gone child's was kept (or none, before a
        # load resolved under tree limits). So loads take the standbys until one waits
        # in a kept cgroup (the first standby started after a child's was kept).
        gone: set[str] = set()
        for number in range(5):
            record = await loaded(sup, f"limited-{number}", "heartbeat:main", limits)
            with trio.fail_after(BOUND):
                await sup.dispose(record.handle)
            gone.add(await kept(execution, record))
            ready = await until(lambda: standby.ready, "a standby", bound=BOUND)
            if ready.cgroup is not None and ready.cgroup.path in gone:
                break
        assert ready.cgroup is not None, "no standby in a kept cgroup"
        path = ready.cgroup.path
        assert path in gone, "no standby in a kept cgroup"
        await until(lambda: waiting(path), "a standby waiting in the kept cgroup", bound=BOUND)
        # A load that asks for no tree limit takes it, and no limit of the first's.
        third = await loaded(sup, "third", "heartbeat:main", Limits())
        assert third.child.cgroup == path
        assert int(read(execution, path, "memory", "memory.limit_in_bytes")) >= UNLIMITED
        assert read(execution, path, "pids", "pids.max") == "max"
        with trio.fail_after(BOUND):
            await sup.dispose(third.handle)
        await kept(execution, third)
        roots = execution.cgroups.roots({"memory", "pids"})  # and the kill's
        directories = [root / path for root in roots]
        assert all(directory.is_dir() for directory in directories)
    # The execution's end empties the pool, and then the parents go.
    assert not any(directory.exists() for directory in directories)
    assert not any(directory.parent.exists() for directory in directories)


async def test_the_pool_is_emptied_as_the_execution_ends(tmp_path: Path) -> None:
    limits = Limits(memory_bytes=256 * MiB, processes=10)
    async with (
        SubprocessExecution(tmp_path, entry_paths=[PLUGINS]) as execution,
        open_supervisor(MemoryStore(), execution, lease=30.0, grace=1.0) as sup,
    ):
        if not {"memory", "pids"} <= set(execution.cgroups.limits):
            pytest.skip(f"cgroups here: {execution.cgroups.describe()}")
        records = [await loaded(sup, name, "heartbeat:main", limits) for name in "ab"]
        with trio.fail_after(BOUND):
            for record in records:
                await sup.dispose(record.handle)
        paths = [await kept(execution, record) for record in records]
        roots = execution.cgroups.roots({"memory", "pids"})  # and the kill's
        directories = [root / path for path in paths for root in roots]
        assert all(directory.is_dir() for directory in directories)
        # Kept with their control files open (the next child's limits are written there).
        assert all(any(path in name for name in open_files()) for path in paths)
    assert not any(directory.exists() for directory in directories)
    assert not any(directory.parent.exists() for directory in directories)
    assert len(execution._pool) == 0
    # The control files it kept open are closed.
    assert not [path for path in open_files() if execution.cgroups.parent in path]


def open_files() -> list[str]:
    """What this process's file descriptors name."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the directory's own, closed meanwhile
    return found


async def test_recovery_by_the_same_execution_leaves_a_kept_cgroup_to_its_new_child(
    tmp_path: Path,
) -> None:
    # A runner that heals itself keeps its execution: the next incarnation recovers
    # records of the one before, one of which may name a cgroup that the execution has
    # emptied and given to another child since.
    limits = Limits(processes=10)
    store = MemoryStore()
    async with (
        SubprocessExecution(tmp_path, entry_paths=[PLUGINS]) as execution,
        open_supervisor(store, execution, lease=30.0, grace=1.0) as first,
    ):
        if "pids" not in execution.cgroups.limits:
            pytest.skip(f"cgroups here: {execution.cgroups.describe()}")
        gone = await loaded(first, "gone", "heartbeat:main", limits)
        crashed = store.copy()  # as if its Stopped record were never saved
        with trio.fail_after(BOUND):
            await first.dispose(gone.handle)
        path = await kept(execution, gone)
        held = await loaded(first, "held", "heartbeat:main", limits)
        assert held.child.cgroup == path
        async with open_supervisor(crashed, execution, lease=30.0, grace=1.0) as second:
            recovered = await second.status(gone.handle)
            assert isinstance(recovered, StoppedRecord)
            assert recovered.reason.kind == "Recovery"
            assert recovered.termination.describe() == "exited (already gone; exit status unknown)"
        # The child now in the cgroup was not touched.
        assert held.child.pid is not None
        assert running(held.child.pid)
        assert str(held.child.pid) in read(execution, path, "pids", "cgroup.procs").split()
        with trio.fail_after(BOUND):
            termination = await first.dispose(held.handle)
        assert termination.kind == "exited", termination.describe()  # by the SIGTERM


# A runner of its own on STATE with the plugins at PLUGINS: two children's cgroups kept
# ("kept PATH PATH"), then a third child in one of them ("holding PID PATH"), until killed.
RUNNER = """
import sys
from pathlib import Path

import trio

from trio_supervisor import Key, Limits, Load, SqliteStore, SubprocessExecution, open_supervisor


async def main(state, plugins):
    async with (
        SqliteStore(Path(state) / "state.db") as store,
        SubprocessExecution(state, entry_paths=[plugins], isolation="none") as execution,
        open_supervisor(store, execution, lease=60.0, grace=1.0) as supervisor,
    ):
        async def load(name):
            key = Key(identity="pool", instance=name)
            record = await supervisor.open(key, "r1", limits=Limits(processes=10))
            await supervisor.load(record.handle, Load(specifier="heartbeat:main"))
            return await supervisor.status(record.handle)

        for record in [await load("first"), await load("second")]:
            await supervisor.dispose(record.handle)
        while len(execution._pool) < 2:  # kept in a worker thread once the loop is idle
            await trio.sleep(0.01)
        print("kept", *execution._pool.paths(), flush=True)
        third = await load("third")
        print("holding", third.child.pid, third.child.cgroup, flush=True)
        await trio.sleep_forever()


trio.run(main, sys.argv[1], sys.argv[2])
"""


async def test_a_restarted_runner_removes_what_a_killed_one_kept_and_recovers_what_it_held(
    tmp_path: Path,
) -> None:
    command: list[str | Path] = [sys.executable, "-c", RUNNER, tmp_path, PLUGINS]
    ready = "holding"
    with launched(
        command, ready=lambda line: line.startswith(ready), stop=signal.SIGKILL
    ) as runner:
        _, *paths = runner.lines[-2].split()
        _, pid, path = runner.lines[-1].split()
        assert path in paths
        # Stopped, so that its dead-man switch cannot act as its runner dies: the
        # restarted runner's recovery has to end it, and empty its cgroup.
        os.kill(int(pid), signal.SIGSTOP)
        runner.process.send_signal(signal.SIGKILL)
        runner.process.wait()
    pids = ROOT / "pids"
    held = (pids / path / "cgroup.procs").read_text().split()
    assert pid in held
    [empty] = [found for found in paths if found != path]
    assert (pids / empty / "cgroup.procs").read_text() == ""
    try:
        async with (
            SqliteStore(tmp_path / "state.db") as store,
            SubprocessExecution(tmp_path, entry_paths=[PLUGINS], isolation="none") as execution,
        ):
            # The one kept empty is gone as the execution starts, before any recovery.
            assert not (pids / empty).exists()
            async with open_supervisor(store, execution, lease=30.0, grace=1.0):
                third = Key(identity="pool", instance="third")
                [record] = [found for found in await store.list() if found.handle.key == third]
                assert isinstance(record, StoppedRecord)
                assert record.termination.kind == "killed", record.termination.describe()
                assert not (pids / path).exists()
                assert list(execution.cgroups.leftovers()) == []
    finally:
        reap_orphans()  # what the recovery killed was the dead runner's: re-parented to us
    assert not running(int(pid))
