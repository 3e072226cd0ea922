"""The ledger: what this runner's live sessions take, kept as their records are made durable.

Theory of operation
-------------------
The supervisor calls :meth:`Ledger.note` with every record it makes durable, at once and
in the task that made it durable (:meth:`Supervisor.listen
<trio_supervisor.Supervisor.listen>`), so the ledger never lags behind the records: a
session counts from its Open record until its Stopped record, and its child from its
load's first (Loading) record until then (a Stopping child still holds its memory). The
ledger keeps what each key identity takes, summed, so that what a tenant takes is a sum
over the identities its patterns match: it costs the number of distinct identities, not
of sessions. A live session's count never goes back a phase: a record of it older than
one the ledger has counted changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

import attrs

from ..model import Key, Limits, Phase, SessionRecord, StoppingRecord

__all__ = ["Ledger", "Take", "Usage", "holds_child"]

_CHILD_PHASES: Final = (Phase.LOADING, Phase.LOADED)
_ORDER: Final = {phase: rank for rank, phase in enumerate(Phase)}


@attrs.frozen(kw_only=True)
class Usage:
    """What one tenant (or the runner) holds: the counts a quota bounds, and how many of
    its children have no CPU ceiling (each counts as every core in ``cpu_percent``).

    Attributes:
        sessions: Live (not Stopped) sessions.
        children: Children, from their load's first record until they are Stopped.
        memory_bytes: The children's summed memory ceilings (one without: the
            allocatable memory).
        cpu_percent: The children's summed CPU ceilings, 100 a core (one without: every
            core of the runner's machine), not the CPU they use.
        children_without_cpu_limit: Of those children, the ones without a CPU ceiling.
    """

    sessions: int = 0
    children: int = 0
    memory_bytes: int = 0
    cpu_percent: int = 0
    children_without_cpu_limit: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            sessions=self.sessions + other.sessions,
            children=self.children + other.children,
            memory_bytes=self.memory_bytes + other.memory_bytes,
            cpu_percent=self.cpu_percent + other.cpu_percent,
            children_without_cpu_limit=(
                self.children_without_cpu_limit + other.children_without_cpu_limit
            ),
        )

    def __sub__(self, other: Usage) -> Usage:
        return Usage(
            sessions=self.sessions - other.sessions,
            children=self.children - other.children,
            memory_bytes=self.memory_bytes - other.memory_bytes,
            cpu_percent=self.cpu_percent - other.cpu_percent,
            children_without_cpu_limit=(
                self.children_without_cpu_limit - other.children_without_cpu_limit
            ),
        )


NOTHING: Final = Usage()


def holds_child(record: SessionRecord) -> bool:
    """Whether the session of ``record`` has a child that takes its room: from its load's
    first record until it is Stopped (a Stopping child still holds its memory)."""
    if isinstance(record, StoppingRecord):
        return record.previous.phase in _CHILD_PHASES
    return record.phase in _CHILD_PHASES


@attrs.frozen
class Take:
    """What one live session takes, as its last record says."""

    identity: str
    request: tuple[Key, str]  # its open's key and request id
    rank: int  # its phase's place in the order of phases
    usage: Usage


Weigh = Callable[[Limits], tuple[int, int]]
"""A child's memory and CPU, as counted, for its limits."""


class Ledger:
    """What the live sessions take (see the module's docstring).

    Args:
        weigh: A child's memory and CPU as counted, for its limits (a child without a
            ceiling counts as the most it could take).
    """

    def __init__(self, weigh: Weigh) -> None:
        self._weigh = weigh
        self._takes: dict[str, Take] = {}  # by session token
        self._requests: set[tuple[Key, str]] = set()
        self._by_identity: dict[str, Usage] = {}

    def take(self, record: SessionRecord) -> Usage:
        """What the session of ``record`` takes, as that record says."""
        if record.phase is Phase.STOPPED:
            return NOTHING
        if not holds_child(record):
            return Usage(sessions=1)
        return Usage(sessions=1) + self.child(record.limits)

    def child(self, limits: Limits) -> Usage:
        """What a child with ``limits`` takes, as counted."""
        memory, cpu = self._weigh(limits)
        return Usage(
            children=1,
            memory_bytes=memory,
            cpu_percent=cpu,
            children_without_cpu_limit=int(limits.cpu_percent is None),
        )

    def note(self, record: SessionRecord) -> None:
        """Count ``record``, the last durable one of its session."""
        token = record.handle.token
        rank = _ORDER[record.phase]
        old = self._takes.get(token)
        if old is not None:
            if rank < old.rank:
                return  # an older record of a session the ledger has seen further on
            self._count(old.identity, NOTHING - old.usage)
            self._requests.discard(old.request)
            del self._takes[token]
        if record.phase is Phase.STOPPED:
            return
        key = record.handle.key
        take = Take(key.identity, (key, record.request_id), rank, self.take(record))
        self._takes[token] = take
        self._requests.add(take.request)
        self._count(take.identity, take.usage)

    def _count(self, identity: str, change: Usage) -> None:
        total = self._by_identity.get(identity, NOTHING) + change
        if total.sessions:
            self._by_identity[identity] = total
        else:
            self._by_identity.pop(identity, None)

    def seed(self, records: Iterable[SessionRecord]) -> None:
        """Count ``records`` (the supervisor's live ones when the ledger starts)."""
        for record in records:
            self.note(record)

    def has_child(self, token: str) -> bool:
        """Whether the session of ``token`` has a child counted."""
        take = self._takes.get(token)
        return take is not None and take.usage.children > 0

    def has_request(self, request: tuple[Key, str]) -> bool:
        """Whether the open of ``request`` (a key and a request id) made a live session."""
        return request in self._requests

    def usage(self, uses: Callable[[str], bool] | None) -> Usage:
        """What the sessions of the identities ``uses`` says yes to take (all: None)."""
        total = NOTHING
        for identity, usage in self._by_identity.items():
            if uses is None or uses(identity):
                total += usage
        return total
