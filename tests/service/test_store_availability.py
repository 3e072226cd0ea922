"""A runner rides through what happens to its store (docs/design.md and SERVICE.md
section E, "Availability"), with real ``serve`` processes, real servers and real disks.

* B7: two runners of a fleet behind PgBouncer in session mode work as they do on the
  server itself (a supersede across them, F6), and ride through a fast restart of the
  cluster behind the bouncer: renewals answered, nothing poisoned, the session alive;
* B7: PgBouncer in transaction mode is refused as the runner starts, in one line;
* B5: a runner alone on SQLite whose disk fills is poisoned by the failed save, reaps
  its children, and once the disk has room again serves by itself as a new incarnation,
  its old sessions recovered as stopped.

Waits are bounded polls (``until``) of what the runners answer or of /proc; the only
pauses are a host's renewal period.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
import trio

from trio_supervisor import (
    Key,
    Load,
    LoadedRecord,
    Recovery,
    RunnerRestartingError,
    Shutdown,
    StateStorageError,
    StoppedRecord,
    Superseded,
    SupervisorError,
)
from trio_supervisor.client import connect

from ..support import ROOT
from ..support.clusters import own_clusters
from ..support.members import (
    FLEET_HOSTS_TOKEN,
    FLEET_OPERATOR_TOKEN,
    child_of,
    hosts,
    member,
    stopped_on,
)
from ..support.plugins import PLUGINS
from ..support.processes import process_state, reap_orphans, running
from ..support.runners import Runner, serving
from ..support.waits import until

KEY: Final = Key(identity="b7", instance="one")
# A fleet runner's row with the default lease (10 s), trusted for 8 s unrenewed (F2): a
# fast restart of the server is well within it. The fleet's tests' 1 s would be fenced
# by any outage longer than 0.8 s, which is their point, not this one's.
RUNNER_LEASE: Final = "10"
# Through PgBouncer a query waits for a server up to query_wait_timeout (120 s by
# default) and a failed server login turns clients away for server_login_retry (15 s):
# both longer than a runner waits for its store (--store-wait, 5 s).
BOUNCER_OUTAGE: Final = {"query_wait_timeout": 2, "server_login_retry": 1}


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    yield
    reap_orphans()  # what a runner killed on the way out left to the test process


async def readiness(runner: Runner) -> tuple[int, str]:
    """``/readyz``: its status and its problem's code ("" when it has none)."""
    async with runner.http(FLEET_OPERATOR_TOKEN) as client:
        answer = await client.get("/readyz")
    code = answer.json().get("code", "") if answer.status_code != 200 else ""
    return answer.status_code, str(code)


# -- B7: PgBouncer ----------------------------------------------------------------------


async def test_b7_two_runners_behind_pgbouncer_in_session_mode_work_and_supersede_across_runners(
    tmp_path: Path, tokens: tuple[Path, Path]
) -> None:
    """Two runners whose --store is PgBouncer (session mode) in front of a cluster of
    the test's own. F6 across them: a host's open of the next generation on r2 returns
    only once r1's child is gone. Then a fast restart of the cluster behind the bouncer
    while a loaded session lives on r2 and its host renews it every 0.2 s: every
    renewal is answered (renew needs no store, F5), neither runner is poisoned or says
    RunnerRestarting, the session and its child live on, and both runners write to the
    store again once it is back (a supersede across them once more)."""
    with own_clusters() as clusters:
        cluster = clusters.primary("b7")
        bouncer = clusters.bouncer(cluster, pool_mode="session", settings=BOUNCER_OUTAGE)
        store = bouncer.dsn()
        flags = ("--runner-lease", RUNNER_LEASE)
        with (
            member(tmp_path, tokens, store, "r1", *flags) as r1,
            member(tmp_path, tokens, store, "r2", *flags) as r2,
        ):
            async with hosts([r1, r2]) as (first, second):
                # F6 through the bouncer.
                held = await first.open(KEY, "held", lease=30.0)
                await first.load(held.handle, Load(specifier="heartbeat:main"))
                pid = await child_of(first, held.handle)
                assert running(pid)
                began = time.monotonic()
                newer = await second.open(KEY, "supersede", expected_generation=1, lease=30.0)
                superseded_in = time.monotonic() - began
                assert process_state(pid) in (None, "Z"), "the open returned before r1's child went"
                older = await stopped_on(first, held.handle)
                assert isinstance(older.reason, Superseded), older.reason
                assert newer.handle.generation == 2
                print(f"F6 through the bouncer: the supersede returned in {superseded_in:.2f} s")

                # A session that lives on r2 through the restart, renewed by its host.
                live_key = Key(identity="b7", instance="live")
                live = await second.open(live_key, "live", lease=4.0)
                await second.load(live.handle, Load(specifier="heartbeat:main"))
                live_pid = await child_of(second, live.handle)
                renewals: list[float] = []
                refusals: list[str] = []
                unready: list[tuple[str, int, str]] = []
                restarted = trio.Event()

                async def renew() -> None:
                    async with connect(r2.url, token=FLEET_HOSTS_TOKEN, retry_for=0) as strict:
                        while not restarted.is_set():
                            try:
                                renewals.append(await strict.renew(live.handle))
                            except SupervisorError as error:
                                refusals.append(f"{error.code}: {error.detail}")
                            await trio.sleep(0.2)

                async def watch(name: str, runner: Runner) -> None:
                    while not restarted.is_set():
                        status, code = await readiness(runner)
                        if status != 200:
                            unready.append((name, status, code))
                        await trio.sleep(0.1)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(renew)
                    nursery.start_soon(watch, "r1", r1)
                    nursery.start_soon(watch, "r2", r2)
                    with trio.fail_after(60):
                        began = time.monotonic()
                        await trio.to_thread.run_sync(cluster.restart)
                        down_for = time.monotonic() - began
                        # Both runners write again through the bouncer: an open on each
                        # (a StoreUnavailable is waited out by the client).
                        for number, host in enumerate((first, second)):
                            after = await host.open(
                                Key(identity="b7", instance=f"after-{number}"), "after"
                            )
                            assert after.handle.generation == 1
                        # Two more renewal periods with the store back.
                        count = len(renewals)
                        await until(lambda: len(renewals) >= count + 2, "two more renewals")
                    restarted.set()
                print(f"the cluster restarted in {down_for:.2f} s; {len(renewals)} renewals")
                assert not refusals, refusals
                assert renewals, "no renewal answered"
                assert all(seconds == 4.0 for seconds in renewals), renewals
                assert not any(code == "RunnerRestarting" for _, _, code in unready), unready
                assert not unready, unready
                status = await second.status(live.handle)
                assert isinstance(status, LoadedRecord), status
                assert running(live_pid), "the session's child did not survive the restart"

                # The fleet still supersedes across its runners: r2's child goes first.
                again = await first.open(live_key, "again", expected_generation=1, lease=30.0)
                assert again.handle.generation == 2
                assert process_state(live_pid) in (None, "Z")
                gone = await stopped_on(second, live.handle)
                assert isinstance(gone.reason, Superseded), gone.reason
            logs = {"r1": r1.stderr(), "r2": r2.stderr()}
            for name, log in logs.items():
                assert "poisoned" not in log, f"{name} poisoned itself:\n{log}"
            assert r1.stop() == 0, logs["r1"]
            assert r2.stop() == 0, logs["r2"]
        for name, log in logs.items():
            print(f"--- {name}'s stderr ---\n{log}")


async def test_b7_pgbouncer_in_transaction_mode_is_refused_at_start_in_one_line(
    tmp_path: Path, tokens: tuple[Path, Path]
) -> None:
    """``serve --store`` at PgBouncer in transaction mode exits 1 at start, saying in one
    line that the pooler shares server sessions between transactions and what to do; it
    never listens."""
    hosts_token, operators_token = tokens
    with own_clusters() as clusters:
        cluster = clusters.primary("b7t")
        bouncer = clusters.bouncer(cluster, pool_mode="transaction", settings=BOUNCER_OUTAGE)
        command = [
            sys.executable,
            "-m",
            "trio_supervisor",
            "serve",
            "--state",
            str(tmp_path / "refused"),
            "--listen",
            "127.0.0.1:0",
            "--plugins",
            str(PLUGINS),
            "--store",
            bouncer.dsn(),
            "--runner-id",
            "r1",
            "--token-file",
            str(hosts_token),
            "--operator-token-file",
            str(operators_token),
        ]
        done = await trio.to_thread.run_sync(
            lambda: subprocess.run(
                command,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        )
    print(f"serve exited {done.returncode}; its stderr:\n{done.stderr}")
    assert done.returncode == 1, done.stderr
    assert "listening on" not in done.stdout, done.stdout
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    last = lines[-1]
    assert last.startswith("Error: cannot open the fleet's store at"), last
    for said in (
        "shares one server session between its clients' transactions",
        "pool_mode=transaction",
        "point --store at the server, or at a pool with pool_mode=session",
    ):
        assert said in last, last
    assert "Traceback" not in done.stderr, done.stderr


# -- B5: a full disk under SQLite ----------------------------------------------------------


@contextlib.contextmanager
def small_filesystem(directory: Path, size: str = "8m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on ``directory`` (made here), unmounted (lazily, so
    nothing that still holds a file there can keep it) on the way out. Skips when the
    mount is refused (not root, no CAP_SYS_ADMIN); fails instead where ``CI`` is set."""
    directory.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        why = (
            f"a full disk needs a small filesystem of the test's own, and mounting a tmpfs "
            f"on {directory} failed ({mounted.returncode}): {mounted.stderr.strip()}"
        )
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, check=False)


def fill(path: Path) -> int:
    """Write ``path`` until its filesystem has no room left (ENOSPC); its size."""
    written = 0
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        for block in (1 << 20, 1 << 12, 1):
            chunk = b"\0" * block
            while True:
                try:
                    written += os.write(descriptor, chunk)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(descriptor)
    return written


async def metrics_of(runner: Runner) -> str:
    async with runner.http(FLEET_OPERATOR_TOKEN) as operator:
        answer = await operator.get("/metrics")
    assert answer.status_code == 200, answer.text
    return answer.text


async def test_b5_a_runner_alone_whose_disk_fills_heals_once_it_frees(
    tmp_path: Path, tokens: tuple[Path, Path]
) -> None:
    """A runner alone on SQLite, its state directory on a tmpfs of 8 MiB. Two sessions,
    one with a child; then the disk fills. The next save fails ("database or disk is
    full"): the host's open fails, and the supervisor is poisoned (H1). The runner
    answers 503 RunnerRestarting while the old incarnation's child is stopped and
    reaped; once the test frees the disk, it serves again by itself: its old sessions
    read as stopped (Recovery, or Shutdown where the stop's record landed), a new open
    works, and the restart is counted as the store's."""
    hosts_token, operators_token = tokens
    state = tmp_path / "state"
    with (
        small_filesystem(state) as small,
        serving(
            state,
            "--token-file",
            str(hosts_token),
            "--operator-token-file",
            str(operators_token),
            "--grace",
            "0.5",
            "--confirmation-timeout",
            "1",
            log=tmp_path / "alone.stderr",  # not on the small filesystem
        ) as runner,
    ):
        async with connect(runner.url, token=FLEET_HOSTS_TOKEN) as host:
            loaded = await host.open(Key(identity="disk", instance="loaded"), "l", lease=60.0)
            await host.load(loaded.handle, Load(specifier="heartbeat:main"))
            idle = await host.open(Key(identity="disk", instance="idle"), "i", lease=60.0)
            pid = await child_of(host, loaded.handle)
            assert running(pid)

            filler = small / "filler"
            size = fill(filler)
            print(f"the state directory's filesystem is full: {size} bytes of filler")
            late = Key(identity="disk", instance="late")
            async with connect(runner.url, token=FLEET_HOSTS_TOKEN, retry_for=0) as hurried:
                with pytest.raises((StateStorageError, RunnerRestartingError)) as refused:
                    await hurried.open(late, "late")
            print(f"the open while the disk is full: {refused.value.code}: {refused.value}")

            async def restarting() -> bool:
                return await readiness(runner) == (503, "RunnerRestarting")

            await until(restarting, "readyz 503 RunnerRestarting", bound=15)
            async with runner.http(FLEET_OPERATOR_TOKEN) as operator:
                health = await operator.get("/healthz")
            assert health.status_code == 200, health.text
            await until(lambda: process_state(pid) is None, "the old child reaped", bound=15)
            assert "database or disk is full" in runner.stderr()
            assert "the supervisor was poisoned (store)" in runner.stderr()
            # A new incarnation tried on a disk still full fails, and is tried again
            # after the next back-off.
            await until(
                lambda: "cannot start a new incarnation yet" in runner.stderr(),
                "a new incarnation tried while the disk is still full",
                bound=15,
            )
            assert await readiness(runner) == (503, "RunnerRestarting")

            filler.unlink()

            async def ready() -> bool:
                return (await readiness(runner))[0] == 200

            await until(ready, "the runner serving again", bound=35)
            for record in (loaded, idle):
                status = await host.status(record.handle)
                assert isinstance(status, StoppedRecord), status
                assert isinstance(status.reason, (Recovery, Shutdown)), status.reason
                print(f"{record.handle.key.instance}: {status.reason.kind}")
            again = await host.open(late, "late-again")
            assert again.handle.generation == 1
            await host.load(again.handle, Load(specifier="heartbeat:main"))
            assert running(await child_of(host, again.handle))
            samples = await metrics_of(runner)
            assert 'trio_supervisor_restarts_total{cause="store"} 1.0' in samples, samples
        assert runner.stop() == 0, runner.stderr()
        print(f"--- the runner's stderr ---\n{runner.stderr()}")
