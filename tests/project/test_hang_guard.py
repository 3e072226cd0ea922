"""The run's hang guard: a deadlocked test ends the run with tracebacks, not never."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_a_deadlocked_test_ends_the_run(tmp_path: Path) -> None:
    (tmp_path / "test_deadlock.py").write_text(
        "import trio\n\n"
        "async def test_waits_for_nothing(autojump_clock):\n"
        "    await trio.Event().wait()  # nobody will ever set it\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\ntrio_mode = true\n")
    (tmp_path / "conftest.py").write_text("from tests.conftest import no_hang  # noqa: F401\n")
    environment = {**os.environ, "TRIO_SUPERVISOR_TEST_TIMEOUT": "1", "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode != 0
    assert "test_waits_for_nothing still runs after 1 s: deadlocked?" in completed.stderr
    assert "Thread" in completed.stderr  # the tracebacks
