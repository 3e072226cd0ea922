"""The store protocol (docs/design.md, "Adapters")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from ..model import Key, SessionRecord
from ..retention import Retention

__all__ = ["BatchStore", "Store"]


@runtime_checkable
class Store(Protocol):
    """Where records are made durable.

    A store keeps, per token, the last record saved; applies its retention policy on
    every save; and keeps each key's high-water generation apart from retention, never
    evicting it.

    ``save`` must be safe to cancel: when its caller is cancelled, either the record is
    durable and ``save`` returns normally (the cancellation is seen at the caller's next
    checkpoint), or ``Cancelled`` is raised and nothing was written. It must return or
    raise in bounded time: the supervisor waits for it while terminating children.
    """

    @property
    def retention(self) -> Retention:
        """The retention policy this store applies."""
        ...

    async def save(self, record: SessionRecord) -> None:
        """Make ``record`` durable, replacing its token's earlier record.

        Raises:
            StateStorageError: The record could not be made durable.
        """
        ...

    async def list(self) -> Sequence[SessionRecord]:
        """Every retained record, in the order they were last saved.

        Raises:
            StateStorageError: The store cannot be read, or holds a record that is
                malformed or of an unknown version (a ``RecordFormatError``).
        """
        ...

    async def high_water(self) -> Mapping[Key, int]:
        """Every key's highest generation ever saved."""
        ...


@runtime_checkable
class BatchStore(Store, Protocol):
    """A store that can make several records durable at once (used by recovery)."""

    async def save_many(self, records: Sequence[SessionRecord]) -> None:
        """Make every record durable, as one atomic write where the store can."""
        ...
