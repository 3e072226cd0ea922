"""The fleet, as a PostgreSQL store's runner takes part in it: an open's wait for the
older generations of its key on other runners (O5 across the fleet, F6), the takeover
of dead runners (F7), and :meth:`~Upkeep.run_member`'s upkeep of this runner's
membership: its row renewed within its local trust, its inbox of supersedes read, dead
runners taken over, its sessions' times published when a listing asks, and the fleet's
notifications heard on a thread of their own.

:class:`Upkeep` is the half of :class:`~trio_supervisor.stores.postgres.PostgresStore`
that does this; the store's face (opening, saves, reads, closing) is the other.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from typing import Any

import trio

from .. import _defaults as defaults
from .. import realtime
from .._defaults import takeover_margin
from ..abc import FleetMember
from ..errors import RunnerFencedError, StateStorageError, TerminationUnconfirmedError
from ..model import Handle, Key
from ..realtime import outside_the_run
from ._jobs import Job, Opening
from ._postgres_connection import Listener, Settings
from ._postgres_records import Older

__all__ = ["Upkeep"]

logger = logging.getLogger("trio_supervisor.stores.postgres")


class Upkeep(Opening):
    """A fleet store's part in the fleet: the waits for other runners, takeovers, and
    :meth:`run_member`.

    The store that inherits it sets the attributes below and answers the stubs.
    """

    _settings: Settings
    _fenced: RunnerFencedError | None  # once run_member found it fenced
    _check_period: float  # how often run_member checks the live keys' high-water
    _heard: trio.Event | None  # set when a stop is notified
    _listening: trio.Event | None  # set once run_member LISTENs
    _times_asked: trio.Event | None  # set when a listing asks for times
    # What the last saves of Opens found superseded on other runners, by token, with the
    # event of the next notified stop as the save began.
    _older_seen: dict[str, tuple[list[Older], trio.Event]]

    @property
    def dsn(self) -> str:
        raise NotImplementedError

    @property
    def member(self) -> str:
        raise NotImplementedError

    @property
    def epoch(self) -> int:
        raise NotImplementedError

    async def _ask(self, kind: str, *args: Any) -> Any:
        raise NotImplementedError

    # A stub the store overrides, never run: its default is no mutant's to change.
    async def _submit(self, job: Job, *, abandonable: bool = False) -> Any:  # pragma: no mutate
        raise NotImplementedError

    async def take_over_dead(self) -> int:
        """Take over every dead runner whose margin passed; how many records that stopped.

        :meth:`run_member` does this periodically; it is public for tools and tests (F7).

        Returns:
            How many records were written Stopped with reason Recovery.
        """
        taken = 0
        for runner, epoch in await self._ask("dead"):
            taken += len(await self._submit(Job("takeover", args=(runner, epoch))))
        return taken

    async def wait_older_stopped(self, handle: Handle) -> None:
        """Return once no record of ``handle.key`` below its generation is unstopped on
        another runner (O5 across the fleet).

        A runner dead past its takeover margin is taken over on the way; a live one gets
        its ``stop_bound`` plus two check periods, counted from when no runner holding an
        older generation than its own is dead (its older generation may be an open that
        waits for that takeover).

        Implements :meth:`trio_supervisor.abc.FleetStore.wait_older_stopped` (F6, F7).

        Raises:
            TerminationUnconfirmedError: A live runner did not stop its older generation
                in time.
        """
        key, generation = handle.key, handle.generation
        deadlines: dict[str, float] = {}  # each live holder's, from when it was first seen
        failed_takeovers = 0
        while True:
            # The event of the next notified stop is taken before the look, so a stop
            # notified while the look runs wakes this wait at once.
            if self._heard is None:
                self._heard = trio.Event()
            heard = self._heard
            seen = self._older_seen.pop(handle.token, None)
            if seen is not None and not seen[1].is_set():
                # Nothing stopped since the save looked: its look is as good as a new one.
                older, heard = seen
            else:
                older = await self._ask("older", key, generation)
            if not older:
                return
            now = time.monotonic()
            dead: dict[str, int] = {}
            # The lowest generation held by a runner whose row expired: a live runner's
            # later generation may itself be an open waiting for that takeover (F6), so
            # its stop bound starts once the takeover is done, never before.
            lost = min((row[2] for row in older if row[5] > 0), default=None)
            for runner, epoch, held, lease, stop_bound, expired_for in older:
                if expired_for > takeover_margin(lease, stop_bound):
                    dead[runner] = epoch
                elif expired_for > 0 or (lost is not None and held > lost):
                    deadlines.pop(runner, None)  # a takeover's margin bounds the wait
                else:
                    bound = stop_bound + 2 * defaults.FLEET_CHECK
                    if now > deadlines.setdefault(runner, now + bound):
                        raise TerminationUnconfirmedError(
                            f"runner {runner} did not stop generation {held} of "
                            f"{key.identity}/{key.instance} within {bound:g} s of generation "
                            f"{generation} being opened"
                        )
            taken = 0
            for runner, epoch in dead.items():
                try:
                    taken += len(await self._submit(Job("takeover", args=(runner, epoch))))
                except StateStorageError as error:
                    # Its row may still be locked by its frozen incarnation, until the
                    # server ends that idle transaction: tried again at the next look.
                    failed_takeovers += 1
                    if failed_takeovers > defaults.TAKEOVER_TRIES:
                        raise
                    logger.warning("%s; trying again", error)
            if taken:
                continue  # look again at once: those records are Stopped now
            with realtime.bounded(defaults.OLDER_POLL):
                await heard.wait()

    async def run_member(self, member: FleetMember) -> None:
        """Keep this runner in the fleet until cancelled (see the module docs).

        Implements :meth:`trio_supervisor.abc.FleetStore.run_member` (F1, F2, F5, F7).

        Raises:
            RunnerFencedError: This runner's row was not renewed within its local trust
                (``runner_lease`` minus a fifth, from when the last renewal was sent), or
                another runner took its records over.
            StateStorageError: The row could not be renewed for another reason.
        """
        await self.open()
        # Read only after _keep raised, which set it: its start value is never read.
        failure: StateStorageError | None = None  # pragma: no mutate
        async with trio.open_nursery() as nursery:
            listening = self._listening = trio.Event()
            nursery.start_soon(self._hear, member, listening)
            nursery.start_soon(self._check, member)
            nursery.start_soon(self._publish_times, member, listening)
            try:
                await self._keep(member)
            except StateStorageError as error:
                failure = error
                if isinstance(error, RunnerFencedError):
                    # No write of this incarnation may land any more (F4): its stops
                    # need not wait for the store to say so, each for its store_wait.
                    self._fenced = error
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _keep(self, member: FleetMember) -> None:
        """Renew this runner's row every third of its lease; raise once it is not trusted.

        A renewal that fails is tried again until the row's local trust ends (B2): a
        blip of the database, or a restart of its server, costs no more than that.
        """
        lease = self._settings.runner_lease
        trust = lease - lease / 5
        trusted_until: float | None = None
        while True:
            sent = time.monotonic()
            # The first renewal gets a whole trust of its own: whether the row was taken
            # over meanwhile, its epoch says.
            until = sent + trust if trusted_until is None else trusted_until
            alive = await self._renew_within(member, until, trust)
            if not alive:
                raise RunnerFencedError(
                    f"{self.dsn}: runner {self.member} lost its row: its epoch {self.epoch} "
                    "was taken over by another runner of the fleet"
                )
            trusted_until = sent + trust
            # The run's clock: under a virtual one, renewals come more often, never late.
            await trio.sleep(max(0.0, sent + lease / 3 - time.monotonic()))

    async def _renew_within(self, member: FleetMember, until: float, trust: float) -> bool:
        """Renew the row, trying again until ``until`` (monotonic); whether it still
        held this epoch. Trust counts from when the first try was sent, so a later try
        that succeeds only shortens it.

        Raises:
            StateStorageError: No try succeeded before ``until``: the runner is fenced.
        """
        failed: StateStorageError | None = None
        # (Whether the loop is entered with exactly no time left cannot be told.)
        while (left := until - time.monotonic()) > 0:  # pragma: no mutate
            with realtime.bounded(left) as scope:
                try:
                    # One short row: the sessions' times are published when asked. Its
                    # wait ends with the trust, as the scope's abandonment of it does
                    # (so its mutants cannot be told apart: left out).
                    alive: bool = await self._submit(
                        Job("renew", args=(member.stop_bound,), wait=left),  # pragma: no mutate
                        abandonable=True,
                    )
                except StateStorageError as error:
                    if failed is None:
                        logger.warning(
                            "%s; trying again for %.1f s, until this runner's row is no "
                            "longer trusted",
                            error,
                            left,
                        )
                    failed = error
                    # The worker tried again already while the store was out of reach;
                    # any other failure is given a moment before the next try (the scope
                    # ends that moment where the trust ends).
                    await trio.sleep(defaults.FLEET_CHECK)
                    continue
            if scope.cancelled_caught:
                break
            if failed is not None:
                logger.info("%s: runner %s renewed its row again", self.dsn, self.member)
            return alive
        fenced = RunnerFencedError(
            f"{self.dsn}: runner {self.member} could not renew its row within {trust:g} s "
            "of the last renewal sent; it may be taken over, so it stops serving"
            + (f" (last failure: {failed.detail})" if failed is not None else "")
        )
        raise fenced from failed

    async def _check(self, member: FleetMember) -> None:
        """The guarantee beneath the notifications, and the takeover of dead runners:
        this runner's inbox of supersedes (one index probe, whatever the number of its
        sessions), at least every third of its shortest lease (F5) and every check
        period."""
        takeover_every = self._settings.runner_lease / 3
        # Equivalent mutants left out below: the first look for dead runners is due at
        # once for any start at or below the monotonic clock (seconds since boot),
        # `failing` is only tested for its truth, a moment equal to the due one cannot
        # be told from one past it, and a warning of "%s" and the error says the error.
        next_takeover = 0.0  # pragma: no mutate
        failing = False  # pragma: no mutate
        while True:
            try:
                if member.live():
                    inbox: dict[Key, int] = await self._ask("inbox")
                    for key, high in inbox.items():
                        member.superseded(key, high)
                if time.monotonic() >= next_takeover:  # pragma: no mutate
                    next_takeover = time.monotonic() + takeover_every
                    await self.take_over_dead()
                failing = False  # pragma: no mutate
            except StateStorageError as error:
                # The renewals decide whether this runner is still a member; a check
                # that failed is tried again (and said once while the store is away).
                if not failing:
                    logger.warning("%s", error)  # pragma: no mutate
                failing = True
            shortest = member.shortest_lease()
            period = self._check_period if shortest is None else shortest / 3
            await trio.sleep(min(self._check_period, period))

    async def _publish_times(self, member: FleetMember, listening: trio.Event) -> None:
        """Publish the member's sessions' times each time a listing asks (requests that
        come while one is published are answered by the next), and once it listens,
        which says it answers such requests."""
        await listening.wait()
        while True:
            asked = self._times_asked = trio.Event()
            try:
                await self._ask("publish_times", dict(member.times()))
            except StateStorageError as error:
                logger.warning("%s", error)  # pragma: no mutate (as in _check)
            await asked.wait()

    async def _hear(self, member: FleetMember, listening: trio.Event) -> None:
        """Listen for notifications, on a thread, and act on them in the run."""
        token = trio.lowlevel.current_trio_token()
        send, receive = trio.open_memory_channel[str](math.inf)

        def offer(payload: str) -> None:  # in the run
            # run_member may have ended meanwhile: the receiving end closes first (its
            # close lets the run go on), then the sending end.
            with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                send.send_nowait(payload)

        def hand(payload: str) -> None:  # on the listener's thread
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(offer, payload)

        def ready() -> None:  # on the listener's thread
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(listening.set)

        listener = Listener(self._settings, hand, ready)
        listener.thread.start()
        try:
            async with receive:
                async for payload in receive:
                    self._heard_of(member, payload)
        finally:
            listener.stopping.set()
            send.close()
            # The thread sees the flag within its poll; nothing of run_member outlives
            # it by more (a hung connection is left to its daemon thread).
            with outside_the_run(), realtime.bounded(4 * Listener.POLL, shield=True):
                await trio.to_thread.run_sync(listener.thread.join, abandon_on_cancel=True)

    def _heard_of(self, member: FleetMember, payload: str) -> None:
        try:
            note = json.loads(payload)
            kind = note["kind"]
            if kind == "times":  # a listing asks every runner: no key
                if self._times_asked is not None:
                    self._times_asked.set()
                return
            key = Key(identity=note["identity"], instance=note["instance"])
            generation = int(note["generation"])
        except (ValueError, KeyError, TypeError) as error:
            logger.warning("%s: a notification no runner sent: %r (%s)", self.dsn, payload, error)
            return
        if kind == "superseded" and note.get("runner") == self.member:
            member.superseded(key, generation)

        elif kind == "stopped" and self._heard is not None:
            self._heard.set()
            # (None would do as well: the next wait or save makes the event it needs.)
            self._heard = trio.Event()  # pragma: no mutate
