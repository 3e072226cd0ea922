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
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import trio

from trio_supervisor import (
    Disposed,
    Key,
    Limits,
    Load,
    LoadedRecord,
    Phase,
    RunnerUnreachableError,
    StaleSessionError,
    StoppedRecord,
)
from trio_supervisor.client import RemoteSupervisor, RunnerAccessError, connect

from ..support import ROOT
from ..support.plugins import PLUGINS
from ..support.processes import STARTUP, descendants, reap, running, without_others_on_the_machine
from ..support.runners import LISTENING, Runner, serving
from ..support.waits import settled, until

ORPHANS: Final = 10.0  # seconds what a test leaves may take to die by itself
SIGTERM_BIT: Final = 1 << (signal.SIGTERM - 1)  # in /proc/PID/status SigIgn


# -- processes, through /proc ---------------------------------------------------------------


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


@pytest.fixture(autouse=True)
def leaves_no_process() -> Iterator[None]:
    """Fail a test that leaves a process of its own running; kill and reap what it left.

    A runner killed with SIGKILL leaves its children to us; they end by themselves (the
    dead-man switch, the lease) or when a restarted runner recovers them. What still
    runs ``ORPHANS`` seconds after the test is a leak.
    """
    before = descendants(os.getpid())
    yield

    def leftovers() -> set[int]:
        return {pid for pid in descendants(os.getpid()) - before if running(pid)}

    settled(lambda: not leftovers(), ORPHANS)
    left = leftovers()
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in left:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # killed: this returns at once
    reap(descendants(os.getpid()) - before)
    assert not left, f"processes outlived the test by {ORPHANS:g} s: {sorted(left)}"


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
    with serving(state, plugins=()) as runner:
        match = LISTENING.fullmatch(runner.line)
        assert match is not None
        assert runner.line == f"listening on http://127.0.0.1:{match['port']}\n"
        assert int(match["port"]) > 0  # the real port, not the 0 it was given
        async with runner.http() as operator:
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
    with serving(state, plugins=()) as again:
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
    with serving(state, "--token-file", given, plugins=()) as runner:
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
    with serving(state, plugins=()) as runner:
        command = [sys.executable, "-m", "trio_supervisor", "serve", "--state", str(state)]
        # The store is refused at once, not after SQLite's lock wait: the first runner's
        # store owns the file (stores/_sqlite_file.py).
        with trio.fail_after(STARTUP):
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
        [error] = [line for line in stderr.splitlines() if line.startswith("Error")]
        # The store's own words, which name the runner's process that holds it.
        holder = f"in process {runner.process.pid} ({sys.executable} -m trio_supervisor serve"
        assert error.startswith(
            f"Error: the store {state / 'runner.db'}: cannot open: the file is locked by "
            f"another store that owns it, {holder}"
        ), stderr
        assert error.endswith(
            "): stop it, or give this runner a state directory of its own with --state DIR"
        ), stderr
        async with runner.host() as host:  # the first one serves on, undisturbed
            assert await host.high_water(Key(identity="any", instance="a")) is None
        assert await runner.terminate() == 0


async def test_an_example_on_a_serving_runners_state_directory_says_to_give_it_its_own(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    with serving(state, plugins=()) as runner:
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
    with serving(tmp_path / "state") as runner:
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
            # The hosts' token is no operator's: it may not dispose by key.
            async with httpx.AsyncClient(base_url=runner.url) as bare:
                refused = await bare.post(
                    "/v1/admin/dispose",
                    json={"key": {"identity": "x", "instance": "y"}, "generation": 1},
                    headers={"Authorization": f"Bearer {runner.token()}"},
                )
            assert refused.status_code == 403
        assert await runner.terminate() == 0


async def test_a_session_block_keeps_a_2_s_lease_alive_for_10_s_then_disposes(
    tmp_path: Path,
) -> None:
    with serving(tmp_path / "state") as runner:
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
    with serving(tmp_path / "state", "--grace", "1") as runner:
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
        assert await runner.terminate(signal.Signals[signal_name]) == 0, runner.stderr()
        assert not {pid for pid in everything if running(pid)}
        reap(everything)


async def test_a_second_sigterm_skips_the_grace_and_exits_1(tmp_path: Path) -> None:
    with serving(tmp_path / "state", "--grace", "30") as runner:
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
        assert runner.process.poll() is None
        runner.process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            status = await runner.wait()
        took = trio.current_time() - started
        assert status == 1, runner.stderr()
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
    flags = ("--lease", "5")
    plugins = (PLUGINS, slow)
    loading = Key(identity="crash", instance="loading")
    loaded = Key(identity="crash", instance="loaded")
    with serving(state, *flags, plugins=plugins) as first:
        async with first.host() as host:
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
                except RunnerUnreachableError as error:
                    failures.append(error)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(load_slowly)

                async def spawned() -> bool:  # the listing is polled: nothing announces a spawn
                    record = await first.record(loading, 2)
                    return (
                        record is not None
                        and record["phase"] == "Loading"
                        and bool(record["child"])
                    )

                await until(spawned, "the slow load spawned its child")
                everything = first.descendants()
                first.process.kill()
                await first.wait()
            assert len(failures) == 1, "the load in flight got no answer from a killed runner"

    with serving(state, *flags, plugins=plugins) as second:
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

    with serving(tmp_path / "s", "--insecure-http", plugins=(), listen="0.0.0.0:0") as runner:
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
    with serving(tmp_path / "state", "--config", config, plugins=(), listen=None) as runner:
        assert runner.url.startswith("http://127.0.0.1:")
        assert await lease_and_load(runner) == 3.0
        assert await runner.terminate() == 0

    # Alone, this listen would be refused (plain HTTP off loopback): the flags win.
    config.write_text(f'listen = "0.0.0.0:0"\nplugins = ["{PLUGINS}"]\nlease = 3\n')
    flags = ("--config", config, "--lease", "4")
    with serving(tmp_path / "state", *flags, plugins=(), listen="127.0.0.1:0") as runner:
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
    flags = ("--certfile", cert, "--keyfile", key_file)
    with serving(tmp_path / "state", *flags) as runner:
        assert re.fullmatch(r"listening on https://127\.0\.0\.1:\d+\n", runner.line)
        key = Key(identity="tls", instance="a")
        async with connect(runner.url, token=runner.token(), verify=str(cert)) as host:
            record = await host.open(key, "req-1")
            await host.load(record.handle, Load(specifier="heartbeat:main"))
            assert (await host.dispose(record.handle)).kind == "exited"
        # Verification is real: without the certificate, the runner is not trusted.
        async with connect(runner.url, token=runner.token(), request_timeout=10) as stranger:
            with pytest.raises(RunnerUnreachableError, match="refused the TLS handshake"):
                await stranger.status(record.handle)
        assert await runner.terminate() == 0


# -- 7. many hosts at once ----------------------------------------------------------------------

HOSTS: Final = 200
SMALL: Final = Limits(memory_bytes=64 << 20)  # 200 of these fit any machine the tests run on
# A bound against a hang, not a speed test: the 200 loads and disposes take about 15 s on
# a quiet machine, over 60 s at a load of 7 on 2 cores. Nothing else of the test may run
# out first: each session's lease, each host's request, each child's own life.
MANY_BOUND: Final = 300.0
MANY_LEASE: Final = MANY_BOUND + 60.0


async def test_200_concurrent_sessions_all_stop_and_every_child_is_reaped(tmp_path: Path) -> None:
    # More children than the default capacity of a machine of 2 cores (64 per core).
    flags = ("--command", f"sleeper=sleep {2 * MANY_LEASE:g}", "--max-children", str(HOSTS))
    with serving(tmp_path / "state", *flags, plugins=()) as runner:
        pids: dict[int, int] = {}
        terminations: list[str] = []
        all_loaded = trio.Event()
        started = trio.current_time()

        async def one_host(number: int) -> None:
            key = Key(identity="many", instance=f"host-{number}")
            token = runner.hosts_token
            async with connect(runner.url, token=token, request_timeout=MANY_BOUND) as host:
                # Each asks for a small memory ceiling: with the default's 1 GiB the
                # runner would take as many as the machine's memory allows, and no more.
                # The lease outlasts the wait for all the others (the runner's default
                # of 30 s would not on a loaded machine).
                record = await host.open(key, f"req-{number}", limits=SMALL, lease=MANY_LEASE)
                await host.load(record.handle, Load(specifier="sleeper"))
                pids[number] = await child_of(host, record.handle)
                if len(pids) == HOSTS:
                    all_loaded.set()
                await all_loaded.wait()  # every child runs at once before any ends
                assert await host.renew(record.handle) == record.lease
                terminations.append((await host.dispose(record.handle)).kind)

        with trio.fail_after(MANY_BOUND):
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
        assert await runner.terminate() == 0, runner.stderr()
        said = without_others_on_the_machine(runner.stderr())
        problems = [line for line in said.splitlines() if " INFO " not in line]
        assert not problems, runner.stderr()
