"""Draining a runner (docs/service.md section B): ``trio-supervisor drain`` and
``serve --drain-on-sigterm``, on real ``serve`` processes.

A draining runner takes no new sessions or children (503 ``RunnerDraining``, and
``/readyz`` says so), answers everything else for the sessions it holds, and exits 0 once
they have ended, or at its deadline, having stopped the rest. Waits are bounded; the
runner's exit is the handshake.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from trio_supervisor import Key, Load, RunnerDrainingError

from ..support import ROOT
from ..support.runners import serving
from ..support.waits import until

KEY = Key(identity="drain", instance="one")
OTHER = Key(identity="drain", instance="two")


async def test_a_drained_runner_refuses_new_work_serves_its_sessions_and_exits_once_they_end(
    tmp_path: Path,
) -> None:
    with serving(tmp_path / "state") as runner:
        async with runner.host() as host, runner.operator() as operator:
            kept = await host.open(KEY, "kept", lease=30.0)
            await host.load(kept.handle, Load(specifier="heartbeat:main"))
            lapsing = await host.open(OTHER, "lapsing", lease=4.0)
            with trio.fail_after(60):
                drained = await trio.run_process(
                    [sys.executable, "-m", "trio_supervisor", "drain", "--url", runner.url,
                     "--state", str(runner.state), "--deadline", "60"],
                    capture_stdout=True, capture_stderr=True, cwd=ROOT, check=False,
                )  # fmt: skip
            assert drained.returncode == 0, drained.stderr
            said = drained.stdout.decode()
            # Two, unless the short lease ran out while the command started.
            assert re.match(
                rf"{re.escape(runner.url)}: draining; (2 sessions|1 session) left, stopped by "
                r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00 at the latest\n$",
                said,
            ), said
            ready = await host.health()
            assert (ready["status"], ready["code"]) == (503, "RunnerDraining")
            with pytest.raises(RunnerDrainingError, match="no new sessions") as refused:
                await host.open(Key(identity="drain", instance="new"), "new")
            assert refused.value.retry_after == 5
            with pytest.raises(RunnerDrainingError, match="no new children"):
                await host.load(lapsing.handle, Load(specifier="heartbeat:main"))
            # What it holds goes on: renew, status, an open repeated by its request id.
            assert await host.renew(kept.handle) == 30.0
            assert (await host.open(KEY, "kept", lease=30.0)).handle == kept.handle
            (info,) = await operator.runners()
            assert info.draining
            await host.dispose(kept.handle)
            # The other session's lease runs out; then nothing is left, and it exits 0.
            with trio.fail_after(30):
                assert await runner.wait() == 0
        assert "drained: no session is left" in runner.stderr()


async def test_drain_on_sigterm_stops_what_is_left_at_the_deadline_and_exits_0(
    tmp_path: Path,
) -> None:
    with serving(tmp_path / "state", "--drain-on-sigterm", "1") as runner:
        async with runner.host() as host:
            record = await host.open(KEY, "held", lease=30.0)
            await host.load(record.handle, Load(specifier="heartbeat:main"))
            signalled = time.monotonic()
            runner.process.terminate()

            async def refused() -> bool:
                return (await host.health()).get("code") == "RunnerDraining"

            await until(refused, "it drains")
            assert await host.renew(record.handle) == 30.0
            with trio.fail_after(30):
                assert await runner.wait() == 0
            assert time.monotonic() - signalled >= 1.0
        log = runner.stderr()
        assert "SIGTERM: draining (--drain-on-sigterm)" in log
        assert "drain: the deadline passed; the 1 session left stop now" in log


def test_a_drain_deadline_that_is_not_seconds_is_a_usage_error(tmp_path: Path) -> None:
    answer = subprocess.run(
        [sys.executable, "-m", "trio_supervisor", "drain", "--deadline", "-1",
         "--url", "http://127.0.0.1:9"],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert answer.returncode == 2
    assert "--deadline must be a finite number of seconds >= 0" in answer.stderr
