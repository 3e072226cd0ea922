"""Session tokens: the random part of a handle (O1), made fast and never twice."""

from __future__ import annotations

import os
import threading
import uuid

__all__ = ["TOKENS", "Tokens"]


class Tokens:
    """Session tokens: random UUIDs (version 4) as ``uuid.uuid4()`` makes them, from the
    operating system's random bytes fetched for 256 at a time. ``uuid4()`` asks for
    each token's 16 bytes alone, and the call gives up the GIL, which a store's worker
    thread then holds until its statement is done: 15% of a SQLite store's cycle was that
    wait (docs/benchmarks.md, issue 51). A process forked since the last fetch fetches
    anew, so no two processes hand out the same token, and supervisors in runs of other
    threads take theirs under a lock."""

    __slots__ = ("_at", "_bytes", "_lock", "_pid")

    BATCH = 256

    def __init__(self) -> None:
        self._bytes = b""
        self._at = 0
        self._pid = 0
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            if self._at >= len(self._bytes) or self._pid != os.getpid():
                self._bytes = os.urandom(16 * self.BATCH)
                self._at = 0
                self._pid = os.getpid()
            at = self._at
            self._at = at + 16
            chosen = self._bytes[at : at + 16]
        return str(uuid.UUID(bytes=chosen, version=4))


#: The process's session tokens, shared by its supervisors.
TOKENS = Tokens()
