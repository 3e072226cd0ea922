"""A runner that heals itself (docs/design.md, "Availability", B5).

Theory of operation
-------------------
The engine poisons a supervisor for good (H1): one incarnation that can no longer vouch
for its records refuses new work, and its sessions drain. Healing is the service's, as
PostgreSQL's postmaster restarts its backends and an OTP supervisor restarts a child:

* the HTTP listener outlives every incarnation: Hypercorn serves the :class:`Front`,
  which hands each request to the serving incarnation's app, or, while none serves, to
  the restarting app (:func:`restarting_app`): ``/healthz`` 200, ``/readyz`` 503, the
  session calls 503 ``RunnerRestarting`` with ``Retry-After``, the dashboard and
  ``/metrics`` as always, each saying why;
* the poisoned incarnation is shut down (Z1, Z2: every child stopped and reaped), its
  store closed, and after a back-off (:class:`Healer`: 1 s, doubling to 30 s, back to 1
  s once an incarnation served for 30 s) the runner opens its store again (waiting for
  it to answer), which registers a new epoch in a fleet (F1), recovers what is left
  (V1-V5), and serves;
* restarts are limited as OTP's intensity is: past ``N`` within ``SECONDS``
  (``--restart-limit``) the runner gives up and exits 3, for its service manager to
  restart it or to tell someone. Every restart is logged with its cause and counted
  (``trio_supervisor_restarts_total{cause}``).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import _defaults as defaults
from ..errors import (
    ExecutionError,
    RunnerAccessError,
    RunnerFencedError,
    RunnerRestartingError,
    StateStorageError,
    SupervisorError,
    TerminationUnconfirmedError,
)
from .callers import OPERATORS, bearer_caller
from .calls import CALLS
from .metrics import Metrics
from .openapi import document
from .routes.dashboard import dashboard_page, dashboard_response
from .routes.health import metrics_response
from .sign_in import SignIns
from .tenants_file import Roster
from .wire import problem_body

__all__ = ["Front", "Healer", "cause_of", "restarting_app"]

logger = logging.getLogger(__name__)

FIRST_BACKOFF: Final = defaults.HEAL_FIRST_BACKOFF
LAST_BACKOFF: Final = defaults.HEAL_LAST_BACKOFF
SAY_EVERY: Final = defaults.HEAL_SAY_EVERY
# Exit status of a runner past its restart limit: neither 0 (a clean stop) nor 1 (a
# failed start or a second signal), so that a service manager can tell.
GAVE_UP: Final = 3

_ASGI = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


def cause_of(error: BaseException) -> str:
    """What poisoned an incarnation, in one word: the ``cause`` label of the restarts."""
    if isinstance(error, RunnerFencedError):
        return "fenced"  # its row was not renewed in time, or taken over (B2, F4)
    if isinstance(error, StateStorageError):
        return "store"  # a save failed (H1), a full disk under SQLite included
    if isinstance(error, TerminationUnconfirmedError):
        return "termination"
    if isinstance(error, ExecutionError):
        return "execution"
    return "crash"  # a task of the supervisor's crashed


class Healer:
    """When to restart, and why the runner is not serving meanwhile.

    Args:
        limit: At most this many restarts within these many seconds.
        metrics: Where restarts are counted.

    Attributes:
        why: Why the runner does not serve now (None while an incarnation serves).
    """

    def __init__(self, limit: tuple[int, float], metrics: Metrics) -> None:
        self.limit = limit
        self.why: str | None = "starting"
        self._metrics = metrics
        self._restarts: collections.deque[float] = collections.deque()
        self._backoff = FIRST_BACKOFF
        self._serving_since: float | None = None
        self._said: float | None = None  # when a failed start was last logged

    @property
    def retry_after(self) -> float:
        """Seconds a host may wait before it calls again."""
        return self._backoff

    def serving(self) -> None:
        """An incarnation serves from now on."""
        self.why = None
        self._said = None
        self._serving_since = time.monotonic()
        self._metrics.restarting.set(0)

    def withdrawn(self, error: SupervisorError) -> None:
        """The serving incarnation was poisoned by ``error``; it stops every session
        and reaps every child before the runner restarts."""
        self.why = (
            f"restarting after its supervisor was poisoned ({cause_of(error)}): {error}; "
            "every child of the old incarnation is stopped first"
        )
        self._metrics.restarting.set(1)

    def poisoned(self, error: SupervisorError) -> bool:
        """The serving incarnation was poisoned by ``error``: log and count it; whether
        the runner may restart (False: past its limit, it gives up)."""
        cause = cause_of(error)
        now = time.monotonic()
        if self._serving_since is not None and now - self._serving_since >= LAST_BACKOFF:
            self._backoff = FIRST_BACKOFF  # it was stable: this is no crash loop
        self._serving_since = None
        count, seconds = self.limit
        while self._restarts and now - self._restarts[0] > seconds:
            self._restarts.popleft()
        if len(self._restarts) >= count:
            self.why = f"gave up after {count} restarts within {seconds:g} s; last: {error}"
            logger.critical(
                "the supervisor was poisoned (%s: %s) after %d restarts within %g s "
                "(--restart-limit %d/%g): the runner gives up and exits %d",
                cause,
                error,
                len(self._restarts),
                seconds,
                count,
                seconds,
                GAVE_UP,
            )
            return False
        self._restarts.append(now)
        self._metrics.restarts.labels(cause=cause).inc()
        self._metrics.restarting.set(1)
        self.why = f"restarting after its supervisor was poisoned ({cause}): {error}"
        logger.error(
            "the supervisor was poisoned (%s): %s; every child is stopped and reaped, then "
            "the runner makes a new incarnation in %g s (restart %d of at most %d within "
            "%g s)",
            cause,
            error,
            self._backoff,
            len(self._restarts),
            count,
            seconds,
        )
        return True

    async def pause(self) -> None:
        """Wait out the back-off before the next incarnation, and double it."""
        await trio.sleep(self._backoff)
        self._backoff = min(2 * self._backoff, LAST_BACKOFF)

    def failed_start(self, error: BaseException) -> None:
        """A new incarnation could not start (its store does not answer, or its recovery
        failed): it is tried again, uncounted. Said once per minute at most."""
        self.why = f"restarting: cannot start a new incarnation yet: {error}"
        now = time.monotonic()
        if self._said is None or now - self._said >= SAY_EVERY:
            self._said = now
            logger.warning("%s; trying again until it can", self.why)


class Front:
    """The app Hypercorn serves for the runner's whole life: the serving incarnation's,
    or the restarting app while none serves.

    Args:
        restarting: What answers while no incarnation serves.
    """

    def __init__(self, restarting: Starlette) -> None:
        self._restarting = restarting
        self._serving: Starlette | None = None

    def serve(self, app: Starlette) -> None:
        """Hand every request from now on to ``app``."""
        self._serving = app

    def withdraw(self, why: str) -> None:
        """The serving incarnation stops serving: its event streams end, every request
        from now on gets the restarting app, and a call of its still under way that its
        poisoned supervisor refuses is answered RunnerRestarting with ``why`` (the host
        waits that out, and repeats it of the next incarnation)."""
        app, self._serving = self._serving, None
        if app is not None:
            app.state.restarting = why
            app.state.end_event_streams()

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] == "lifespan":
            # No app of the runner's has a lifespan of its own: the runner's is its.
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        app = self._serving or self._restarting
        await app(scope, receive, send)


def restarting_app(
    healer: Healer,
    *,
    operator_token: str,
    tenants: Roster,
    metrics: Metrics,
    sign_ins: SignIns | None = None,
) -> Starlette:
    """What answers while no incarnation serves (see the module docs).

    Every call of the table is served under its path: a call that needs a token still
    answers 401 without a valid one, so that the restart tells nothing to a stranger.
    ``sign_ins``: the dashboard's sign-ins by code, whose pages keep their sign-in across
    the restart.
    """
    page = dashboard_page()
    operators = operator_token.encode()
    openapi = document()

    def restarting() -> Response:
        detail = healer.why or "restarting"
        return JSONResponse(
            problem_body(503, RunnerRestartingError.code, detail),
            status_code=503,
            media_type="application/problem+json",
            headers={"Retry-After": str(max(1, round(healer.retry_after)))},
        )

    def endpoint(name: str, role: str | None) -> Callable[[Request], Awaitable[Response]]:
        async def answer(request: Request) -> Response:
            if name == "healthz":
                return JSONResponse({"status": "ok"})
            if name == "openapi":
                return JSONResponse(openapi)
            if name == "dashboard":
                return dashboard_response(page)
            if role is not None:
                caller = bearer_caller(request, operators, tenants, sign_ins)
                if caller is None:
                    return JSONResponse(
                        problem_body(401, RunnerAccessError.code, "a valid bearer token is needed"),
                        status_code=401,
                        media_type="application/problem+json",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                if name == "metrics" and caller is OPERATORS:
                    return metrics_response(metrics)
            return restarting()

        return answer

    return Starlette(
        routes=[
            Route(call.path, endpoint(call.name, call.role), methods=[call.method])
            for call in CALLS
        ]
    )


def asgi(app: Front) -> _ASGI:
    """``app`` as Hypercorn's serve types an ASGI app."""
    return app
