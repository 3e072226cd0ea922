"""Loads that fail: one outcome however far the child got, one sentence, the whole traceback.

Real processes, started and forked; the real clock, every wait bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from trio_supervisor import (
    ExecutionError,
    ExitStatus,
    Key,
    Load,
    LoadFailed,
    MemoryStore,
    PackageError,
    StoppedRecord,
    SubprocessExecution,
    Supervisor,
    Termination,
    open_supervisor,
)

from ..support.waits import BOUND

ROUNDS = 8  # the traceback was lost 13 times in 20 when the child wrote it last

SOURCES = {
    "raises.py": "def helper():\n    raise RuntimeError('broken at import')\n\nhelper()\n",
    "syntax.py": "def f(:\n    pass\n",
    "fine.py": "def main(context):\n    pass\n",
    "quits.py": "import os\n\nos._exit(3)\n",
    "killed.py": "import os\nimport signal\n\nos.kill(os.getpid(), signal.SIGKILL)\n",
}

# specifier -> the whole message of the PackageError the load raises.
FAILURES = {
    "raises:main": (
        "cannot load 'raises:main': importing raises raised RuntimeError: broken at import "
        "(its traceback is in the session's log); fix the module"
    ),
    "syntax:f": (
        "cannot load 'syntax:f': syntax.py line 1: invalid syntax "
        "(its traceback is in the session's log); fix the module"
    ),
    "fine:absent": "cannot load 'fine:absent': fine defines no 'absent'; name a function "
    "that it defines",
    "absent:main": "cannot load 'absent:main': there is no module 'absent' on the runner's "
    "entry paths; check its name",
    # The plugin ends itself as it is imported: T reports how, and that is the sentence.
    "quits:main": "cannot load 'quits:main': the child exited with code 3 while its module "
    "was imported, before it started; fix the module",
}


@pytest.fixture(params=[False, True], ids=["started", "forked"])
async def execution(
    tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[SubprocessExecution]:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    for name, text in SOURCES.items():
        (plugins / name).write_text(text)
    async with SubprocessExecution(
        tmp_path / "state", entry_paths=[plugins], fork_server=request.param
    ) as started:
        yield started


@pytest.fixture
async def sup(execution: SubprocessExecution) -> AsyncIterator[Supervisor]:
    async with open_supervisor(MemoryStore(), execution, lease=30.0, grace=1.0) as supervisor:
        yield supervisor


@pytest.mark.parametrize("specifier", sorted(FAILURES))
async def test_a_failed_load_raises_one_sentence_and_ends_with_no_child(
    sup: Supervisor, specifier: str
) -> None:
    for round_ in range(ROUNDS):
        record = await sup.open(Key(identity="failing", instance=str(round_)), "r")
        with trio.fail_after(BOUND), pytest.raises(PackageError) as raised:
            await sup.load(record.handle, Load(specifier=specifier))
        assert str(raised.value) == FAILURES[specifier]
        stopped = await sup.status(record.handle)
        assert isinstance(stopped, StoppedRecord)
        assert isinstance(stopped.reason, LoadFailed)
        assert stopped.reason.cause[0].message == FAILURES[specifier]
        # However far the child got (resolved in the runner, or in the bootstrap, or
        # importing), the session's code never ran, and its end says so.
        assert stopped.termination == Termination(kind="none", exit=ExitStatus())
        assert stopped.termination.describe() == "no child"


async def test_a_child_killed_before_it_started_says_by_what(sup: Supervisor) -> None:
    # Killed by a signal (here its own; an operator's or the kernel's reads the same):
    # not the package's fault as far as anyone can tell, and the sentence says what.
    record = await sup.open(Key(identity="failing", instance="killed"), "r")
    with trio.fail_after(BOUND), pytest.raises(ExecutionError) as raised:
        await sup.load(record.handle, Load(specifier="killed:main"))
    assert (
        str(raised.value) == "the child for 'killed:main' was killed by SIGKILL before it started"
    )
    stopped = await sup.status(record.handle)
    assert isinstance(stopped, StoppedRecord)
    assert isinstance(stopped.reason, LoadFailed)
    assert stopped.termination.describe() == "no child"


async def test_the_import_traceback_always_reaches_the_log(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    for round_ in range(ROUNDS):
        record = await sup.open(Key(identity="raising", instance=str(round_)), "r")
        with trio.fail_after(BOUND), pytest.raises(PackageError):
            await sup.load(record.handle, Load(specifier="raises:main"))
        log = execution.logs(record.handle)
        assert "Traceback (most recent call last):" in log
        assert "in helper" in log, log
        assert log.rstrip().endswith("RuntimeError: broken at import"), log
