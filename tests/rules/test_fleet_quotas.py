"""F9: a tenant's quota holds across a fleet. Two supervisors (two runners) on one
PostgreSQL database, their opens and loads racing for a tenant's last slots; the
database counts each claim in the transaction that would save its record. The
translation of the tenant's patterns into SQL is tested in
tests/adapters/test_postgres_quotas.py."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import trio

from trio_supervisor import (
    Key,
    Limits,
    Load,
    MemoryStore,
    OpenRecord,
    Phase,
    PostgresStore,
    QuotaClaim,
    QuotaExceededError,
    SessionRecord,
    Supervisor,
)
from trio_supervisor.testing import FakeExecution

from ..support.postgres import own_schema
from ..support.sessions import supervise_embedded

ACME = ("acme-*", "shared")  # the tenant's identities
LOAD = Load(specifier="x")


@contextlib.asynccontextmanager
async def two_runners(
    database: str,
) -> AsyncIterator[tuple[Supervisor, Supervisor, FakeExecution, FakeExecution]]:
    """Supervisors ``a`` and ``b`` of one fleet, in a schema of the test's own, and
    their executions."""
    on_a, on_b = FakeExecution(), FakeExecution()
    with own_schema(database) as schema:
        async with (
            PostgresStore(database, runner_id="a", schema=schema, runner_lease=3) as store_a,
            PostgresStore(database, runner_id="b", schema=schema, runner_lease=3) as store_b,
            supervise_embedded(store_a, on_a) as a,
            supervise_embedded(store_b, on_b) as b,
        ):
            yield a, b, on_a, on_b


def claim(**quota: int) -> QuotaClaim:
    return QuotaClaim(tenant="acme", identities=ACME, **quota)


def key(n: int) -> Key:
    return Key(identity=f"acme-{n % 3}", instance=f"i{n}")


async def race(
    calls: list[tuple[Supervisor, Key]], attempt: object
) -> tuple[dict[Key, object], dict[Key, QuotaExceededError]]:
    """Run ``attempt(supervisor, key)`` for every call at once; what each returned, and
    each refusal."""
    done: dict[Key, object] = {}
    refused: dict[Key, QuotaExceededError] = {}

    async def one(supervisor: Supervisor, of: Key) -> None:
        try:
            done[of] = await attempt(supervisor, of)  # type: ignore[operator]
        except QuotaExceededError as error:
            refused[of] = error

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for supervisor, of in calls:
                nursery.start_soon(one, supervisor, of)
    return done, refused


async def test_f9_two_runners_admit_exactly_the_sessions_quota(database: str) -> None:
    async with two_runners(database) as (a, b, _, _):
        # Sessions of other tenants' identities do not count; the tenant's own do.
        await a.open(Key(identity="other", instance="x"), "other")
        await b.open(Key(identity="shared", instance="x"), "held")
        quota = claim(sessions=4)
        calls = [(a if n % 2 else b, key(n)) for n in range(12)]

        async def open_(supervisor: Supervisor, of: Key) -> SessionRecord:
            return await supervisor.open(of, "first", quota=quota)

        opened, refused = await race(calls, open_)
        assert len(opened) == 3  # 4 less the one "shared" session held already
        assert len(refused) == 9
        for error in refused.values():
            assert (error.quota, error.requested, error.used, error.hard) == ("sessions", 1, 4, 4)
            assert error.detail == (
                "tenant 'acme' exceeded quota: sessions, requested 1, used 4, limited 4"
            )
        for of in refused:
            # No generation consumed, on either runner's view of the fleet.
            assert await a.high_water(of) is None
            assert await b.high_water(of) is None
        assert (a.poisoned, b.poisoned) == (None, None)
        # An open that supersedes a live generation of its key takes no new session,
        # even on another runner than the one holding it.
        by_key = {of: supervisor for supervisor, of in calls}
        first = next(iter(opened))
        other = a if by_key[first] is b else b
        again = await other.open(first, "second", expected_generation=1, quota=quota)
        assert again.handle.generation == 2
        # A refused key opens once the tenant has room again.
        later = next(iter(refused))
        with pytest.raises(QuotaExceededError):
            await a.open(later, "retry", quota=quota)
        await other.dispose(again.handle)
        assert (await a.open(later, "retry", quota=quota)).handle.generation == 1


async def test_f9_two_runners_admit_exactly_the_children_quota(database: str) -> None:
    async with two_runners(database) as (a, b, on_a, on_b):
        holder: dict[Key, Supervisor] = {}
        records: dict[Key, OpenRecord] = {}
        for n in range(8):
            supervisor = a if n % 2 else b
            opened = await supervisor.open(key(n), "open")
            assert isinstance(opened, OpenRecord)
            holder[key(n)], records[key(n)] = supervisor, opened
        quota = claim(children=3)

        async def load(supervisor: Supervisor, of: Key) -> object:
            return await supervisor.load(records[of].handle, LOAD, quota=quota)

        loaded, refused = await race([(holder[of], of) for of in records], load)
        assert len(loaded) == 3
        assert len(refused) == 5
        for error in refused.values():
            assert (error.quota, error.requested, error.used, error.hard) == ("children", 1, 3, 3)
        # Refused before anything was spawned: the sessions stay Open, live.
        assert len(on_a.units) + len(on_b.units) == 3
        for of in refused:
            status = await holder[of].status(records[of].handle)
            assert status.phase is Phase.OPEN
            await holder[of].renew(records[of].handle)
        assert (a.poisoned, b.poisoned) == (None, None)
        # Once a child's session is disposed, a refused session loads.
        done = next(iter(loaded))
        await holder[done].dispose(records[done].handle)
        waiting = next(iter(refused))
        with trio.fail_after(10):
            await holder[waiting].load(records[waiting].handle, LOAD, quota=quota)
        assert (await holder[waiting].status(records[waiting].handle)).phase is Phase.LOADED
        # And the next one is refused again, counting the new child.
        last = list(refused)[1]
        with pytest.raises(QuotaExceededError, match="children, requested 1, used 3"):
            await holder[last].load(records[last].handle, LOAD, quota=quota)


async def test_f9_memory_is_counted_from_the_records_limits(database: str) -> None:
    async with two_runners(database) as (a, b, _, _):
        sizes = {Key(identity="acme-m", instance=str(size)): size for size in (100, 200, 300)}
        records = {
            of: await (a if size == 200 else b).open(
                of, "open", limits=Limits(memory_bytes=size, cpu_percent=50)
            )
            for of, size in sizes.items()
        }
        unlimited = await a.open(Key(identity="acme-m", instance="none"), "open")
        quota = claim(memory_bytes=450, cpu_percent=1000, unlimited_memory_bytes=1000)
        keys = list(sizes)
        await b.load(records[keys[0]].handle, LOAD, quota=quota)  # 100
        await a.load(records[keys[1]].handle, LOAD, quota=quota)  # 300 in all
        with pytest.raises(QuotaExceededError) as caught:
            await b.load(records[keys[2]].handle, LOAD, quota=quota)
        error = caught.value
        assert (error.quota, error.requested, error.used, error.hard) == (
            "memory_bytes",
            300,
            300,
            450,
        )
        # A child without a memory limit counts what the claim says such a child takes.
        with pytest.raises(QuotaExceededError, match="memory_bytes, requested 1000, used 300"):
            await a.load(unlimited.handle, LOAD, quota=quota)
        # The CPU quota is counted the same way, after memory's.
        tight = claim(memory_bytes=10_000, cpu_percent=120)
        with pytest.raises(QuotaExceededError, match="cpu_percent, requested 50, used 100"):
            await b.load(records[keys[2]].handle, LOAD, quota=tight)
        # Without a quota claim nothing is counted.
        await b.load(records[keys[2]].handle, LOAD)
        assert (a.poisoned, b.poisoned) == (None, None)


async def test_f9_a_store_that_is_no_fleets_ignores_the_claim() -> None:
    async with supervise_embedded(MemoryStore(), FakeExecution()) as supervisor:
        opened = await supervisor.open(key(1), "open", quota=claim(sessions=0, children=0))
        await supervisor.load(opened.handle, LOAD, quota=claim(sessions=0, children=0))
        assert (await supervisor.status(opened.handle)).phase is Phase.LOADED
