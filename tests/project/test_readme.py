"""The README's examples run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from ..support.runners import serving

README = Path(__file__).parents[2] / "README.md"


def block(containing: str) -> str:
    """The README's Python block that holds ``containing``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    [found] = [text for text in blocks if containing in text]
    return str(found)


def test_the_embedding_example_runs_again_and_again_in_one_folder(tmp_path: Path) -> None:
    embedding = block("open_supervisor(store, execution")
    for generation in (1, 2, 3):
        done = subprocess.run(
            [sys.executable, "-c", embedding],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            f"working for Key(identity='billing', instance='eu-1') generation {generation}",
            "exited (cancelled)",
        ]
    assert (tmp_path / "state.db").exists()


def test_the_adapter_testing_example_runs_under_pytest(tmp_path: Path) -> None:
    # As written: its stores go to a temporary directory of its own, which it removes
    # (the run's guard in conftest.py fails the run if anything is left behind).
    adapter = block("conformance_machine")
    (tmp_path / "my_package.py").write_text("from trio_supervisor import SqliteStore as MyStore\n")
    (tmp_path / "test_my_adapter.py").write_text(adapter)
    # As written, in a folder with no pytest configuration: the kit carries its marker.
    environment = {
        **os.environ,
        "TRIO_SUPERVISOR_CONFORMANCE": "quick",
        "PYTHONPATH": str(tmp_path),
    }
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *("--basetemp", str(tmp_path / "basetemp"), str(tmp_path)),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\b8 passed\b", done.stdout), done.stdout


def test_the_client_example_runs_against_a_served_runner(tmp_path: Path) -> None:
    client = block("from trio_supervisor.client import connect")
    with serving(None, "--grace", "1", cwd=tmp_path) as runner:  # ./runner-state
        # As written, but for the port: the README's runner listens on 8470.
        done = subprocess.run(
            [sys.executable, "-c", client.replace("http://127.0.0.1:8470", runner.url)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["exited (code 0)"]
        assert runner.stop() == 0
