"""Retention (docs/design.md, "Persistence and retention") and the index of retained records.

Every record that is not Stopped is kept. Of Stopped records, the newest
``stopped_per_key`` of each key are kept, and no more than ``stopped_total`` in all;
the oldest go first. The generation high-water of every key is kept apart and never
evicted, so a key whose records were all evicted still continues at n + 1.

:class:`RecordIndex` applies that policy on every save and answers the supervisor's
lookups (by token, by key and request id, a key's high-water) in O(1). The memory store
uses it as its storage; the supervisor keeps one as its view of what is durable.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import attrs

from .model import Key, SessionRecord, StoppedRecord

__all__ = ["RecordIndex", "Retention"]


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


class RecordIndex:
    """Retained records by token, with O(1) lookups and retention applied on save."""

    __slots__ = ("_high_water", "_records", "_requests", "_stopped", "_stopped_by_key", "retention")

    def __init__(self, retention: Retention) -> None:
        self.retention = retention
        # In the order they were last saved, oldest first.
        self._records: dict[str, SessionRecord] = {}
        self._requests: dict[tuple[Key, str], str] = {}
        # Tokens of Stopped records in the order they stopped, in all and per key.
        self._stopped: dict[str, None] = {}
        self._stopped_by_key: dict[Key, dict[str, None]] = {}
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
            if token in self._stopped:  # never happens with a well-behaved caller
                self._forget_stopped(token, handle.key)
            return []
        if token in self._stopped:
            return []
        self._stopped[token] = None
        of_key = self._stopped_by_key.setdefault(handle.key, {})
        of_key[token] = None
        evicted: list[SessionRecord] = []
        while len(of_key) > self.retention.stopped_per_key:
            evicted.append(self._evict(next(iter(of_key))))
        while len(self._stopped) > self.retention.stopped_total:
            evicted.append(self._evict(next(iter(self._stopped))))
        return evicted

    def save_all(self, records: Iterable[SessionRecord]) -> list[SessionRecord]:
        """Save several records in order; return every record evicted."""
        evicted: list[SessionRecord] = []
        for record in records:
            evicted.extend(self.save(record))
        return evicted

    def _evict(self, token: str) -> SessionRecord:
        record = self._records.pop(token)
        key = record.handle.key
        self._forget_stopped(token, key)
        if self._requests.get((key, record.request_id)) == token:
            del self._requests[(key, record.request_id)]
        return record

    def _forget_stopped(self, token: str, key: Key) -> None:
        self._stopped.pop(token, None)
        of_key = self._stopped_by_key.get(key)
        if of_key is not None:
            of_key.pop(token, None)
            if not of_key:
                del self._stopped_by_key[key]
