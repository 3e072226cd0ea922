"""The README's main job: the embedded example, run twice on one state directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..support.postgres import server_dsn, with_parts

EXAMPLE = Path(__file__).parents[2] / "examples" / "embedded.py"
FLEET = Path(__file__).parents[2] / "examples" / "fleet.py"


def run(state: Path) -> str:
    # 2 s leases: short enough to watch one expire, long enough that a loaded machine
    # (the suite's other workers) renews in time.
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--state", str(state), "--lease", "2.0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def rows(output: str) -> dict[str, str]:
    """The final table's rows by session, each row as its line."""
    table = output.split("\n\n")[-1].splitlines()[2:]
    return {line.split()[0]: line for line in table}


def test_the_example_reports_each_session_and_continues_generations(tmp_path: Path) -> None:
    first = rows(run(tmp_path))
    assert set(first) == {
        "example/renewed",
        "example/expiring",
        "example/finishing",
        "example/stubborn",
    }
    assert [first[name].split()[1] for name in sorted(first)] == ["1"] * 4
    assert first["example/expiring"].endswith("Expired   exited (code 0)")
    assert first["example/finishing"].endswith("Exited    exited (code 0)")
    # In-process children are tasks: they are cancelled, never signalled.
    assert first["example/stubborn"].endswith("Disposed  killed (did not stop in time; cancelled)")
    assert first["example/renewed"].endswith("Disposed  exited (cancelled)")
    assert "Open > Loading > Loaded > Stopping > Stopped" in first["example/renewed"]

    output = run(tmp_path)
    assert "continuing from the stored high-water generation 1" in output
    second = rows(output)
    assert [second[name].split()[1] for name in sorted(second)] == ["2"] * 4


REMOTE_HOST = Path(__file__).parents[2] / "examples" / "remote_host.py"


def test_the_remote_host_example_runs_against_a_runner_of_its_own_twice() -> None:
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, str(REMOTE_HOST), "--serve", "--seconds", "1.5"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        lines = done.stdout.splitlines()
        assert lines[0].startswith("connected to http://127.0.0.1:")
        assert "beating: still Loaded after 1.5 s of 1.5-s leases" in lines
        assert "beating: disposed, exited (code 0)" in lines
        assert "spawning: disposed, exited (SIGTERM; 2 descendants killed)" in lines
        assert any(line.startswith("a load of nowhere:main: PackageError: ") for line in lines)
        assert any(line.startswith("a guessed token: StaleSessionError: ") for line in lines)
        assert lines[-1] == "the runner stopped (exit status 0), every child reaped"


def test_the_fleet_example_runs_twice_on_the_machine_s_postgresql() -> None:
    """examples/fleet.py (README, "Run a fleet"): two runners, one killed, a takeover."""
    url = with_parts(server_dsn(), path="/postgres")  # the example makes its own database
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, str(FLEET), url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert "renewed through r2 (sent on to r1, the holder): lease 3 s" in lines
        assert "r1 killed with SIGKILL" in lines
        assert any(line.startswith("opened generation 2 on r2 after ") for line in lines), lines
        assert "generation 1, on r1: Recovery, exited (runner lost; exit status unknown)" in lines
        assert lines[-1] == "r2 stopped, every child reaped; the example's database is dropped"
