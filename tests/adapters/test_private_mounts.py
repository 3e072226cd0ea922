"""What each isolated child has of its own: its PID namespace's ``/proc``, and a fresh
tmpfs over ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (``_bootstrap.own_mounts``).

Real processes; the plugin (``plugins_isolation/attacks.py:private``) prints what it
sees and what each attempt got, then says "done". What two children see is tested with
children started, forked by the fork server and taken from the standby, isolated by
uids of their own and by namespaces alone; the kill with each of the three starts.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import uuid
from pathlib import Path

import attrs
import pytest
import trio

from trio_supervisor import (
    ExecutionError,
    ExitStatus,
    Key,
    Load,
    LoadedRecord,
    MemoryStore,
    SubprocessExecution,
    Supervisor,
    Termination,
    open_supervisor,
)
from trio_supervisor.executions.limits._view import PRIVATE
from trio_supervisor.executions.trees import _containment

from ..support.plugins import ISOLATION, PLUGINS
from ..support.processes import IN_SYSTEM_TMP
from ..support.waits import BOUND, until_logged
from .children import STARTS, attacks, loaded

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="children get uids of their own as root")

KINDS = ("users", "namespace")


@pytest.fixture(params=list(STARTS))
def start(request: pytest.FixtureRequest) -> dict[str, bool]:
    return STARTS[request.param]


def seen(log: str, what: str) -> list[list[str]]:
    """The words after ``what`` on each line of the log that starts with it."""
    return [line.split()[1:] for line in log.splitlines() if line.startswith(what + " ")]


def plugin_of(record: LoadedRecord) -> int:
    """The plugin process (our pid for it): the tracked process's one child."""
    tracked = record.child.pid
    [plugin] = Path(f"/proc/{tracked}/task/{tracked}/children").read_text().split()
    return int(plugin)


async def private_child(
    supervisor: Supervisor, instance: str, marks: dict[str, str], other: str, **config: object
) -> LoadedRecord:
    return await loaded(
        supervisor,
        instance,
        "attacks:private",
        runner=os.getpid(),
        mine=marks[instance],
        other=marks[other],
        **config,
    )


def listed(execution: SubprocessExecution, mark: str) -> list[list[str]]:
    """What a child lists in each fresh tmpfs: the file it left there (``mark``), and the
    mount points of what was kept for it below one (a checkout, a state directory or
    an entry path under /tmp, say), nothing else."""
    kept = [*execution.isolated.keep]
    if execution.isolated.homes_kept is not None:
        kept.append(str(execution.isolated.homes_kept))
    found = []
    for directory in PRIVATE:
        points = {
            Path(path).relative_to(directory).parts[0]
            for path in kept
            if Path(path).is_relative_to(directory) and Path(path) != Path(directory)
        }
        found.append([directory, *sorted({mark, *points})])
    return found


@pytest.mark.parametrize("kind", KINDS)
async def test_two_children_see_neither_each_other_nor_the_runner(
    tmp_path: Path, start: dict[str, bool], kind: str
) -> None:
    marks = {name: f"trio-supervisor-{name}-{uuid.uuid4().hex}" for name in ("a", "b")}
    async with (
        SubprocessExecution(
            tmp_path / "state",
            entry_paths=[ISOLATION],
            fork_server=start["fork_server"],
            standby=start["standby"],
            isolation=kind,  # type: ignore[arg-type]
        ) as execution,
        open_supervisor(MemoryStore(), execution, grace=1.0) as supervisor,
    ):
        assert execution.isolated.proc_refused == ""
        # Both loaded at once; "b" looks for what "a" left once "a" has left it.
        records = {}
        for name, other in (("a", "b"), ("b", "a")):
            records[name] = await private_child(supervisor, name, marks, other)
            await until_logged(execution, records[name].handle, "done", bound=BOUND)
        for name, record in records.items():
            log = execution.logs(record.handle)
            # Its /proc lists its namespace alone: its tracked process (PID 1) and itself.
            [[own, *pids]] = seen(log, "PIDS")
            assert [int(pid) for pid in pids] == [1, int(own)], log
            outcomes = attacks(log)
            assert outcomes.pop("write in its TMPDIR").startswith("SUCCEEDED")
            assert set(outcomes) == {
                "read the runner's command line",
                "read the runner's environment",
                *(f"read the other's file in {directory}" for directory in PRIVATE),
            }
            # The runner's pid is nobody in there; nor are the other's files.
            assert all(said.startswith("refused FileNotFoundError") for said in outcomes.values())
            # Each directory is a fresh tmpfs: it holds what the child wrote alone, which
            # is in the child's mount namespace, not on the host.
            assert seen(log, "LISTED") == listed(execution, marks[name])
            root = Path(f"/proc/{plugin_of(record)}/root")
            for directory in PRIVATE:
                assert (root / directory.lstrip("/") / marks[name]).is_file()
                assert not Path(directory, marks[name]).exists()  # noqa: ASYNC240
        for record in records.values():
            with trio.fail_after(BOUND):
                termination = await supervisor.dispose(record.handle)
            # The interrupt still reaches the plugin, and its status is the plugin's.
            assert (termination.kind, termination.exit.signal) == ("exited", 15)
    for mark in marks.values():
        assert not any(Path(directory, mark).exists() for directory in PRIVATE)  # noqa: ASYNC240


async def test_the_kill_still_ends_a_stubborn_child_and_its_grandchildren(
    tmp_path: Path, start: dict[str, bool]
) -> None:
    # One plugin ignores the interrupt: the kill after the grace ends it. The other dies
    # of it at once, and its grandchildren, which ignore it, are killed as it ends. Each
    # status is as without a /proc and /tmp of their own.
    async with (
        SubprocessExecution(
            tmp_path,
            entry_paths=[PLUGINS],
            fork_server=start["fork_server"],
            standby=start["standby"],
        ) as execution,
        open_supervisor(MemoryStore(), execution, grace=1.0) as supervisor,
    ):
        assert execution.isolated.kind == "users"
        stubborn = await loaded(supervisor, "stubborn", "stubborn:main")
        spawner = await loaded(supervisor, "spawner", "spawner:main", leader="dies at once")
        await until_logged(execution, stubborn.handle, "ignoring SIGTERM", bound=BOUND)
        await until_logged(execution, spawner.handle, "grandchildren", bound=BOUND)
        terminations = {}

        async def dispose(record: LoadedRecord) -> None:
            terminations[record.handle.key.instance] = await supervisor.dispose(record.handle)

        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                for record in (stubborn, spawner):
                    nursery.start_soon(dispose, record)
        assert terminations == {
            "stubborn": Termination(kind="killed", exit=ExitStatus(signal=signal.SIGKILL)),
            "spawner": Termination(
                kind="exited", exit=ExitStatus(signal=signal.SIGTERM, descendants_killed=2)
            ),
        }


@pytest.mark.parametrize("kind", KINDS)
async def test_what_children_need_below_tmp_is_mounted_back_in_their_own(kind: str) -> None:
    # The state directory and the entry path in the host's /tmp: the child's fresh /tmp
    # has them mounted back (its private directory writable, the rest read-only), and
    # nothing else of the host's.
    with tempfile.TemporaryDirectory(prefix=IN_SYSTEM_TMP, dir="/tmp") as directory:
        base = Path(directory)
        plugins = base / "plugins"
        shutil.copytree(ISOLATION, plugins)
        marks = {"a": f"trio-supervisor-{uuid.uuid4().hex}", "b": "none"}
        async with (
            SubprocessExecution(base / "state", entry_paths=[plugins], isolation=kind) as execution,  # type: ignore[arg-type]
            open_supervisor(MemoryStore(), execution, grace=1.0) as supervisor,
        ):
            assert str(plugins) in execution.isolated.keep
            assert execution.isolated.homes_kept == base / "state" / "children"
            record = await private_child(supervisor, "a", marks, "b", entry=True)
            await until_logged(execution, record.handle, "done", bound=BOUND)
            log = execution.logs(record.handle)
            assert seen(log, "LISTED") == listed(execution, marks["a"])
            assert base.name in seen(log, "LISTED")[0]
            assert attacks(log)["write in its TMPDIR"].startswith("SUCCEEDED")
            assert attacks(log)["write in its entry path"].startswith("refused")
            with trio.fail_after(BOUND):
                await supervisor.dispose(record.handle)


async def test_a_child_in_a_user_namespace_mounts_its_own_proc_too(tmp_path: Path) -> None:
    # What a runner that is not root gives its children: the PID namespace is made in a
    # user namespace of its own ("user"), forced here for children started from now on.
    marks = {"a": f"trio-supervisor-{uuid.uuid4().hex}", "b": "none"}
    async with (
        SubprocessExecution(tmp_path, entry_paths=[ISOLATION], isolation="namespace") as execution,
        open_supervisor(MemoryStore(), execution, grace=1.0) as supervisor,
    ):
        execution.mechanism = attrs.evolve(execution.mechanism, unshare="user")
        record = await private_child(supervisor, "a", marks, "b")
        await until_logged(execution, record.handle, "done", bound=BOUND)
        tracked = record.child.pid
        assert os.readlink(f"/proc/{tracked}/ns/user") != os.readlink("/proc/self/ns/user")
        log = execution.logs(record.handle)
        [[own, *pids]] = seen(log, "PIDS")
        assert [int(pid) for pid in pids] == [1, int(own)], log
        assert seen(log, "LISTED") == listed(execution, marks["a"])
        with trio.fail_after(BOUND):
            await supervisor.dispose(record.handle)


async def test_a_step_that_fails_fails_the_load_naming_it(tmp_path: Path) -> None:
    async with (
        SubprocessExecution(tmp_path / "on", entry_paths=[ISOLATION]) as execution,
        SubprocessExecution(
            tmp_path / "swept", entry_paths=[ISOLATION], containment="sweep"
        ) as swept,
        open_supervisor(MemoryStore(), execution, grace=1.0) as supervisor,
        open_supervisor(MemoryStore(), swept, grace=1.0) as swept_supervisor,
    ):
        # A directory to make private that is not there.
        execution.isolated.private = ("/nonexistent-trio-supervisor",)
        # A child promised a /proc of its own, without a PID namespace.
        assert swept.isolated.proc_refused.startswith("no PID namespace")
        swept.isolated.proc_refused = ""
        for sup, words in (
            (
                supervisor,
                r"^cannot isolate the child: \[Errno 2\] mount /nonexistent-trio-supervisor: No ",
            ),
            (swept_supervisor, r"^cannot isolate the child: it has no PID namespace of its own"),
        ):
            record = await sup.open(Key(identity="tenant", instance="a"), "a")
            with trio.fail_after(BOUND), pytest.raises(ExecutionError, match=words):
                await sup.load(record.handle, Load(specifier="attacks:identity"))


async def test_where_the_kernel_refuses_their_own_proc_the_log_says_so_and_they_keep_the_host_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # As in a container whose /proc has paths masked, to a runner that is not root.
    refusal = "[Errno 1] mount /proc: Operation not permitted"

    async def probed(python: str, bootstrap: Path) -> tuple[bool, str]:
        await trio.lowlevel.checkpoint()
        return True, f"pid\nno /proc: {refusal}"

    monkeypatch.setattr(_containment, "_probe", probed)
    marks = {"a": f"trio-supervisor-{uuid.uuid4().hex}", "b": "none"}
    with caplog.at_level(logging.INFO, "trio_supervisor.executions.subprocess"):
        async with (
            SubprocessExecution(tmp_path, entry_paths=[ISOLATION]) as execution,
            open_supervisor(MemoryStore(), execution, grace=1.0) as supervisor,
        ):
            assert execution.mechanism.kind == "namespace"
            record = await private_child(supervisor, "a", marks, "b")
            await until_logged(execution, record.handle, "done", bound=BOUND)
            log = execution.logs(record.handle)
            # The host's /proc: the runner is in it. Its /tmp is its own all the same.
            assert os.getpid() in [int(pid) for pid in seen(log, "PIDS")[0][1:]]
            assert seen(log, "LISTED") == listed(execution, marks["a"])
            with trio.fail_after(BOUND):
                await supervisor.dispose(record.handle)
    [said] = [record.getMessage() for record in caplog.records if "isolated by" in record.message]
    assert f"the host's /proc, with every process in it ({refusal})" in said
