"""What the tests share: keys, a supervisor with test timings, process helpers, bounded
waits, and the one way a test starts a runner process (:func:`launched`, and
:func:`serving` for ``trio-supervisor serve``)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import Any, Final, TypeVar, overload

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from trio_supervisor import (
    Handle,
    Key,
    Load,
    StoppedRecord,
    SubprocessExecution,
    Supervisor,
    SupervisorError,
    open_supervisor,
    realtime,
)
from trio_supervisor._background import open_background_nursery
from trio_supervisor.abc import Store, SupervisorAPI
from trio_supervisor.client import RemoteSupervisor, connect
from trio_supervisor.executions import DEFAULT_CHILD_USERS
from trio_supervisor.executions._groups import read_stat
from trio_supervisor.service import create_app
from trio_supervisor.testing import FakeExecution

KEY = Key(identity="plugin", instance="a")
OTHER = Key(identity="plugin", instance="b")


# A directory a test must make in the system's /tmp itself (a checkout there) takes
# this prefix, which names the run (its pid): the run's guards (conftest.py) tell what
# is its own from what other runs of the suite on this machine make meanwhile.
IN_SYSTEM_TMP: Final = f"trio-supervisor-test-{os.getpid()}-"


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


# How the tests of the rules reach the supervisor: "embedded" (the object itself), or
# "remote" (a RemoteSupervisor through a real Hypercorn server on an ephemeral loopback
# port, in the test's own Trio run). Set per test by the ``wire`` fixture (conftest.py).
WIRE = ["embedded"]
TIMINGS: dict[str, Any] = {"lease": 10.0, "grace": 1.0, "confirmation_timeout": 1.0}
HOSTS_TOKEN = "hosts-token-for-tests"
OPERATOR_TOKEN = "operator-token-for-tests"


@contextlib.asynccontextmanager
async def supervise(store: Store, execution: Any, **options: Any) -> AsyncIterator[SupervisorAPI]:
    """open_supervisor with the short timings the tests use unless they say otherwise.

    Yields the supervisor, or, when the test runs over the wire, a client of it: either
    way only the calls both offer (``SupervisorAPI``). The server outlives the
    supervisor's block, so calls made during its shutdown (Z1) and the errors of leaving
    it (Z3) reach the test as they would embedded.
    """
    settings = {**TIMINGS, **options}
    if WIRE[0] == "embedded":
        async with open_supervisor(store, execution, **settings) as supervisor:
            yield supervisor
        return
    async with supervise_served(store, execution, **settings) as (_, remote):
        yield remote


@contextlib.asynccontextmanager
async def supervise_embedded(
    store: Store, execution: Any, **options: Any
) -> AsyncIterator[Supervisor]:
    """open_supervisor with the tests' timings, never over the wire: for tests that look
    inside the supervisor (its poison, its records, its watchers)."""
    async with open_supervisor(store, execution, **{**TIMINGS, **options}) as supervisor:
        yield supervisor


@contextlib.asynccontextmanager
async def supervise_served(
    store: Store, execution: Any, **settings: Any
) -> AsyncIterator[tuple[Supervisor, RemoteSupervisor]]:
    """A supervisor and a client of its server, which outlives the supervisor's block."""
    async with (
        server_slot() as serve_it,
        open_supervisor(store, execution, **settings) as supervisor,
    ):
        yield supervisor, await serve_it(supervisor)


@contextlib.asynccontextmanager
async def served(supervisor: Supervisor, **app_options: Any) -> AsyncIterator[RemoteSupervisor]:
    """Serve ``supervisor`` on an ephemeral loopback port; yield a client connected to it
    (with the hosts' token; the operators' when ``app_options`` give tenants instead)."""
    async with server_slot(**app_options) as serve_it:
        yield await serve_it(supervisor)


@contextlib.asynccontextmanager
async def server_slot(
    **app_options: Any,
) -> AsyncIterator[Callable[[Supervisor], Awaitable[RemoteSupervisor]]]:
    """A place for a server: yields what serves a supervisor there, and returns a client.

    The server runs until this block ends, so a supervisor served from within a block
    nested in it (``open_supervisor``) keeps its server through its own shutdown.
    ``app_options`` go to ``create_app`` (tenants, admission); without tenants the app
    has the hosts' token :data:`HOSTS_TOKEN`.
    """
    if "tenants" not in app_options:
        app_options = {"hosts_token": HOSTS_TOKEN, **app_options}
    token = HOSTS_TOKEN if "hosts_token" in app_options else OPERATOR_TOKEN
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    stop = trio.Event()
    async with contextlib.AsyncExitStack() as stack, open_background_nursery() as nursery:

        async def serve_it(supervisor: Supervisor) -> RemoteSupervisor:
            app = create_app(supervisor, operator_token=OPERATOR_TOKEN, **app_options)
            # The readiness handshake: serve reports its bound address once it listens.
            binds = await nursery.start(
                functools.partial(serve, app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
            )
            return await stack.enter_async_context(connect(binds[0], token=token))

        try:
            yield serve_it
        finally:
            # The server stops first and answers what is in flight (a dispose that
            # joined the shutdown, say); the client closes once it is done.
            stop.set()


def embedded() -> bool:
    """Whether this test reaches its supervisor directly (not over the wire)."""
    return WIRE[0] == "embedded"


async def poisoning(supervisor: SupervisorAPI) -> SupervisorError | None:
    """The error that poisoned the supervisor, or None; over the wire, as open sees it."""
    if isinstance(supervisor, Supervisor):
        return supervisor.poisoned
    try:
        # Poisoned, open refuses at once (O1) and changes nothing. Healthy, this opens a
        # probe session, which is why tests ask only when they expect the poison.
        await supervisor.open(Key(identity="probe", instance="poisoned?"), "probe")
    except SupervisorError as error:
        return error
    return None


async def opened(
    supervisor: SupervisorAPI, key: Key = KEY, request_id: str = "r1", **options: Any
) -> Handle:
    """Open a session of ``key`` at the next generation; return its handle."""
    expected = await supervisor.high_water(key)
    record = await supervisor.open(key, request_id, expected_generation=expected, **options)
    return record.handle


async def during_shutdown(
    store: Store,
    fake: FakeExecution,
    action: Callable[[SupervisorAPI, Handle], Awaitable[None]],
) -> Handle:
    """Run ``action`` half a second into a shutdown that waits for a slow child.

    The session's child takes 0.8 s to exit on interrupt, so at 0.5 s the supervisor is
    closing and the session is stopping. Needs a MockClock; returns the session's handle.
    """
    fake.behave("slow", exit_delay=0.8)
    async with trio.open_nursery() as callers, supervise(store, fake) as sup:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="slow"))

        async def late() -> None:
            await trio.sleep(0.5)
            await action(sup, handle)

        callers.start_soon(late)
    return handle


def report_in(log: str) -> dict[str, Any]:
    """The JSON report the ``inspector`` example plugin printed into its log."""
    report: dict[str, Any] = json.loads(log.split("REPORT ", 1)[1].splitlines()[0])
    return report


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


# -- bounded waits --------------------------------------------------------------------------

T = TypeVar("T")


@overload
async def until(
    condition: Callable[[], Awaitable[T | None]],
    what: str,
    *,
    bound: float = ...,
    every: float = ...,
) -> T: ...
@overload
async def until(
    condition: Callable[[], T | None], what: str, *, bound: float = ..., every: float = ...
) -> T: ...
async def until(
    condition: Callable[[], Any], what: str, *, bound: float = 20.0, every: float = 0.02
) -> Any:
    """Poll ``condition()`` (awaited if it is async) until it is truthy; return that value.

    For what has nothing to wait on (/proc, a file, a runner over HTTP), asked every
    ``every`` seconds. Fails naming ``what`` after ``bound`` seconds. What it polls is
    outside the run, so the pauses and the bound are real time, also on a virtual clock.
    """
    with realtime.bounded(bound):
        while True:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            await realtime.sleep(every)
    raise AssertionError(f"{what}: not within {bound:g} s")


def settled(condition: Callable[[], T], bound: float, *, every: float = 0.02) -> T:
    """Poll ``condition()``, blocking, every ``every`` seconds until it is truthy or
    ``bound`` seconds passed; its last value (truthy if it held in time).

    For sync tests and fixtures; an async test uses :func:`until`.
    """
    deadline = time.monotonic() + bound
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(every)
    return value


def survivors(pids: Iterable[int], bound: float) -> set[int]:
    """Wait until none of ``pids`` runs; those still running after ``bound`` seconds."""
    pids = set(pids)

    def alive() -> set[int]:
        return {pid for pid in pids if running(pid)}

    settled(lambda: not alive(), bound)
    return alive()


async def until_logged(
    execution: SubprocessExecution, handle: Handle, text: str, *, bound: float = 20.0
) -> None:
    """Wait, bounded, until the child wrote ``text`` (its log is a file: we poll it)."""
    await until(lambda: text in execution.logs(handle), f"{text!r} in the log", bound=bound)


async def until_stopped(
    supervisor: Supervisor, handle: Handle, *, bound: float = 20.0
) -> StoppedRecord:
    """Poll a session until it is stopped (its child ended it, its lease expired)."""

    async def stopped() -> StoppedRecord | None:
        record = await supervisor.status(handle)
        return record if isinstance(record, StoppedRecord) else None

    return await until(stopped, f"{handle} stopped", bound=bound)


# -- runner processes ---------------------------------------------------------------------

ROOT: Final = Path(__file__).parents[1]
PLUGINS: Final = ROOT / "examples" / "plugins"
# The isolation tests' plugins (entry path): attacks on the runner and on other children.
ISOLATION: Final = ROOT / "tests" / "adapters" / "plugins_isolation"
# Seconds a test waits for what a real child does (starts, writes, exits) before failing.
BOUND: Final = 20.0
STARTUP: Final = 30.0  # seconds a process may take to say it is ready (a loaded machine is slow)
SHUTDOWN: Final = 30.0  # seconds a runner may take to exit on SIGTERM
LISTENING: Final = re.compile(
    r"listening on (?P<scheme>https?)://(?P<host>[^\s:/]+):(?P<port>\d+)\n"
)


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


class Runner(Launched):
    """A ``trio-supervisor serve`` process that said it listens (see :func:`serving`).

    Attributes:
        line: Its first line on stdout, as it printed it (``listening on URL\\n``).
        url: The URL the line names.
        state: Its state directory.
    """

    def __init__(self, started: Launched, state: Path) -> None:
        super().__init__(started.process, started.lines, started.log)
        self.line = started.lines[-1]
        self.url = self.line.removeprefix("listening on ").strip()
        self.state = state

    def token(self, name: str = "token") -> str:
        """A token from its state directory: ``token`` (hosts) or ``operator-token``."""
        return (self.state / name).read_text().strip()

    @property
    def hosts_token(self) -> str:
        return self.token("token")

    @property
    def operator_token(self) -> str:
        return self.token("operator-token")

    def host(
        self, token: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[RemoteSupervisor]:
        """A host's client: the URL and the hosts' token (or ``token``), nothing else."""
        return connect(self.url, token=token or self.hosts_token)

    def operator(self) -> contextlib.AbstractAsyncContextManager[RemoteSupervisor]:
        """An operator's client: the URL and the operators' token."""
        return connect(self.url, token=self.operator_token)

    def http(self, token: str | None = None) -> httpx.AsyncClient:
        """A bare HTTP client with ``token`` (the operators' by default) as its bearer."""
        bearer = {"Authorization": f"Bearer {token or self.operator_token}"}
        return httpx.AsyncClient(base_url=self.url, headers=bearer, timeout=30.0)

    async def sessions(self) -> list[dict[str, Any]]:
        """Every record the runner holds, as ``GET /v1/sessions`` lists it."""
        return await self.sessions_as(self.operator_token)

    async def sessions_as(self, token: str) -> list[dict[str, Any]]:
        """:meth:`sessions`, asked with ``token`` (an operators' token kept elsewhere)."""
        async with self.http(token) as operator:
            answer = await operator.get("/v1/sessions", params={"limit": 1000})
        assert answer.status_code == 200, answer.text
        sessions: list[dict[str, Any]] = answer.json()["sessions"]
        return sessions

    async def record(self, key: Key, generation: int) -> dict[str, Any] | None:
        """The runner's record of one session, as an operator lists it (no token)."""
        wanted = {"key": {"identity": key.identity, "instance": key.instance}}
        for record in await self.sessions():
            if record["handle"] == {**wanted, "generation": generation}:
                return record
        return None


@contextlib.contextmanager
def serving(
    state: Path | None,
    *flags: str | Path,
    plugins: Sequence[Path] = (PLUGINS,),
    listen: str | None = "127.0.0.1:0",
    cwd: Path = ROOT,
    log: Path | None = None,
) -> Iterator[Runner]:
    """Run ``trio-supervisor serve`` until it listens; on the way out, stop it (SIGTERM,
    then SIGKILL after SHUTDOWN seconds) if it still runs.

    The readiness handshake is its first line on stdout, ``listening on URL`` (SERVICE.md
    section A), never a guessed while.

    Args:
        state: Its ``--state``; None leaves the flag out (``./runner-state`` in ``cwd``).
        flags: More flags.
        plugins: A ``--plugins`` flag for each (the example plugins by default).
        listen: Its ``--listen``; None leaves the flag out (a config file gives it).
        cwd: Its working directory.
        log: Where its stderr goes (beside the state directory by default).

    Raises:
        NotReady: Its first line was not ``listening on URL``, within STARTUP seconds.
    """
    state_path = cwd / "runner-state" if state is None else state
    command: list[str | Path] = [sys.executable, "-m", "trio_supervisor", "serve"]
    if state is not None:
        command += ["--state", state]
    if listen is not None:
        command += ["--listen", listen]
    for directory in plugins:
        command += ["--plugins", directory]
    command += flags
    log = log or state_path.with_name(state_path.name + ".stderr")
    with launched(command, ready=lambda line: True, cwd=cwd, log=log) as started:
        if not LISTENING.fullmatch(started.lines[-1]):
            raise NotReady(
                f"serve printed {started.lines[-1]!r} as its first line; its stderr:\n"
                + started.stderr()
            )
        yield Runner(started, state_path)


LEASE: Final = 120.0  # seconds: no session of the runner tests expires while it runs


async def open_sessions(
    runner: Runner, count: int, *, loaded: int = 0, first: int = 1
) -> list[Handle]:
    """Open ``count`` sessions of the identity ``acme`` (instances ``eu-FIRST``, ...); load
    ``heartbeat:main`` in the first ``loaded`` of them. Their lease is LEASE seconds."""
    handles = []
    async with runner.host() as host:
        for number in range(count):
            key = Key(identity="acme", instance=f"eu-{first + number}")
            record = await host.open(key, f"open-{uuid.uuid4()}", lease=LEASE)
            if number < loaded:
                await host.load(record.handle, Load(specifier="heartbeat:main"))
            handles.append(record.handle)
    return handles


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
