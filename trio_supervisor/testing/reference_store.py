"""The reference model's store: what the supervisor had acknowledged, as retention keeps it.

Written from docs/design.md, "Persistence and retention", not from ``retention.py``:

* a save replaces the earlier record of its session, and moves it to the end of the
  save order (recovery walks the records in that order);
* every record that is not Stopped is kept. Each Stopped record joins the stop order
  when it first arrives; then the oldest Stopped records of its key go until
  ``stopped_per_key`` are left, and the oldest in all until ``stopped_total`` are left.
  With ``stopped_for`` (not 0) the key's go only once that old: the machine draws it
  far longer than an example runs by the stores' wall clock, so none does, and a key
  keeps all of its Stopped records, up to the cap in all;
* each key's high-water generation is kept apart and never evicted;
* a save can be refused: once for the session (or key) a rule picks, or every save
  from now on (a broken disk). The machine asks for those faults; the model poisons
  the supervisor when one hits (H1).

**Saves at one instant.** Sessions that stop at the same virtual instant (leases that
run out together, a shutdown stopping everything at once) save their records in
whatever order Trio's scheduler runs them, which the model cannot know. Saves made
inside :meth:`ModelStore.together` share one *instant* number; every other save gets a
new one. The model evicts in its own order, and remembers what it evicted; once the
machine has seen the store, :meth:`ModelStore.resolve` takes the store's choice when it
is one that some order of the saves of each instant gives. The cap per key never
depends on that order: one key's sessions never stop at the same instant. Where nothing was
evicted, the store still shows the order: it lists records in save order, and the model
takes that order for the Stopped records of one instant, since it decides which of them
the cap in all evicts first at a later save.

A record is described by :class:`Durable`, the fields the machine compares: its phase,
whether it names a child, its request id and, once it stops, the phase it came from,
its reason and its whole termination (kind and exit status; the cause is not compared).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TypeAlias

from ..model import Key, Termination

__all__ = ["Durable", "Faults", "ModelStore", "SessionId", "refusing"]

SessionId: TypeAlias = tuple[Key, int]
# When a record was saved: the instant's number, then the save's own number.
Stamp: TypeAlias = tuple[int, int]


def refusing(target: SessionId | Key) -> Callable[[SessionId, str], bool]:
    """A fault: the next save of a session, or the next save of an Open record of a key."""
    if isinstance(target, Key):
        key = target
        return lambda ident, phase: ident[0] == key and phase == "Open"
    return lambda ident, phase: ident == target


@dataclasses.dataclass
class Faults:
    """The save failures the machine asked for. The model's store and the stores of the
    supervisor's runs (:mod:`.incarnation`) each hold one, told the same.

    Attributes:
        broken: Every save fails from now on.
        once: Faults (see :func:`refusing`) that each fail one save, then are used up.
    """

    broken: bool = False
    once: list[Callable[[SessionId, str], bool]] = dataclasses.field(default_factory=list)

    def refuses(self, ident: SessionId, phase: str) -> bool:
        """Whether the next save of ``ident`` in ``phase`` fails (and uses up its fault)."""
        if self.broken:
            return True
        for index, rule in enumerate(self.once):
            if rule(ident, phase):
                del self.once[index]
                return True
        return False


@dataclasses.dataclass(frozen=True)
class Durable:
    """What the store holds for one session (the fields the machine compares)."""

    phase: str
    child: bool
    request_id: str
    previous: str | None = None  # the phase of ``previous``, for Stopping and Stopped
    previous_child: bool | None = None
    reason: str | None = None
    termination: Termination | None = None  # without its cause


@dataclasses.dataclass
class ModelStore:
    """The records, their order, the high-water marks and the faults asked for.

    Args:
        stopped_per_key: The retention of Stopped records per key.
        stopped_total: The retention of Stopped records in all.
        stopped_for: The retention's ``stopped_for``: 0, or longer than the example
            runs, so that every Stopped record is young throughout.
    """

    stopped_per_key: int
    stopped_total: int
    stopped_for: float = 0.0
    records: dict[SessionId, Durable] = dataclasses.field(default_factory=dict)
    high: dict[Key, int] = dataclasses.field(default_factory=dict)
    saved: dict[SessionId, Stamp] = dataclasses.field(default_factory=dict)
    # Sessions whose Stopped record is retained, oldest first in the model's order.
    stopped: dict[SessionId, None] = dataclasses.field(default_factory=dict)
    # What the cap in all evicted since the store was last seen, in case the store
    # ordered the saves of one instant otherwise (see the module's docs).
    evicted: dict[SessionId, tuple[Durable, Stamp]] = dataclasses.field(default_factory=dict)
    saves: int = 0
    instant: int = 0
    joined: int = 0  # depth of together()
    faults: Faults = dataclasses.field(default_factory=Faults)

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """The saves made inside land in an order the model cannot know."""
        self.join()
        try:
            yield
        finally:
            self.leave()

    def join(self) -> None:
        """From now until :meth:`leave`, saves land in an order the model cannot know."""
        if not self.joined:
            self.instant += 1
        self.joined += 1

    def leave(self) -> None:
        self.joined -= 1

    def save(self, ident: SessionId, record: Durable) -> list[SessionId]:
        """Keep ``record`` in place of its session's earlier one and apply retention.

        Returns:
            The sessions whose records retention evicted, oldest first.
        """
        key, generation = ident
        if not self.joined:
            self.instant += 1
        self.saves += 1
        self.records[ident] = record
        self.saved[ident] = (self.instant, self.saves)
        self.high[key] = max(self.high.get(key, 0), generation)
        if record.phase != "Stopped" or ident in self.stopped:
            return []
        self.stopped[ident] = None
        evicted = []
        of_key = [stopped for stopped in self.stopped if stopped[0] == key]
        while not self.stopped_for and len(of_key) > self.stopped_per_key:
            evicted.append(self._evict(of_key.pop(0), certain=True))
        while len(self.stopped) > self.stopped_total:
            evicted.append(self._evict(next(iter(self.stopped)), certain=False))
        return evicted

    def _evict(self, ident: SessionId, *, certain: bool) -> SessionId:
        record = self.records.pop(ident)
        saved = self.saved.pop(ident)
        del self.stopped[ident]
        if not certain:
            self.evicted[ident] = (record, saved)
        return ident

    def resolve(self, kept: Mapping[SessionId, Durable]) -> None:
        """Take the store's order of each instant's saves, as far as it shows.

        Args:
            kept: What the store holds now, in the order it lists it (save order).
        """
        self._resolve_evictions(kept)
        # The Stopped records of one instant that both sides kept: the store lists them
        # in the order they landed, which decides which of them the cap in all evicts
        # first, later. Across instants the model's order is the store's already.
        position = {ident: index for index, ident in enumerate(kept)}
        self.stopped = dict.fromkeys(
            sorted(
                self.stopped,
                key=lambda ident: (self.saved[ident][0], position.get(ident, -1)),
            )
        )

    def _resolve_evictions(self, kept: Mapping[SessionId, Durable]) -> None:
        """Take the store's choice of evictions, if an order of each instant's saves gives it."""
        evicted, self.evicted = self.evicted, {}
        ours = set(self.stopped)
        theirs = {ident for ident, record in kept.items() if record.phase == "Stopped"}
        if not evicted or theirs == ours:
            return
        pool = {ident: self.saved[ident] for ident in ours}
        pool.update((ident, saved) for ident, (_, saved) in evicted.items())
        # Per key only the newest stopped_per_key can be kept, whatever the order (all
        # of them, while they are young).
        eligible: set[SessionId] = set()
        for key in {ident[0] for ident in pool}:
            of_key = sorted((i for i in pool if i[0] == key), key=pool.__getitem__)
            eligible.update(of_key if self.stopped_for else of_key[-self.stopped_per_key :])
        if not theirs <= eligible or len(theirs) != len(ours):
            return
        gone = eligible - theirs
        if max((pool[i][0] for i in gone), default=0) > min(pool[i][0] for i in theirs):
            return  # a record of a later instant went while an older one stayed
        if any(g[0] == k[0] and pool[g] > pool[k] for g in gone for k in theirs):
            return  # one key's sessions stop one after the other, even at one instant
        for ident in ours - theirs:
            self._evict(ident, certain=True)
        for ident in theirs - ours:
            self.records[ident], self.saved[ident] = evicted[ident]
        self.stopped = dict.fromkeys(sorted(theirs, key=self.saved.__getitem__))

    def of_request(self, key: Key, request_id: str) -> SessionId | None:
        """The retained session of ``key`` opened with ``request_id`` (O3), if any."""
        for ident, record in self.records.items():
            if ident[0] == key and record.request_id == request_id:
                return ident
        return None

    def pending_recovery(self) -> list[list[SessionId]]:
        """The sessions whose record is not Stopped, in save order (V2, V3), grouped by
        instant: the store lists the records of one instant in an order of its own."""
        pending = sorted(
            (ident for ident, record in self.records.items() if record.phase != "Stopped"),
            key=self.saved.__getitem__,
        )
        groups: dict[int, list[SessionId]] = {}
        for ident in pending:
            groups.setdefault(self.saved[ident][0], []).append(ident)
        return list(groups.values())
