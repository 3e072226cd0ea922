"""What a runner reads of its supervisor beside the hosts' calls: every retained record,
the live ones, a repeated open's record, whether a key runs here, one generation's
record, the records as they become durable (``watch``, ``listen``) and a session's
times. The service's operators, admission and metrics read these
(``service/served.py``); none changes anything.
"""

from __future__ import annotations

from collections.abc import Callable

from ..model import Handle, Key, Phase, SessionRecord
from .events import DEFAULT_BUFFER, Watch
from .records import Records
from .running import Running

__all__ = ["OperatorReads"]


class OperatorReads:
    """The reads of :class:`~trio_supervisor.Supervisor` that are not a host's call,
    over its records and its running sessions."""

    _records: Records
    _running: Running

    def records(self) -> list[SessionRecord]:
        """Every retained record, in the order it was last saved: for operators.

        Each record holds its session's handle, token included: the capability to act
        on the session. Show them to whoever may act on every session, and no one else.
        """
        return list(self._records.index)

    def live_records(self) -> list[SessionRecord]:
        """The last durable record of every session whose task runs here (Stopped ones
        included until their task ends): what a runner's admission counts.

        Costs the number of live sessions, not of retained records.
        """
        index = self._records.index
        found = (index.get(token) for token in self._running.tokens())
        return [
            record for record in found if record is not None and record.phase is not Phase.STOPPED
        ]

    def retained_request(self, key: Key, request_id: str) -> SessionRecord | None:
        """The retained record an open of ``key`` with ``request_id`` made here, if any:
        an open repeating it returns that record again (O3).

        Args:
            key: The key.
            request_id: The open's request id.

        Returns:
            The record, or None. Reads no store.
        """
        return self._records.index.find_request(key, request_id)

    def holds_key(self, key: Key) -> bool:
        """Whether a session of ``key`` runs here: an open of the key stops it (O5).

        Args:
            key: Any key.

        Returns:
            True while a session of ``key`` has not ended here.
        """
        return bool(self._running.of_key(key))

    def find(self, key: Key, generation: int) -> SessionRecord | None:
        """The retained record of ``key``'s ``generation``, if any: for operators.

        Live sessions are found at once; a stopped one by a scan of the retained
        records (operator calls are rare; the hosts' calls carry a handle).

        Args:
            key: The session's key.
            generation: The session's generation.

        Returns:
            The record, or None when none is retained here.
        """
        for session in self._running.of_key(key):
            if session.handle.generation == generation:
                record = self._records.index.get(session.handle.token)
                if record is not None:
                    return record
        for record in self._records.index:
            if record.handle.key == key and record.handle.generation == generation:
                return record
        return None

    def watch(self, buffer: int = DEFAULT_BUFFER) -> Watch:
        """Watch every record the supervisor makes durable, from now on.

        ``async with supervisor.watch() as events: async for event in events: ...``
        gives each record once the store acknowledged it. The supervisor never waits
        for a watcher: one that falls behind by more than ``buffer`` records loses the
        rest and reads one :class:`~trio_supervisor.Overflow`; it should then list
        the records afresh (:meth:`records`) and go on. The iteration ends when the
        supervisor shuts down.

        Args:
            buffer: How many records a watcher may fall behind by before it overflows.

        Returns:
            The watch, to use as ``async with``.
        """
        return self._records.watchers.watch(buffer)

    def listen(self, listener: Callable[[SessionRecord], None]) -> Callable[[], None]:
        """Call ``listener`` with every record the supervisor makes durable from now on,
        at once, in the task that made it durable; what it returns stops that.

        For what must count every record without lag (a runner's admission): unlike
        :meth:`watch`, nothing is buffered and nothing is lost. The listener must be
        quick and must not raise or block: the supervisor waits for it.

        Args:
            listener: Called with each record, once the store acknowledged it.

        Returns:
            A function that stops the calls.
        """
        return self._records.watchers.listen(listener)

    def times(self, handle: Handle) -> tuple[float, float] | None:
        """How long the session has existed and how long its lease has left, in seconds.

        For operators. None once the session's task is over (stopped, or found by
        recovery): records carry no times, and leases are not persisted (R6); a fleet's
        store publishes a member's (F2), for the other runners' operators.

        Args:
            handle: The session's handle.

        Returns:
            Its age and its lease left, in seconds, or None.
        """
        return self._running.times(handle)
