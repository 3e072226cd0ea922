"""The conformance machine on PostgresStore: each example in a schema of its own."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import settings

from trio_supervisor import PostgresStore, Retention
from trio_supervisor.abc import Store
from trio_supervisor.testing import conformance_machine

# Where the machine's stores go: it calls ``postgres`` for each, no fixture reaches it,
# so this module's database is set before its tests run.
DATABASE: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _database(database: str) -> Iterator[None]:
    DATABASE.append(database)
    yield
    DATABASE.clear()


def postgres(previous: Store | None, retention: Retention) -> Store:
    # A fresh store is a fresh schema (a fleet of its own); a restart is the same runner
    # in the same schema: a new epoch, which lists what the last one left.
    schema = (
        previous.schema if isinstance(previous, PostgresStore) else f"c_{uuid.uuid4().hex[:16]}"
    )
    return PostgresStore(DATABASE[0], runner_id="conformance", schema=schema, retention=retention)


Machine = conformance_machine(postgres)
# Every example creates a schema and talks to a server: fewer of them than on SQLite,
# unless TRIO_SUPERVISOR_POSTGRES_EXAMPLES says how many (``nox -s fleet``).
CAP = int(os.environ.get("TRIO_SUPERVISOR_POSTGRES_EXAMPLES", "40"))
Machine.TestCase.settings = settings(
    Machine.TestCase.settings, max_examples=min(CAP, Machine.TestCase.settings.max_examples)
)
TestPostgresStoreWithFakeExecution = Machine.TestCase
