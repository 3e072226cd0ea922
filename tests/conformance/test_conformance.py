"""The conformance machine against the built-in adapters; the testing package's face; the
harnesses' word on the exit statuses the model predicts."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from trio_supervisor import Handle, Key, Limits, Load, MemoryStore, Retention, SqliteStore
from trio_supervisor.abc import Store
from trio_supervisor.testing import (
    FakeHarness,
    Harness,
    InProcessHarness,
    SubprocessHarness,
    conformance_machine,
)
from trio_supervisor.testing.reference import Ending

# Where the SQLite machine's stores go: the machine calls ``sqlite`` for each, no fixture
# reaches it, so this module's directory is set before its tests run.
DIRECTORY: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _stores_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    DIRECTORY.append(tmp_path_factory.mktemp("conformance-stores"))
    yield
    DIRECTORY.clear()


def memory(previous: Store | None, retention: Retention) -> Store:
    return previous or MemoryStore(retention=retention)


def sqlite(previous: Store | None, retention: Retention) -> Store:
    path = (
        previous.path
        if isinstance(previous, SqliteStore)
        else DIRECTORY[0] / f"{uuid.uuid4().hex}.db"
    )
    return SqliteStore(path, retention=retention)


# The rules get the whole "ci" pass on the memory store and the fake execution; the SQLite
# store and the in-process execution, a short one each in the suite (``nox -s
# conformance`` runs every machine deep: $TRIO_SUPERVISOR_CONFORMANCE).
ADAPTERS = None if os.environ.get("TRIO_SUPERVISOR_CONFORMANCE") else "short"
TestMemoryStoreWithFakeExecution = conformance_machine(memory).TestCase
TestSqliteStoreWithFakeExecution = conformance_machine(sqlite, profile=ADAPTERS).TestCase
TestMemoryStoreWithInProcessExecution = conformance_machine(
    memory, InProcessHarness, profile=ADAPTERS
).TestCase


def test_the_testing_package_imports_without_hypothesis_or_pytest() -> None:
    # FakeExecution users may have neither: both are test-only dependencies.
    script = """
import sys
sys.modules["hypothesis"] = sys.modules["pytest"] = None  # importing them fails
import trio_supervisor.testing as testing
from trio_supervisor.testing import FakeExecution, FakeHarness, FaultyStore
assert FakeHarness.__name__ == "FakeHarness"
try:
    testing.conformance_machine
except ImportError:
    print("no hypothesis")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["no", "hypothesis"]


def test_the_machine_kits_and_harnesses_are_importable_from_the_testing_package() -> None:
    import trio_supervisor.testing as testing
    from trio_supervisor.testing import conformance, contracts, harnesses

    assert testing.conformance_machine is conformance.conformance_machine
    assert testing.StoreContract is contracts.StoreContract
    assert testing.ExecutionContract is contracts.ExecutionContract
    assert testing.SubprocessHarness is harnesses.SubprocessHarness
    assert set(testing.__all__) <= set(dir(testing))


@pytest.mark.parametrize("make", [FakeHarness, InProcessHarness, SubprocessHarness])
async def test_each_harness_tells_the_model_the_exit_statuses_its_execution_reports(
    make: Callable[..., Harness], tmp_path: Path
) -> None:
    # The model predicts every termination whole from what the harness says; the machine
    # drives the fake and the in-process harness, this holds all three to their word.
    endings: list[Ending] = ["exit", "interrupt", "kill", "recover", "gone"]
    harness = make(tmp_path) if make is SubprocessHarness else make()
    async with harness:
        for generation, ending in enumerate(endings, 1):
            handle = Handle(
                key=Key(identity="h", instance="x"), token="a" * 32, generation=generation
            )
            with trio.fail_after(20):
                unit = await harness.execution.spawn(
                    handle, Load(specifier=harness.specifiers[0]), Limits()
                )
                await unit.start()
                if ending == "exit":
                    harness.exit(handle, unit.identity, 3)
                    status = await unit.wait()
                elif ending == "interrupt":
                    await unit.interrupt()
                    status = await unit.wait()
                elif ending == "kill":
                    await unit.kill()
                    status = await unit.wait()
                else:
                    if ending == "gone":
                        await unit.kill()
                        await unit.wait()
                    status = (await harness.execution.recover(unit.identity)).exit
                await unit.aclose()
            assert status == harness.exit_status(ending, 3), (
                f"{type(harness).__name__}.exit_status({ending!r}) says "
                f"{harness.exit_status(ending, 3)}, the execution reported {status}"
            )
