"""The README's examples run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from trio_supervisor import (
    Key,
    Load,
    MemoryStore,
    PackageError,
    SubprocessExecution,
    open_supervisor,
)

from ..support.plugins import PLUGINS
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
    assert re.search(r"\b9 passed\b", done.stdout), done.stdout


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


# -- the plugins the README names ----------------------------------------------------------

# A name passed to load: Load(specifier="..."), or a wire body's "specifier" (in a shell
# line its quotes are escaped).
LOADED = re.compile(r'specifier=\\?"([^"\\]+)\\?"|\\?"specifier\\?":\s*\\?"([^"\\]+)\\?"')
# The example of a load that fails: `cannot load 'SPECIFIER': ...`, quoted whole.
FAILED = re.compile(r"`(cannot load '([^']+)':[^`]+)`")


async def loaded(specifiers: set[str], state: Path) -> dict[str, str | None]:
    """Each ``module:function`` loaded for real into a child, from the examples' entry
    path (the README's ``serve --plugins examples/plugins``): None, or the sentence the
    load failed with."""
    found: dict[str, str | None] = {}
    async with (
        MemoryStore() as store,
        SubprocessExecution(state, entry_paths=[PLUGINS], isolation="none") as execution,
        open_supervisor(store, execution, lease=30.0, grace=1.0) as supervisor,
    ):
        for number, specifier in enumerate(sorted(specifiers)):
            record = await supervisor.open(Key(identity="readme", instance=str(number)), "r")
            try:
                await supervisor.load(record.handle, Load(specifier=specifier))
            except PackageError as error:
                found[specifier] = error.detail
            else:
                found[specifier] = None
                await supervisor.dispose(record.handle)
    return found


async def test_every_plugin_the_readme_loads_resolves(tmp_path: Path) -> None:
    text = README.read_text()
    named = {first or second for first, second in LOADED.findall(text)}
    specifiers = {name for name in named if ":" in name}
    assert "heartbeat:main" in specifiers  # the wire example's and the client's
    for specifier, failure in (await loaded(specifiers, tmp_path)).items():
        assert failure is None, f"the README loads {specifier!r}, but {failure}"
    # A bare name is an in-process plugin: a name of the InProcessExecution beside it.
    for name in named - specifiers:
        where = block(f'specifier="{name}"')
        assert re.search(rf'InProcessExecution\(\{{[^}}]*"{name}": ', where), name
        assert f"def {name}(" in where, name  # defined there, as plain or async


async def test_the_readmes_failed_load_says_what_such_a_load_says(tmp_path: Path) -> None:
    # The README's example of a load that fails is a real misspelling, worded as it is.
    text = " ".join(README.read_text().split())  # the sentence may wrap over lines
    examples = {specifier: sentence for sentence, specifier in FAILED.findall(text)}
    assert examples, "the README shows no failed load"
    assert await loaded(set(examples), tmp_path) == examples
