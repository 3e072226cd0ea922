"""A store in memory: durable for as long as the process lives."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Self

import trio

from ..model import Key, SessionRecord
from ..retention import RecordIndex, Retention

__all__ = ["MemoryStore"]


class MemoryStore:
    """Records in a dict, with the retention policy of docs/design.md, "Persistence and retention".

    One MemoryStore may serve several supervisors one after the other, which is how
    tests restart a supervisor "on the same storage".

    Args:
        retention: Which Stopped records to keep.
        clock: The wall clock a stop's time is read from, for ``retention.stopped_for``
            (seconds since the Unix epoch); tests give one they move themselves.
    """

    def __init__(
        self, *, retention: Retention | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self._index = RecordIndex(retention or Retention(), clock=clock)

    def copy(self) -> MemoryStore:
        """A new store holding what this one holds now, as a crash would leave it."""
        twin = MemoryStore(retention=self.retention)
        twin._index = self._index.copy()
        return twin

    async def __aenter__(self) -> Self:
        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Nothing to release; the records stay, so the store can be used again.

        Every store is used as ``async with``; this one keeps its records when it is
        left, as a file would, which is how tests restart a supervisor on it.
        """
        await trio.lowlevel.checkpoint()

    @property
    def retention(self) -> Retention:
        """The retention policy this store applies."""
        return self._index.retention

    async def save(self, record: SessionRecord) -> None:
        """Keep ``record``; a cancelled save did nothing.

        Implements :meth:`trio_supervisor.abc.Store.save`.
        """
        # The checkpoint comes first, so a cancellation lands before the write.
        await trio.lowlevel.checkpoint()
        self._index.save(record)

    async def save_many(self, records: Sequence[SessionRecord]) -> None:
        """Keep every record, all at once.

        Implements :meth:`trio_supervisor.abc.BatchStore.save_many`.
        """
        await trio.lowlevel.checkpoint()
        self._index.save_all(records)

    async def list(self) -> Sequence[SessionRecord]:
        """Every retained record, in the order they were last saved.

        Implements :meth:`trio_supervisor.abc.Store.list`.
        """
        await trio.lowlevel.checkpoint()
        return list(self._index)

    async def high_water(self) -> Mapping[Key, int]:
        """Every key's highest generation ever saved.

        Implements :meth:`trio_supervisor.abc.Store.high_water`.
        """
        await trio.lowlevel.checkpoint()
        return self._index.high_waters()
