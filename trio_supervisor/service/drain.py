"""A runner's drain: no new work, the sessions it holds run on, then it stops
(docs/service.md section B).

Theory of operation
-------------------
``POST /v1/admin/drain`` (``trio-supervisor drain``), or SIGTERM under
``serve --drain-on-sigterm``, begins it with a deadline. From then on the runner refuses
opens and loads (503 ``RunnerDraining`` with ``Retry-After``: behind a balancer the retry
lands on another runner), and ``/readyz`` answers 503, so that a balancer stops sending it
work. Renew, status and dispose go on as before: the hosts' sessions run until their hosts
dispose them or their leases run out. :meth:`Drain.wait` returns once none is left, or at
the deadline; the runner then stops as on SIGTERM (the rest stop with reason
``Shutdown``, every child reaped) and exits 0. A second drain may bring the deadline
closer, never push it back. In a fleet the runner's row says it drains, for the
fleet's listing (``GET /v1/runners``); the row's next registration clears it.

An open that repeats one this runner answered (its request id: O3) is answered as before:
it creates nothing. An open or load admitted before the drain began is waited for: its
session counts once it exists.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from typing import Final

import trio

from .. import _defaults as defaults
from ..abc import FleetStore
from ..errors import RunnerDrainingError
from ..model import SessionRecord
from .served import ServedSupervisor

__all__ = ["RETRY_DRAINING", "Drain"]

logger = logging.getLogger(__name__)

RETRY_DRAINING: Final = defaults.DRAINING_RETRY_AFTER


class Drain:
    """Whether, and until when, the runner drains.

    Attributes:
        until: When the drain's deadline passes, seconds since the Unix epoch; None
            while the runner does not drain.
    """

    def __init__(self, supervisor: ServedSupervisor, store: FleetStore | None = None) -> None:
        self._supervisor = supervisor
        self._store = store
        self._deadline = math.inf  # on Trio's clock
        self._begun = trio.Event()
        self._wake = trio.Event()  # set by each record saved, and a deadline moved
        self._admitted = 0  # calls under way that make new work
        self.until: float | None = None

    @property
    def draining(self) -> bool:
        return self._begun.is_set()

    async def begin(self, deadline: float) -> float:
        """Drain from now on; its sessions stop in ``deadline`` seconds at the latest
        (sooner if an earlier drain said so). Returns when, in seconds since the Unix
        epoch; the fleet's row says it drains by then.

        Raises:
            StateStorageError: The fleet's row could not be marked (the drain has begun
                all the same: this runner refuses new work).
        """
        now = trio.current_time()
        if now + deadline < self._deadline:
            self._deadline = now + deadline
            self.until = time.time() + deadline
            self._wake.set()
        first = not self._begun.is_set()
        self._begun.set()
        left = len(self._supervisor.live_records())
        logger.info(
            "draining: no new sessions or children; %d session%s left, stopped by %s at the latest",
            left,
            "" if left == 1 else "s",
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.until)),
        )
        if first and self._store is not None:
            await self._store.drain()
        assert self.until is not None
        return self.until

    @contextlib.contextmanager
    def admitted(self, what: str) -> Iterator[None]:
        """The block of a call that makes new work (``what``: sessions, children), unless
        the runner drains; a drain waits for the blocks begun before it.

        Raises:
            RunnerDrainingError: 503, with ``Retry-After``.
        """
        if self._begun.is_set():
            raise RunnerDrainingError(
                f"the runner drains: it takes no new {what}; call another runner of the fleet",
                RETRY_DRAINING,
            )
        self._admitted += 1
        try:
            yield
        finally:
            self._admitted -= 1
            if not self._admitted:
                self._wake.set()

    async def wait(self) -> None:
        """Return once a drain has begun and either no session is left or its deadline
        passed (logged either way)."""
        await self._begun.wait()
        unlisten = self._supervisor.listen(self._heard)
        try:
            # An open admitted before the drain may not have made its session yet.
            while self._admitted or self._supervisor.live_records():
                if trio.current_time() >= self._deadline:
                    left = len(self._supervisor.live_records())
                    logger.info(
                        "drain: the deadline passed; the %d session%s left stop now",
                        left,
                        "" if left == 1 else "s",
                    )
                    return
                # Until a record is saved, the deadline moves or passes: look again then.
                with trio.move_on_at(self._deadline):
                    await self._wake.wait()
                self._wake = trio.Event()
            logger.info("drained: no session is left")
        finally:
            unlisten()

    def _heard(self, record: SessionRecord) -> None:
        self._wake.set()
