"""The run's temporary-files guard: a run that leaves anything in the system's temporary
directory fails, naming it; the tests' own files go in tmp_path (tests/conftest.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from ..support import ROOT
from ..support.processes import run_pytest

TESTS = """\
import tempfile


def test_writes_in_its_tmp_path(tmp_path):
    (tmp_path / "kept.db").write_text("a store")


def test_leaves_a_file_behind():
    tempfile.mkstemp(prefix="left-behind-", suffix=".db")
"""

CONFTEST = (
    "from tests.conftest import (  # noqa: F401\n"
    "    no_leaked_temporary_files, pytest_configure, pytest_unconfigure\n"
    ")\n"
)


def test_a_run_that_leaves_a_temporary_file_fails_naming_it(tmp_path: Path) -> None:
    (tmp_path / "test_leaving.py").write_text(TESTS)
    (tmp_path / "conftest.py").write_text(CONFTEST)

    clean = run_pytest(tmp_path, "-k", "tmp_path")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "1 passed" in clean.stdout

    leaking = run_pytest(tmp_path)
    output = leaking.stdout + leaking.stderr
    assert leaking.returncode == 1, output
    assert "2 passed, 1 error" in output  # the guard's, at the end of the run
    found = re.search(r"the run left 1 entries in the temporary directory (\S+) ", output)
    assert found is not None, output
    assert re.search(r"\): left-behind-\w+\.db", output), output
    # The run's temporary directory was its own, below the project, not the system's,
    # and it went with the run.
    directory = Path(found[1])
    assert directory.parent == ROOT / ".pytest-tmp"
    assert not directory.exists()


TWICE = """\
import os, sys, tempfile

import pytest

before = os.environ.get("TMPDIR"), tempfile.gettempdir()
arguments = sys.argv[1:]
codes = [int(pytest.main(arguments)), int(pytest.main(arguments))]
print("codes", codes)
print("restored", (os.environ.get("TMPDIR"), tempfile.gettempdir()) == before)
"""


def test_runs_one_after_another_in_one_process_each_get_their_own_directory(
    tmp_path: Path,
) -> None:
    # mutmut runs pytest.main several times in its own process (then in forks of it):
    # pytest makes its capture files with tempfile before it reads a conftest, so a run
    # that left TMPDIR naming the directory it removed failed the next one's start.
    (tmp_path / "test_writing.py").write_text(
        "import tempfile\n\n\ndef test_writes():\n    tempfile.TemporaryFile().close()\n"
    )
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "twice.py").write_text(TWICE)
    command = [sys.executable, str(tmp_path / "twice.py"), "-c", str(ROOT / "pyproject.toml")]
    command += ["--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-q", str(tmp_path)]
    command += ["--basetemp", str(tmp_path / "basetemp")]
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    environment.pop("TMPDIR")  # as a shell starts it: this run's own goes with it
    twice = subprocess.run(
        command,
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = twice.stdout + twice.stderr
    assert twice.returncode == 0, output
    assert "codes [0, 0]" in output
    assert "restored True" in output
