"""The conformance machine against the built-in adapters."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import uuid
from pathlib import Path

from trio_supervisor import MemoryStore, Retention, SqliteStore
from trio_supervisor.stores.base import Store
from trio_supervisor.testing.conformance import conformance_machine
from trio_supervisor.testing.harnesses import InProcessHarness

RETENTION = Retention(stopped_per_key=2, stopped_total=100_000)
DIRECTORY = Path(tempfile.mkdtemp(prefix="trio-supervisor-conformance-"))
atexit.register(shutil.rmtree, DIRECTORY, ignore_errors=True)


def memory(previous: Store | None) -> Store:
    return previous or MemoryStore(retention=RETENTION)


def sqlite(previous: Store | None) -> Store:
    path = (
        previous.path if isinstance(previous, SqliteStore) else DIRECTORY / f"{uuid.uuid4().hex}.db"
    )
    return SqliteStore(path, retention=RETENTION)


TestMemoryStoreWithFakeExecution = conformance_machine(memory).TestCase
TestSqliteStoreWithFakeExecution = conformance_machine(sqlite).TestCase
TestMemoryStoreWithInProcessExecution = conformance_machine(memory, InProcessHarness).TestCase
