"""Processes: through /proc, the one way a test starts a process and waits for its
readiness handshake (:func:`launched`), what tells this run's processes, uids and
directories from other runs' on this machine (for the leak guards, conftest.py), and
another pytest run."""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Final

import trio

from trio_supervisor.executions import DEFAULT_CHILD_USERS
from trio_supervisor.executions.trees._groups import read_stat

from . import ROOT
from .waits import settled

STARTUP: Final = 30.0  # seconds a process may take to say it is ready (a loaded machine is slow)
SHUTDOWN: Final = 30.0  # seconds a runner may take to exit on SIGTERM


# -- what is this run's ---------------------------------------------------------------------

# A directory a test must make in the system's /tmp itself (a checkout there) takes
# this prefix, which names the run (its pid): the run's guards (conftest.py) tell what
# is its own from what other runs of the suite on this machine make meanwhile.
IN_SYSTEM_TMP: Final = f"trio-supervisor-test-{os.getpid()}-"

# What a runner logs of other processes of the machine, never of what the test did:
# processes of another run (or a killed one) running as uids of the children's range,
# claims an earlier version made (executions/limits/_claims.py).
OTHERS_ON_THE_MACHINE: Final = re.compile(
    r"processes that no runner claimed run as uids|claims that name no runner"
)


def without_others_on_the_machine(text: str) -> str:
    """``text`` less the lines a runner logs of other processes of the machine."""
    return "\n".join(line for line in text.splitlines() if not OTHERS_ON_THE_MACHINE.search(line))


def uids_of_this_run(slot: int, count: int = 1) -> range:
    """``count`` uids (at most 8) that no other test gives children, nor any other run of
    the suite on this machine: each run has a block of 64 of its own (by its pid), above
    the children's default range, and each test a ``slot`` (0-7) in it. For a test that
    counts the uids its runners may give, as runners of other runs claim from ranges of
    their own meanwhile."""
    assert 0 <= slot < 8
    assert 0 < count <= 8
    start = DEFAULT_CHILD_USERS.stop + 1024 + (os.getpid() % 100_000) * 64 + slot * 8
    return range(start, start + count)


# -- processes, through /proc -------------------------------------------------------------


def process_state(pid: int) -> str | None:
    """The state letter of a process (``/proc/PID/stat``), or None when it is gone."""
    stat = read_stat(pid)
    return None if stat is None else stat.state


def running(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    return process_state(pid) not in (None, "Z")


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, and every member of their process groups (but not of
    ``pid``'s own group, which a runner started by a test shares with the test)."""
    table: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        stat = read_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None:
            table[int(entry.name)] = (stat.ppid, stat.pgid)
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _) in table.items():
            if ppid == parent and child not in found:
                found.add(child)
                frontier.append(child)
    groups = {table[member][1] for member in found} - {table.get(pid, (0, 0))[1]}
    return found | {member for member, (_, pgid) in table.items() if pgid in groups}


def reap(pids: Iterable[int]) -> None:
    """Reap those of ``pids`` that are our dead children (orphans re-parented to us)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def reap_orphans() -> None:
    """Reap every zombie child of ours: what killed runners left to us (the test process
    is a child subreaper, conftest.py)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def survivors(pids: Iterable[int], bound: float) -> set[int]:
    """Wait until none of ``pids`` runs; those still running after ``bound`` seconds."""
    pids = set(pids)

    def alive() -> set[int]:
        return {pid for pid in pids if running(pid)}

    settled(lambda: not alive(), bound)
    return alive()


# -- processes a test starts -----------------------------------------------------------


class NotReady(AssertionError):
    """A process exited, stayed silent, or said something else before it said it is ready."""


class Launched:
    """A process a test started, once it said it is ready (see :func:`launched`).

    Attributes:
        process: The process.
        lines: What it printed on stdout up to its readiness line, that one included.
        log: The file its stderr goes to (None: the test's own stderr).
    """

    def __init__(self, process: subprocess.Popen[bytes], lines: list[str], log: Path | None):
        self.process = process
        self.lines = lines
        self.log = log

    def stderr(self, last: int | None = None) -> str:
        """What it logged so far (its ``last`` lines only, if given)."""
        if self.log is None:
            return "(its stderr is the test's)"
        try:
            text = self.log.read_text(errors="replace")
        except OSError as error:
            return f"(no log: {error})"
        return text if last is None else "\n".join(text.splitlines()[-last:])

    def descendants(self) -> set[int]:
        """Every process below it, and every member of their process groups."""
        return descendants(self.process.pid)

    def stop(self, number: signal.Signals = signal.SIGTERM, bound: float = SHUTDOWN) -> int:
        """Signal it (SIGTERM), then its exit status within ``bound`` seconds; past that it
        is killed and the test fails."""
        if self.process.poll() is None:
            self.process.send_signal(number)
            try:
                self.process.wait(bound)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"it ignored {number.name} for {bound:g} s") from None
        return self.process.returncode

    async def wait(self) -> int:
        """Its exit status, once it exits: cancellable (Trio waits on a pidfd), so bound it
        with ``trio.fail_after``."""
        if self.process.poll() is None:
            try:
                pidfd = os.pidfd_open(self.process.pid)
            except ProcessLookupError:
                pass  # reaped meanwhile: wait() says so
            else:
                try:
                    await trio.lowlevel.wait_readable(pidfd)
                finally:
                    os.close(pidfd)
        return self.process.wait()

    async def terminate(
        self, number: signal.Signals = signal.SIGTERM, bound: float = SHUTDOWN
    ) -> int:
        """Signal it (SIGTERM), then its exit status within ``bound`` seconds."""
        self.process.send_signal(number)
        with trio.fail_after(bound):
            return await self.wait()


def _read_until_ready(
    process: subprocess.Popen[bytes], ready: Callable[[str], bool], bound: float
) -> tuple[list[str], bool]:
    """Its stdout lines up to the first that is ``ready``; whether one was, within
    ``bound`` seconds (a line read so far without its newline is the last one)."""
    assert process.stdout is not None
    descriptor = process.stdout.fileno()
    lines: list[str] = []
    data = b""
    deadline = time.monotonic() + bound
    with selectors.DefaultSelector() as selector:
        selector.register(descriptor, selectors.EVENT_READ)
        while True:
            while b"\n" in data:
                line, data = data.split(b"\n", 1)
                lines.append(line.decode(errors="replace") + "\n")
                if ready(lines[-1]):
                    return lines, True
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                break
            chunk = os.read(descriptor, 4096)
            if not chunk:
                break  # it exited (or closed its stdout) without saying so
            data += chunk
    if data:
        lines.append(data.decode(errors="replace"))
    return lines, False


@contextlib.contextmanager
def launched(
    command: Sequence[str | Path],
    *,
    ready: Callable[[str], bool],
    cwd: Path = ROOT,
    log: Path | None = None,
    stop: signal.Signals = signal.SIGTERM,
) -> Iterator[Launched]:
    """Start ``command`` and wait for its readiness handshake, a line on its stdout; on the
    way out, end it if it still runs.

    Args:
        command: What to run (``sys.executable`` first, for a Python script).
        ready: Whether a line of its stdout says it is ready (the lines before it are
            kept in :attr:`Launched.lines`).
        cwd: Its working directory.
        log: A file its stderr is appended to; None leaves it the test's.
        stop: How it is ended on the way out if it still runs: with SIGTERM it gets
            SHUTDOWN seconds before SIGKILL.

    Raises:
        NotReady: No line was ``ready`` before it exited, or within STARTUP seconds.
    """
    with contextlib.ExitStack() as files:
        stderr = files.enter_context(log.open("ab")) if log is not None else None
        process = subprocess.Popen(
            [str(part) for part in command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=cwd,
        )
    try:
        lines, said = _read_until_ready(process, ready, STARTUP)
        started = Launched(process, lines, log)
        if not said:
            status = process.poll()
            raise NotReady(
                f"{' '.join(str(part) for part in command[1:3])} "
                f"{'exited ' + str(status) if status is not None else 'still runs'} without "
                f"saying it is ready (it printed {lines!r}); its stderr:\n{started.stderr()}"
            )
        yield started
    finally:
        # It must not outlive the test, even a failed one.
        try:
            if process.poll() is None:
                process.send_signal(stop)
                try:
                    process.wait(SHUTDOWN)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        finally:
            assert process.stdout is not None
            process.stdout.close()


def run_pytest(
    directory: Path, *arguments: str, env: Mapping[str, str | None] | None = None
) -> subprocess.CompletedProcess[str]:
    """Another pytest run, of the tests in ``directory``, with the project's settings
    (pyproject.toml) and ``tests`` importable; its tmp_path directories go in
    ``directory`` too. ``env`` adds to the environment (None: takes the variable out).
    For the tests of the run's own guards (conftest.py)."""
    command: list[str] = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")]
    command += ["--rootdir", str(directory), "-p", "no:cacheprovider"]
    command += ["--basetemp", str(directory / "basetemp"), *arguments, str(directory)]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        command,
        cwd=directory,
        env={name: value for name, value in environment.items() if value is not None},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
