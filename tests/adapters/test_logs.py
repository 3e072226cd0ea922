"""A child's log lives exactly as long as its session's record (``executions/_logs.py``),
whichever store keeps the records: memory, SQLite, PostgreSQL.

Real processes (the example heartbeat, which prints a beat every 0.2 s) and the real
clock; every wait is a bounded poll of a file.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from trio_supervisor import (
    Handle,
    Key,
    Load,
    MemoryStore,
    Retention,
    SqliteStore,
    SubprocessExecution,
    open_supervisor,
)
from trio_supervisor.abc import Store

from ..support.plugins import PLUGINS
from ..support.postgres import fresh_schema
from ..support.waits import BOUND, until, until_logged

HEARTBEAT = Load(specifier="heartbeat:main")
KEY = Key(identity="logs", instance="a")
RETENTION = Retention(stopped_per_key=1)

Stores = Callable[[], contextlib.AbstractAsyncContextManager[Store]]


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Stores:
    """Opens the test's store again and again, on the same records (a MemoryStore's
    records live as long as the object)."""
    if request.param == "memory":
        memory = MemoryStore(retention=RETENTION)

        @contextlib.asynccontextmanager
        async def same() -> AsyncIterator[Store]:
            yield memory

        return same
    if request.param == "sqlite":
        return lambda: SqliteStore(tmp_path / "records.db", retention=RETENTION)
    from trio_supervisor.stores.postgres import PostgresStore

    dsn: str = request.getfixturevalue("database")
    schema = fresh_schema()
    options: dict[str, Any] = {"runner_id": "logs", "schema": schema, "retention": RETENTION}
    return lambda: PostgresStore(dsn, **options)


def gone(path: Path) -> Callable[[], bool]:
    return lambda: not path.exists()


async def test_a_log_is_read_while_its_record_is_retained_and_removed_with_it(
    tmp_path: Path, stores: Stores
) -> None:
    async with (
        SubprocessExecution(tmp_path / "state", entry_paths=[PLUGINS]) as execution,
        stores() as store,
        open_supervisor(store, execution, grace=5.0) as supervisor,
    ):
        first = await supervisor.open(KEY, "1")
        await supervisor.load(first.handle, HEARTBEAT)
        await until_logged(execution, first.handle, "beat 1 of logs/a #1\n", bound=BOUND)
        # Generation 2 supersedes it: generation 1 is Stopped, and still retained.
        second = await supervisor.open(KEY, "2", expected_generation=1)
        await supervisor.load(second.handle, HEARTBEAT)
        await until_logged(execution, second.handle, "beat 1 of logs/a #2\n", bound=BOUND)
        assert execution.logs(first.handle).startswith("beat 1 of logs/a #1\n")
        # Generation 2 stops: with one Stopped record kept per key, generation 1's goes,
        # and its log with it.
        await supervisor.dispose(second.handle)
        await until(gone(execution.log_path(first.handle)), "generation 1's log removed")
        assert execution.logs(first.handle) == ""
        assert "stopping after" in execution.logs(second.handle)
        await supervisor.open(KEY, "3", expected_generation=2)
    # The shutdown stopped generation 3 (never loaded: no log), which evicted generation
    # 2's record: its log went as the execution ended.
    assert not execution.log_path(second.handle).exists()
    assert list((tmp_path / "state" / "logs").iterdir()) == []


async def test_a_start_removes_the_logs_of_records_it_does_not_retain(
    tmp_path: Path, stores: Stores
) -> None:
    state = tmp_path / "state"
    async with SubprocessExecution(state, entry_paths=[PLUGINS]) as execution:
        async with stores() as store, open_supervisor(store, execution, grace=5.0) as supervisor:
            record = await supervisor.open(KEY, "1")
            await supervisor.load(record.handle, HEARTBEAT)
            await until_logged(execution, record.handle, "beat 1 of", bound=BOUND)
            await supervisor.dispose(record.handle)
        # What an earlier run left whose record no store retains (evicted while no
        # supervisor ran), and a file of the directory that is no log of ours.
        earlier = Handle(key=KEY, token="t" * 32, generation=7)
        execution.log_path(earlier).write_text("beat 1 of logs/a #7\n")
        (state / "logs" / "notes.txt").write_text("the owner's\n")
        async with stores() as store, open_supervisor(store, execution, grace=5.0):
            assert not execution.log_path(earlier).exists()
            assert (state / "logs" / "notes.txt").exists()
            # Generation 1's record is retained (a MemoryStore's too: the same object).
            assert "stopping after" in execution.logs(record.handle)
