"""The fork server: children forked from a prepared interpreter, the same as started ones.

Real processes and the real clock; every wait is bounded by ``fail_after`` and none is a
timing assertion. The lifecycle, limit, output and identity tests of test_subprocess.py
run forked as well as started (its ``execution`` fixture), and test_containment.py runs
its dispose and killed-runner tests forked.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_supervisor import (
    ExecutionError,
    Key,
    Load,
    LoadedRecord,
    MemoryStore,
    SubprocessExecution,
    Supervisor,
    open_supervisor,
)
from trio_supervisor.executions.starting._standby import Interpreter
from trio_supervisor.executions.trees._groups import read_stat

from ..support.plugins import PLUGINS, report_in
from ..support.sessions import opened
from ..support.waits import BOUND, until, until_logged
from .children import bootstraps

# A plugin that says which of the modules it names were imported before it was.
PRELOADED = """
import sys

FOUND = {name: name in sys.modules for name in ("json", "email.message")}


def main(context):
    print("PRELOADED", sorted(name for name, found in FOUND.items() if found), flush=True)
    import time

    while True:
        time.sleep(0.1)
"""


@pytest.fixture
async def forking(tmp_path: Path) -> AsyncIterator[tuple[SubprocessExecution, Supervisor]]:
    async with (
        SubprocessExecution(tmp_path, entry_paths=[PLUGINS], fork_server=True) as execution,
        open_supervisor(MemoryStore(), execution, lease=30.0, grace=2.0) as supervisor,
    ):
        yield execution, supervisor


async def loaded(supervisor: Supervisor, instance: str, specifier: str) -> LoadedRecord:
    handle = await opened(supervisor, Key(identity="fork", instance=instance))
    await supervisor.load(handle, Load(specifier=specifier))
    record = await supervisor.status(handle)
    assert isinstance(record, LoadedRecord)
    return record


def descriptors(pid: int) -> set[str]:
    """What the process's open descriptors point at."""
    base = Path(f"/proc/{pid}/fd")
    return {os.readlink(base / fd) for fd in os.listdir(base)}


async def test_a_forked_child_is_our_child_leading_its_own_session(
    forking: tuple[SubprocessExecution, Supervisor],
) -> None:
    execution, supervisor = forking
    server = execution.fork_server_pid
    assert server is not None
    before = descriptors(server)
    record = await loaded(supervisor, "a", "inspector:main")
    pid = record.child.pid
    assert pid is not None
    assert execution.fork_server_forks == 1
    stat = read_stat(pid)
    assert stat is not None
    # Re-parented to us (the intermediate process is gone), in its own session.
    assert stat.ppid == os.getpid()
    assert os.getsid(pid) == pid == os.getpgid(pid) == record.child.pgid
    await until_logged(execution, record.handle, "REPORT", bound=BOUND)
    report = report_in(execution.logs(record.handle))
    assert report["environment"]["TRIO_SUPERVISOR_INSTANCE"] == "a"
    # The server kept nothing of the session: no socket, pipe or log of it.
    assert descriptors(server) == before
    termination = await supervisor.dispose(record.handle)
    assert termination.kind == "exited"
    assert termination.exit.signal == signal.SIGTERM


async def test_loads_fall_back_to_starting_while_the_server_is_gone_and_it_comes_back(
    forking: tuple[SubprocessExecution, Supervisor], caplog: pytest.LogCaptureFixture
) -> None:
    execution, supervisor = forking
    first = await loaded(supervisor, "first", "heartbeat:main")
    server = execution.fork_server_pid
    assert server is not None
    os.kill(server, signal.SIGKILL)
    with caplog.at_level(logging.WARNING):
        # The next load finds it gone, starts its own interpreter, and runs all the same.
        second = await loaded(supervisor, "second", "heartbeat:main")
    assert execution.fork_server_forks == 1
    assert second.child.pid is not None
    assert read_stat(second.child.pid) is not None
    await until_logged(execution, second.handle, "beat 1", bound=BOUND)
    assert any("fork server" in message for message in caplog.messages)
    # A child forked before the server died is not touched by its death.
    await until_logged(execution, first.handle, "beat 1", bound=BOUND)
    assert isinstance(await supervisor.status(first.handle), LoadedRecord)
    # Started again in the background (at most once a second): loads fork once more.
    with trio.fail_after(BOUND):
        while execution.fork_server_pid in (None, server):
            await trio.sleep(0.05)
            await loaded(supervisor, f"again-{trio.current_time()}", "heartbeat:main")
    third = await loaded(supervisor, "third", "heartbeat:main")
    assert execution.fork_server_forks >= 2
    assert third.child.pid is not None
    for record in (first, second, third):
        await supervisor.dispose(record.handle)


async def test_preloaded_modules_are_in_every_child_and_nothing_else_is(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "preloaded.py").write_text(PRELOADED)
    for preload, expected in ((["json"], "['json']"), ([], "[]")):
        async with (
            SubprocessExecution(
                tmp_path / str(len(preload)),
                entry_paths=[plugins],
                fork_server=True,
                preload=preload,
            ) as execution,
            open_supervisor(MemoryStore(), execution, lease=30.0, grace=2.0) as supervisor,
        ):
            record = await loaded(supervisor, "p", "preloaded:main")
            await until_logged(execution, record.handle, "PRELOADED", bound=BOUND)
            assert f"PRELOADED {expected}" in execution.logs(record.handle)
            await supervisor.dispose(record.handle)


async def test_a_preloaded_module_that_cannot_be_imported_fails_the_start(tmp_path: Path) -> None:
    execution = SubprocessExecution(tmp_path, fork_server=True, preload=["no_such_module_here"])
    with pytest.raises(ExecutionError, match="no_such_module_here"):
        async with execution:
            pass  # pragma: no cover - not reached
    assert execution.fork_server_pid is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"preload": ["json", "not a module"]}, "'not a module'"),
        ({"preload": ["json", ""]}, "got ''"),
        ({"fork_server": True, "subreaper": False}, "needs subreaper=True"),
    ],
)
def test_bad_fork_server_options_are_refused(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SubprocessExecution(tmp_path, **options)  # type: ignore[arg-type]


def test_preload_must_be_a_list_of_names(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="not one string"):
        SubprocessExecution(tmp_path, preload="json")


# How many standbys the race test may take to catch a fork request under way.
TRIES = 5


async def test_an_execution_closed_while_its_standby_is_forked_leaves_nothing(
    tmp_path: Path,
) -> None:
    # A load takes the standby, and the next one is forked in the background; the
    # execution exits while the fork server is still answering that request.
    taken: list[Interpreter] = []
    async with SubprocessExecution(
        tmp_path, entry_paths=[PLUGINS], fork_server=True, standby=True
    ) as execution:
        standby = execution._standby  # white-box: take the standby as a load would
        fork_server = execution._host.server
        assert execution._nursery is not None
        assert fork_server is not None
        for _ in range(TRIES):
            await until(lambda: standby.ready is not None, "the standby is ready", bound=BOUND)
            interpreter = standby.take(execution._nursery)
            assert interpreter is not None
            taken.append(interpreter)
            # The next standby is forked once the loop is idle (Standby.fill): the first
            # idle moment starts its request, and the next finds it waiting for the
            # answer, unless the server answered at once (the runner was preempted).
            await trio.testing.wait_all_tasks_blocked()
            await trio.testing.wait_all_tasks_blocked()
            if fork_server._lock.locked():
                break
        else:
            pytest.fail(f"the next fork was never seen under way in {TRIES} tries")
        server = execution.fork_server_pid
        assert server is not None
    for interpreter in taken:  # as loads that failed would
        await interpreter.discard()
    assert read_stat(server) is None, "the fork server outlived its execution"
    assert bootstraps() == set(), "a bootstrap outlived its execution"
