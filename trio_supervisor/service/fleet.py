"""The fleet as the service sees it: which runner this is, which runner holds a session,
and the fleet's runners and sessions for operators (docs/service.md section C).

Theory of operation
-------------------
The engine does the fleet's work (global fencing, superseding, takeover) through its
``FleetStore``. The service only reads that store, in three places:

* **Routing.** A session call whose handle this runner's supervisor does not know
  (it raised ``StaleSession``) asks ``store.owner(token)``. When another runner holds
  the session, the answer is ``421 Misdirected Request``, its problem body naming that
  runner (``owner``) and where it is reached (``location``); the client follows it
  once. When that runner's row has expired (it died, or is cut off), sending the host
  there would only time out: the answer is ``503 HolderLost`` instead, naming the runner,
  when its lease ran out and when the session's takeover is due, with ``Retry-After``
  until then. A session this runner holds (an earlier epoch's, say), or one no runner
  holds, keeps its ``StaleSession``: a token that matches nothing still leaks nothing.
  Operator calls that name a session by key and generation (logs, admin dispose) are
  routed by the fleet's record of it.
* **``GET /v1/runners``**: ``store.runners()``.
* **``GET /v1/sessions``**: ``store.fleet_records()``, each record with its runner.

A runner without a fleet store is a fleet of one: it lists itself (epoch 0, no lease of
its own: ``lease_until`` is the time of the answer), and every record as its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

from .._defaults import takeover_margin
from ..abc import FleetStore
from ..errors import MisdirectedError, RunnerLostError
from ..model import FleetRecord, Key, Phase, RunnerInfo, SessionRecord, StoppedRecord
from .wire import Problem

__all__ = ["MISDIRECTED", "Fleet"]

MISDIRECTED: Final = MisdirectedError.code  # the problem code of a 421


class Fleet:
    """This runner's place in its fleet (a fleet of one without a fleet store).

    Attributes:
        runner_id: This runner's id: the store's member id, or the one it was given.
        store: The fleet's store, or None for a runner on a store of its own.
        advertise: Where hosts and other runners reach this runner; set by the runner
            once it listens, unless it was known before.
        started_at: When this runner started, in seconds since the Unix epoch.
    """

    def __init__(
        self, runner_id: str, *, store: FleetStore | None = None, advertise: str = ""
    ) -> None:
        self.runner_id = store.member if store is not None else runner_id
        self.store = store
        self.advertise = advertise
        self.started_at = time.time()

    async def route(self, token: str) -> None:
        """Refuse with a 421 if another runner of the fleet holds the session of ``token``.

        Called once this runner's supervisor did not know the token; returns when no
        other runner holds it (the caller then answers ``StaleSession``).

        Raises:
            Problem: 421, with ``owner`` and ``location``.
            RunnerLostError: The runner holding it no longer renews its row (503).
            StateStorageError: The store cannot say (a 503: the host retries).
        """
        if self.store is None:
            return
        owner = await self.store.owner(token)
        if owner is None or owner.runner_id == self.runner_id:
            return
        if owner.alive:
            raise misdirected(owner)
        held = await self.store.held(token)
        if held is not None and not isinstance(held.record, StoppedRecord):
            raise lost(owner, held.record.lease)

    async def route_key(self, key: Key, generation: int) -> None:
        """:meth:`route` for a session named by key and generation (operator calls)."""
        if self.store is None:
            return
        for held in reversed(await self.store.fleet_records()):
            handle = held.record.handle
            if handle.key == key and handle.generation == generation:
                await self.route(handle.token)
                return

    async def runners(self, here: Sequence[SessionRecord]) -> Sequence[RunnerInfo]:
        """The fleet's runners; for a fleet of one, this runner (``here``: its records)."""
        if self.store is not None:
            return await self.store.runners()
        unstopped = sum(1 for record in here if record.phase is not Phase.STOPPED)
        return [
            RunnerInfo(
                runner_id=self.runner_id,
                epoch=0,
                advertise=self.advertise,
                started_at=self.started_at,
                lease_until=time.time(),
                alive=True,
                sessions=unstopped,
            )
        ]

    async def records(self, here: Sequence[SessionRecord]) -> Sequence[FleetRecord]:
        """The fleet's retained records, each with its runner, one per session (the last
        saved); for a fleet of one, ``here`` (this runner's records) as its own."""
        if self.store is None:
            return [
                FleetRecord(record=record, runner_id=self.runner_id, epoch=0) for record in here
            ]
        last: dict[str, FleetRecord] = {}
        for held in await self.store.fleet_records():
            last.pop(held.record.handle.token, None)  # kept in the order of its last save
            last[held.record.handle.token] = held
        return list(last.values())


def lost(owner: RunnerInfo, lease: float) -> RunnerLostError:
    """The 503 answered for a session of ``lease`` held by ``owner``, whose row expired:
    the takeover may come once its row is older than the lease and its stop bound (F7).
    ``Retry-After`` reads the database's times against this runner's clock."""
    takeover_at = owner.lease_until + takeover_margin(lease, owner.stop_bound)
    left = takeover_at - time.time()
    where = f" at {owner.advertise}" if owner.advertise else ""
    due = f"in {left:.0f} s" if left >= 0.5 else "now"
    return RunnerLostError(
        f"the session is held by the runner {owner.runner_id!r}{where}, which stopped "
        f"renewing its lease {max(time.time() - owner.lease_until, 0.0):.0f} s ago; its "
        f"sessions are taken over {due}, and then read as stopped (reason Recovery)",
        max(left, 1.0),
        owner=owner.runner_id,
        location=owner.advertise,
        lease_until=owner.lease_until,
        takeover_at=takeover_at,
    )


def misdirected(owner: RunnerInfo) -> Problem:
    """The 421 answered for a session that ``owner`` holds."""
    where = owner.advertise or "an address it did not advertise"
    return Problem(
        421,
        MISDIRECTED,
        f"the session is held by the runner {owner.runner_id!r} at {where}: call it there",
        fields={"owner": owner.runner_id, "location": owner.advertise},
    )
