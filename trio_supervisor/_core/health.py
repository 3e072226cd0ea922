"""Health: whether the supervisor is still trustworthy (H1-H3).

The first failure that poisons the supervisor (a save the store could not make durable,
a crash of one of its background tasks, a child whose exit could not be confirmed) is
*the* poisoning error: open, renew and load raise a copy of it from then on. Later
failures are kept too, so shutdown can report every one of them (Z3).
"""

from __future__ import annotations

import logging

import trio

from ..errors import SupervisorError

__all__ = ["Health"]

# The public name, not the private module's.
logger = logging.getLogger("trio_supervisor.health")


class Health:
    """The poisoned-or-not state of one supervisor.

    Attributes:
        failures: Every failure recorded, the poisoning one first, each once; the
            shutdown reports them all (Z3).
    """

    __slots__ = ("_event", "failures")

    def __init__(self) -> None:
        self._event = trio.Event()
        self.failures: list[SupervisorError] = []

    @property
    def error(self) -> SupervisorError | None:
        """The poisoning error, or None while healthy."""
        return self.failures[0] if self.failures else None

    def poison(self, failure: BaseException) -> SupervisorError:
        """Record a failure; the first one poisons the supervisor.

        A failure that is not a :class:`SupervisorError` (a bug in a background task,
        say) is wrapped in one, so callers always meet the documented errors.

        Returns:
            The failure as it was recorded.
        """
        if isinstance(failure, SupervisorError):
            error = failure
        else:
            error = SupervisorError(f"a background task of the supervisor crashed: {failure!r}")
            error.__cause__ = failure
        if all(error is not known for known in self.failures):
            if not self.failures:
                logger.error(
                    "the supervisor is poisoned: it refuses new work, and drains and reaps "
                    "what runs: %s",
                    error,
                )
            self.failures.append(error)
        self._event.set()
        return error

    def check(self) -> None:
        """Raise a copy of the poisoning error, if there is one (H2)."""
        if self.failures:
            raise self.failures[0].again()

    async def wait_failed(self) -> None:
        """Block until poisoned, then raise the poisoning error (H3)."""
        await self._event.wait()
        raise self.failures[0].again()
