"""The README's examples run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_the_embedding_example_runs_again_and_again_in_one_folder(tmp_path: Path) -> None:
    embedding = blocks()[0]
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
    adapter = blocks()[1]
    (tmp_path / "my_package.py").write_text("from trio_supervisor import SqliteStore as MyStore\n")
    (tmp_path / "test_my_adapter.py").write_text(adapter)
    # As written, in a folder with no pytest configuration: the kit carries its marker.
    environment = {
        **os.environ,
        "TRIO_SUPERVISOR_CONFORMANCE": "quick",
        "PYTHONPATH": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\b8 passed\b", done.stdout), done.stdout
