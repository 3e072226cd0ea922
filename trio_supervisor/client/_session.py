"""A session that keeps itself alive: :class:`RemoteSession`, renewed in the background
while its block runs, and disposed when the block ends, however it ends.

:meth:`RemoteSupervisor.session <trio_supervisor.client.RemoteSupervisor.session>` opens
the session and hands it here, with the two calls the keep-alive makes within windows of
its own (what is left of the lease), which the public ``renew`` and ``dispose`` do not
take.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

import httpx
import trio

from .._background import open_background_nursery
from ..abc import SupervisorAPI
from ..errors import (
    LeaseExpiredError,
    SessionLostError,
    SessionStoppedError,
    StaleSessionError,
    SupervisorError,
)
from ..model import CodeIdentity, Handle, Load, SessionRecord, Termination

# A renew that fails with one of these failed for good: the session is gone.
_LOST: Final = (LeaseExpiredError, SessionStoppedError, StaleSessionError)

Renew = Callable[[Handle, float], Awaitable[float]]
"""A renew of the handle's lease, retried within the seconds given; the new lease."""
Dispose = Callable[[Handle, float], Awaitable[Termination]]
"""A dispose of the handle's session, retried within the seconds given."""


class RemoteSession:
    """A session opened by :meth:`RemoteSupervisor.session`, renewed in the background.

    Args:
        runner: The supervisor the session was opened on.
        record: Its Open record.

    Attributes:
        record: The Open record the session began with.
        handle: Its handle.
        termination: How its child ended, once the block disposed it (else None).
        last_error: The last renew that failed without losing the session, if any.
    """

    def __init__(self, runner: SupervisorAPI, record: SessionRecord) -> None:
        self._runner = runner
        self.record = record
        self.handle = record.handle
        self.termination: Termination | None = None
        self.last_error: Exception | None = None

    async def load(self, load: Load) -> CodeIdentity:
        """Load code into the session (L1-L6).

        Args:
            load: What to load.

        Returns:
            What was loaded.

        Raises:
            SessionConflictError, PackageError, ExecutionError: As for
                :meth:`trio_supervisor.abc.SupervisorAPI.load`.
        """
        return await self._runner.load(self.handle, load)

    async def renew(self) -> float:
        """Renew now, besides the background renewal (R1-R6).

        Returns:
            The lease, in seconds.

        Raises:
            LeaseExpiredError, SessionStoppedError, StaleSessionError: As for
                :meth:`trio_supervisor.abc.SupervisorAPI.renew`.
        """
        return await self._runner.renew(self.handle)

    async def status(self) -> SessionRecord:
        """The session's last durable record (S1).

        Returns:
            The record.
        """
        return await self._runner.status(self.handle)


@contextlib.asynccontextmanager
async def kept_alive(
    runner: SupervisorAPI, record: SessionRecord, renew: Renew, dispose: Dispose
) -> AsyncIterator[RemoteSession]:
    """The session ``record`` opened, renewed every third of its lease while the block
    runs, and disposed when it ends (see :meth:`RemoteSupervisor.session`).

    Raises:
        SessionLostError: The session's lease was lost while the block ran.
    """
    session = RemoteSession(runner, record)
    lost: list[SupervisorError] = []
    try:
        async with open_background_nursery() as nursery:
            nursery.start_soon(_keep_alive, session, renew, lost, nursery.cancel_scope)
            try:
                yield session
            finally:
                nursery.cancel_scope.cancel()
    finally:
        # Shielded: the session must not outlive the block, even a cancelled one;
        # bounded: a runner that does not answer within the lease lets it expire.
        with trio.move_on_after(record.lease, shield=True):
            with contextlib.suppress(SupervisorError, httpx.HTTPError):
                session.termination = await dispose(record.handle, record.lease)
    if lost:
        key = record.handle.key
        raise SessionLostError(
            f"the session {key.identity}/{key.instance} generation "
            f"{record.handle.generation} was lost: {lost[0].detail}",
            lost[0],
        ) from lost[0]


async def _keep_alive(
    session: RemoteSession, renew: Renew, lost: list[SupervisorError], body: trio.CancelScope
) -> None:
    lease = session.record.lease
    every = lease / 3
    renewed = trio.current_time()  # the lease runs from about then
    while True:
        await trio.sleep(every)
        try:
            # Retried, and a runner that did not make it (StoreUnavailable,
            # RunnerRestarting) asked again, within what is left of the lease.
            lease = await renew(session.handle, max(renewed + lease - trio.current_time(), 0.0))
        except _LOST as error:
            lost.append(error)
            body.cancel()
            return
        except (SupervisorError, httpx.HTTPError) as error:
            # Not lost yet (a runner closing or restarting, a store or a network that
            # failed for a while): the next period tries again; the runner says when
            # the lease is over.
            session.last_error = error
        else:
            renewed = trio.current_time()
