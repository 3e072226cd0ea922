"""The fleet machine (``trio_supervisor.testing.fleet``) on PostgresStore: two or three
supervisors on one PostgreSQL database, each reaching it through a proxy of the test's
own (:mod:`tests.support.tcp_proxy`), which holds a runner's bytes to cut it off past its
takeover, and resets them to crash it.

The suite runs a short pass, 3 examples (each waits for takeovers in real time);
``nox -s fleet`` runs 200 (``TRIO_SUPERVISOR_FLEET_EXAMPLES``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from typing import Literal

import psycopg
import pytest

from trio_supervisor import PostgresStore, Retention
from trio_supervisor.abc import FleetStore
from trio_supervisor.testing.fleet import FleetBackend, fleet_machine

from ..support.tcp_proxy import TcpProxy

DATABASE: list[str] = []  # the module's database, set by the fixture below
PROXIES: dict[str, TcpProxy] = {}  # each member's way to the database


@pytest.fixture(scope="module", autouse=True)
def _database(database: str) -> Iterator[None]:
    DATABASE.append(database)
    try:
        yield
    finally:
        for proxy in PROXIES.values():
            proxy.close()
        PROXIES.clear()
        DATABASE.clear()


def proxy(member: str) -> TcpProxy:
    if member not in PROXIES:
        PROXIES[member] = TcpProxy(("127.0.0.1", 5432))
    return PROXIES[member]


@contextlib.asynccontextmanager
async def member(name: str, runner_lease: float, retention: Retention) -> AsyncIterator[FleetStore]:
    through = proxy(name).url(DATABASE[0])
    async with PostgresStore(
        through, runner_id=name, runner_lease=runner_lease, retention=retention
    ) as store:
        yield store


def reset() -> None:
    with psycopg.connect(DATABASE[0], autocommit=True) as connection:
        connection.execute("DROP SCHEMA IF EXISTS trio_supervisor CASCADE")
    for each in PROXIES.values():
        each.restore()


def cut_off(name: str, how: Literal["hold", "reset"]) -> None:
    if how == "hold":
        proxy(name).pause()
    else:
        proxy(name).cut()


def let_through(name: str) -> None:
    proxy(name).restore()  # delivers what was held, and accepts connections again


TestFleetOnPostgres = fleet_machine(
    FleetBackend(member=member, reset=reset, cut_off=cut_off, let_through=let_through),
    examples=None if os.environ.get("TRIO_SUPERVISOR_FLEET_EXAMPLES") else 3,
).TestCase
