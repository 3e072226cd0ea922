"""The client of the runner service: the supervisor's API, over HTTP.

``connect(url, token=...)`` gives a :class:`RemoteSupervisor` whose methods have the
embedded :class:`~trio_supervisor.Supervisor`'s names, signatures, values and errors (an
error's wire code maps back to its class), so code moves from embedded to remote by
changing one line. :meth:`RemoteSupervisor.session` adds what a host needs on a
network: it opens a session, renews its lease in the background every third of the
lease, and disposes it when the block ends, however it ends. If the lease is lost for
good (expired, stopped, superseded, stale), the block is cancelled and
:class:`SessionLostError` says why.

What the client tries again, and for how long (a refused connection, a call cut off, a
fleet's 421 and lost holder, a store or a runner that did not make the call), is said in
``_transport.py`` and in :func:`connect`'s arguments; what is not mended in time is one
of the package's errors, never an httpx exception.

The client imports only the package's values, errors and codec (and its
background-nursery helper), never the service. Its errors (:class:`SessionLostError`,
:class:`RunnerAccessError`, :class:`ForbiddenError`, :class:`OperatorsOnlyError`) and the
admission's refusals (:class:`QuotaExceededError`, :class:`ThrottledError`,
:class:`RunnerFullError`, each with the ``retry_after`` the runner gave) live in
``trio_supervisor.errors`` with the others, and are re-exported here. The wire it
speaks is docs/service.md, section A.

Example::

    async with connect("http://127.0.0.1:8470", token=token) as runner:
        high = await runner.high_water(key)
        async with runner.session(key, expected_generation=high) as session:
            await session.load(Load(specifier="worker:main"))
            ...  # renewed meanwhile
        print(session.termination.describe())
"""

from __future__ import annotations

from .._extras import needs_extra

with needs_extra("client", "trio_supervisor.client", "httpx"):
    import httpx  # noqa: F401  (checked here, before any module of the client needs it)

from ..errors import ForbiddenError as ForbiddenError
from ..errors import OperatorsOnlyError as OperatorsOnlyError
from ..errors import QuotaExceededError as QuotaExceededError
from ..errors import RunnerAccessError as RunnerAccessError
from ..errors import RunnerDrainingError as RunnerDrainingError
from ..errors import RunnerFullError as RunnerFullError
from ..errors import RunnerLostError as RunnerLostError
from ..errors import RunnerRestartingError as RunnerRestartingError
from ..errors import RunnerUnreachableError as RunnerUnreachableError
from ..errors import SessionLostError as SessionLostError
from ..errors import StoreUnavailableError as StoreUnavailableError
from ..errors import ThrottledError as ThrottledError
from ._api import RemoteSupervisor as RemoteSupervisor
from ._api import connect as connect
from ._session import RemoteSession as RemoteSession

__all__ = [
    "ForbiddenError",
    "OperatorsOnlyError",
    "QuotaExceededError",
    "RemoteSession",
    "RemoteSupervisor",
    "RunnerAccessError",
    "RunnerDrainingError",
    "RunnerFullError",
    "RunnerLostError",
    "RunnerRestartingError",
    "RunnerUnreachableError",
    "SessionLostError",
    "StoreUnavailableError",
    "ThrottledError",
    "connect",
]
