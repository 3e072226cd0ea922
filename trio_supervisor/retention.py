"""Retention (docs/design.md, "Persistence and retention") and the index of retained records.

Every record that is not Stopped is kept. Of Stopped records, the newest
``stopped_per_key`` of each key are kept, and so is any record of the key that stopped
less than ``stopped_for`` seconds ago; no more than ``stopped_total`` are kept in all,
young or not. The oldest go first, and only a new stop evicts. The generation
high-water of every key is kept apart and never evicted, so a key whose records were
all evicted still continues at n + 1.

:class:`StopOrder` is that policy, once: the tokens of Stopped records in the order they
stopped, in all and per key, and which of them a new stop evicts. Both keepers of
records use it, so they cannot disagree on what exists: :class:`RecordIndex`, which
also answers the supervisor's lookups (by token, by key and request id, a key's
high-water) in O(1) and is the memory store's storage, and the SQLite store, which
keeps one beside its table so that a save needs no reads first.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Final, Generic, TypeVar

import attrs

from . import _defaults as defaults
from . import _fields as fields
from .model import Key, SessionRecord, StoppedRecord

__all__ = ["RecordIndex", "Retention", "StopOrder"]

_K = TypeVar("_K", bound=Hashable)


def _positive(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"Retention.{attribute.name} must be an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"Retention.{attribute.name} must be >= 1, got {value}")


# A duration, finite and not negative (0: no record is kept past the count per key).
_STOPPED_FOR: Final = fields.Seconds(minimum=0.0, inclusive=True)


@attrs.frozen(kw_only=True)
class Retention:
    """How many Stopped records are kept, and for how long (O10).

    Every record that is not Stopped is kept; the store and the supervisor's index apply
    the same policy (docs/design.md, "Persistence and retention").

    Attributes:
        stopped_per_key: Stopped records kept per key, newest first.
        stopped_total: Stopped records kept in all: the cap on storage, which evicts
            the oldest first even if they are younger than ``stopped_for``.
        stopped_for: Seconds a Stopped record is kept after it stopped even beyond
            ``stopped_per_key``, so that a lost runner's records (and what its execution
            keeps of them, its logs) can still be read in that window. A key's records
            kept so go at a later stop of the key once they are this old (only a new
            stop evicts). 0 keeps none past the count per key.

    Raises:
        ValueError: A count is below 1, or ``stopped_for`` is negative or not finite.
    """

    stopped_per_key: int = attrs.field(default=defaults.STOPPED_PER_KEY, validator=_positive)
    stopped_total: int = attrs.field(default=defaults.STOPPED_TOTAL, validator=_positive)
    stopped_for: float = attrs.field(
        default=defaults.STOPPED_FOR, converter=fields.as_float, validator=_STOPPED_FOR
    )


class StopOrder(Generic[_K]):
    """The tokens of Stopped records in the order they stopped, in all and per key.

    Each stop gets a number, 1, 2, 3, ..., which a store can persist to find the order
    again (:meth:`restore`), and the time it happened (seconds since the Unix epoch, by
    the caller's wall clock), which ``stopped_for`` measures from. Insertion-ordered
    dictionaries keep the order, so remembering, forgetting and evicting a token are
    O(1). The times are taken to rise in stop order, so a key's records that are old
    enough to go come before any that are not: a clock set back keeps some a while
    longer, never fewer.
    """

    __slots__ = ("_by_key", "_keys", "_last", "_numbers", "_times")

    def __init__(self) -> None:
        self._last = 0  # the last stop number given or restored
        # A token's number and its key, both oldest first. Two dictionaries, not one of
        # (number, key) pairs: a pair holding a Key is one more object per Stopped record
        # for Python's cyclic collector to visit, which costs more than the look-ups.
        self._numbers: dict[str, int] = {}
        self._keys: dict[str, _K] = {}
        self._times: dict[str, float] = {}  # when each stopped
        self._by_key: dict[_K, dict[str, None]] = {}  # oldest first

    def __contains__(self, token: object) -> bool:
        return token in self._numbers

    def __len__(self) -> int:
        return len(self._numbers)

    def stop(self, token: str, key: _K, at: float = 0.0) -> int:
        """Remember that ``token``'s record (of ``key``) stopped at ``at``; return its
        stop number.

        A token that is Stopped already keeps its place, its number and its time.

        Args:
            token: The record's token.
            key: The record's key.
            at: When it stopped, seconds since the Unix epoch.

        Returns:
            The stop's number.
        """
        known = self._numbers.get(token)
        if known is not None:
            return known
        self.restore(token, key, self._last + 1, at)
        return self._last

    def stop_evicting(
        self, token: str, key: _K, retention: Retention, now: float
    ) -> tuple[int, list[str]]:
        """:meth:`stop` at ``now``, then :meth:`evict` if it is a new stop: what every
        save of a Stopped record does.

        Args:
            token: The record's token.
            key: The record's key.
            retention: The policy to apply.
            now: When it stopped, seconds since the Unix epoch.

        Returns:
            The stop number, and the tokens evicted, oldest first.
        """
        known = self._numbers.get(token)
        if known is not None:
            return known, []  # only a new stop evicts (a young extra may have aged since)
        # stop() and restore() inline, with one look-up of the key: the busiest path of
        # retention, once for every Stopped record the index or a store takes in.
        number = self._last = self._last + 1
        self._numbers[token] = number
        self._keys[token] = key
        self._times[token] = now
        of_key = self._by_key.get(key)
        if of_key is None:
            of_key = self._by_key[key] = {}
        of_key[token] = None
        if len(of_key) > retention.stopped_per_key or len(self._numbers) > retention.stopped_total:
            return number, self.evict(key, retention, now)
        return number, []

    def restore(self, token: str, key: _K, number: int, at: float = 0.0) -> None:
        """Take in a stop read back from storage (its number and time); call it in stop
        order.

        Args:
            token: The record's token.
            key: The record's key.
            number: Its stop number, as :meth:`stop` gave it.
            at: When it stopped, seconds since the Unix epoch.
        """
        self._last = max(self._last, number)
        self._numbers[token] = number
        self._keys[token] = key
        self._times[token] = at
        self._by_key.setdefault(key, {})[token] = None

    def copy(self) -> StopOrder[_K]:
        """A new order holding the same stops, their numbers and times."""
        twin: StopOrder[_K] = StopOrder()
        twin._last = self._last
        twin._numbers = dict(self._numbers)
        twin._keys = dict(self._keys)
        twin._times = dict(self._times)
        twin._by_key = {key: dict(tokens) for key, tokens in self._by_key.items()}
        return twin

    def stopped_at(self, token: str) -> float:
        """When ``token``'s record stopped, as it was told.

        Args:
            token: A token this order holds.

        Returns:
            Seconds since the Unix epoch.

        Raises:
            KeyError: The order holds no stop of ``token``.
        """
        return self._times[token]

    def forget(self, token: str) -> None:
        """Forget ``token``'s stop, if it had one.

        Args:
            token: Any token.
        """
        if self._numbers.pop(token, None) is None:
            return
        del self._times[token]
        key = self._keys.pop(token)
        of_key = self._by_key[key]
        del of_key[token]
        if not of_key:
            del self._by_key[key]

    def evict(self, key: _K, retention: Retention, now: float = 0.0) -> list[str]:
        """Forget and return the tokens ``retention`` drops once ``key`` had a stop at
        ``now``.

        The oldest of ``key`` beyond ``stopped_per_key`` go first, those of them that
        stopped ``stopped_for`` or more before ``now``; then the oldest of any key
        beyond ``stopped_total``, however young.

        Args:
            key: The key that had a stop.
            retention: The policy to apply.
            now: When the stop happened, seconds since the Unix epoch.

        Returns:
            The tokens evicted, oldest first.
        """
        evicted: list[str] = []
        of_key = self._by_key.get(key, {})
        extra = len(of_key) - retention.stopped_per_key
        if extra > 0:
            kept_for = retention.stopped_for
            times = self._times
            for token in itertools.islice(of_key, extra):
                # The times rise in stop order: the first young one ends the old ones.
                if kept_for and now - times[token] < kept_for:
                    break
                evicted.append(token)
            for token in evicted:
                self.forget(token)
        while len(self._numbers) > retention.stopped_total:
            evicted.append(next(iter(self._numbers)))
            self.forget(evicted[-1])
        return evicted


class RecordIndex:
    """Retained records by token, with O(1) lookups and retention applied on save.

    Args:
        retention: The policy applied on every save.
        clock: The wall clock a stop's time is read from (seconds since the Unix epoch),
            which ``retention.stopped_for`` measures against; read only when
            ``stopped_for`` is not 0. A store reads its own clock (PostgreSQL's, the
            database's), so at the edge of the window the two may decide a record's
            fate a moment apart; and a restart gives the records it reads back the
            time they are read, so the index keeps them at least as long as the store.
    """

    __slots__ = ("_clock", "_high_water", "_records", "_requests", "_stops", "retention")

    def __init__(self, retention: Retention, *, clock: Callable[[], float] = time.time) -> None:
        self.retention = retention
        self._clock = clock
        # In the order they were last saved, oldest first.
        self._records: dict[str, SessionRecord] = {}
        # By (identity, instance, request_id): strings alone, so that Python's cyclic
        # collector stops looking at each entry once it has seen it.
        self._requests: dict[tuple[str, str, str], str] = {}
        self._stops: StopOrder[Key] = StopOrder()
        self._high_water: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self._records)

    def copy(self) -> RecordIndex:
        """A new index holding what this one holds: the records, their stops (numbers
        and times) and the marks."""
        twin = RecordIndex(self.retention, clock=self._clock)
        twin._records = dict(self._records)
        twin._requests = dict(self._requests)
        twin._stops = self._stops.copy()
        twin._high_water = dict(self._high_water)
        return twin

    def __iter__(self) -> Iterator[SessionRecord]:
        """Every retained record, in the order it was last saved."""
        return iter(list(self._records.values()))

    def get(self, token: str) -> SessionRecord | None:
        """The retained record of a token, if any.

        Args:
            token: A handle's token.

        Returns:
            The record, or None.
        """
        return self._records.get(token)

    def find_request(self, key: Key, request_id: str) -> SessionRecord | None:
        """The retained record of ``key`` opened with ``request_id``, if any (O3).

        Args:
            key: The key.
            request_id: The open's request id.

        Returns:
            The record, or None.
        """
        token = self._requests.get((key.identity, key.instance, request_id))
        return None if token is None else self._records[token]

    def high_water(self, key: Key) -> int:
        """The highest generation ever saved for ``key``; 0 if none (S2, V5).

        Args:
            key: Any key.

        Returns:
            The generation.
        """
        return self._high_water.get(key, 0)

    def high_waters(self) -> Mapping[Key, int]:
        """Every key's high-water generation."""
        return dict(self._high_water)

    def raise_high_water(self, key: Key, generation: int) -> None:
        """Take in a high-water mark read from a store; a lower one changes nothing.

        Args:
            key: The key.
            generation: Its high-water in the store.
        """
        if generation > self._high_water.get(key, 0):
            self._high_water[key] = generation

    def raise_high_waters(self, marks: Mapping[Key, int]) -> None:
        """Take in the high-water marks read from a store; lower ones change nothing.

        Args:
            marks: Generations by key.
        """
        high_water = self._high_water
        for key, generation in marks.items():
            if generation > high_water.get(key, 0):
                high_water[key] = generation

    def save(self, record: SessionRecord) -> list[SessionRecord]:
        """Keep ``record`` in place of its token's earlier record, then apply retention.

        Args:
            record: The record a store acknowledged.

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
        retention = self.retention
        now = self._clock() if retention.stopped_for else 0.0
        _, gone = stops.stop_evicting(token, key, retention, now)
        return [self._evict(each) for each in gone]

    def save_all(self, records: Iterable[SessionRecord]) -> list[SessionRecord]:
        """Save several records in order; return every record evicted.

        Args:
            records: The records, in the order they were saved.

        Returns:
            The records evicted, oldest first.
        """
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
