"""Tenants' cost and fairness (docs/service.md section D).

* ``service.cycle.tenants``: service.cycle's open + renew + dispose cycles (same clients,
  same server, one process) with tenants on: ten tenants, each client one's, each with a
  quota, ceilings and fairness that never refuse, against the same cycles with the
  hosts' single token. What the tenant's lookup, its identity check, its fairness and
  its quota's count cost per cycle. Target: >= 0.95.
* ``service.flood``: a real ``trio-supervisor serve`` with two tenants. A victim renews
  one session with a 1 s lease, RENEWS times, paced, while the runner is quiet and then
  while a flooding tenant (``benchmarks/flood.py``, a process of its own) opens new keys
  from FLOODERS connections as fast as the runner answers: the victim's renew p99
  flooded / quiet, in the same runner. Target: <= 10 ("a small multiple").
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import trio

from trio_supervisor import InProcessExecution, Key, Limits, MemoryStore, open_supervisor
from trio_supervisor.client import RemoteSupervisor, connect
from trio_supervisor.service import create_app
from trio_supervisor.service.admission import Admission, Capacity
from trio_supervisor.service.tenants import (
    Ceilings,
    Fairness,
    Quota,
    Tenant,
    Tenants,
    token_hash,
)
from trio_supervisor.service.tenants_file import Roster

from . import service
from .measure import Result, compare
from .skeleton import LEASE

TENANTS: Final = 10
FLOODERS: Final = 16
ROOT: Final = Path(__file__).parents[1]


def _tenant_token(number: int) -> str:
    return f"bench-tenant-{number}"


def _roster() -> Roster:
    """Ten tenants whose limits are all in force and never refuse the benchmark."""
    tenants = {
        f"t{number}": Tenant(
            name=f"t{number}",
            token_sha256=token_hash(_tenant_token(number)),
            identities=("bench",),
            quota=Quota(sessions=10**6, children=10**6, memory_bytes=1 << 60, cpu_percent=10**9),
            limits=Ceilings(default=Limits(memory_bytes=1 << 30), max=Limits(memory_bytes=1 << 40)),
            fairness=Fairness(inflight=10**6, rate=1e9, burst=10**9),
        )
        for number in range(TENANTS)
    }
    return Roster(Tenants(tenants))


def tenants_rate(clients: int, cycles: int) -> float:
    async def main() -> float:
        async with (
            InProcessExecution() as execution,
            open_supervisor(MemoryStore(), execution, lease=LEASE) as supervisor,
        ):
            admission = Admission(
                supervisor,
                ceilings=Ceilings(max=Limits(memory_bytes=1 << 40)),
                capacity=Capacity(max_children=10**6, allocatable=1 << 50),
            )
            app = create_app(
                supervisor,
                tenants=_roster(),
                admission=admission,
                operator_token=service.OPERATOR_TOKEN,
            )
            async with service._serving(app) as url:
                tokens = [_tenant_token(client % TENANTS) for client in range(clients)]
                return await service._drive(url, clients, cycles, tokens=tokens)

    return trio.run(main)


# -- the flood ----------------------------------------------------------------------------


@contextlib.contextmanager
def _serve(state: Path, tenants: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``trio-supervisor serve`` with ``tenants``, until the block ends; its URL."""
    command = [sys.executable, "-m", "trio_supervisor", "serve", "--state", str(state)]
    command += ["--listen", "127.0.0.1:0", "--tenants", str(tenants)]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()  # the readiness handshake
            if not line.startswith("listening on "):
                raise RuntimeError(f"serve did not start: {line!r}")
            yield process, line.removeprefix("listening on ").strip()
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(30)


@contextlib.contextmanager
def _flooding(url: str, token: str) -> Iterator[None]:
    command = [sys.executable, "-m", "benchmarks.flood", url, token, str(FLOODERS)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT) as process:
        try:
            assert process.stdout is not None
            if process.stdout.readline() != "flooding\n":
                raise RuntimeError("the flood did not start")
            yield
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(30)


async def _renewals(remote: RemoteSupervisor, key: Key, renews: int) -> list[float]:
    record = await remote.open(key, "r1", lease=1.0)
    took = []
    for _ in range(renews):
        began = time.perf_counter()
        await remote.renew(record.handle)
        took.append(time.perf_counter() - began)
        await trio.sleep(0.005)
    await remote.dispose(record.handle)
    return took


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98]


def flood_round(renews: int) -> tuple[float, float]:
    """The victim's renew p99 on one runner: quiet, then flooded (seconds)."""
    with tempfile.TemporaryDirectory() as scratch:
        tenants = Path(scratch, "tenants.toml")
        tenants.write_text(
            f'[tenants.victim]\ntoken_sha256 = "{token_hash("victim")}"\nidentities = ["victim"]\n'
            f'[tenants.flood]\ntoken_sha256 = "{token_hash("flood")}"\nidentities = ["flood"]\n'
            "fairness = { inflight = 8, rate = 10, burst = 10 }\nquota = { sessions = 10 }\n"
        )
        os.chmod(tenants, 0o600)
        with _serve(Path(scratch, "state"), tenants) as (_, url):

            async def main() -> tuple[float, float]:
                async with connect(url, token="victim") as victim:
                    quiet = await _renewals(victim, Key(identity="victim", instance="q"), renews)
                    with _flooding(url, "flood"):
                        key = Key(identity="victim", instance="f")
                        flooded = await _renewals(victim, key, renews)
                return p99(quiet), p99(flooded)

            return trio.run(main)


def run(quick: bool, rounds: int) -> list[Result]:
    clients = 10 if quick else service.CLIENTS
    cycles = 2 if quick else 8
    renews = 50 if quick else 300
    flooded: list[float] = []
    quiet: list[float] = []
    for _ in range(rounds):
        calm, busy = flood_round(renews)
        quiet.append(calm)
        flooded.append(busy)
    return [
        compare(
            "service.cycle.tenants",
            ours=lambda: tenants_rate(clients, cycles),
            baseline=lambda: service.ours_rate(clients, cycles),
            baseline_name="service.cycle with the hosts' single token",
            unit="cycles/s",
            better="higher",
            target=0.95,
            rounds=rounds,
            note=f"{TENANTS} tenants with quotas, ceilings and fairness that never refuse",
        ),
        Result(
            name="service.flood",
            unit="s (renew p99)",
            better="lower",
            target=10.0,
            ours=flooded,
            baseline=quiet,
            baseline_name="the same runner's renew p99 before the flood",
            note=f"a victim's renewals while another tenant floods opens from {FLOODERS} "
            "connections (a process of its own)",
        ),
    ]


__all__ = ["flood_round", "run", "tenants_rate"]
