"""``trio-supervisor serve`` as operators and hosts use it: real runners, real time.

Each test starts the console command (``python -m trio_supervisor serve``) on an
ephemeral loopback port and waits for its readiness line, ``listening on URL``, never
for a guessed while (docs/service.md section A). Hosts reach it with nothing but the URL and
the hosts' token, through ``trio_supervisor.client``; operators with the operators'
token, over plain HTTP. Processes are watched through /proc: a runner's descendants are
collected before it is signalled or killed, and each must be gone afterwards.

The test process is a child subreaper (conftest.py), so whatever a killed runner leaves
behind is re-parented to us: :func:`leaves_no_process` fails a test that leaves a
process running, and reaps the ones it left dead. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import trio

from trio_supervisor import (
    Disposed,
    Key,
    Load,
    LoadedRecord,
    Phase,
    StaleSessionError,
    StoppedRecord,
)
from trio_supervisor.client import RemoteSupervisor, RunnerAccessError, connect
from trio_supervisor.executions._groups import read_stat

ROOT: Final = Path(__file__).parents[2]
PLUGINS: Final = ROOT / "examples" / "plugins"
STARTUP: Final = 30.0  # seconds a runner may take to listen (a loaded machine is slow)
SHUTDOWN: Final = 30.0  # seconds a runner may take to exit on SIGTERM
ORPHANS: Final = 10.0  # seconds what a test leaves may take to die by itself
LISTENING: Final = re.compile(
    r"listening on (?P<scheme>https?)://(?P<host>[^\s:/]+):(?P<port>\d+)\n"
)
SIGTERM_BIT: Final = 1 << (signal.SIGTERM - 1)  # in /proc/PID/status SigIgn


# -- processes, through /proc ---------------------------------------------------------------


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    stat = read_stat(pid)
    return stat is not None and stat.state != "Z"


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, and every member of their process groups."""
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


def ignores_sigterm(tracked: int) -> bool:
    """Whether the plugin below the tracked process ``tracked`` (its child) has set
    SIGTERM to be ignored (``SigIgn`` of /proc/PID/status)."""
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{tracked}/task/{tracked}/children").read_text().split()
        for child in children:
            for line in Path(f"/proc/{child}/status").read_text().splitlines():
                if line.startswith("SigIgn:") and int(line.split()[1], 16) & SIGTERM_BIT:
                    return True
    return False


async def until(condition: Any, what: str, *, bound: float = 20.0) -> None:
    """Poll ``condition()`` until it holds; fail naming ``what`` after ``bound`` seconds."""
    try:
        with trio.fail_after(bound):
            while not condition():  # noqa: ASYNC110  # /proc has nothing to wait on
                await trio.sleep(0.02)
    except trio.TooSlowError:
        raise AssertionError(f"{what}: not within {bound:g} s") from None


def reap(pids: Sequence[int] | set[int]) -> None:
    """Reap those of ``pids`` that are our dead children (orphans re-parented to us)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@pytest.fixture(autouse=True)
def leaves_no_process() -> Iterator[None]:
    """Fail a test that leaves a process of its own running; kill and reap what it left.

    A runner killed with SIGKILL leaves its children to us; they end by themselves (the
    dead-man switch, the lease) or when a restarted runner recovers them. What still
    runs ``ORPHANS`` seconds after the test is a leak.
    """
    before = descendants(os.getpid())
    yield
    deadline = time.monotonic() + ORPHANS
    while True:
        left = {pid for pid in descendants(os.getpid()) - before if running(pid)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in left:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # killed: this returns at once
    reap(descendants(os.getpid()) - before)
    assert not left, f"processes outlived the test by {ORPHANS:g} s: {sorted(left)}"


# -- a runner, as the tests hold it -------------------------------------------------------------


class Runner:
    """A ``serve`` process that said it listens.

    Attributes:
        process: The process.
        line: Its first line on stdout, as it printed it.
        url: The URL the line names.
        state: Its state directory.
    """

    def __init__(self, process: trio.Process, line: str, state: Path, stderr: bytearray) -> None:
        self.process = process
        self.line = line
        self.url = line.removeprefix("listening on ").strip()
        self.state = state
        self._stderr = stderr

    @property
    def stderr(self) -> str:
        """What it logged so far."""
        return self._stderr.decode(errors="replace")

    def token(self, name: str = "token") -> str:
        """A token from its state directory: ``token`` (hosts) or ``operator-token``."""
        return (self.state / name).read_text().strip()

    def host(
        self, token: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[RemoteSupervisor]:
        """A host's client: the URL and the hosts' token, nothing else."""
        return connect(self.url, token=token or self.token())

    def operator(self) -> httpx.AsyncClient:
        """An operator's bare HTTP client."""
        bearer = {"Authorization": f"Bearer {self.token('operator-token')}"}
        return httpx.AsyncClient(base_url=self.url, headers=bearer, timeout=30.0)

    async def sessions(self) -> list[dict[str, Any]]:
        """Every record the runner holds, as ``GET /v1/sessions`` lists it."""
        async with self.operator() as operator:
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

    def descendants(self) -> set[int]:
        """Every process below the runner, and every member of their process groups."""
        return descendants(self.process.pid)

    async def terminate(
        self, number: signal.Signals = signal.SIGTERM, bound: float = SHUTDOWN
    ) -> int:
        """Signal it (SIGTERM), then its exit status within ``bound`` seconds."""
        self.process.send_signal(number)
        with trio.fail_after(bound):
            return await self.process.wait()


async def _first_line(stream: trio.abc.ReceiveStream) -> str:
    data = bytearray()
    while b"\n" not in data:
        chunk = await stream.receive_some()
        if not chunk:
            break  # it exited without a line: the caller reports its stderr
        data += chunk
    return data[: data.find(b"\n") + 1 or len(data)].decode(errors="replace")


async def _drain(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
    # A runner whose stderr pipe is full blocks: it is read for as long as it runs.
    async for chunk in stream:
        into += chunk


@contextlib.asynccontextmanager
async def serving(
    state: Path, *flags: str | Path, listen: str | None = "127.0.0.1:0"
) -> AsyncIterator[Runner]:
    """Run ``serve`` until it listens; on the way out, stop it if it still runs.

    Args:
        state: Its ``--state``.
        flags: More flags.
        listen: Its ``--listen``; None leaves the flag out (a config file gives it).
    """
    command = [sys.executable, "-m", "trio_supervisor", "serve", "--state", str(state)]
    if listen is not None:
        command += ["--listen", listen]
    command += [str(flag) for flag in flags]
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT
    )
    stderr = bytearray()
    try:
        assert process.stdout is not None
        assert process.stderr is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_drain, process.stderr, stderr)
            try:
                with trio.fail_after(STARTUP):
                    line = await _first_line(process.stdout)
            except trio.TooSlowError:
                line = ""
            if not LISTENING.fullmatch(line):
                raise AssertionError(
                    f"serve printed {line!r} as its first line; its stderr:\n"
                    + stderr.decode(errors="replace")
                )
            nursery.start_soon(_drain, process.stdout, bytearray())
            yield Runner(process, line, state, stderr)
            nursery.cancel_scope.cancel()
    finally:
        # Shielded: the runner must not outlive the test, even a cancelled one; bounded
        # by SHUTDOWN, then killed (what it leaves is leaves_no_process's to judge).
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(SHUTDOWN):
                    await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


async def child_of(host: RemoteSupervisor, handle: Any) -> int:
    """The pid of a loaded session's child, from its record's child identity."""
    record = await host.status(handle)
    assert isinstance(record, LoadedRecord), record
    assert record.child.pid is not None
    return record.child.pid


# -- 1. the process, its line, its state directory -------------------------------------------


async def test_serve_prints_its_url_first_and_keeps_private_tokens_across_restarts(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    async with serving(state) as runner:
        match = LISTENING.fullmatch(runner.line)
        assert match is not None
        assert runner.line == f"listening on http://127.0.0.1:{match['port']}\n"
        assert int(match["port"]) > 0  # the real port, not the 0 it was given
        async with runner.operator() as operator:
            assert (await operator.get("/healthz")).json() == {"status": "ok"}
        assert state.stat().st_mode & 0o777 == 0o700
        tokens: dict[str, str] = {}
        for name in ("token", "operator-token"):
            path = state / name
            assert path.stat().st_mode & 0o777 == 0o600, name
            tokens[name] = path.read_text().strip()
            assert len(tokens[name]) >= 43, name  # secrets.token_urlsafe(32)
        assert tokens["token"] != tokens["operator-token"]
        async with runner.host() as host:
            assert await host.high_water(Key(identity="any", instance="a")) is None
        assert await runner.terminate() == 0

    state.chmod(0o755)  # a directory someone loosened is made private again
    async with serving(state) as again:
        assert state.stat().st_mode & 0o777 == 0o700
        for name, token in tokens.items():
            assert again.token(name) == token, f"{name} was not reused"
        async with again.host(tokens["token"]) as host:
            assert await host.high_water(Key(identity="any", instance="a")) is None
        assert await again.terminate() == 0


async def test_a_given_token_file_is_the_hosts_token(tmp_path: Path) -> None:
    state = tmp_path / "state"
    given = tmp_path / "hosts-token"
    given.write_text("a-token-the-operator-chose-for-the-hosts\n")
    async with serving(state, "--token-file", given) as runner:
        key = Key(identity="given", instance="a")
        async with runner.host("a-token-the-operator-chose-for-the-hosts") as host:
            assert await host.high_water(key) is None
        assert not (state / "token").exists()  # no second hosts' token was made
        async with runner.host("not-the-token") as host:
            with pytest.raises(RunnerAccessError):
                await host.high_water(key)
        assert given.read_text() == "a-token-the-operator-chose-for-the-hosts\n"
        assert await runner.terminate() == 0


async def test_a_second_runner_on_a_state_directory_in_use_exits_1_saying_why(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    async with serving(state) as runner:
        command = [sys.executable, "-m", "trio_supervisor", "serve", "--state", str(state)]
        with trio.fail_after(STARTUP + 10):  # SQLite waits 10 s for the store's lock
            second = await trio.run_process(
                [*command, "--listen", "127.0.0.1:0"],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                cwd=ROOT,
            )
        assert second.returncode == 1, second.stderr
        assert second.stdout == b""  # it never listened
        stderr = second.stderr.decode()
        assert "Traceback" not in stderr, stderr  # the detail, as the CLI promises
        errors = [line for line in stderr.splitlines() if line.startswith("Error")]
        assert errors == [
            f"Error: the store {state / 'runner.db'} is locked by another process (a runner "
            f"serving on {state}?): stop it, or give this runner a state directory of its "
            "own with --state DIR"
        ], stderr
        async with runner.host() as host:  # the first one serves on, undisturbed
            assert await host.high_water(Key(identity="any", instance="a")) is None
        assert await runner.terminate() == 0


async def test_an_example_on_a_serving_runners_state_directory_says_to_give_it_its_own(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    async with serving(state) as runner:
        with trio.fail_after(STARTUP + 10):  # SQLite waits 10 s for the store's lock
            example = await trio.run_process(
                [sys.executable, str(ROOT / "examples" / "runner.py"), "--state", str(state)],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                cwd=tmp_path,
            )
        assert example.returncode == 1, example.stderr
        assert example.stderr.decode() == (
            f"the store in {state} is locked by another process (a runner serving on "
            f"{state}?): stop it, or give this example a state directory of its own with "
            "--state DIR\n"
        )
        async with runner.host() as host:  # the runner serves on, undisturbed
            assert await host.high_water(Key(identity="any", instance="a")) is None
        assert await runner.terminate() == 0


# -- 2. a host --------------------------------------------------------------------------------


async def test_a_host_with_the_url_and_token_opens_loads_renews_and_disposes(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path / "state", "--plugins", PLUGINS) as runner:
        key = Key(identity="billing", instance="eu-1")
        async with runner.host() as host:
            record = await host.open(key, "req-1", expected_generation=None)
            assert record.phase is Phase.OPEN
            assert record.handle.generation == 1
            code = await host.load(record.handle, Load(specifier="heartbeat:main"))
            assert code.specifier == "heartbeat:main"
            assert code.origin == str(PLUGINS / "heartbeat.py")
            pid = await child_of(host, record.handle)
            assert running(pid)
            assert await host.renew(record.handle) == record.lease
            termination = await host.dispose(record.handle)
            assert termination.kind == "exited"
            assert termination.exit.code == 0  # heartbeat says goodbye on SIGTERM
            assert not running(pid)
            stopped = await host.status(record.handle)
            assert isinstance(stopped, StoppedRecord)
            assert stopped.reason == Disposed()
            # The hosts' token is no operator's: no listing of other hosts' sessions.
            async with httpx.AsyncClient(base_url=runner.url) as bare:
                listed = await bare.get(
                    "/v1/sessions", headers={"Authorization": f"Bearer {runner.token()}"}
                )
            assert listed.status_code == 403
        assert await runner.terminate() == 0


async def test_a_session_block_keeps_a_2_s_lease_alive_for_10_s_then_disposes(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path / "state", "--plugins", PLUGINS) as runner:
        key = Key(identity="billing", instance="eu-2")
        async with runner.host() as host:
            with trio.fail_after(40):
                high = await host.high_water(key)
                async with host.session(key, expected_generation=high, lease=2.0) as session:
                    assert session.record.lease == 2.0
                    await session.load(Load(specifier="heartbeat:main"))
                    pid = await child_of(host, session.handle)
                    await trio.sleep(10)  # five leases: only the block's renewals keep it
                    assert await child_of(host, session.handle) == pid
                    assert running(pid)
                    assert session.last_error is None
            assert session.termination is not None
            assert session.termination.kind == "exited"
            assert not running(pid)
            stopped = await host.status(session.handle)
            assert isinstance(stopped, StoppedRecord)
            assert stopped.reason == Disposed()
        assert await runner.terminate() == 0


# -- 3. signals ------------------------------------------------------------------------------


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
async def test_a_signal_stops_every_child_reaps_it_and_exits_0(
    tmp_path: Path, signal_name: str
) -> None:
    async with serving(tmp_path / "state", "--plugins", PLUGINS, "--grace", "1") as runner:
        async with runner.host() as host:
            pids = {}
            for identity, specifier in (("beat", "heartbeat:main"), ("spawn", "spawner:main")):
                record = await host.open(Key(identity=identity, instance="a"), f"req-{identity}")
                await host.load(record.handle, Load(specifier=specifier))
                pids[identity] = await child_of(host, record.handle)
        # The spawner's two grandchildren ignore SIGTERM: only its group's kill ends them.
        spawner = pids["spawn"]
        await until(lambda: len(descendants(spawner)) >= 2, "the spawner started its grandchildren")
        everything = runner.descendants()
        assert set(pids.values()) | descendants(spawner) <= everything
        assert await runner.terminate(signal.Signals[signal_name]) == 0, runner.stderr
        assert not {pid for pid in everything if running(pid)}
        reap(everything)


async def test_a_second_sigterm_skips_the_grace_and_exits_1(tmp_path: Path) -> None:
    async with serving(tmp_path / "state", "--plugins", PLUGINS, "--grace", "30") as runner:
        async with runner.host() as host:
            stubborn = await host.open(Key(identity="stubborn", instance="a"), "req-stubborn")
            await host.load(stubborn.handle, Load(specifier="stubborn:main"))
            stubborn_pid = await child_of(host, stubborn.handle)
            beat = await host.open(Key(identity="beat", instance="a"), "req-beat")
            await host.load(beat.handle, Load(specifier="heartbeat:main"))
            beat_pid = await child_of(host, beat.handle)
        await until(lambda: ignores_sigterm(stubborn_pid), "stubborn ignores SIGTERM")
        everything = runner.descendants()
        started = trio.current_time()
        runner.process.send_signal(signal.SIGTERM)
        # The shutdown interrupts every child: the heartbeat leaves at once, the stubborn
        # one stays, and the shutdown waits out its 30-s grace.
        await until(lambda: not running(beat_pid), "the shutdown stopped the heartbeat")
        assert running(stubborn_pid)
        assert runner.process.returncode is None
        runner.process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            status = await runner.process.wait()
        took = trio.current_time() - started
        assert status == 1, runner.stderr
        assert took < 15, f"exited {took:.1f} s after the first SIGTERM: the grace is 30 s"
        assert not {pid for pid in everything if running(pid)}
        reap(everything)


# -- 4. a crash and a restart ------------------------------------------------------------------

# Its import takes a minute: a load of it stays in flight, its child spawned.
SLOW_PLUGIN: Final = '''\
"""Imports for a minute, so a load of it stays in flight."""

import time

time.sleep(60)


def main(context: object) -> None:
    pass
'''


async def test_a_runner_killed_mid_load_recovers_on_restart_before_it_listens(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    slow = tmp_path / "slow-plugins"
    slow.mkdir()
    (slow / "slow.py").write_text(SLOW_PLUGIN)
    flags = ("--plugins", PLUGINS, "--plugins", slow, "--lease", "5")
    loading = Key(identity="crash", instance="loading")
    loaded = Key(identity="crash", instance="loaded")
    async with serving(state, *flags) as first, first.host() as host:
        one = await host.open(loading, "req-1")
        await host.dispose(one.handle)
        two = await host.open(loading, "req-2", expected_generation=1)
        assert two.handle.generation == 2
        spawner = await host.open(loaded, "req-3")
        await host.load(spawner.handle, Load(specifier="spawner:main"))
        spawner_pid = await child_of(host, spawner.handle)
        await until(lambda: len(descendants(spawner_pid)) >= 2, "the grandchildren started")
        grandchildren = descendants(spawner_pid)

        failures: list[BaseException] = []

        async def load_slowly() -> None:
            try:
                await host.load(two.handle, Load(specifier="slow:main"))
            except httpx.TransportError as error:
                failures.append(error)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(load_slowly)

            with trio.fail_after(20):
                while True:  # the listing is polled: nothing announces a spawn
                    record = await first.record(loading, 2)
                    if record is not None and record["phase"] == "Loading" and record["child"]:
                        break
                    await trio.sleep(0.02)
            everything = first.descendants()
            first.process.kill()
            await first.process.wait()
        assert len(failures) == 1, "the load in flight got no answer from a killed runner"

    async with serving(state, *flags) as second:
        # The first thing anyone can ask it shows recovery done: it ran before listening.
        recorded = set()
        for key, generation in ((loading, 2), (loaded, 1)):
            record = await second.record(key, generation)
            assert record is not None, (key, generation)
            assert record["phase"] == Phase.STOPPED.value, record
            assert record["reason"] == {"kind": "Recovery"}, record
            recorded.add(record["previous"]["child"]["pid"])
        assert spawner_pid in recorded
        assert not {pid for pid in recorded | grandchildren if running(pid)}
        # The rest (the killed runner's standby interpreter) ends by itself.
        await until(lambda: not {pid for pid in everything if running(pid)}, "every orphan is gone")
        reap(everything)

        async with second.host() as host:
            assert await host.high_water(loading) == 2
            with pytest.raises(StaleSessionError):
                await host.open(loading, "req-4", expected_generation=1)
            three = await host.open(loading, "req-5", expected_generation=2)
            assert three.handle.generation == 3
            again = await host.open(loaded, "req-6", expected_generation=1)
            assert again.handle.generation == 2
            await host.dispose(three.handle)
            await host.dispose(again.handle)
        assert await second.terminate() == 0


# -- 5. where it listens, and its config file --------------------------------------------------


async def test_plain_http_off_loopback_is_refused_unless_insecure_http(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "trio_supervisor", "serve", "--state", str(tmp_path / "s")]
    with trio.fail_after(STARTUP):
        refused = await trio.run_process(
            [*command, "--listen", "0.0.0.0:0"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=ROOT,
        )
    assert refused.returncode == 2
    assert b"--insecure-http" in refused.stderr, refused.stderr
    assert b"listening" not in refused.stdout

    async with serving(tmp_path / "s", "--insecure-http", listen="0.0.0.0:0") as runner:
        match = LISTENING.fullmatch(runner.line)
        assert match is not None
        assert match["host"] == "0.0.0.0"
        async with httpx.AsyncClient() as client:
            answer = await client.get(f"http://127.0.0.1:{match['port']}/healthz")
        assert answer.json() == {"status": "ok"}
        assert await runner.terminate() == 0


async def test_a_config_file_is_honoured_and_a_flag_wins_over_it(tmp_path: Path) -> None:
    key = Key(identity="configured", instance="a")

    async def lease_and_load(runner: Runner) -> float:
        async with runner.host() as host:
            high = await host.high_water(key)
            record = await host.open(key, f"req-{high}", expected_generation=high)
            await host.load(record.handle, Load(specifier="heartbeat:main"))  # --plugins
            await host.dispose(record.handle)
            return record.lease

    config = tmp_path / "runner.toml"
    # standby and fork_server off: every load starts an interpreter of its own.
    config.write_text(
        f'listen = "127.0.0.1:0"\nplugins = ["{PLUGINS}"]\nlease = 3\n'
        "standby = false\nfork_server = false\n"
    )
    async with serving(tmp_path / "state", "--config", config, listen=None) as runner:
        assert runner.url.startswith("http://127.0.0.1:")
        assert await lease_and_load(runner) == 3.0
        assert await runner.terminate() == 0

    # Alone, this listen would be refused (plain HTTP off loopback): the flags win.
    config.write_text(f'listen = "0.0.0.0:0"\nplugins = ["{PLUGINS}"]\nlease = 3\n')
    flags = ("--config", config, "--lease", "4")
    async with serving(tmp_path / "state", *flags, listen="127.0.0.1:0") as runner:
        assert runner.url.startswith("http://127.0.0.1:")
        assert await lease_and_load(runner) == 4.0
        assert await runner.terminate() == 0


# -- 6. TLS ------------------------------------------------------------------------------------


async def test_tls_serves_https_to_a_client_that_verifies_the_certificate(
    tmp_path: Path,
) -> None:
    openssl = shutil.which("openssl")
    assert openssl is not None, "the openssl command is needed to make a certificate"
    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    with trio.fail_after(30):
        await trio.run_process(
            [
                openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
                "-keyout", str(key_file), "-out", str(cert), "-subj", "/CN=localhost",
                "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
            ],
            capture_stdout=True,
            capture_stderr=True,
        )  # fmt: skip
    flags = ("--plugins", PLUGINS, "--certfile", cert, "--keyfile", key_file)
    async with serving(tmp_path / "state", *flags) as runner:
        assert re.fullmatch(r"listening on https://127\.0\.0\.1:\d+\n", runner.line)
        key = Key(identity="tls", instance="a")
        async with connect(runner.url, token=runner.token(), verify=str(cert)) as host:
            record = await host.open(key, "req-1")
            await host.load(record.handle, Load(specifier="heartbeat:main"))
            assert (await host.dispose(record.handle)).kind == "exited"
        # Verification is real: without the certificate, the runner is not trusted.
        async with connect(runner.url, token=runner.token(), request_timeout=10) as stranger:
            with pytest.raises(httpx.ConnectError):
                await stranger.status(record.handle)
        assert await runner.terminate() == 0


# -- 7. many hosts at once ----------------------------------------------------------------------

HOSTS: Final = 200


async def test_200_concurrent_sessions_all_stop_and_every_child_is_reaped(tmp_path: Path) -> None:
    async with serving(tmp_path / "state", "--command", "sleeper=sleep 60") as runner:
        pids: dict[int, int] = {}
        terminations: list[str] = []
        all_loaded = trio.Event()
        started = trio.current_time()

        async def one_host(number: int) -> None:
            key = Key(identity="many", instance=f"host-{number}")
            async with runner.host() as host:
                record = await host.open(key, f"req-{number}")
                await host.load(record.handle, Load(specifier="sleeper"))
                pids[number] = await child_of(host, record.handle)
                if len(pids) == HOSTS:
                    all_loaded.set()
                await all_loaded.wait()  # every child runs at once before any ends
                assert await host.renew(record.handle) == record.lease
                terminations.append((await host.dispose(record.handle)).kind)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for number in range(HOSTS):
                    nursery.start_soon(one_host, number)
                await all_loaded.wait()
                loaded = trio.current_time() - started
                assert all(running(pid) for pid in pids.values())
            took = trio.current_time() - started
        print(f"{HOSTS} sessions: all loaded after {loaded:.1f} s, all disposed after {took:.1f} s")
        assert terminations == ["exited"] * HOSTS
        assert not {pid for pid in pids.values() if running(pid)}
        sessions = await runner.sessions()
        assert len(sessions) == HOSTS
        assert {record["phase"] for record in sessions} == {Phase.STOPPED.value}
        assert {record["reason"]["kind"] for record in sessions} == {"Disposed"}
        assert await runner.terminate() == 0, runner.stderr
        problems = [line for line in runner.stderr.splitlines() if " INFO " not in line]
        assert not problems, runner.stderr
