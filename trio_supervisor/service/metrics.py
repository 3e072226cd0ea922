"""The runner's metrics, in Prometheus' text format (``GET /metrics``; docs/service.md section B).

Theory of operation
-------------------
Everything lives in the service's own ``CollectorRegistry``, never the global one, so
two runners in one process (tests do that) never share a series. Four sources:

* at scrape time, from the supervisor's retained records: sessions by phase, children
  alive (a child is alive while its session is not Stopped), and whether the supervisor
  is poisoned;
* counted by the app as it answers: calls by outcome (``ok`` or the error's wire code)
  and tenant;
* at scrape time, from the app's admission (:meth:`Metrics.watch_tenants`): each
  tenant's usage on this runner and its quota;
* followed from the supervisor's events (:meth:`Metrics.follow`): terminations by kind
  and reason, and how long each stop took (from its Stopping record to its Stopped
  record); and from the store (:class:`TimedStore`): how long each save took.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Final

import trio
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as CounterMetric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._core.events import Overflow
from ..abc import BatchStore, FleetMember, FleetStore, Store
from ..model import (
    FleetRecord,
    Handle,
    Key,
    LoadedRecord,
    LoadingRecord,
    Phase,
    QuotaClaim,
    RunnerInfo,
    SessionRecord,
    StoppedRecord,
    StoppingRecord,
)
from ..retention import Retention
from .served import ServedSupervisor

__all__ = ["Metrics", "TimedFleetStore", "TimedStore", "timed"]

PREFIX: Final = "trio_supervisor"


class _Snapshot(Collector):
    """The gauges read from the supervisor when Prometheus scrapes."""

    def __init__(self, supervisor: ServedSupervisor) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterator[Metric]:
        records = self._supervisor.records()
        phases = Counter(record.phase for record in records)
        sessions = GaugeMetricFamily(
            f"{PREFIX}_sessions", "Retained sessions by phase.", labels=["phase"]
        )
        for phase in Phase:
            sessions.add_metric([phase.value], phases.get(phase, 0))
        yield sessions
        yield GaugeMetricFamily(
            f"{PREFIX}_children_alive",
            "Sessions whose child may run: it was registered and the session is not Stopped.",
            value=sum(1 for record in records if _has_child(record)),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_poisoned",
            "1 while the supervisor is poisoned: it refuses new work.",
            value=1 if self._supervisor.poisoned is not None else 0,
        )

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _has_child(record: SessionRecord) -> bool:
    if isinstance(record, StoppedRecord):
        return False
    active = record.previous if isinstance(record, StoppingRecord) else record
    return isinstance(active, LoadingRecord | LoadedRecord) and active.child is not None


Tally = Callable[[], Iterable[tuple[str, Mapping[str, int | None], Mapping[str, int]]]]
"""Each tenant's name, quota and usage, by resource (``sessions``, ``children``,
``memory_bytes``, ``cpu_percent``): what the tenant gauges are read from."""


class _Tenants(Collector):
    """Each tenant's usage and quota on this runner, read when Prometheus scrapes."""

    def __init__(self, tally: Tally) -> None:
        self._tally = tally

    def collect(self) -> Iterator[Metric]:
        used = GaugeMetricFamily(
            f"{PREFIX}_tenant_used",
            "What each tenant holds on this runner, by resource (sessions, children, "
            "memory_bytes and cpu_percent of its children's ceilings).",
            labels=["tenant", "resource"],
        )
        hard = GaugeMetricFamily(
            f"{PREFIX}_tenant_quota",
            "Each tenant's quota, by resource; a resource without one has no sample.",
            labels=["tenant", "resource"],
        )
        for name, quota, usage in self._tally():
            for resource, value in usage.items():
                used.add_metric([name, resource], value)
                limit = quota.get(resource)
                if limit is not None:
                    hard.add_metric([name, resource], limit)
        yield used
        yield hard

    def describe(self) -> Iterator[Metric]:
        return iter(())


class _LostWrites(Collector):
    """How many of this runner's records and marks failovers were found to have lost."""

    def __init__(self, count: Callable[[], int]) -> None:
        self._count = count

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            f"{PREFIX}_store_lost_writes",
            "Live records and high-water marks of this runner that its store was found to "
            "have lost after a failover (written back; docs/design.md B6).",
            value=self._count(),
        )

    def describe(self) -> Iterator[Metric]:
        return iter(())


class Metrics:
    """The service's series, in a registry of its own.

    Attributes:
        registry: What ``GET /metrics`` renders.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.calls = CounterMetric(
            f"{PREFIX}_calls",
            "Calls answered, by call, outcome (ok, or the error's code) and tenant "
            "('operators' for the operators' token, '' for no valid token).",
            ["call", "outcome", "tenant"],
            registry=self.registry,
        )
        self.terminations = CounterMetric(
            f"{PREFIX}_terminations",
            "Sessions stopped, by the termination's kind and the stop's reason.",
            ["kind", "reason"],
            registry=self.registry,
        )
        self.termination_seconds = Histogram(
            f"{PREFIX}_termination_seconds",
            "Seconds from a session's Stopping record to its Stopped record.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30),
            registry=self.registry,
        )
        self.restarts = CounterMetric(
            f"{PREFIX}_restarts",
            "New incarnations the runner made by itself after its supervisor was poisoned, "
            "by cause (fenced, store, termination, execution, crash).",
            ["cause"],
            registry=self.registry,
        )
        self.restarting = Gauge(
            f"{PREFIX}_restarting",
            "1 while the runner makes a new incarnation of its supervisor: it answers "
            "503 RunnerRestarting meanwhile.",
            registry=self.registry,
        )
        self._tenants: _Tenants | None = None
        self.save_seconds = Histogram(
            f"{PREFIX}_store_save_seconds",
            "Seconds a store save (one transaction) took, from the call to its acknowledgement.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1),
            registry=self.registry,
        )

    def watch_tenants(self, tally: Tally) -> None:
        """Render each tenant's usage and quota (``tally``) at every scrape, in place of
        the tally watched before (a runner's new incarnation brings its own)."""
        if self._tenants is not None:
            self.registry.unregister(self._tenants)
        self._tenants = _Tenants(tally)
        self.registry.register(self._tenants)

    def watch_lost_writes(self, count: Callable[[], int]) -> None:
        """Render ``count()`` as the writes a failover was found to have lost (B6)."""
        self.registry.register(_LostWrites(count))

    def called(self, call: str, outcome: str, tenant: str = "") -> None:
        """Count one answered call."""
        self.calls.labels(call=call, outcome=outcome, tenant=tenant).inc()

    async def follow(self, supervisor: ServedSupervisor) -> None:
        """Read the gauges from ``supervisor``, and count its terminations from its
        events until it shuts down (run it as a task beside the supervisor)."""
        snapshot = _Snapshot(supervisor)
        self.registry.register(snapshot)
        try:
            await self._count(supervisor)
        finally:
            self.registry.unregister(snapshot)

    async def _count(self, supervisor: ServedSupervisor) -> None:
        stopping: dict[str, float] = {}
        async with supervisor.watch() as events:
            async for event in events:
                if isinstance(event, Overflow):
                    stopping.clear()  # the durations of those stops are lost; counts too
                    continue
                token = event.handle.token
                if isinstance(event, StoppingRecord):
                    stopping[token] = trio.current_time()
                elif isinstance(event, StoppedRecord):
                    self.terminations.labels(
                        kind=event.termination.kind, reason=event.reason.kind
                    ).inc()
                    began = stopping.pop(token, None)
                    if began is not None:
                        self.termination_seconds.observe(trio.current_time() - began)


class TimedStore:
    """A store that times every save into ``Metrics.save_seconds``; otherwise the store."""

    def __init__(self, store: Store, histogram: Histogram) -> None:
        self._store = store
        self._histogram = histogram
        # Checked once: a runtime check against a Protocol costs microseconds a call.
        self._batch = store if isinstance(store, BatchStore) else None

    @property
    def retention(self) -> Retention:
        return self._store.retention

    async def save(self, record: SessionRecord) -> None:
        began = trio.current_time()
        await self._store.save(record)
        self._histogram.observe(trio.current_time() - began)

    async def save_many(self, records: Sequence[SessionRecord]) -> None:
        """One transaction is one save to time (a childless stop's two records, say)."""
        if self._batch is not None:
            began = trio.current_time()
            await self._batch.save_many(records)
            self._histogram.observe(trio.current_time() - began)
        else:
            for record in records:
                await self.save(record)

    async def list(self) -> Sequence[SessionRecord]:
        return await self._store.list()

    async def high_water(self) -> Mapping[Key, int]:
        return await self._store.high_water()


class TimedFleetStore(TimedStore):
    """A fleet's store, its saves timed: still a ``FleetStore`` to the supervisor, which
    becomes a member of the fleet through it (the fleet's calls go straight through)."""

    def __init__(self, store: FleetStore, histogram: Histogram) -> None:
        super().__init__(store, histogram)
        self._fleet = store

    @property
    def member(self) -> str:
        return self._fleet.member

    async def save_within(self, record: SessionRecord, quota: QuotaClaim) -> None:
        began = trio.current_time()
        await self._fleet.save_within(record, quota)
        self._histogram.observe(trio.current_time() - began)

    async def lookup(self, key: Key, request_id: str | None) -> tuple[int, SessionRecord | None]:
        return await self._fleet.lookup(key, request_id)

    async def wait_older_stopped(self, handle: Handle) -> None:
        await self._fleet.wait_older_stopped(handle)

    async def run_member(self, member: FleetMember) -> None:
        await self._fleet.run_member(member)

    async def runners(self) -> Sequence[RunnerInfo]:
        return await self._fleet.runners()

    async def fleet_records(self) -> Sequence[FleetRecord]:
        return await self._fleet.fleet_records()

    async def held(self, token: str) -> FleetRecord | None:
        return await self._fleet.held(token)

    async def owner(self, token: str) -> RunnerInfo | None:
        return await self._fleet.owner(token)

    async def drain(self) -> None:
        await self._fleet.drain()


def timed(store: Store, histogram: Histogram) -> TimedStore:
    """``store`` with its saves timed into ``histogram``, a fleet's store still one."""
    if isinstance(store, FleetStore):
        return TimedFleetStore(store, histogram)
    return TimedStore(store, histogram)
