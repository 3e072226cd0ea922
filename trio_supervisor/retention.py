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

    __slots__ = ("_by_key", "_last", "_tokens")

    def __init__(self) -> None:
        self._last = 0  # the last stop number given or restored
        self._tokens: dict[str, tuple[int, _K]] = {}  # oldest first
        self._by_key: dict[_K, dict[str, None]] = {}  # oldest first

    def __contains__(self, token: object) -> bool:
        return token in self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def stop(self, token: str, key: _K) -> int:
        """Remember that ``token``'s record (of ``key``) stopped; return its stop number.

        A token that is Stopped already keeps its place and its number.
        """
        known = self._tokens.get(token)
        if known is not None:
            return known[0]
        self.restore(token, key, self._last + 1)
        return self._last

    def restore(self, token: str, key: _K, number: int) -> None:
        """Take in a stop read back from storage; call it in stop order."""
        self._last = max(self._last, number)
        self._tokens[token] = (number, key)
        self._by_key.setdefault(key, {})[token] = None

    def forget(self, token: str) -> None:
        """Forget ``token``'s stop, if it had one."""
        known = self._tokens.pop(token, None)
        if known is None:
            return
        key = known[1]
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
        while len(self._tokens) > retention.stopped_total:
            evicted.append(next(iter(self._tokens)))
            self.forget(evicted[-1])
        return evicted


class RecordIndex:
    """Retained records by token, with O(1) lookups and retention applied on save."""

    __slots__ = ("_high_water", "_records", "_requests", "_stops", "retention")

    def __init__(self, retention: Retention) -> None:
        self.retention = retention
        # In the order they were last saved, oldest first.
        self._records: dict[str, SessionRecord] = {}
        self._requests: dict[tuple[Key, str], str] = {}
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
        token = self._requests.get((key, request_id))
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

    def save(self, record: SessionRecord) -> list[SessionRecord]:
        """Keep ``record`` in place of its token's earlier record, then apply retention.

        Returns:
            The records evicted, oldest first.
        """
        handle = record.handle
        token = handle.token
        self._records.pop(token, None)
        self._records[token] = record
        self._requests[(handle.key, record.request_id)] = token
        self.raise_high_water(handle.key, handle.generation)
        if not isinstance(record, StoppedRecord):
            self._stops.forget(token)  # a no-op but for a caller that un-stops a record
            return []
        if token in self._stops:
            return []
        self._stops.stop(token, handle.key)
        return [self._evict(gone) for gone in self._stops.evict(handle.key, self.retention)]

    def save_all(self, records: Iterable[SessionRecord]) -> list[SessionRecord]:
        """Save several records in order; return every record evicted."""
        evicted: list[SessionRecord] = []
        for record in records:
            evicted.extend(self.save(record))
        return evicted

    def _evict(self, token: str) -> SessionRecord:
        record = self._records.pop(token)
        request = (record.handle.key, record.request_id)
        if self._requests.get(request) == token:
            del self._requests[request]
        return record
