"""One lock per key, held only while somebody uses it (O2).

Opens of one key must run one at a time: each reads the key's high-water, supersedes the
live generation and writes the next (O3-O8). Opens of different keys must not wait for
each other. A lock per key does both; and since a control plane may see millions of
keys, a key's lock exists only while an open holds it or waits for it.

Almost every open finds its key free, so a held key is just an entry in a dictionary;
a queue of waiters (a ``ParkingLot``) is made only for a key somebody has to wait for.
The lock is handed straight to the first waiter on release, so it is fair (first come,
first served) and no newcomer can slip in between.
"""

from __future__ import annotations

import trio

from ..model import Key

__all__ = ["KeyLocks"]


class KeyLocks:
    """A lock per key, made on first use and dropped when its last user leaves."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        # The keys held, each with the tasks waiting for it (None: nobody waits).
        self._held: dict[Key, trio.lowlevel.ParkingLot | None] = {}

    async def acquire(self, key: Key) -> None:
        """Wait for ``key``'s lock and take it.

        Uncontended (the usual case), taking the lock is no schedule point: the
        caller's store write is one.
        """
        held = self._held
        if key not in held:
            held[key] = None
            return
        waiters = held[key]
        if waiters is None:
            waiters = held[key] = trio.lowlevel.ParkingLot()
        # Woken by release, which has handed the lock over already. A waiter cancelled
        # before that leaves the queue and never holds it.
        await waiters.park()

    def release(self, key: Key) -> None:
        """Give ``key``'s lock back: to the first waiter, or to nobody."""
        waiters = self._held[key]
        if waiters is None or not waiters:
            del self._held[key]
        else:
            waiters.unpark()
