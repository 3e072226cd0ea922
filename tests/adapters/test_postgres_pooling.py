"""B7 at the store itself: a PostgresStore reached through PgBouncer refuses a pool that
shares one server session between its clients' transactions (``pool_mode=transaction``)
as it opens, in words that say what to do, and opens through one that gives each client
a session of its own (``pool_mode=session``). PgBouncer runs in front of the machine's
server (tests/support/clusters.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from trio_supervisor import Handle, Key, Limits, OpenRecord, PostgresStore, StateStorageError

from ..support import clusters
from ..support.postgres import query_in


@pytest.fixture(scope="module")
def poolers(database: str) -> Iterator[dict[str, str]]:
    """The test database's DSN through PgBouncer, by pool mode."""
    target = int(conninfo_to_dict(database).get("port") or 5432)
    with clusters.own_clusters() as made:
        machine = clusters.Cluster(made.root / "machine", target)  # ours to reach, not to run
        yield {
            mode: make_conninfo(database, host="127.0.0.1", port=str(bouncer.port))
            for mode in ("transaction", "session")
            for bouncer in [made.bouncer(machine, pool_mode=mode)]
        }


async def test_a_transaction_pool_is_refused_as_the_store_opens(
    poolers: dict[str, str], database: str, schema: str
) -> None:
    store = PostgresStore(poolers["transaction"], runner_id="a", schema=schema)
    with pytest.raises(StateStorageError) as refused:
        await store.open()
    await store.aclose()
    assert str(refused.value) == (
        f"{store.dsn}: this store shares one server session between its clients' "
        "transactions (a pooler such as PgBouncer with pool_mode=transaction or statement), "
        "and the fleet needs sessions of its own (its settings, and LISTEN for supersedes): "
        "point --store at the server, or at a pool with pool_mode=session"
    )
    # Refused before anything was written: not even the schema's tables.
    tables = "SELECT table_name FROM information_schema.tables WHERE table_schema = %s"
    assert query_in(database, schema, tables, schema) == []


async def test_a_session_pool_is_a_store_like_the_server(
    poolers: dict[str, str], database: str, schema: str
) -> None:
    async with PostgresStore(poolers["session"], runner_id="a", schema=schema) as store:
        handle = Handle(
            key=Key(identity="p", instance="k"), token="k-1".rjust(32, "0"), generation=1
        )
        saved = OpenRecord(handle=handle, request_id="r1", lease=5.0, limits=Limits())
        await store.save(saved)
        assert [r.handle for r in await store.list()] == [saved.handle]
