"""One lock per key, held only while somebody uses it (O2).

Opens of one key must run one at a time: each reads the key's high-water, supersedes the
live generation and writes the next (O3-O8). Opens of different keys must not wait for
each other. A lock per key does both; and since a control plane may see millions of
keys, a key's lock exists only while an open holds it or waits for it.
"""

from __future__ import annotations

import trio

from .model import Key

__all__ = ["KeyLocks"]


class KeyLocks:
    """A lock per key, made on first use and dropped when its last user leaves."""

    __slots__ = ("_locks",)

    def __init__(self) -> None:
        # Each key's lock, and how many tasks hold it or wait for it.
        self._locks: dict[Key, tuple[trio.Lock, list[int]]] = {}

    async def acquire(self, key: Key) -> None:
        """Wait for ``key``'s lock and take it."""
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = (trio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            # Uncontended (the usual case), taking the lock is no schedule point: the
            # caller's store write is one.
            lock.acquire_nowait()
        except trio.WouldBlock:
            try:
                await lock.acquire()
            except BaseException:
                self._forget(key, users)
                raise

    def release(self, key: Key) -> None:
        """Give ``key``'s lock back."""
        lock, users = self._locks[key]
        lock.release()
        self._forget(key, users)

    def _forget(self, key: Key, users: list[int]) -> None:
        users[0] -= 1
        if not users[0]:
            del self._locks[key]
