"""SubprocessExecution(standby=True): the interpreter started ahead of the next load.

Real processes and the real clock; every wait is bounded and none is a timing assertion.
The standby is found the way an operator would find it: a process of ours running the
bootstrap that no session names as its child.
"""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_supervisor import (
    Handle,
    Limits,
    Load,
    LoadedRecord,
    MemoryStore,
    SubprocessExecution,
    Supervisor,
    open_supervisor,
)
from trio_supervisor.executions.starting._standby import ForkedProcess

from ..support.plugins import PLUGINS, report_in
from ..support.processes import process_state, running
from ..support.sessions import opened
from ..support.waits import BOUND, until, until_logged
from .children import bootstraps


async def standby_other_than(execution: SubprocessExecution, *taken: int) -> int:
    """The waiting interpreter: a bootstrap of ours that is none of ``taken``.

    Once the execution offers one, it is the only such bootstrap: the process that made
    it (and its namespace) is gone and reaped, and it is our child.
    """

    def offered() -> int | None:
        ready = execution._standby.ready  # white-box: only when to look
        if ready is None or ready.process.pid in taken:
            return None
        waiting = bootstraps() - set(taken)
        assert waiting == {ready.process.pid}, (
            f"the standby offered is {ready.process.pid}; our bootstraps: {waiting}"
        )
        return ready.process.pid

    return await until(offered, "a standby interpreter is offered", bound=BOUND)


@pytest.fixture
async def execution(tmp_path: Path) -> AsyncIterator[SubprocessExecution]:
    async with SubprocessExecution(tmp_path, entry_paths=[PLUGINS], standby=True) as execution:
        yield execution


@pytest.fixture
async def sup(execution: SubprocessExecution) -> AsyncIterator[Supervisor]:
    async with open_supervisor(
        MemoryStore(), execution, lease=30.0, grace=1.0, confirmation_timeout=5.0
    ) as supervisor:
        yield supervisor


async def report_of(execution: SubprocessExecution, handle: Handle) -> dict[str, Any]:
    await until_logged(execution, handle, "REPORT ", bound=BOUND)
    return report_in(execution.logs(handle))


async def test_a_load_runs_in_the_interpreter_started_ahead_as_the_session_s_child(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    ahead = await standby_other_than(execution)
    handle = await opened(sup, limits=Limits(open_files=64, cpu_seconds=30))
    await sup.load(handle, Load(specifier="inspector:main", config={"chatter": 3}))
    record = await sup.status(handle)
    assert isinstance(record, LoadedRecord)
    assert record.child.pid == ahead
    assert record.child.pgid == ahead
    # It took its session's environment, limits and log, like a child started for it.
    report = await report_of(execution, handle)
    environment = report["environment"]
    assert environment["TRIO_SUPERVISOR_IDENTITY"] == handle.key.identity
    assert environment["TRIO_SUPERVISOR_INSTANCE"] == handle.key.instance
    assert environment["TRIO_SUPERVISOR_GENERATION"] == str(handle.generation)
    assert set(environment) <= {
        "PATH",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "PYTHONUNBUFFERED",
        "TRIO_SUPERVISOR_IDENTITY",
        "TRIO_SUPERVISOR_INSTANCE",
        "TRIO_SUPERVISOR_GENERATION",
    }
    assert report["limits"] == {
        "RLIMIT_AS": resource.getrlimit(resource.RLIMIT_AS)[0],  # inherited: not limited
        "RLIMIT_CPU": 30,
        "RLIMIT_NOFILE": 64,
        "RLIMIT_FSIZE": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
    }
    await until_logged(execution, handle, "xxx")  # printed after the report
    # The next one is already on its way.
    following = await standby_other_than(execution, ahead)
    with trio.fail_after(BOUND):
        await sup.dispose(handle)
    assert not running(ahead)
    assert running(following)


async def test_the_execution_s_exit_ends_its_standby(tmp_path: Path) -> None:
    async with SubprocessExecution(tmp_path, entry_paths=[PLUGINS], standby=True) as execution:
        ahead = await standby_other_than(execution)
    assert process_state(ahead) is None, "the standby was not ended and reaped"


async def test_an_execution_closed_while_its_standby_starts_leaves_no_process(
    tmp_path: Path,
) -> None:
    # The standby's start is under way (or not begun) when the execution exits.
    for attempt in range(5):
        async with SubprocessExecution(tmp_path / str(attempt), standby=True):
            for _ in range(attempt):
                await trio.lowlevel.checkpoint()
        assert bootstraps() == set(), f"left running after {attempt} checkpoints"


@pytest.mark.parametrize("reaped_first", [True, False], ids=["reaped", "just-killed"])
async def test_a_standby_that_died_is_replaced_by_a_fresh_child(
    sup: Supervisor, execution: SubprocessExecution, reaped_first: bool
) -> None:
    ahead = await standby_other_than(execution)
    os.kill(ahead, signal.SIGKILL)
    if reaped_first:
        await until(lambda: process_state(ahead) == "Z", "the killed standby", bound=BOUND)
    handle = await opened(sup)
    await sup.load(handle, Load(specifier="inspector:main"))
    record = await sup.status(handle)
    assert isinstance(record, LoadedRecord)
    assert record.child.pid != ahead
    report = await report_of(execution, handle)
    assert report["environment"]["TRIO_SUPERVISOR_INSTANCE"] == handle.key.instance
    with trio.fail_after(BOUND):
        await sup.dispose(handle)


async def test_capped_output_gets_a_child_of_its_own_and_the_standby_waits_on(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    ahead = await standby_other_than(execution)
    handle = await opened(sup, limits=Limits(output_bytes=1000))
    await sup.load(handle, Load(specifier="inspector:main", config={"chatter": 5000}))
    record = await sup.status(handle)
    assert isinstance(record, LoadedRecord)
    assert record.child.pid != ahead
    await until_logged(execution, handle, "output beyond", bound=BOUND)
    assert running(ahead)
    assert bootstraps() == {ahead, record.child.pid}
    with trio.fail_after(BOUND):
        await sup.dispose(handle)


async def test_a_standby_whose_supervisor_is_gone_exits_by_itself(
    execution: SubprocessExecution,
) -> None:
    ahead = await standby_other_than(execution)
    # What the supervisor's death looks like from the standby: its socket closes.
    ready = execution._standby.ready  # white-box: the only handle on the waiting socket
    assert ready is not None
    assert ready.process.pid == ahead
    ready.control.close()
    with trio.fail_after(BOUND):
        code = await ready.process.wait()
    assert code == 2


async def test_a_standby_is_offered_only_once_its_maker_is_reaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a PID namespace the standby T is made by a process that exits at once. Offered
    # before that process was reaped, a load (or a reader of the process table) could
    # find T not yet re-parented to us, and the maker in its place.
    offered_first: list[bool] = []
    reap_maker = ForkedProcess.reap_maker

    async def watched(process: ForkedProcess) -> None:
        ready = standby_execution._standby.ready
        offered_first.append(ready is not None and ready.process is process)
        await reap_maker(process)

    monkeypatch.setattr(ForkedProcess, "reap_maker", watched)
    async with SubprocessExecution(
        tmp_path, entry_paths=[PLUGINS], standby=True
    ) as standby_execution:
        await standby_other_than(standby_execution)
        if standby_execution.mechanism.kind != "namespace":
            # The sweep makes no namespace: the standby is started, and nothing made it.
            assert offered_first == []
            return
        assert offered_first, "the standby's maker was never reaped"
        assert not any(offered_first), "the standby was offered before its maker was reaped"
