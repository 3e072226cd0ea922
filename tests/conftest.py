"""Shared fixtures, and the guard that fails the run when a child process leaks."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from trio_supervisor import MemoryStore, Supervisor
from trio_supervisor.executions._groups import read_stat
from trio_supervisor.testing import FakeExecution

from . import support
from .support import supervise

# The tests of these rules run twice: on the embedded supervisor, and over the wire
# (SERVICE.md section A), except those marked ``embedded_only`` (they look inside it).
WIRE_MODULES = ("test_open", "test_renew", "test_load", "test_stop", "test_recovery")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    module = metafunc.module.__name__.rpartition(".")[2]
    if (
        module in WIRE_MODULES
        and "wire" in metafunc.fixturenames
        and metafunc.definition.get_closest_marker("embedded_only") is None
    ):
        metafunc.parametrize("wire", ["embedded", "remote"], indirect=True)


@pytest.fixture(autouse=True)
def wire(request: pytest.FixtureRequest) -> Iterator[str]:
    """How this test reaches its supervisor: "embedded", or "remote" over HTTP."""
    chosen = getattr(request, "param", "embedded")
    support.WIRE[0] = chosen
    try:
        yield chosen
    finally:
        support.WIRE[0] = "embedded"


_PR_SET_CHILD_SUBREAPER = 36


def _children(pid: int) -> list[tuple[int, str]]:
    """Processes whose parent is ``pid``: (pid, command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        stat = read_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is None or stat.ppid != pid:
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # it exited meanwhile
        found.append((int(entry.name), command.strip() or stat.name))
    return found


# A test that deadlocks never ends under an autojump clock (nothing is left to jump to).
# Rather than hang the run, end it with every thread's traceback. Seconds of real time
# per test; 0 turns the guard off (the deep conformance profile runs for minutes).
HANG_TIMEOUT = float(os.environ.get("TRIO_SUPERVISOR_TEST_TIMEOUT", "600"))


@pytest.fixture(autouse=True)
def no_hang(request: pytest.FixtureRequest) -> Iterator[None]:
    if HANG_TIMEOUT <= 0:
        yield
        return
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def hung() -> None:
        try:
            if capture is not None:
                capture.suspend_global_capture(in_=True)  # write to the real stderr
            stream = sys.__stderr__ or sys.stderr
            stream.write(
                f"\n{request.node.nodeid} still runs after {HANG_TIMEOUT:g} s: deadlocked? "
                "Every thread's traceback follows; the run ends here.\n"
            )
            stream.flush()
            faulthandler.dump_traceback(file=stream, all_threads=True)
        finally:
            os._exit(1)

    timer = threading.Timer(HANG_TIMEOUT, hung)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@pytest.fixture(scope="session", autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """Fail the run if any child process of it is still alive at the end.

    The test process makes itself a child subreaper, so a grandchild whose parent died
    is re-parented to us instead of to init, and is found here too.
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    yield
    leaked = []
    for pid, command in _children(os.getpid()):
        try:
            waited, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            waited = pid
        if waited == 0:  # still running: a leak
            leaked.append(f"{pid}: {command}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    if leaked:
        pytest.fail("child processes outlived the test run:\n" + "\n".join(leaked), pytrace=False)


@pytest.fixture
def fake() -> FakeExecution:
    return FakeExecution()


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
async def sup(store: MemoryStore, fake: FakeExecution) -> AsyncIterator[Supervisor]:
    async with supervise(store, fake) as supervisor:
        yield supervisor
