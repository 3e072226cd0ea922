"""Tenants over the wire (docs/service.md section D): hosts that do not trust each other.

Two tenants, ``acme`` and ``globex``, share one runner served by a real Hypercorn on a
loopback port; each attack is made with a real client and the tenant's real token, and
then the victim's session is checked untouched. The runner here runs fake children
(the ceilings' effect on real process trees is in ``test_tenants_serve.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import pytest
import trio

from trio_supervisor import (
    ForbiddenError,
    Handle,
    Key,
    Limits,
    Load,
    MemoryStore,
    Phase,
    QuotaExceededError,
    RunnerFullError,
    Supervisor,
    ThrottledError,
)
from trio_supervisor.client import RemoteSupervisor, connect
from trio_supervisor.codec import converter
from trio_supervisor.service.admission import Admission, Capacity, Usage
from trio_supervisor.service.tenants import (
    Ceilings,
    Fairness,
    Quota,
    Tenant,
    Tenants,
    TenantsError,
    effective_limits,
    token_hash,
)
from trio_supervisor.service.tenants_file import Roster
from trio_supervisor.testing import FakeExecution

from ..support.service import OPERATOR_TOKEN, served
from ..support.sessions import supervise_embedded
from ..support.waits import until

ACME_TOKEN: Final = "acme-token-for-tests"
GLOBEX_TOKEN: Final = "globex-token-for-tests"
ACME_KEY: Final = Key(identity="acme-web", instance="eu-1")
GLOBEX_KEY: Final = Key(identity="globex", instance="eu-1")
WORKER: Final = Load(specifier="worker:main")
MIB: Final = 1 << 20


def acme(**more: Any) -> Tenant:
    return Tenant(
        name="acme", token_sha256=token_hash(ACME_TOKEN), identities=("acme", "acme-*"), **more
    )


def globex(**more: Any) -> Tenant:
    return Tenant(
        name="globex", token_sha256=token_hash(GLOBEX_TOKEN), identities=("globex",), **more
    )


class Runner:
    """A served supervisor with tenants: clients per tenant, a bare client."""

    def __init__(self, supervisor: Supervisor, operator: RemoteSupervisor, roster: Roster):
        self.supervisor = supervisor
        self.operator = operator
        self.roster = roster
        self.url = str(operator._client.base_url)

    def tenant(self, token: str) -> contextlib.AbstractAsyncContextManager[RemoteSupervisor]:
        return connect(self.url, token=token, retry_for=0)

    def bare(self, token: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {token}"})


@contextlib.asynccontextmanager
async def runner(
    fake: FakeExecution,
    *tenants: Tenant,
    ceilings: Ceilings | None = None,
    capacity: Capacity | None = None,
) -> AsyncIterator[Runner]:
    roster = Roster(Tenants({tenant.name: tenant for tenant in tenants or (acme(), globex())}))
    async with supervise_embedded(MemoryStore(), fake) as supervisor:
        admission = Admission(supervisor, ceilings=ceilings, capacity=capacity)
        async with served(supervisor, tenants=roster, admission=admission) as operator:
            yield Runner(supervisor, operator, roster)


async def loaded(host: RemoteSupervisor, key: Key, request_id: str = "r1") -> Handle:
    record = await host.open(key, request_id)
    await host.load(record.handle, WORKER)
    return record.handle


# -- authorization --------------------------------------------------------------------------


async def test_a_tenant_can_neither_supersede_nor_touch_nor_read_another_tenants_key(
    fake: FakeExecution,
) -> None:
    async with runner(fake) as run, run.tenant(ACME_TOKEN) as victim:
        handle = await loaded(victim, ACME_KEY)
        async with run.tenant(GLOBEX_TOKEN) as attacker:
            # Even holding the victim's handle, token included (leaked, say).
            attacks = {
                "high-water": attacker.high_water(ACME_KEY),
                "supersede": attacker.open(ACME_KEY, "steal", expected_generation=1),
                "renew": attacker.renew(handle),
                "status": attacker.status(handle),
                "load": attacker.load(handle, Load(specifier="evil:main")),
                "dispose": attacker.dispose(handle),
                "logs": attacker.logs(ACME_KEY, 1),
            }
            for name, attack in attacks.items():
                with pytest.raises(ForbiddenError) as refused:
                    await attack
                assert refused.value.detail == (
                    "tenant 'globex' may not use identity 'acme-web'"
                ), name
            # Its listings hold its own keys alone.
            assert await attacker.sessions() == []
        # The victim is untouched: the same generation, Loaded, its child never signalled.
        record = await victim.status(handle)
        assert (record.phase, record.handle.generation) == (Phase.LOADED, 1)
        assert await victim.high_water(ACME_KEY) == 1
        assert fake.unit_of(handle).signals == []
        assert await victim.renew(handle) == record.lease
        assert [r.handle.generation for r in run.supervisor.records()] == [1]


async def test_a_key_outside_the_patterns_is_refused_alike_whether_it_exists_or_not(
    fake: FakeExecution,
) -> None:
    async with runner(fake) as run:
        async with run.tenant(ACME_TOKEN) as owner:
            await owner.open(ACME_KEY, "r1")
        async with run.bare(GLOBEX_TOKEN) as attacker:
            answers = [
                await attacker.post(
                    "/v1/high-water", json={"key": {"identity": identity, "instance": "eu-1"}}
                )
                for identity in ("acme-web", "acme-nothing-here")
            ]
        assert [answer.status_code for answer in answers] == [403, 403]
        details = [
            answer.json()["detail"].rpartition("'")[0].rpartition("'")[0] for answer in answers
        ]
        assert details[0] == details[1]  # the same words but for the identity named
        assert run.supervisor.records()[0].handle.key == ACME_KEY  # nothing else made


async def test_a_tenant_lists_and_watches_its_own_keys_and_the_operators_every_key(
    fake: FakeExecution,
) -> None:
    async with runner(fake) as run:
        async with run.tenant(ACME_TOKEN) as acme_host, run.tenant(GLOBEX_TOKEN) as globex_host:
            seen: list[str] = []

            async def watch() -> None:
                async with contextlib.aclosing(globex_host.events()) as stream:
                    async for event in stream:
                        seen.append(event["handle"]["key"]["identity"])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                # Rounds of an acme open then a globex one, until the stream has shown a
                # globex record, and one round more: that round's acme record was surely
                # published while the stream was open.
                rounds = itertools.count()

                async def a_round() -> bool:
                    instance = f"{next(rounds)}"
                    await acme_host.open(Key(identity="acme", instance=instance), "r1")
                    await globex_host.open(Key(identity="globex", instance=instance), "r1")
                    return bool(seen)

                await until(a_round, "the stream showed a globex record")
                wanted = len(seen) + 1
                await a_round()
                await until(lambda: len(seen) >= wanted, "the last round's globex record")
                nursery.cancel_scope.cancel()
            assert set(seen) == {"globex"}
            assert {s["handle"]["key"]["identity"] for s in await acme_host.sessions()} == {"acme"}
            assert {s["handle"]["key"]["identity"] for s in await globex_host.sessions()} == {
                "globex"
            }
        every = await run.operator.sessions()
        assert {s["handle"]["key"]["identity"] for s in every} == {"acme", "globex"}
        # The operators' calls stay theirs.
        async with run.bare(ACME_TOKEN) as bare:
            for path in ("/v1/runners", "/metrics"):
                assert (await bare.get(path)).status_code == 403


async def test_a_revoked_tenant_is_refused_at_once_and_its_event_stream_sees_no_more(
    fake: FakeExecution,
) -> None:
    async with runner(fake) as run, run.tenant(ACME_TOKEN) as host:
        record = await host.open(ACME_KEY, "r1")
        run.roster.tenants = Tenants({"globex": globex()})  # what a reload does
        async with run.bare(ACME_TOKEN) as bare:
            answer = await bare.post(
                "/v1/renew",
                json={"handle": converter.unstructure(record.handle)},
            )
        assert answer.status_code == 401
        # Its session stays: an operator decides what becomes of it.
        assert (await run.operator.status(record.handle)).phase is Phase.OPEN


# -- ceilings ------------------------------------------------------------------------------


async def test_ceilings_fill_what_the_host_left_out_and_lower_what_it_asked_above_the_max(
    fake: FakeExecution,
) -> None:
    runner_ceilings = Ceilings(
        default=Limits(memory_bytes=512 * MIB, processes=100),
        max=Limits(memory_bytes=1024 * MIB, processes=100, cpu_percent=200),
    )
    tenant = acme(
        limits=Ceilings(
            default=Limits(memory_bytes=256 * MIB),
            max=Limits(memory_bytes=300 * MIB, open_files=64),
        )
    )
    async with (
        runner(fake, tenant, ceilings=runner_ceilings) as run,
        run.tenant(ACME_TOKEN) as host,
    ):
        nothing = await host.open(Key(identity="acme", instance="a"), "r1")
        assert nothing.limits == Limits(
            memory_bytes=256 * MIB, processes=100, open_files=64, cpu_percent=200
        )
        greedy = await host.open(
            Key(identity="acme", instance="b"),
            "r1",
            limits=Limits(memory_bytes=8 << 30, processes=10**6, cpu_percent=10**4),
        )
        assert greedy.limits == Limits(
            memory_bytes=300 * MIB, processes=100, open_files=64, cpu_percent=200
        )
        modest = await host.open(
            Key(identity="acme", instance="c"),
            "r1",
            limits=Limits(memory_bytes=64 * MIB, processes=5),
        )
        assert (modest.limits.memory_bytes, modest.limits.processes) == (64 * MIB, 5)
        # What the child was given is what the record says.
        await host.load(greedy.handle, WORKER)
        assert fake.unit_of(greedy.handle).limits == greedy.limits


# -- quotas and capacity ---------------------------------------------------------------------


async def test_over_the_sessions_quota_is_429_naming_it_and_nothing_changes(
    fake: FakeExecution,
) -> None:
    async with runner(fake, acme(quota=Quota(sessions=2))) as run, run.tenant(ACME_TOKEN) as host:
        first = await host.open(Key(identity="acme", instance="1"), "r1")
        await host.open(Key(identity="acme", instance="2"), "r1")
        third = Key(identity="acme", instance="3")
        with pytest.raises(QuotaExceededError) as refused:
            await host.open(third, "r1")
        error = refused.value
        assert error.detail == (
            "tenant 'acme' exceeded quota: sessions, requested 1, used 2, limited 2"
        )
        assert (error.quota, error.requested, error.used, error.hard) == ("sessions", 1, 2, 2)
        assert await host.high_water(third) is None  # no generation consumed
        assert len(run.supervisor.records()) == 2  # no record
        # A retry of an answered open, and an open that supersedes, take nothing new.
        assert await host.open(first.handle.key, "r1") == first
        again = await host.open(first.handle.key, "r2", expected_generation=1)
        assert again.handle.generation == 2
        # Once a session is Stopped, there is room again at once.
        await host.dispose(again.handle)
        await host.open(third, "r1")  # counted from the records: no lag


async def test_over_the_children_quota_is_429_and_the_session_stays_open_to_load_later(
    fake: FakeExecution,
) -> None:
    tenant = acme(quota=Quota(children=1, memory_bytes=300 * MIB))
    ceilings = Ceilings(default=Limits(memory_bytes=100 * MIB))
    async with runner(fake, tenant, ceilings=ceilings) as run, run.tenant(ACME_TOKEN) as host:
        one = await loaded(host, Key(identity="acme", instance="1"))
        two = await host.open(Key(identity="acme", instance="2"), "r1")
        with pytest.raises(QuotaExceededError) as refused:
            await host.load(two.handle, WORKER)
        assert (refused.value.quota, refused.value.used, refused.value.hard) == ("children", 1, 1)
        assert (await host.status(two.handle)).phase is Phase.OPEN
        # A load into a session that loads already takes nothing more (L2).
        assert (await host.load(one, WORKER)).specifier == "worker:main"
        await host.dispose(one)
        await host.load(two.handle, WORKER)  # counted from the records: no lag
        # Memory: 100 MiB each; a child asking 250 MiB more passes the quota's 300 no more.
        big = await host.open(
            Key(identity="acme", instance="3"), "r1", limits=Limits(memory_bytes=250 * MIB)
        )
        with pytest.raises(QuotaExceededError) as refused:
            await host.load(big.handle, WORKER)
        assert refused.value.quota in ("children", "memory_bytes")


async def test_a_full_runner_is_503_with_retry_after_and_the_session_stays_open(
    fake: FakeExecution,
) -> None:
    capacity = Capacity(max_children=1, allocatable=200 * MIB)
    ceilings = Ceilings(default=Limits(memory_bytes=150 * MIB))
    async with (
        runner(fake, ceilings=ceilings, capacity=capacity) as run,
        run.tenant(ACME_TOKEN) as acme_host,
        run.tenant(GLOBEX_TOKEN) as globex_host,
    ):
        await loaded(acme_host, ACME_KEY)
        record = await globex_host.open(GLOBEX_KEY, "r1", limits=Limits(memory_bytes=10 * MIB))
        with pytest.raises(RunnerFullError) as full:
            await globex_host.load(record.handle, WORKER)
        assert full.value.retry_after == 5.0
        assert "1 children of 1 run" in full.value.detail
        assert (await globex_host.status(record.handle)).phase is Phase.OPEN
        async with run.bare(GLOBEX_TOKEN) as bare:
            answer = await bare.post(
                "/v1/load",
                json={
                    "handle": converter.unstructure(record.handle),
                    "load": converter.unstructure(WORKER),
                },
            )
        assert (answer.status_code, answer.headers["retry-after"]) == (503, "5")
        assert answer.json()["code"] == "RunnerFull"
    # Memory: one child of 150 MiB leaves no room for another 150 in 200.
    async with (
        runner(
            FakeExecution(),
            ceilings=ceilings,
            capacity=Capacity(max_children=5, allocatable=200 * MIB),
        ) as run,
        run.tenant(ACME_TOKEN) as host,
    ):
        await loaded(host, ACME_KEY)
        second = await host.open(Key(identity="acme", instance="2"), "r1")
        with pytest.raises(
            RunnerFullError, match="memory ceilings take 157,286,400 of 209,715,200"
        ):
            await host.load(second.handle, WORKER)


async def test_two_loads_racing_for_the_last_slot_admit_exactly_one(fake: FakeExecution) -> None:
    async with (
        runner(fake, acme(quota=Quota(children=3))) as run,
        run.tenant(ACME_TOKEN) as host,
    ):
        records = [await host.open(Key(identity="acme", instance=f"{n}"), "r1") for n in range(8)]
        outcomes: list[str] = []

        async def load(handle: Handle) -> None:
            try:
                await host.load(handle, WORKER)
                outcomes.append("loaded")
            except QuotaExceededError:
                outcomes.append("refused")

        async with trio.open_nursery() as nursery:
            for record in records:
                nursery.start_soon(load, record.handle)
        assert sorted(outcomes) == ["loaded"] * 3 + ["refused"] * 5


# -- fairness ----------------------------------------------------------------------------------


async def test_opens_beyond_the_rate_are_429_with_retry_after_and_renewals_never(
    fake: FakeExecution,
) -> None:
    # One open per 100 s after a burst of 2: the third within the test is refused.
    tenant = acme(fairness=Fairness(rate=0.01, burst=2))
    async with runner(fake, tenant, globex()) as run, run.tenant(ACME_TOKEN) as host:
        first = await host.open(Key(identity="acme", instance="1"), "r1")
        await host.open(Key(identity="acme", instance="2"), "r1")
        with pytest.raises(ThrottledError) as throttled:
            await host.open(Key(identity="acme", instance="3"), "r1")
        assert throttled.value.retry_after is not None
        assert 90 < throttled.value.retry_after <= 100
        assert await host.high_water(Key(identity="acme", instance="3")) is None
        for _ in range(5):  # renew and status are not rated
            await host.renew(first.handle)
            await host.status(first.handle)
        # Another tenant's bucket is its own.
        async with run.tenant(GLOBEX_TOKEN) as other:
            await other.open(GLOBEX_KEY, "r1")


async def test_calls_beyond_inflight_are_refused_while_renewals_pass(fake: FakeExecution) -> None:
    # The bound itself, without a network: a call in flight is a block of calling().
    async with supervise_embedded(MemoryStore(), fake) as supervisor:
        admission = Admission(supervisor)
        tenant = acme(fairness=Fairness(inflight=1))
        with admission.calling(tenant, bounded=True, rated=False):
            with (
                pytest.raises(ThrottledError, match="1 calls in flight") as throttled,
                admission.calling(tenant, bounded=True, rated=True),
            ):
                pass
            assert throttled.value.retry_after == 1.0
            with admission.calling(tenant, bounded=False, rated=False):  # renew, dispose
                pass
            with admission.calling(globex(fairness=Fairness(inflight=1)), bounded=True, rated=True):
                pass  # another tenant's calls are counted apart
        with admission.calling(tenant, bounded=True, rated=True):
            pass  # the first call ended: room again


# -- what operators see -------------------------------------------------------------------------


async def test_usage_against_quota_in_tenants_metrics_and_runners(fake: FakeExecution) -> None:
    tenant = acme(quota=Quota(sessions=5, children=2))
    ceilings = Ceilings(default=Limits(memory_bytes=64 * MIB))
    capacity = Capacity(max_children=7, allocatable=1024 * MIB)
    async with (
        runner(fake, tenant, globex(), ceilings=ceilings, capacity=capacity) as run,
        run.tenant(ACME_TOKEN) as host,
    ):
        await loaded(host, ACME_KEY)
        await host.open(Key(identity="acme", instance="idle"), "r1")
        async with run.bare(OPERATOR_TOKEN) as operator:
            answer = (await operator.get("/v1/tenants")).json()
            listed = answer["tenants"]
            scraped = (await operator.get("/metrics")).text
            [here] = (await operator.get("/v1/runners")).json()["runners"]
        by_name = {one["name"]: one for one in listed}
        assert by_name["acme"]["usage"] == {
            "sessions": 2,
            "children": 1,
            "memory_bytes": 64 * MIB,
            "cpu_percent": 100 * (os.cpu_count() or 1),  # no CPU ceiling: every core
            "children_without_cpu_limit": 1,  # which the answer says, with what it counts as
        }
        assert answer["unlimited_cpu_percent"] == 100 * (os.cpu_count() or 1)
        assert by_name["acme"]["quota"]["sessions"] == 5
        assert by_name["globex"]["usage"]["sessions"] == 0
        assert 'trio_supervisor_tenant_used{resource="children",tenant="acme"} 1.0' in scraped
        assert 'trio_supervisor_tenant_quota{resource="sessions",tenant="acme"} 5.0' in scraped
        assert "children_without_cpu_limit" not in scraped  # a gauge per resource a quota bounds
        assert 'trio_supervisor_calls_total{call="load",outcome="ok",tenant="acme"} 1.0' in scraped
        assert (here["children"], here["memory_allocated"]) == (1, 64 * MIB)
        assert (here["max_children"], here["allocatable"]) == (7, 1024 * MIB)
        # A tenant sees itself alone, without its token's hash.
        async with run.bare(GLOBEX_TOKEN) as other:
            [itself] = (await other.get("/v1/tenants")).json()["tenants"]
        assert itself["name"] == "globex"
        assert "token_sha256" not in itself


async def test_the_ledger_counts_each_phase_of_a_session_and_forgets_it_once_stopped(
    fake: FakeExecution,
) -> None:
    fake.behave("stubborn:main", ignore_interrupt=True)  # stays Stopping for its grace
    async with supervise_embedded(MemoryStore(), fake, grace=3600.0) as supervisor:
        ceilings = Ceilings(default=Limits(memory_bytes=64 * MIB, cpu_percent=50))
        admission = Admission(supervisor, ceilings=ceilings)
        tenant = acme()

        def used() -> tuple[int, int, int, int]:
            usage = admission.usage(tenant)
            return (usage.sessions, usage.children, usage.memory_bytes, usage.cpu_percent)

        limits = admission.limits(tenant, None)
        record = await supervisor.open(ACME_KEY, "r1", limits=limits)
        assert used() == (1, 0, 0, 0)
        await supervisor.open(GLOBEX_KEY, "r1", limits=limits)  # not acme's
        assert used() == (1, 0, 0, 0)
        assert admission.usage(None).sessions == 2
        await supervisor.load(record.handle, Load(specifier="stubborn:main"))
        assert used() == (1, 1, 64 * MIB, 50)
        admission._ledger.note(record)  # an older record of the session changes nothing
        assert used() == (1, 1, 64 * MIB, 50)

        def phase() -> Phase | None:
            found = supervisor.find(ACME_KEY, 1)
            return None if found is None else found.phase

        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor.dispose, record.handle)
            await until(lambda: phase() is Phase.STOPPING, "the stop began")
            assert used() == (1, 1, 64 * MIB, 50)  # a Stopping child still holds its room
            supervisor.skip_grace()
        assert used() == (0, 0, 0, 0)  # its Stopped record is durable: at once
        admission.close()


# -- the tenants' values, without a runner (kills mutmut's mutants of tenants.py) ----------


def test_ceilings_over_a_base_take_the_base_s_fields_they_leave_unset() -> None:
    own = Ceilings(default=Limits(memory_bytes=1 * MIB), max=Limits(processes=5))
    base = Ceilings(
        default=Limits(memory_bytes=2 * MIB, open_files=30),
        max=Limits(processes=9, cpu_percent=50),
    )
    assert own.over(base) == Ceilings(
        default=Limits(memory_bytes=1 * MIB, open_files=30),
        max=Limits(processes=5, cpu_percent=50),
    )
    assert Ceilings().over(base) == base
    assert own.over(Ceilings()) == own


def test_effective_limits_fill_from_tenant_then_runner_and_lower_to_either_max() -> None:
    tenant = Ceilings(default=Limits(memory_bytes=64 * MIB), max=Limits(processes=100))
    runner = Ceilings(
        default=Limits(memory_bytes=32 * MIB, open_files=64),
        max=Limits(processes=50, open_files=1000, cpu_percent=200),
    )
    assert effective_limits(None, tenant, runner) == Limits(
        memory_bytes=64 * MIB, open_files=64, processes=50, cpu_percent=200
    )
    asked = Limits(memory_bytes=8 * MIB, open_files=5000, processes=10)
    assert effective_limits(asked, tenant, runner) == Limits(
        memory_bytes=8 * MIB, open_files=1000, processes=10, cpu_percent=200
    )
    assert effective_limits(None, Ceilings(), Ceilings()) == Limits()


def test_each_value_describes_itself_in_a_line_of_a_log() -> None:
    ceilings = Ceilings(
        default=Limits(memory_bytes=64 * MIB), max=Limits(processes=1024, cpu_percent=200)
    )
    # memory_bytes is set, cpu_seconds is not, processes and cpu_percent come after it.
    assert ceilings.described() == (
        "memory_bytes 67,108,864 by default, at most unlimited; "
        "processes unlimited by default, at most 1,024; "
        "cpu_percent unlimited by default, at most 200"
    )
    assert Ceilings().described() == "none"
    assert Quota(sessions=1000, cpu_percent=50).described() == "sessions 1,000, cpu_percent 50"
    assert Quota().described() == "none"
    fairness = Fairness(inflight=2000, rate=50, burst=100)
    assert fairness.described() == "inflight 2,000, rate 50, burst 100"
    assert Fairness(rate=0.5).described() == "rate 0.5"
    assert Fairness().described() == "none"


def test_the_bucket_is_the_burst_or_else_the_rate_rounded_up() -> None:
    assert Fairness(rate=2.5).bucket == 3
    assert Fairness(rate=2.5, burst=7).bucket == 7
    assert Fairness(rate=0.2).bucket == 1
    assert Fairness().bucket == 1


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"inflight": 0}, ValueError, "Fairness.inflight must be at least 1, got 0"),
        ({"burst": -1}, ValueError, "Fairness.burst must be >= 0, got -1"),
        ({"inflight": "8"}, TypeError, "Fairness.inflight must be an int, not str"),
        ({"rate": 0}, ValueError, "Fairness.rate must be a number above 0, got 0.0"),
        ({"rate": math.inf}, ValueError, "Fairness.rate must be a number above 0, got inf"),
        ({"rate": True}, TypeError, "Fairness.rate must be a number, not bool"),
        ({"rate": "5"}, TypeError, "Fairness.rate must be a number, not str"),
    ],
)
def test_fairness_refuses_what_cannot_bound_naming_the_field(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        Fairness(**fields)
    assert str(caught.value) == message
    assert Fairness(rate=1e-3).rate == 1e-3  # any number above 0 is a rate


def test_a_tenant_refuses_a_bad_name_hash_or_identities_naming_the_field() -> None:
    good: dict[str, Any] = {
        "name": "acme",
        "token_sha256": token_hash(ACME_TOKEN),
        "identities": ("acme",),
    }
    with pytest.raises(ValueError, match=r"^Tenant\.name must be 1-63 letters.*got '-acme'$"):
        Tenant(**{**good, "name": "-acme"})
    hashed = (
        r"^Tenant\.token_sha256 must be the hex SHA-256 of the tenant's token \(64 "
        r"characters 0-9a-f; `trio-supervisor tenants add` writes it\)$"
    )
    for bad in ("F" * 64, "0" * 63, 64):
        with pytest.raises(ValueError, match=hashed):
            Tenant(**{**good, "token_sha256": bad})
    with pytest.raises(ValueError, match=r"^Tenant\.identities must be a non-empty array"):
        Tenant(**{**good, "identities": ()})
    # A lone pattern is one pattern, not one per character ("*" among them).
    lone = Tenant(**{**good, "identities": "acme-*"})
    assert lone.identities == ("acme-*",)
    assert lone.may_use("acme-web")
    assert not lone.may_use("globex")


def test_tenants_are_found_by_token_and_no_two_share_one() -> None:
    tenants = Tenants({"acme": acme(), "globex": globex()})
    assert tenants.find(ACME_TOKEN) == acme()
    assert tenants.find("no-such-token") is None
    assert len(tenants) == 2
    assert [tenant.name for tenant in tenants] == ["acme", "globex"]
    twin = Tenant(name="twin", token_sha256=token_hash(ACME_TOKEN), identities=("twin",))
    with pytest.raises(TenantsError) as caught:
        Tenants({"acme": acme(), "twin": twin})
    assert str(caught.value) == (
        "tenants 'acme' and 'twin' have the same token: each tenant needs a token of its own"
    )


def test_without_a_tenants_file_the_token_is_tenant_default_who_may_use_every_key() -> None:
    tenants = Tenants.single("the-hosts-token")
    (only,) = tenants
    assert tenants.find("the-hosts-token") is only
    assert (only.name, only.identities) == ("default", ("*",))
    assert (only.quota, only.limits, only.fairness) == (Quota(), Ceilings(), Fairness())
    assert only.may_use("anything-at-all")
    assert tenants.find("another-token") is None


async def test_a_runner_full_by_memory_names_the_bytes_and_when_to_load_again(
    fake: FakeExecution,
) -> None:
    async with supervise_embedded(MemoryStore(), fake) as supervisor:
        capacity = Capacity(max_children=5, allocatable=200 * MIB)
        admission = Admission(supervisor, capacity=capacity)
        first = await supervisor.open(ACME_KEY, "r1", limits=Limits(memory_bytes=150 * MIB))
        with admission.loading(acme(), first):
            await supervisor.load(first.handle, WORKER)
        second = await supervisor.open(
            Key(identity="acme", instance="2"), "r1", limits=Limits(memory_bytes=60 * MIB)
        )
        with pytest.raises(RunnerFullError) as full, admission.loading(acme(), second):
            pytest.fail("admitted a child past the allocatable memory")
        assert full.value.retry_after == 5.0
        assert full.value.detail == (
            "the runner is full: its children's memory ceilings take 157,286,400 of "
            "209,715,200 allocatable bytes, and this child's is 62,914,560; load again "
            "later, or on another runner"
        )
        admission.close()


async def test_a_tally_counts_what_a_tenant_holds_among_records_given_it(
    fake: FakeExecution,
) -> None:
    async with supervise_embedded(MemoryStore(), fake) as supervisor:
        admission = Admission(supervisor)
        limits = Limits(memory_bytes=64 * MIB, cpu_percent=50)
        loaded_record = await supervisor.open(ACME_KEY, "r1", limits=limits)
        await supervisor.load(loaded_record.handle, WORKER)
        await supervisor.open(Key(identity="acme", instance="2"), "r1", limits=limits)
        await supervisor.open(GLOBEX_KEY, "r1", limits=limits)
        records = supervisor.live_records()
        assert admission.tally(records, acme()) == Usage(
            sessions=2, children=1, memory_bytes=64 * MIB, cpu_percent=50
        )
        assert admission.tally(records, globex()) == Usage(sessions=1)
        assert admission.tally(records, None) == Usage(
            sessions=3, children=1, memory_bytes=64 * MIB, cpu_percent=50
        )
        assert admission.tally([], None) == Usage()
        admission.close()


async def test_a_child_that_exactly_fills_the_runner_s_memory_is_admitted(
    fake: FakeExecution,
) -> None:
    async with supervise_embedded(MemoryStore(), fake) as supervisor:
        admission = Admission(supervisor, capacity=Capacity(max_children=5, allocatable=200 * MIB))
        for instance, memory in (("1", 150 * MIB), ("2", 50 * MIB)):
            record = await supervisor.open(
                Key(identity="acme", instance=instance), "r1", limits=Limits(memory_bytes=memory)
            )
            with admission.loading(acme(), record):
                await supervisor.load(record.handle, WORKER)
        assert admission.usage(None).memory_bytes == 200 * MIB
        admission.close()


async def test_the_bucket_admits_a_call_once_a_whole_token_refilled(fake: FakeExecution) -> None:
    now = [100.0]
    tenant = acme(fairness=Fairness(rate=1, burst=1))
    async with supervise_embedded(MemoryStore(), fake) as supervisor:
        admission = Admission(supervisor, clock=lambda: now[0])
        with admission.calling(tenant, bounded=True, rated=True):
            pass
        now[0] += 0.25
        with (
            pytest.raises(ThrottledError) as throttled,
            admission.calling(tenant, bounded=True, rated=True),
        ):
            pytest.fail("admitted a call with a quarter of a token")
        assert throttled.value.detail == (
            "tenant 'acme' opens and loads faster than its rate (1 per second, burst 1); "
            "try again in 0.75 s"
        )
        assert throttled.value.retry_after == 0.75
        now[0] += 0.75  # exactly one token again
        with admission.calling(tenant, bounded=True, rated=True):
            pass
        admission.close()


def test_retry_after_is_whole_seconds_and_at_least_one() -> None:
    from trio_supervisor.service.admission import retry_after_header

    assert [retry_after_header(s) for s in (0.0, 0.5, 1.0, 1.01, 5.0)] == ["1", "1", "1", "2", "5"]


async def test_a_tenant_s_claim_carries_its_quota_as_this_runner_counts_children(
    fake: FakeExecution,
) -> None:
    """What a fleet's store checks (docs/design.md, F9): the tenant's quota, with a child
    without ceilings counted as this runner counts one (the allocatable memory, every
    core); made once per tenant; none for the operators or a tenant without a quota."""
    from trio_supervisor.model import QuotaClaim

    quota = Quota(sessions=3, children=2, memory_bytes=256 * MIB, cpu_percent=150)
    every_core = 100 * (os.cpu_count() or 1)
    async with supervise_embedded(MemoryStore(), fake) as supervisor:
        sized = Admission(supervisor, capacity=Capacity(max_children=4, allocatable=512 * MIB))
        claim = sized.claim(acme(quota=quota))
        assert claim == QuotaClaim(
            tenant="acme",
            identities=("acme", "acme-*"),
            sessions=3,
            children=2,
            memory_bytes=256 * MIB,
            cpu_percent=150,
            unlimited_memory_bytes=512 * MIB,
            unlimited_cpu_percent=every_core,
        )
        assert sized.claim(acme(quota=quota)) is claim
        assert sized.claim(globex(quota=Quota(sessions=1))) == QuotaClaim(
            tenant="globex",
            identities=("globex",),
            sessions=1,
            unlimited_memory_bytes=512 * MIB,
            unlimited_cpu_percent=every_core,
        )
        assert sized.claim(acme()) is None
        assert sized.claim(None) is None
        assert sized.unlimited_cpu_percent == every_core
        unsized = Admission(supervisor)  # no capacity: a child without a ceiling weighs 0
        found = unsized.claim(acme(quota=quota))
        assert found is not None
        assert found.unlimited_memory_bytes == 0
        sized.close()
        unsized.close()
