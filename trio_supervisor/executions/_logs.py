"""The children's logs: one file per session, for exactly as long as its record is retained.

Theory of operation. A session's child writes its output, stdout and stderr, into
``STATE/logs/<key>-<generation>.log`` (``<key>`` a digest of the key's identity and
instance), opened by the runner before the child runs anything. The supervisor tells
the execution what it no longer retains (``abc.Retaining``):

* a record retention evicts: its log is removed, off the event loop, in batches, by a
  task of the execution's (:meth:`Logs.remove_evicted`), within ``LINGER`` seconds; what
  is still queued as the execution ends is removed then;
* once recovery is over, the records it retains: every other log goes
  (:meth:`Logs.keep_only`), those of records evicted while no supervisor ran, or kept by
  a store that held nothing across the restart (a ``MemoryStore``).

So a log is read (``SubprocessExecution.logs``, ``GET /v1/logs``) for every retained
generation of a key, and is gone with its record. A file of the directory that is no
log of ours is never touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import re
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Final

import trio

from .. import _defaults as defaults
from .._background import when_idle
from ..model import Handle
from ..realtime import outside_the_run

__all__ = ["Logs"]

logger = logging.getLogger(__name__)

LOGS: Final = "logs"
_LOG: Final = re.compile(r"[0-9a-f]{16}-[0-9]+\.log")
# How long an evicted record's log may wait for others to be removed with it, and how
# many go at once without waiting longer: under a stream of stops (every stop of a key
# evicts its generation before), one trip to a worker thread for a batch, not one a stop.
LINGER: Final = defaults.LOG_LINGER
BATCH: Final = defaults.LOG_BATCH


class Logs:
    """The logs of one state directory's children.

    Args:
        state_directory: Whose ``logs/`` they are.
    """

    def __init__(self, state_directory: Path) -> None:
        self.directory = state_directory / LOGS
        self._doomed, self._queue = trio.open_memory_channel[Path](math.inf)
        # How many are queued; set once there is one, and once there are BATCH.
        self._queued = 0
        self._some = trio.Event()
        self._enough = trio.Event()

    def path(self, handle: Handle) -> Path:
        """The log file of a session's child."""
        key = f"{handle.key.identity}\0{handle.key.instance}".encode()
        name = hashlib.sha256(key).hexdigest()[:16]
        return self.directory / f"{name}-{handle.generation}.log"

    def read(self, handle: Handle, *, tail: int | None = None) -> str:
        """What a session's child wrote, or its last ``tail`` bytes ("" where it wrote
        nothing, or its log is gone)."""
        try:
            data = self.path(handle).read_bytes()
        except FileNotFoundError:
            return ""
        return data[-tail:].decode(errors="replace") if tail else data.decode(errors="replace")

    def evicted(self, handles: Sequence[Handle]) -> None:
        """Queue the logs of these sessions, whose records retention evicted, for
        removal (:meth:`remove_evicted`). Returns at once."""
        for handle in handles:
            self._doomed.send_nowait(self.path(handle))
        self._queued += len(handles)
        if self._queued:
            self._some.set()
        if self._queued >= BATCH:
            self._enough.set()

    async def remove_evicted(self) -> None:
        """Remove the queued logs in batches, in a worker thread, once the loop is idle:
        a batch once ``BATCH`` are queued or ``LINGER`` seconds after its first was; until
        cancelled (what is queued then is for :meth:`flush`)."""
        while True:
            await self._some.wait()
            with trio.move_on_after(LINGER):
                await self._enough.wait()
            # Shielded: a batch taken is removed (unlinks: a bounded wait), once the
            # loop is idle. What is still queued when this is cancelled is flush()'s.
            with trio.CancelScope(shield=True):
                await when_idle()
                batch = self._take()
                if batch:
                    with outside_the_run():
                        await trio.to_thread.run_sync(_remove, batch)

    def flush(self) -> None:
        """Remove what is queued now, blocking: as the execution ends."""
        _remove(self._take())

    def _take(self) -> list[Path]:
        """Everything queued, taken off the queue."""
        batch = []
        with contextlib.suppress(trio.WouldBlock):
            while True:
                batch.append(self._queue.receive_nowait())
        self._queued = 0
        self._some = trio.Event()
        self._enough = trio.Event()
        return batch

    def keep_only(self, handles: Collection[Handle]) -> int:
        """Remove every log but those of ``handles``; return how many went. Blocking:
        call it in a worker thread."""
        kept = {self.path(handle).name for handle in handles}
        gone = [
            Path(entry.path)
            for entry in os.scandir(self.directory)
            if _LOG.fullmatch(entry.name) and entry.name not in kept
        ]
        _remove(gone)
        return len(gone)


def _remove(paths: Iterable[Path]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as error:  # the state directory is the owner's: say so, go on
            logger.warning("the log %s cannot be removed: %s", path, error)
