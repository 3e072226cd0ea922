"""What the supervisor knows to be durable, and its one door to the store.

Persistence is write-ahead: a record is saved before the state it describes is acted on
(O8, L3, L4, P2, P5), and :class:`Records` takes a record into its index only once the
store acknowledged it. So the index is exactly what a restart would find, and every
lookup the supervisor makes (a handle's record, a request id, a key's high-water) is
answered from it in O(1), never from the store.

Everything a store raises is wrapped into a
:class:`~trio_supervisor.errors.StateStorageError` here, whatever the adapter raised
(saves in :meth:`Records._failed`, everything else in :func:`storage_call`); and a save
that fails poisons the supervisor (H1), unless the store says it was out of reach and
wrote nothing (:class:`~trio_supervisor.errors.StoreUnavailableError`, B1): that is
passed on as it is, for the caller to try again or give up.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from ..abc import BatchStore, FleetStore, Store
from ..errors import (
    QuotaExceededError,
    StaleSessionError,
    StateStorageError,
    StoreUnavailableError,
)
from ..model import Key, OpenRecord, QuotaClaim, SessionRecord, StoppedRecord, log_fields
from ..retention import RecordIndex, Retention
from .events import Watchers
from .health import Health

__all__ = ["Records", "storage_call"]

# The public name, not the private module's.
logger = logging.getLogger("trio_supervisor.records")

_T = TypeVar("_T")


async def storage_call(call: Awaitable[_T], failed: str) -> _T:
    """Await a store call; anything but a StateStorageError becomes one.

    Args:
        call: The store's coroutine.
        failed: What went wrong, for the message: ``"the store failed to ..."``.
    """
    try:
        return await call
    except StateStorageError:
        raise
    except Exception as failure:
        raise StateStorageError(f"{failed}: {failure!r}") from failure


class Records:
    """The records a supervisor's store acknowledged, and how to add to them.

    Attributes:
        index: Every retained record, with O(1) lookups, as durable as the store says.
        watchers: Who hears of each record once it is durable (``events.py``).
    """

    __slots__ = ("_health", "_save_many", "_save_within", "_store", "index", "watchers")

    def __init__(self, store: Store, retention: Retention, health: Health) -> None:
        self._store = store
        # Looked up once: a runtime check against a Protocol costs microseconds.
        self._save_many: Callable[[Sequence[SessionRecord]], Awaitable[None]] | None = (
            store.save_many if isinstance(store, BatchStore) else None
        )
        # Only a fleet's store counts quota claims; any other ignores them (a runner
        # alone counts its own sessions: service/admission.py).
        self._save_within: Callable[[SessionRecord, QuotaClaim], Awaitable[None]] | None = (
            store.save_within if isinstance(store, FleetStore) else None
        )
        self._health = health
        self.index = RecordIndex(retention)
        self.watchers = Watchers()

    async def save(
        self, record: SessionRecord, quota: QuotaClaim | None = None
    ) -> list[SessionRecord]:
        """Make ``record`` durable, then take it in (O8, O10, H1).

        Args:
            record: What to save.
            quota: A tenant's quota the record counts against, checked by a fleet's
                store in the transaction that writes it (F9); ignored by other stores.

        Returns:
            The records retention evicted from the index, oldest first.

        Raises:
            StoreUnavailableError: The store was out of reach and wrote nothing (B1);
                nothing is poisoned.
            StateStorageError: The store did not acknowledge it; the supervisor is
                poisoned.
            StaleSessionError: A fleet's store refused an Open record because another
                runner took its generation first (global fencing, docs/service.md
                section C): nothing was written, and nothing is poisoned.
            QuotaExceededError: A fleet's store refused it as over ``quota``: nothing
                was written, and nothing is poisoned.
        """
        # Not through storage_call: this is the busiest await of the supervisor, and
        # one coroutine less is measurable. The failure is handled the same way.
        try:
            if quota is not None and self._save_within is not None:
                await self._save_within(record, quota)
            else:
                await self._store.save(record)
        except (QuotaExceededError, StoreUnavailableError):
            # An answer, not a failure: the store wrote nothing (F9; B1: the caller may
            # try again once the store answers), so nothing is poisoned.
            raise
        except StaleSessionError as stale:
            if isinstance(record, OpenRecord):
                raise
            # Only an Open record claims a generation; any other record refused as
            # stale is a store out of step with this supervisor.
            error = self._failed((record,), StateStorageError(f"the store refused it: {stale}"))
            raise error from stale
        except Exception as failure:
            error = self._failed((record,), failure)
            raise error from error.__cause__
        evicted = self.index.save(record)
        self.watchers.publish(record)
        return evicted

    async def save_together(self, records: Sequence[SessionRecord]) -> list[SessionRecord]:
        """Make ``records`` durable in one transaction where the store can, then take
        them in (a childless stop's Stopping and Stopped: session.py).

        A store without ``save_many`` saves them one after the other, in order.

        Returns:
            The records retention evicted from the index, oldest first.

        Raises:
            StateStorageError: The store did not acknowledge them; the supervisor is
                poisoned.
        """
        try:
            await self._write(records)
        except StoreUnavailableError:
            raise  # nothing written, nothing poisoned (B1)
        except Exception as failure:
            error = self._failed(records, failure)
            raise error from error.__cause__
        evicted = self.index.save_all(records)
        for record in records:
            self.watchers.publish(record)
        return evicted

    def _failed(self, records: Sequence[SessionRecord], failure: Exception) -> StateStorageError:
        """Log a failed save (of one session's records) and poison the supervisor (H1)."""
        if not isinstance(failure, StateStorageError):
            wrapped = StateStorageError(f"the store failed to save a record: {failure!r}")
            wrapped.__cause__ = failure
            failure = wrapped
        handle = records[0].handle
        logger.error(
            "the %s record%s of %s/%s generation %d could not be saved: %s",
            " and ".join(record.phase.value for record in records),
            "s" if len(records) > 1 else "",
            handle.key.identity,
            handle.key.instance,
            handle.generation,
            failure,
            extra=log_fields(handle.key, handle.generation),
        )
        self._health.poison(failure)
        return failure

    async def save_all(self, records: Sequence[SessionRecord]) -> None:
        """Make several records durable (at once, where the store can), then take them in.

        For recovery, which runs before the supervisor is usable: a failure is raised,
        and the supervisor never starts, so nothing is poisoned.
        """
        await storage_call(self._write(records), "the store failed to save recovered records")
        self.index.save_all(records)
        for record in records:
            self.watchers.publish(record)

    def _write(self, records: Sequence[SessionRecord]) -> Awaitable[None]:
        """The store's call that makes several records durable: one where it can."""
        if self._save_many is not None:
            return self._save_many(records)
        return self._save_each(records)

    async def _save_each(self, records: Sequence[SessionRecord]) -> None:
        for record in records:
            await self._store.save(record)

    async def read(self) -> list[SessionRecord]:
        """Read every stored record and high-water mark (V1, V5), for recovery.

        The index takes in the Stopped records and every mark; the records that are not
        Stopped are returned instead, for recovery to settle and write back as Stopped,
        which is when the index takes them in (once each, not once read and again
        saved). Recovery runs before the supervisor is usable, and a supervisor whose
        recovery did not finish never is, so nobody looks at the index meanwhile.

        Returns:
            The records that are not Stopped, in the order they were last saved.
        """
        records = await storage_call(self._store.list(), "the store could not be read")
        marks = await storage_call(self._store.high_water(), "the store could not be read")
        pending: list[SessionRecord] = []
        settled: list[SessionRecord] = []
        for record in records:
            (settled if isinstance(record, StoppedRecord) else pending).append(record)
        self.index.save_all(settled)
        self.index.raise_high_waters(marks)
        return pending

    def high_water(self, key: Key) -> int:
        """The highest generation ever opened for ``key``; 0 if none."""
        return self.index.high_water(key)
