"""Admission: what a tenant may take of the runner, decided before the engine acts.

Theory of operation
-------------------
Every call of a tenant's passes here after its token (401) and its key's identity (403)
were checked, and before the supervisor sees it (docs/service.md section D):

- :meth:`Admission.calling`: fairness. At most ``inflight`` calls of the tenant's at
  once, and opens and loads taken from a token bucket filled at ``rate`` per second up to
  ``burst``; over either, :class:`~trio_supervisor.errors.ThrottledError` (429) with the
  seconds to wait. Renew and dispose are never throttled: refusing them would cost the
  tenant sessions it holds. Nothing queues: a call is admitted or refused at once, so no
  tenant's calls wait behind another's.
- :meth:`Admission.opening`: the tenant's ``sessions`` quota.
- :meth:`Admission.loading`: the tenant's ``children`` (from a load's first record until
  the session is Stopped: a Stopping child still holds its memory), ``memory_bytes`` and
  ``cpu_percent`` quotas, then the runner's capacity (its children's summed memory
  ceilings within the allocatable memory, and fewer than ``max_children`` children);
  over quota :class:`~trio_supervisor.errors.QuotaExceededError` (429), over capacity
  :class:`~trio_supervisor.errors.RunnerFullError` (503). The session stays Open.

What is used is counted by the ledger (``ledger.py``) from the records of the
supervisor's live sessions, as each is made durable, each counted for every tenant
whose patterns match its identity; plus the *holds* of opens and loads admitted and
still under way: the check and the hold are one step of the event loop, so two calls
can never both take the last slot. A hold counts until the ledger counts what it
admitted (its Open record, its child's Loading record), or until its call returns. A
retry of an open the supervisor already answered (O3), and an open that supersedes the
key's live session here, take no new session. A load into a session that is not Open
takes nothing: the supervisor answers it without a child (L2) or refuses it.

In a fleet these counts are this runner's own; the fleet's are the database's: the app
passes each call's :meth:`Admission.claim` to the supervisor, and the fleet's store
checks it in the transaction that saves the Open record or the load's first Loading
record (docs/design.md, F9), so two runners never both admit the last slot.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Final

import attrs
import trio

from .. import _defaults as defaults
from ..errors import QuotaExceededError, RunnerFullError, ThrottledError
from ..model import Key, Limits, Phase, QuotaClaim, SessionRecord
from .ledger import NOTHING, Ledger, Usage, holds_child
from .served import ServedSupervisor
from .tenants import Ceilings, Quota, Tenant, effective_limits

__all__ = ["Admission", "Capacity", "Usage", "holds_child"]

FULL_RETRY_AFTER: Final = defaults.FULL_RETRY_AFTER
INFLIGHT_RETRY_AFTER: Final = defaults.INFLIGHT_RETRY_AFTER
_NO_CEILINGS: Final = Ceilings()
_NO_QUOTA: Final = Quota()


@attrs.frozen(kw_only=True)
class Capacity:
    """What the runner's machine gives its children.

    Attributes:
        max_children: Children at once (Loading or Loaded).
        allocatable: Bytes the children's memory ceilings may sum to: the machine's
            memory less the runner's reserve.
    """

    max_children: int
    allocatable: int


@attrs.frozen
class _Hold:
    """An admitted open or load still under way, counted until its call returns, or
    until the ledger counts what it admitted."""

    identity: str
    usage: Usage
    token: str = ""  # a load's: its session's, whose child the ledger counts once Loading
    request: tuple[Key, str] | None = None  # an open's: its key and request id


@attrs.define
class _Bucket:
    """A token bucket: ``tokens`` at ``updated`` (Trio's clock)."""

    tokens: float
    updated: float


class Admission:
    """The runner's admission of its tenants' calls (see the module's docstring).

    Args:
        supervisor: Whose live sessions are counted.
        ceilings: The runner's own ceilings (its ``[limits]``), within which each
            tenant's apply.
        capacity: The runner's capacity; None: loads are bounded by quotas only.
        clock: The time, in seconds, for the token buckets (Trio's by default).
    """

    def __init__(
        self,
        supervisor: ServedSupervisor,
        *,
        ceilings: Ceilings | None = None,
        capacity: Capacity | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.supervisor = supervisor
        self.ceilings = ceilings if ceilings is not None else Ceilings()
        self.capacity = capacity
        self._clock = clock
        self._cores = os.cpu_count() or 1
        self._ledger = Ledger(self._weigh)
        self._ledger.seed(supervisor.live_records())
        self._stop_listening = supervisor.listen(self._ledger.note)
        self._holds: list[_Hold] = []
        self._matches: dict[tuple[tuple[str, ...], str], bool] = {}
        self._claims: dict[Tenant, QuotaClaim] = {}
        self._inflight: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}

    def close(self) -> None:
        """Stop counting the supervisor's records (the admission is no longer used)."""
        self._stop_listening()

    # -- ceilings ---------------------------------------------------------------------

    def limits(self, tenant: Tenant | None, requested: Limits | None) -> Limits:
        """The limits a session of ``tenant``'s (None: the operators') gets for
        ``requested``: never refused, only lowered (see
        :func:`~trio_supervisor.service.tenants.effective_limits`)."""
        own = tenant.limits if tenant is not None else _NO_CEILINGS
        return effective_limits(requested, own, self.ceilings)

    def claim(self, tenant: Tenant | None) -> QuotaClaim | None:
        """``tenant``'s quota as a fleet's store checks it, in the transaction that saves
        the record it admits (docs/design.md, F9); None for a tenant without a quota, or
        the operators. A store that is not a fleet's ignores it."""
        if tenant is None or tenant.quota == _NO_QUOTA:
            return None
        found = self._claims.get(tenant)
        if found is None:
            quota = tenant.quota
            found = self._claims[tenant] = QuotaClaim(
                tenant=tenant.name,
                identities=tenant.identities,
                sessions=quota.sessions,
                children=quota.children,
                memory_bytes=quota.memory_bytes,
                cpu_percent=quota.cpu_percent,
                # Counted as this runner counts them (``_weigh``).
                unlimited_memory_bytes=self._weigh(Limits())[0],
                unlimited_cpu_percent=self._weigh(Limits())[1],
            )
        return found

    # -- usage ------------------------------------------------------------------------

    def usage(self, tenant: Tenant | None) -> Usage:
        """What ``tenant`` holds now on this runner, calls under way included; the whole
        runner's for None. Costs the number of distinct identities and of calls under
        way, not of sessions (``ledger.py``)."""
        uses = None if tenant is None else self._uses(tenant)
        total = self._ledger.usage(uses)
        for hold in self._holds:
            if hold.token and self._ledger.has_child(hold.token):
                continue  # its load's Loading record is durable: the ledger counts it
            if hold.request is not None and self._ledger.has_request(hold.request):
                continue  # its Open record is durable: the ledger counts it
            if uses is None or uses(hold.identity):
                total += hold.usage
        return total

    def _uses(self, tenant: Tenant) -> Callable[[str], bool]:
        """``tenant.may_use``, remembered: identities are few, and fnmatch is not free."""
        patterns = tenant.identities
        matches = self._matches
        if len(matches) > 100_000:
            matches.clear()

        def uses(identity: str) -> bool:
            found = matches.get((patterns, identity))
            if found is None:
                found = matches[(patterns, identity)] = tenant.may_use(identity)
            return found

        return uses

    def tally(self, records: Iterable[SessionRecord], tenant: Tenant | None) -> Usage:
        """What ``tenant`` (None: anyone) holds among ``records`` (a fleet's, say), as
        this runner counts its own."""
        total = NOTHING
        for record in records:
            if tenant is None or tenant.may_use(record.handle.key.identity):
                total += self._ledger.take(record)
        return total

    @property
    def unlimited_cpu_percent(self) -> int:
        """What a child without a CPU ceiling counts as in ``cpu_percent``: every core
        of this machine (100 a core)."""
        return self._weigh(Limits())[1]

    def _weigh(self, limits: Limits) -> tuple[int, int]:
        """A child's memory and CPU as counted: its ceilings, or where it has none the
        most it could take (the allocatable memory, every core)."""
        memory = limits.memory_bytes
        if memory is None:
            memory = self.capacity.allocatable if self.capacity is not None else 0
        cpu = limits.cpu_percent if limits.cpu_percent is not None else 100 * self._cores
        return memory, cpu

    @contextlib.contextmanager
    def _held(self, hold: _Hold) -> Iterator[None]:
        self._holds.append(hold)
        try:
            yield
        finally:
            self._holds.remove(hold)

    # -- opens and loads --------------------------------------------------------------

    @contextlib.contextmanager
    def opening(self, tenant: Tenant | None, key: Key, request_id: str) -> Iterator[None]:
        """Admit an open of ``key`` by ``tenant`` (None: the operators, who have no
        quota), holding its session until the block ends.

        Raises:
            QuotaExceededError: The tenant's live sessions are at its quota.
        """
        taken = 1
        if self.supervisor.retained_request(key, request_id) is not None:
            taken = 0  # the supervisor answers it again with the record it made (O3)
        elif self.supervisor.holds_key(key):
            taken = 0  # it replaces the key's live session here (O5)
        if taken and tenant is not None and tenant.quota.sessions is not None:
            used = self.usage(tenant).sessions
            _check_quota(tenant, "sessions", taken, used, tenant.quota.sessions)
        hold = _Hold(key.identity, Usage(sessions=taken), request=(key, request_id))
        with self._held(hold):
            yield

    @contextlib.contextmanager
    def loading(self, tenant: Tenant | None, record: SessionRecord | None) -> Iterator[None]:
        """Admit a load into the session of ``record`` by ``tenant`` (None: the
        operators, who have no quota but meet the runner's capacity), holding its child
        until the block ends. A session that is not Open (or not found: None) takes
        nothing: the supervisor answers that load without a new child.

        Raises:
            QuotaExceededError: The child would take the tenant past a quota.
            RunnerFullError: The runner has no room for the child.
        """
        if record is None or record.phase is not Phase.OPEN:
            yield
            return
        child = self._ledger.child(record.limits)
        if tenant is not None and _bounds(tenant.quota):
            used = self.usage(tenant)
            for name in ("children", "memory_bytes", "cpu_percent"):
                hard = getattr(tenant.quota, name)
                if hard is not None:
                    asked = getattr(child, name)
                    _check_quota(tenant, name, asked, getattr(used, name), hard)
        if self.capacity is not None:
            self._check_room(child, self.capacity)
        hold = _Hold(record.handle.key.identity, child, token=record.handle.token)
        with self._held(hold):
            yield

    def _check_room(self, child: Usage, capacity: Capacity) -> None:
        runner = self.usage(None)
        if runner.children + 1 > capacity.max_children:
            raise RunnerFullError(
                f"the runner is full: {runner.children} children of {capacity.max_children} "
                "run; load again later, or on another runner",
                FULL_RETRY_AFTER,
            )
        if runner.memory_bytes + child.memory_bytes > capacity.allocatable:
            raise RunnerFullError(
                f"the runner is full: its children's memory ceilings take "
                f"{runner.memory_bytes:,} of {capacity.allocatable:,} allocatable bytes, and "
                f"this child's is {child.memory_bytes:,}; load again later, or on another "
                "runner",
                FULL_RETRY_AFTER,
            )

    # -- fairness ---------------------------------------------------------------------

    @contextlib.contextmanager
    def calling(self, tenant: Tenant, *, bounded: bool, rated: bool) -> Iterator[None]:
        """A call of ``tenant``'s, admitted for as long as the block runs.

        Args:
            tenant: The caller.
            bounded: Whether the call counts against ``inflight`` (renew and dispose
                do not).
            rated: Whether it takes a token from the bucket (opens and loads).

        Raises:
            ThrottledError: The tenant is over ``inflight`` or its rate.
        """
        fairness = tenant.fairness
        name = tenant.name
        if not bounded:
            yield
            return
        inflight = self._inflight.get(name, 0)
        if fairness.inflight is not None and inflight >= fairness.inflight:
            raise ThrottledError(
                f"tenant {name!r} has {inflight} calls in flight, its most "
                f"(fairness.inflight {fairness.inflight}); try again shortly",
                INFLIGHT_RETRY_AFTER,
            )
        if rated and fairness.rate is not None:
            self._take(name, fairness.rate, fairness.bucket)
        self._inflight[name] = inflight + 1
        try:
            yield
        finally:
            left = self._inflight[name] - 1
            if left:
                self._inflight[name] = left
            else:
                del self._inflight[name]

    def _take(self, name: str, rate: float, size: int) -> None:
        now = self._clock()
        bucket = self._buckets.get(name)
        if bucket is None:
            bucket = self._buckets[name] = _Bucket(tokens=float(size), updated=now)
        bucket.tokens = min(float(size), bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens < 1.0:
            wait = (1.0 - bucket.tokens) / rate
            raise ThrottledError(
                f"tenant {name!r} opens and loads faster than its rate ({rate:g} per "
                f"second, burst {size}); try again in {wait:.2f} s",
                wait,
            )
        bucket.tokens -= 1.0


def _bounds(quota: Quota) -> bool:
    return (quota.children, quota.memory_bytes, quota.cpu_percent) != (None, None, None)


def _check_quota(tenant: Tenant, name: str, requested: int, used: int, hard: int) -> None:
    if used + requested > hard:
        raise QuotaExceededError.of(tenant.name, name, requested, used, hard)


def retry_after_header(seconds: float) -> str:
    """``Retry-After``'s value for ``seconds``: whole seconds, at least one."""
    return str(max(1, math.ceil(seconds)))
