"""The support for clusters of the tests' own (tests/support/clusters.py), against real
servers: what a fleet's test of restarts, outages and failovers will rely on, and what
PgBouncer does to a client that a fleet must cope with.

Real processes and the real clock; every wait is bounded, none is a timing assertion.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from ..support.clusters import Cluster, Clusters, own_clusters
from ..support.processes import running
from ..support.waits import BOUND, settled

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def clusters() -> Iterator[Clusters]:
    with own_clusters() as made:
        yield made


def write(cluster: Cluster, value: str) -> None:
    """Commit ``value`` into the table ``t`` (made on first use), autocommit."""
    with psycopg.connect(cluster.dsn(), autocommit=True) as connection:
        connection.execute("CREATE TABLE IF NOT EXISTS t (value text PRIMARY KEY)")
        connection.execute("INSERT INTO t VALUES (%s)", (value,))


def read(cluster: Cluster) -> set[str]:
    with psycopg.connect(cluster.dsn(), autocommit=True) as connection:
        return {value for (value,) in connection.execute("SELECT value FROM t")}


def server_port(url: str) -> int:
    """The port of the server a connection to ``url`` reached."""
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as connection:
        row = connection.execute("SELECT inet_server_port()").fetchone()
    assert row is not None
    return int(row[0])


def test_a_primary_keeps_its_commits_across_a_restart_a_stop_and_a_crash(
    clusters: Clusters,
) -> None:
    primary = clusters.primary("a")
    write(primary, "before the restart")
    primary.restart()
    assert primary.accepting()
    write(primary, "before the stop")
    primary.stop()
    assert not primary.is_running()
    assert not primary.accepting()
    primary.start()
    assert primary.accepting()
    write(primary, "before the crash")
    primary.kill()
    assert not primary.is_running()
    assert not primary.accepting()
    primary.start()
    assert read(primary) == {"before the restart", "before the stop", "before the crash"}


def test_a_synchronous_standby_has_each_acknowledged_commit_after_a_failover(
    clusters: Clusters,
) -> None:
    primary = clusters.primary("a")
    standby = clusters.standby(primary, "b", synchronous=True)
    standby.wait_caught_up()
    write(primary, "acknowledged")
    # At once, and as a power cut: the commit's acknowledgement is all the primary gave.
    primary.kill()
    assert not primary.accepting()
    standby.promote()
    assert read(standby) == {"acknowledged"}
    write(standby, "on the new primary")
    assert read(standby) == {"acknowledged", "on the new primary"}


def test_an_asynchronous_standby_down_meanwhile_loses_commits_when_promoted(
    clusters: Clusters,
) -> None:
    # The module's recipe for lost writes.
    primary = clusters.primary("a")
    standby = clusters.standby(primary, "b", synchronous=False)
    write(primary, "replicated")
    standby.wait_caught_up()
    standby.stop()
    write(primary, "lost")  # acknowledged: only the primary has it
    primary.kill()
    standby.start()
    standby.promote()
    assert read(standby) == {"replicated"}
    write(standby, "after")
    assert read(standby) == {"replicated", "after"}


def test_a_multi_host_url_reaches_the_primary_before_and_after_a_promotion(
    clusters: Clusters,
) -> None:
    primary = clusters.primary("a")
    standby = clusters.standby(primary, "b", synchronous=True)
    # The standby first: libpq passes over it while it is read-only.
    url = (
        f"postgresql://postgres@127.0.0.1:{standby.port},127.0.0.1:{primary.port}/postgres"
        "?target_session_attrs=read-write"
    )
    assert server_port(url) == primary.port
    primary.kill()
    standby.promote()
    assert server_port(url) == standby.port


def test_pgbouncer_passes_queries_through_and_in_transaction_mode_settings_do_not_stick(
    clusters: Clusters,
) -> None:
    """What a fleet's code must cope with behind PgBouncer in transaction mode: a ``SET``
    outside a transaction stays with the server connection, which the next transaction
    of the same client may not get, and another client may (so the store refuses that
    mode: B7)."""
    primary = clusters.primary("a")
    for pool_mode in ("session", "transaction"):
        bouncer = clusters.bouncer(primary, pool_mode=pool_mode)
        with psycopg.connect(bouncer.dsn(), autocommit=True) as connection:
            assert connection.execute("SELECT 1").fetchone() == (1,)
            assert connection.execute("SELECT inet_server_port()").fetchone() == (primary.port,)
    with (
        psycopg.connect(bouncer.dsn(), autocommit=True) as setter,
        psycopg.connect(bouncer.dsn(), autocommit=True) as other,
    ):
        setter.execute("SET statement_timeout = '1234ms'")
        # The other client's transaction takes the server connection the SET went to
        # (the pool's last used, first out); the setter's next statement gets another.
        with other.transaction():
            assert other.execute("SHOW statement_timeout").fetchone() == ("1234ms",)
            assert setter.execute("SHOW statement_timeout").fetchone() == ("0",)


def test_through_pgbouncer_a_query_while_the_server_is_down_waits_then_fails(
    clusters: Clusters,
) -> None:
    """What a fleet's code meets behind PgBouncer during an outage: its connection to the
    bouncer stays up, and a query waits ``query_wait_timeout`` for a server, then fails
    with 08P01 and the connection is closed. New connections work again once the server
    is back and ``server_login_retry`` passed since the bouncer's last failed login (until
    then they are refused with 08P01 too)."""
    primary = clusters.primary("a")
    settings = {"query_wait_timeout": 1, "server_login_retry": 1}
    bouncer = clusters.bouncer(primary, pool_mode="transaction", settings=settings)
    with psycopg.connect(bouncer.dsn(), autocommit=True) as connection:
        connection.execute("SELECT 1")
        primary.kill()
        with pytest.raises(psycopg.errors.ProtocolViolation, match="query_wait_timeout"):
            connection.execute("SELECT 1")
        assert connection.closed
    primary.start()
    assert settled(bouncer.accepting, BOUND)


def shared_memory_segments() -> set[str]:
    """The ids of the machine's System V shared memory segments."""
    rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return {row.split()[1] for row in rows}


def test_removal_leaves_no_process_directory_or_shared_memory() -> None:
    with own_clusters() as made:
        primary = made.primary("a")
        standby = made.standby(primary, "b", synchronous=False)
        bouncer = made.bouncer(standby, pool_mode="session")
        # A crashed cluster is removed too, and the segment its postmaster left with it
        # (postmaster.pid's 7th line: its key and id).
        segment = (primary.data_dir / "postmaster.pid").read_text().splitlines()[6].split()[1]
        primary.kill()
        assert segment in shared_memory_segments()
        pids = [standby.postmaster(), bouncer.process.pid]
    assert all(pid is not None and not running(pid) for pid in pids)
    assert not made.root.exists()
    assert segment not in shared_memory_segments()
