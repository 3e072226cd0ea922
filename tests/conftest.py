"""Shared fixtures, and the guards that fail the run when it leaks a child process, a
temporary file, a cgroup or a claim of the machine's."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import hypothesis
import pytest
import pytest_timeout  # type: ignore[import-untyped]
import trio

from trio_supervisor import MemoryStore, SupervisorAPI
from trio_supervisor.executions.limits._cgroups import PARENT
from trio_supervisor.executions.limits._claims import (
    CGROUPS,
    UIDS,
    Claim,
    ClaimError,
    Owner,
    claims_root,
)
from trio_supervisor.executions.trees._groups import read_stat
from trio_supervisor.testing import FakeExecution

from .support import sessions
from .support.postgres import database, schema  # noqa: F401  (fixtures, for every module)
from .support.processes import IN_SYSTEM_TMP
from .support.sessions import supervise

# No Hypothesis deadline: an example's time is no assertion of this suite's (a machine
# busy with other work made examples of the codec's tests pass 200 ms), and a deadlocked
# one is ended by pytest-timeout.
hypothesis.settings.register_profile("suite", deadline=None)
hypothesis.settings.load_profile("suite")

# The tests of these rules run twice: on the embedded supervisor, and over the wire
# (docs/service.md section A), except those marked ``embedded_only`` (they look inside it).
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
    sessions.WIRE[0] = chosen
    try:
        yield chosen
    finally:
        sessions.WIRE[0] = "embedded"


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
# pytest-timeout ends it: after ``timeout`` seconds (pyproject.toml; PYTEST_TIMEOUT or
# --timeout override it, 0 turns it off) its "thread" method dumps every thread's stack
# and ends the run. (Its "signal" method raises inside Trio's run loop: pytest dies with an
# INTERNALERROR and no useful traceback.) A thread's stack shows only Trio waiting for I/O,
# so the tasks' own tracebacks, where each one awaits, are written first.


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """Start pytest-timeout's "thread" timer, with the Trio tasks' tracebacks added."""
    if settings.method != "thread":
        return None  # pytest-timeout's own

    def expired() -> None:
        stream = sys.__stderr__ or sys.stderr
        try:
            stream.write(
                f"\n{item.nodeid} still runs after {settings.timeout:g} s: deadlocked? "
                "Its Trio tasks, then every thread's stack, follow; the run ends here.\n"
            )
            main = sys._current_frames().get(threading.main_thread().ident or 0)
            stream.write(trio_tasks(main))
        except Exception:  # the tasks moved meanwhile (the test was busy, not stuck)
            traceback.print_exc(file=stream)
        finally:
            stream.flush()
            pytest_timeout.timeout_timer(item, settings)  # dumps the threads, os._exit(1)

    timer = threading.Timer(settings.timeout, expired)
    timer.name = f"pytest_timeout {item.nodeid}"
    timer.daemon = True

    def cancel() -> None:
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # pytest-timeout's own slot
    timer.start()
    return True


def trio_tasks(frame: types.FrameType | None) -> str:
    """Where each task of the Trio run on ``frame``'s stack awaits, as tracebacks."""
    while frame is not None and not (
        frame.f_globals.get("__name__") == "trio._core._run" and "runner" in frame.f_locals
    ):
        frame = frame.f_back
    if frame is None:
        return "(no Trio run)\n"
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        indent = "  " * depth
        lines.append(f"{indent}task {task.name}:\n")
        for code_frame, line in task.iter_await_frames():
            summary = traceback.FrameSummary(
                code_frame.f_code.co_filename, line, code_frame.f_code.co_name
            )
            lines.append(f'{indent}  File "{summary.filename}", line {line}, in {summary.name}\n')
            if summary.line:
                lines.append(f"{indent}    {summary.line}\n")
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child, depth + 1)

    walk(frame.f_locals["runner"].init_task, 0)
    return "".join(lines)


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


# Temporary files: none in the system's temporary directory. The run gets one of its own,
# under the project, for as long as it runs: TMPDIR (so tempfile, and every process the
# tests start, write there) is a fresh directory that must be empty when the run ends,
# which it then removes. A check of /tmp itself would be blind to whose entries it sees,
# on a machine where other runs use it at the same time; this one sees only this run's.
# pytest's own tmp_path directories go below the project too (PYTEST_DEBUG_TEMPROOT),
# numbered per run as pytest makes them in /tmp, so runs side by side (mutmut's) never
# share one, as they would a fixed --basetemp, which each run empties first. With
# tmp_path_retention_policy = "failed" (pyproject.toml) only failed tests' directories
# are kept, for the last three runs.
#
# A run gives back what it changed as it ends: the process may run pytest again (mutmut
# calls pytest.main several times in one process, then in forks of it), and pytest makes
# its capture files with tempfile before any conftest is read. Left pointing at the
# directory this run removed, TMPDIR (and tempfile's cached copy of it) would make the
# next run's capture fail with FileNotFoundError.
TEMPORARY: Final = Path(__file__).parents[1] / ".pytest-tmp"
_ENVIRONMENT: Final = ("TMPDIR", "PYTEST_DEBUG_TEMPROOT")
# The run's directory, the environment's values before it, and tempfile's cached
# directory before it (a list, so a run that never ended is undone too).
_RUNS: list[tuple[Path, dict[str, str | None], str | None]] = []


def pytest_configure(config: pytest.Config) -> None:
    TEMPORARY.mkdir(exist_ok=True)
    ignore = TEMPORARY / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# tests/conftest.py: the test runs' temporary files\n*\n")
    before = {name: os.environ.get(name) for name in _ENVIRONMENT}
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", str(TEMPORARY))
    for left in TEMPORARY.glob("tmpdir-*-*"):  # a run that was killed (a hang) left it
        pid = left.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(left, ignore_errors=True)
    run = Path(tempfile.mkdtemp(prefix=f"tmpdir-{os.getpid()}-", dir=TEMPORARY))
    _RUNS.append((run, before, tempfile.tempdir))
    os.environ["TMPDIR"] = str(run)
    tempfile.tempdir = None  # tempfile.gettempdir() reads TMPDIR again


def pytest_unconfigure(config: pytest.Config) -> None:
    while _RUNS:
        run, before, cached = _RUNS.pop()
        shutil.rmtree(run, ignore_errors=True)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        tempfile.tempdir = cached


@pytest.fixture(scope="session", autouse=True)
def no_leaked_temporary_files() -> Iterator[None]:
    """Fail the run if it left anything in the system's temporary directory (the run's
    own, see above), instead of a tmp_path."""
    yield
    directory = Path(tempfile.gettempdir())
    left = sorted(entry.name for entry in directory.iterdir())
    if left:
        pytest.fail(
            f"the run left {len(left)} entries in the temporary directory {directory} "
            f"(use tmp_path or tmp_path_factory): {', '.join(left[:20])}",
            pytrace=False,
        )


def _cgroups_of(directories: tuple[str, ...]) -> list[str]:
    """Every cgroup, in any hierarchy, of the executions whose state directory lies below
    one of ``directories`` (their parents, and their children's cgroups), each with what
    tells whose it was: its claim's owner and state directory, and whether a process is
    still in it. Each parent is told by its claim (executions/limits/_claims.py), which
    names its state directory: other runs of the suite on this machine, and other
    runners, make cgroups meanwhile."""
    claims = claims_root() / CGROUPS
    found: list[str] = []
    for parent in sorted(Path("/sys/fs/cgroup").glob(f"*/{PARENT}/*")):
        try:
            claim = Claim.parse(os.readlink(claims / parent.name), claims / parent.name)
        except (OSError, ClaimError):
            continue  # no claim a runner of this version made: not this run's
        if parent.is_dir() and claim.holds.startswith(directories):
            owner = claim.owner
            alive = owner is not None and owner.alive(owner.boot_id)
            whose = f"{owner} ({'alive' if alive else 'gone'})" if owner else "no owner"
            found.append(f"{parent} (of {whose}, for {claim.holds})")
            for path in sorted(parent.rglob("*")):
                if path.is_dir():
                    try:
                        held = (path / "cgroup.procs").read_text().split()
                    except OSError:
                        held = []
                    found.append(f"{path} ({'holding ' + ' '.join(held) if held else 'empty'})")
    return found


@pytest.fixture(scope="session", autouse=True)
def no_leaked_cgroups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fail the run if it left cgroups of its own behind: every child's cgroup goes with
    its stop, an execution's parent with its end (or, for a killed runner, with its last
    child, or the next runner's start), and what a test kills on purpose is its to
    clean. The run's own are those of state directories in its temporary directories."""
    yield
    directories = (
        f"{tempfile.gettempdir()}/",
        f"{tmp_path_factory.getbasetemp()}/",
        f"/tmp/{IN_SYSTEM_TMP}",
    )
    left = _cgroups_of(directories)
    if left:
        pytest.fail(f"the run left {len(left)} cgroups: {', '.join(left[:10])}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def no_leaked_claims() -> Iterator[None]:
    """Fail the run if an execution of the test process left a claim of the machine's
    behind (executions/limits/_claims.py): it lets go of every uid and cgroup it claimed as it
    ends. (What a runner killed on purpose left, any runner takes back as it starts:
    tests/adapters/test_claims.py.)"""
    yield
    me = Owner.this_process()
    left = []
    for kind in (UIDS, CGROUPS):
        directory = claims_root() / kind
        with contextlib.suppress(FileNotFoundError):
            for name in sorted(os.listdir(directory)):
                with contextlib.suppress(OSError, ClaimError):
                    claim = Claim.parse(os.readlink(directory / name), directory / name)
                    if claim.owner == me:
                        left.append(f"{kind}/{name} ({claim.holds})")
    if left:
        pytest.fail(f"the run left {len(left)} claims: {', '.join(left[:10])}", pytrace=False)


@pytest.fixture
def fake() -> FakeExecution:
    return FakeExecution()


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
async def sup(store: MemoryStore, fake: FakeExecution) -> AsyncIterator[SupervisorAPI]:
    async with supervise(store, fake) as supervisor:
        yield supervisor
