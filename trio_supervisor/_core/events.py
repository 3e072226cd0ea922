"""Events: every record the supervisor made durable, for whoever watches.

Theory of operation
-------------------
A watcher (:meth:`Supervisor.watch <trio_supervisor.Supervisor.watch>`) gets each
record once the store acknowledged it, in the order they were made durable. The
supervisor never waits for a watcher: publishing puts the record into each watcher's
bounded buffer and returns. A watcher that falls behind and finds its buffer full loses
what does not fit; it then reads one :class:`Overflow` (after the records it did keep),
and should list the records afresh (``Supervisor.records()``) before it goes on: from
the overflow on, it gets every record again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Final, Self

import attrs
import trio

from .. import _defaults as defaults
from ..model import SessionRecord

__all__ = ["Overflow", "Watch", "Watchers"]

DEFAULT_BUFFER: Final = defaults.WATCH_BUFFER


@attrs.frozen
class Overflow:
    """The watcher fell behind and lost records: list them afresh, then go on.

    Attributes:
        lost: How many records the watcher missed.
    """

    lost: int


class Watch:
    """One watcher's buffer; an async iterator of records and overflows.

    Use it as ``async with supervisor.watch() as events: async for event in events``.
    Made by :meth:`~trio_supervisor.Supervisor.watch`.

    Args:
        watchers: The supervisor's watchers, which this watch joins.
        buffer: How many records it may hold unread before it overflows.

    Raises:
        ValueError: ``buffer`` is not an int >= 1.
    """

    def __init__(self, watchers: Watchers, buffer: int) -> None:
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise ValueError(f"buffer must be an int >= 1, got {buffer!r}")
        self._watchers = watchers
        self._buffer: deque[SessionRecord] = deque()
        self._size = buffer
        self._lost = 0
        self._wakeup = trio.lowlevel.ParkingLot()
        self._closed = False

    def publish(self, record: SessionRecord) -> None:
        """Keep ``record`` if there is room; never blocks (the supervisor calls this).

        Args:
            record: A record the store acknowledged.
        """
        if self._lost or len(self._buffer) >= self._size:
            self._lost += 1
        else:
            self._buffer.append(record)
        self._wakeup.unpark_all()

    async def __aenter__(self) -> Self:
        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await trio.lowlevel.checkpoint()
        self.close()

    def close(self) -> None:
        """Stop watching; an iteration under way ends."""
        self._closed = True
        self._watchers.discard(self)
        self._wakeup.unpark_all()

    def __aiter__(self) -> AsyncIterator[SessionRecord | Overflow]:
        return self

    async def __anext__(self) -> SessionRecord | Overflow:
        while True:
            if self._buffer:
                await trio.lowlevel.checkpoint()
                return self._buffer.popleft()
            if self._lost:
                lost, self._lost = self._lost, 0
                await trio.lowlevel.checkpoint()
                return Overflow(lost=lost)
            if self._closed:
                raise StopAsyncIteration
            await self._wakeup.park()


Listener = Callable[[SessionRecord], None]


class Watchers:
    """The supervisor's watchers, and its listeners (called with each record as it is
    published, in the supervisor's task); publishing to none costs nothing."""

    __slots__ = ("_listeners", "_watches")

    def __init__(self) -> None:
        self._watches: set[Watch] = set()
        self._listeners: list[Listener] = []

    def listen(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every record published from now on; what it returns
        stops that."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def watch(self, buffer: int = DEFAULT_BUFFER) -> Watch:
        watch = Watch(self, buffer)
        self._watches.add(watch)
        return watch

    def discard(self, watch: Watch) -> None:
        self._watches.discard(watch)

    def publish(self, record: SessionRecord) -> None:
        for listener in self._listeners:
            listener(record)
        for watch in self._watches:
            watch.publish(record)

    def close(self) -> None:
        """The supervisor is gone: every watcher's iteration ends once it has read all."""
        for watch in list(self._watches):
            watch.close()
