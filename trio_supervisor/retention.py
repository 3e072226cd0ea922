"""Retention (docs/design.md, "Persistence and retention") and the index of retained records.

Every record that is not Stopped is kept. Of Stopped records, the newest
``stopped_per_key`` of each key are kept, and no more than ``stopped_total`` in all;
the oldest go first. The generation high-water of every key is kept apart and never
evicted, so a key whose records were all evicted still continues at n + 1.

:class:`StopOrder` is that policy, once: the tokens of Stopped records in the order they
stopped, in all and per key, and which of them a new stop evicts. Both keepers of
records use it, so they cannot disagree on what exists: :class:`RecordIndex`, which
also answers the supervisor's lookups (by token, by key and request id, a key's
high-water) in O(1) and is the memory store's storage, and the SQLite store, which
keeps one beside its table so that a save needs no reads first.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

import attrs

from .model import Key, SessionRecord, StoppedRecord

__all__ = ["RecordIndex", "Retention", "StopOrder"]

_K = TypeVar("_K", bound=Hashable)


def _positive(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"Retention.{attribute.name} must be an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"Retention.{attribute.name} must be >= 1, got {value}")


@attrs.frozen(kw_only=True)
class Retention:
    """How many Stopped records are kept.

    Attributes:
        stopped_per_key: Stopped records kept per key, newest first.
        stopped_total: Stopped records kept in all.
    """

    stopped_per_key: int = attrs.field(default=1, validator=_positive)
    stopped_total: int = attrs.field(default=10_000, validator=_positive)


class StopOrder(Generic[_K]):
    """The tokens of Stopped records in the order they stopped, in all and per key.

    Each stop gets a number, 1, 2, 3, ..., which a store can persist to find the order
    again (:meth:`restore`). Insertion-ordered dictionaries keep the order, so
    remembering, forgetting and evicting a token are O(1).
    """

    __slots__ = ("_by_key", "_keys", "_last", "_numbers")

    def __init__(self) -> None:
        self._last = 0  # the last stop number given or restored
        # A token's number and its key, both oldest first. Two dictionaries, not one of
        # (number, key) pairs: a pair holding a Key is one more object per Stopped record
        # for Python's cyclic collector to visit, which costs more than the look-ups.
        self._numbers: dict[str, int] = {}
        self._keys: dict[str, _K] = {}
        self._by_key: dict[_K, dict[str, None]] = {}  # oldest first

    def __contains__(self, token: object) -> bool:
        return token in self._numbers

    def __len__(self) -> int:
        return len(self._numbers)

    def stop(self, token: str, key: _K) -> int:
        """Remember that ``token``'s record (of ``key``) stopped; return its stop number.

        A token that is Stopped already keeps its place and its number.
        """
        known = self._numbers.get(token)
        if known is not None:
            return known
        self.restore(token, key, self._last + 1)
        return self._last

    def stop_evicting(self, token: str, key: _K, retention: Retention) -> tuple[int, list[str]]:
        """:meth:`stop`, then :meth:`evict`: what every save of a Stopped record does.

        Returns:
            The stop number, and the tokens evicted, oldest first.
        """
        known = self._numbers.get(token)
        if known is not None:
            return known, self.evict(key, retention)
        # stop() and restore() inline, with one look-up of the key: the busiest path of
        # retention, once for every Stopped record the index or a store takes in.
        number = self._last = self._last + 1
        self._numbers[token] = number
        self._keys[token] = key
        of_key = self._by_key.get(key)
        if of_key is None:
            of_key = self._by_key[key] = {}
        of_key[token] = None
        if len(of_key) > retention.stopped_per_key or len(self._numbers) > retention.stopped_total:
            return number, self.evict(key, retention)
        return number, []

    def restore(self, token: str, key: _K, number: int) -> None:
        """Take in a stop read back from storage; call it in stop order."""
        self._last = max(self._last, number)
        self._numbers[token] = number
        self._keys[token] = key
        self._by_key.setdefault(key, {})[token] = None

    def forget(self, token: str) -> None:
        """Forget ``token``'s stop, if it had one."""
        if self._numbers.pop(token, None) is None:
            return
        key = self._keys.pop(token)
        of_key = self._by_key[key]
        del of_key[token]
        if not of_key:
            del self._by_key[key]

    def evict(self, key: _K, retention: Retention) -> list[str]:
        """Forget and return the tokens ``retention`` drops once ``key`` had a stop.

        The oldest of ``key`` beyond ``stopped_per_key`` go first, then the oldest of
        any key beyond ``stopped_total``.
        """
        evicted: list[str] = []
        of_key = self._by_key.get(key, {})
        while len(of_key) > retention.stopped_per_key:
            evicted.append(next(iter(of_key)))
            self.forget(evicted[-1])
        while len(self._numbers) > retention.stopped_total:
            evicted.append(next(iter(self._numbers)))
            self.forget(evicted[-1])
        return evicted


class RecordIndex:
    """Retained records by token, with O(1) lookups and retention applied on save."""

    __slots__ = ("_high_water", "_records", "_requests", "_stops", "retention")

    def __init__(self, retention: Retention) -> None:
        self.retention = retention
        # In the order they were last saved, oldest first.
        self._records: dict[str, SessionRecord] = {}
        # By (identity, instance, request_id): strings alone, so that Python's cyclic
        # collector stops looking at each entry once it has seen it.
        self._requests: dict[tuple[str, str, str], str] = {}
        self._stops: StopOrder[Key] = StopOrder()
        self._high_water: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[SessionRecord]:
        """Every retained record, in the order it was last saved."""
        return iter(list(self._records.values()))

    def get(self, token: str) -> SessionRecord | None:
        """The retained record of a token, if any."""
        return self._records.get(token)

    def find_request(self, key: Key, request_id: str) -> SessionRecord | None:
        """The retained record of ``key`` opened with ``request_id``, if any (O3)."""
        token = self._requests.get((key.identity, key.instance, request_id))
        return None if token is None else self._records[token]

    def high_water(self, key: Key) -> int:
        """The highest generation ever saved for ``key``; 0 if none."""
        return self._high_water.get(key, 0)

    def high_waters(self) -> Mapping[Key, int]:
        """Every key's high-water generation."""
        return dict(self._high_water)

    def raise_high_water(self, key: Key, generation: int) -> None:
        """Take in a high-water mark read from a store."""
        if generation > self._high_water.get(key, 0):
            self._high_water[key] = generation

    def raise_high_waters(self, marks: Mapping[Key, int]) -> None:
        """Take in the high-water marks read from a store."""
        high_water = self._high_water
        for key, generation in marks.items():
            if generation > high_water.get(key, 0):
                high_water[key] = generation

    def save(self, record: SessionRecord) -> list[SessionRecord]:
        """Keep ``record`` in place of its token's earlier record, then apply retention.

        Returns:
            The records evicted, oldest first.
        """
        handle = record.handle
        token = handle.token
        key = handle.key
        records = self._records
        records.pop(token, None)
        records[token] = record
        self._requests[(key.identity, key.instance, record.request_id)] = token
        # raise_high_water() inline: the busiest path of the index.
        generation = handle.generation
        high_water = self._high_water
        if generation > high_water.get(key, 0):
            high_water[key] = generation
        stops = self._stops
        if not isinstance(record, StoppedRecord):
            stops.forget(token)  # a no-op but for a caller that un-stops a record
            return []
        if token in stops:
            return []
        _, gone = stops.stop_evicting(token, key, self.retention)
        return [self._evict(each) for each in gone]

    def save_all(self, records: Iterable[SessionRecord]) -> list[SessionRecord]:
        """Save several records in order; return every record evicted."""
        evicted: list[SessionRecord] = []
        for record in records:
            evicted.extend(self.save(record))
        return evicted

    def _evict(self, token: str) -> SessionRecord:
        record = self._records.pop(token)
        key = record.handle.key
        request = (key.identity, key.instance, record.request_id)
        if self._requests.get(request) == token:
            del self._requests[request]
        return record
