"""The run's hang guard: a deadlocked Trio test ends the run with a failure and
tracebacks (pytest-timeout, as pyproject.toml and tests/conftest.py set it up), not never."""

from __future__ import annotations

from pathlib import Path

from ..support.processes import run_pytest

DEADLOCK = """\
import trio


async def test_waits_for_nothing(autojump_clock):
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep_forever, name="helper")
        await trio.Event().wait()  # nobody will ever set it


def test_never_reached():
    pass
"""


def test_a_deadlocked_trio_test_ends_the_run_with_its_tracebacks(tmp_path: Path) -> None:
    (tmp_path / "test_deadlock.py").write_text(DEADLOCK)
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_timeout_set_timer  # noqa: F401\n"
    )
    # The project's own settings, with the timeout the nox sessions set through the
    # environment shortened to 1 s.
    completed = run_pytest(tmp_path, "-v", env={"PYTEST_TIMEOUT": "1"})
    output = completed.stdout + completed.stderr
    assert completed.returncode == 1, output
    assert "test_deadlock.py::test_waits_for_nothing still runs after 1 s: deadlocked?" in output
    # Where each Trio task awaits: the test, and the task it started.
    test_task = output.index("task <test 'test_waits_for_nothing'>:")
    assert "await trio.Event().wait()  # nobody will ever set it" in output[test_task:], output
    helper = output.index("task helper:", test_task)
    assert "in sleep_forever" in output[helper:], output
    # Then every thread's stack, from pytest-timeout, and the run ends there.
    assert "Stack of MainThread" in output, output
    assert "test_never_reached" not in output, output


def test_a_test_may_run_for_600_s_unless_pytest_timeout_says_otherwise(tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    default = run_pytest(tmp_path, "-v", env={"PYTEST_TIMEOUT": None})
    assert default.returncode == 0, default.stdout + default.stderr
    assert "timeout: 600.0s\ntimeout method: thread\n" in default.stdout, default.stdout
    # What the nox sessions set: 60 (mutants), and 0, off (conformance).
    shorter = run_pytest(tmp_path, "-v", env={"PYTEST_TIMEOUT": "60"})
    assert shorter.returncode == 0, shorter.stdout + shorter.stderr
    assert "timeout: 60.0s\n" in shorter.stdout, shorter.stdout
    off = run_pytest(tmp_path, "-v", env={"PYTEST_TIMEOUT": "0"})
    assert off.returncode == 0, off.stdout + off.stderr
    assert "timeout:" not in off.stdout, off.stdout
