"""The sessions that run in one supervisor: by token, and the unfinished ones by key.

A session is found by its token until its Stopped record is durable (P5), or retention
evicts its record (O10); it stays one of its key's sessions until its stop is over, so
that an open of the key waits for it (O5) and a shutdown stops it (Z2). Usually a key
has one; more while an open supersedes.

An open that saved its record but whose session does not exist yet is counted too
(:meth:`Running.opening`): the shutdown waits for it, and stops its session once it
exists (Z2).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import trio

from ..errors import SupervisorError
from ..model import Handle, Key, Shutdown, Superseded, log_fields
from .session import Session

__all__ = ["Running"]

logger = logging.getLogger("trio_supervisor.supervisor")


class Running:
    """The supervisor's sessions (see the module docs)."""

    __slots__ = ("_by_key", "_by_token", "_opened", "_opening", "closing")

    def __init__(self) -> None:
        self._by_token: dict[str, Session] = {}
        self._by_key: dict[Key, list[Session]] = {}
        # Opens past their last check, whose session does not exist yet.
        self._opening = 0
        self._opened = trio.lowlevel.ParkingLot()
        #: True once the shutdown began (Z1): new work is refused.
        self.closing = False

    def add(self, session: Session) -> None:
        """A session exists: it is found by its token, and is one of its key's."""
        self._by_token[session.handle.token] = session
        of_key = self._by_key.get(session.handle.key)
        if of_key is None:
            self._by_key[session.handle.key] = [session]
        else:
            of_key.append(session)

    def get(self, token: str) -> Session | None:
        """The session of ``token``, while it is found by its token."""
        return self._by_token.get(token)

    def tokens(self) -> Iterator[str]:
        """The tokens of the sessions found by their tokens."""
        return iter(self._by_token)

    def retire(self, token: str) -> None:
        """The session is found by its token no more (its record answers, or is gone)."""
        self._by_token.pop(token, None)

    def ended(self, session: Session) -> None:
        """The session's stop is over: it is no longer one of its key's sessions."""
        key = session.handle.key
        of_key = self._by_key.get(key)
        if of_key is not None and session in of_key:
            if len(of_key) == 1:
                del self._by_key[key]
            else:
                of_key.remove(session)

    def of_key(self, key: Key) -> list[Session]:
        """The unfinished sessions of ``key`` (a copy)."""
        return list(self._by_key.get(key, ()))

    def unfinished(self) -> list[Session]:
        """Every unfinished session."""
        return [session for of_key in self._by_key.values() for session in of_key]

    def __bool__(self) -> bool:
        """Whether any session is unfinished."""
        return bool(self._by_key)

    def live(self) -> dict[Key, int]:
        """The lowest generation of every key with an unfinished session."""
        return {
            key: min(session.handle.generation for session in of_key)
            for key, of_key in self._by_key.items()
        }

    def shortest_lease(self) -> float | None:
        """The shortest lease of the unfinished sessions, in seconds; None if none is."""
        return min(
            (
                session.lifecycle.record.lease
                for of_key in self._by_key.values()
                for session in of_key
            ),
            default=None,
        )

    def times(self, handle: Handle) -> tuple[float, float] | None:
        """How long ``handle``'s session has existed and how long its lease has left, in
        seconds; None once it is found by its token no more."""
        session = self._by_token.get(handle.token)
        if session is None or session.handle != handle:
            return None
        now = trio.current_time()
        return now - session.opened_at, session.lifecycle.remaining(now)

    def all_times(self) -> dict[str, tuple[float, float]]:
        """:meth:`times` of every session found by its token, by token."""
        now = trio.current_time()
        return {
            token: (now - session.opened_at, session.lifecycle.remaining(now))
            for token, session in self._by_token.items()
        }

    # -- stopping ---------------------------------------------------------------------

    async def supersede(self, key: Key) -> None:
        """Stop every unfinished session of ``key`` and wait for their ends (O5)."""
        for session in self.of_key(key):
            generation = session.handle.generation
            where = f"the superseded generation {generation} of {key.identity}/{key.instance}"
            try:
                termination = await session.stop(Superseded())
            except SupervisorError as error:
                logger.warning(
                    "%s did not terminate cleanly: %s",
                    where,
                    error,
                    extra=log_fields(key, generation),
                )
            else:
                if termination.cause:
                    logger.warning(
                        "terminating %s had problems: %s",
                        where,
                        "; ".join(f"{fault.type}: {fault.message}" for fault in termination.cause),
                        extra=log_fields(key, generation),
                    )

    def stop_below(self, key: Key, high_water: int) -> None:
        """Stop every session of ``key`` below ``high_water``: another runner of the fleet
        opened a later generation (O5, F5)."""
        for session in self.of_key(key):
            if session.handle.generation < high_water:
                logger.info(
                    "generation %d of %s/%s is superseded by generation %d, opened on "
                    "another runner of the fleet",
                    session.handle.generation,
                    key.identity,
                    key.instance,
                    high_water,
                    extra=log_fields(key, session.handle.generation),
                )
                session.stop_soon(Superseded())

    @contextlib.contextmanager
    def opening(self) -> Iterator[None]:
        """Count an open from the save of its record until its session exists."""
        self._opening += 1
        try:
            yield
        finally:
            self._opening -= 1
            if self._opened:
                self._opened.unpark_all()

    async def stop_all(self) -> list[Exception]:
        """Stop every session with reason Shutdown and wait for all (Z2), once
        :attr:`closing`; return what went wrong, each problem on the round its session
        ended in."""
        reported: list[Exception] = []
        while self._by_key or self._opening:
            sessions = self.unfinished()
            if not sessions:
                # An open is saving its record; its session stops as soon as it exists.
                await self._opened.park()
                continue
            for session in sessions:
                session.stop_soon(Shutdown())
            for session in sessions:
                with contextlib.suppress(SupervisorError):
                    await session.outcome.wait()
                if session.outcome.error is not None:
                    reported.append(session.outcome.error)
                reported.extend(session.problems)
        return reported
