"""The run's temporary-files guard: a run that leaves anything in the system's temporary
directory fails, naming it; the tests' own files go in tmp_path (tests/conftest.py)."""

from __future__ import annotations

import re
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
