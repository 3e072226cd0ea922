"""The admission's edges, on the real object (docs/service.md section D): what an open or
a load still under way counts (its *hold*), before and after its record is durable;
the operators' limits; a machine whose CPU count is unknown.

Each test drives an :class:`~trio_supervisor.service.admission.Admission` directly,
beside an embedded supervisor on a MemoryStore with fake children: no server is needed
to see what it counts (the wire's answers are ``test_tenants.py``'s).
"""

from __future__ import annotations

import os
from typing import Any, Final

import pytest

from trio_supervisor import Key, Limits, Load, MemoryStore
from trio_supervisor.service.admission import Admission, Usage
from trio_supervisor.service.tenants import Ceilings, Tenant, token_hash
from trio_supervisor.testing import FakeExecution

from ..support.sessions import supervise_embedded

MIB: Final = 1 << 20
WORKER: Final = Load(specifier="worker:main")
ONE: Final = Key(identity="acme-web", instance="1")
TWO: Final = Key(identity="acme-web", instance="2")


def acme(**more: Any) -> Tenant:
    return Tenant(
        name="acme", token_sha256=token_hash("acme-token"), identities=("acme-*",), **more
    )


def globex() -> Tenant:
    return Tenant(name="globex", token_sha256=token_hash("globex-token"), identities=("globex",))


async def test_an_open_under_way_counts_once_before_and_after_its_record_is_durable(
    fake: FakeExecution,
) -> None:
    async with supervise_embedded(MemoryStore(), fake) as supervisor:
        admission = Admission(supervisor)
        tenant = acme()

        def sessions(whose: Tenant | None) -> int:
            return admission.usage(whose).sessions

        with admission.opening(tenant, ONE, "r1"):
            # Admitted, its record not yet made: the hold counts, for its tenant and the
            # runner, never for another tenant.
            assert (sessions(tenant), sessions(None), sessions(globex())) == (1, 1, 0)
            await supervisor.open(ONE, "r1")
            # Its Open record is durable: the ledger counts it, the hold no more.
            assert (sessions(tenant), sessions(None)) == (1, 1)
            with admission.opening(tenant, TWO, "r1"):
                # The first hold's record is durable, the second's is not: each counts once.
                assert (sessions(tenant), sessions(None), sessions(globex())) == (2, 2, 0)
            assert sessions(tenant) == 1  # the second call returned without opening
        assert sessions(tenant) == 1
        admission.close()


async def test_a_load_under_way_counts_its_child_once_before_and_after_its_record_is_durable(
    fake: FakeExecution,
) -> None:
    limits = Limits(memory_bytes=64 * MIB, cpu_percent=50)
    child = Usage(children=1, memory_bytes=64 * MIB, cpu_percent=50)
    async with supervise_embedded(MemoryStore(), fake) as supervisor:
        admission = Admission(supervisor)
        tenant = acme()
        one = await supervisor.open(ONE, "r1", limits=limits)
        two = await supervisor.open(TWO, "r1", limits=limits)
        sessions = Usage(sessions=2)
        assert admission.usage(tenant) == sessions
        with admission.loading(tenant, one):
            # Admitted, no record of its load yet: the hold counts the child.
            assert admission.usage(tenant) == sessions + child
            assert admission.usage(globex()) == Usage()
            await supervisor.load(one.handle, WORKER)
            # Its Loading record is durable: the ledger counts the child, the hold no more.
            assert admission.usage(tenant) == sessions + child
            with admission.loading(tenant, two):
                # The first hold's child is counted by the ledger, the second's by its hold.
                assert admission.usage(tenant) == sessions + child + child
                assert admission.usage(None) == sessions + child + child
            assert admission.usage(tenant) == sessions + child  # returned without loading
        admission.close()


async def test_the_operators_sessions_get_the_runner_s_ceilings_alone(
    fake: FakeExecution,
) -> None:
    runner = Ceilings(default=Limits(memory_bytes=32 * MIB), max=Limits(processes=10))
    tenant = acme(limits=Ceilings(default=Limits(memory_bytes=8 * MIB, open_files=16)))
    async with supervise_embedded(MemoryStore(), fake) as supervisor:
        admission = Admission(supervisor, ceilings=runner)
        assert admission.limits(None, None) == Limits(memory_bytes=32 * MIB, processes=10)
        assert admission.limits(None, Limits(processes=50, cpu_percent=100)) == Limits(
            memory_bytes=32 * MIB, processes=10, cpu_percent=100
        )
        # A tenant's own ceilings apply within the runner's, to its sessions only.
        assert admission.limits(tenant, None) == Limits(
            memory_bytes=8 * MIB, open_files=16, processes=10
        )
        admission.close()


async def test_where_the_cpu_count_is_unknown_a_child_without_a_ceiling_counts_one_core(
    fake: FakeExecution, monkeypatch: pytest.MonkeyPatch
) -> None:
    # os.cpu_count() is None where Python cannot tell the machine's cores.
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    async with supervise_embedded(MemoryStore(), fake) as supervisor:
        admission = Admission(supervisor)
        assert admission.unlimited_cpu_percent == 100
        record = await supervisor.open(ONE, "r1")
        await supervisor.load(record.handle, WORKER)
        assert admission.usage(acme()) == Usage(
            sessions=1, children=1, cpu_percent=100, children_without_cpu_limit=1
        )
        admission.close()
