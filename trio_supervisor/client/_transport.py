"""How a call reaches a runner, and keeps trying: connections retried with backoff
within the client's windows, a fleet's 421 followed to the session's holder (and the
holder remembered), and what a runner answers for a call it did not make waited out.

A connection the runner does not take is tried again for any call within ``connect``'s
``connect_for`` (nothing was sent); a call cut off once sent is retried only when it is
safe to repeat (open by request id, renew, status, dispose, high-water): a session's own
renewals within its lease, other calls within ``retry_for``. What is not mended in time
is one :class:`RunnerUnreachableError` naming the URL, never an httpx exception. In a
fleet, a 421 is followed once and the session's holder remembered; a lost holder
(``HolderLost``) is waited out within ``retry_for``, then raised as
:class:`RunnerLostError` (docs/service.md section C).

A runner whose store did not answer (``StoreUnavailable``: the call wrote nothing) and
a runner making a new incarnation of itself (``RunnerRestarting``: the call was refused
before it began) are waited out too, for any call, a load too (nothing of it was made,
and a load is idempotent by specifier, L2): the call is asked again as the answer's
``Retry-After`` says, at most every two seconds and never past its window (for a
session's own renewals, what is left of its lease). What is not mended in time is the
runner's last answer, :class:`StoreUnavailableError` or :class:`RunnerRestartingError`,
whose detail names the runner's URL, how long the client waited and the runner's cause
(docs/service.md section E). A runner that stops taking connections meanwhile (its
process restarted by its service manager) is still one :class:`RunnerUnreachableError`,
with a note of what it answered before.

Beneath it is httpx's client (and, for tests, any httpx transport); above it, the API's
calls (``_api.py``), which say only which call, with what, and how long it may retry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import trio

from .._defaults import (
    CLIENT_CONNECT_FOR,
    CLIENT_FIRST_BACKOFF,
    CLIENT_MAX_BACKOFF,
    CLIENT_MAX_HOLDERS,
    CLIENT_RETRY_AFTER,
    CLIENT_RETRY_FOR,
)
from ..errors import (
    MisdirectedError,
    RunnerLostError,
    RunnerRestartingError,
    RunnerUnreachableError,
    StoreUnavailableError,
)
from ._problems import (
    Unavailable,
    error_of,
    misdirection,
    note_before,
    refused_by_tls,
    still_unavailable,
    unreachable,
)


class Transport:
    """The calls' way to a runner of the client's URL, and to the fleet's other runners.

    Attributes:
        retry_for: The window of a call made without one of its own (seconds).
        connect_for: How long a refused connection is tried again (seconds).
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        retry_for: float = CLIENT_RETRY_FOR,
        connect_for: float = CLIENT_CONNECT_FOR,
    ) -> None:
        self._client = client
        self.retry_for = retry_for
        self.connect_for = connect_for
        # Where each session called lately lives, when another runner of the fleet holds
        # it than the one at the client's URL: token -> that runner's URL.
        self._holders: dict[str, str] = {}

    @property
    def url(self) -> str:
        """The URL of the runner the client was given."""
        return str(self._client.base_url).rstrip("/")

    def forget(self, token: str) -> None:
        """Forget where ``token``'s session lives (it stopped: no call need find it)."""
        self._holders.pop(token, None)

    async def exchange(
        self, method: str, path: str, retry_for: float | None, token: str | None, **request: Any
    ) -> httpx.Response:
        """The 200 answer of ``method path`` for the session of ``token`` (or none).

        In a fleet the session's holder answers (docs/service.md section C). A 421 names
        it: the call goes there, once, and the client remembers where the session lives,
        so its next calls go there at once (behind a balancer, one round trip). When the
        holder does not take the connection, the call goes back to where it came from:
        the fleet answers ``HolderLost`` once the holder's row has expired.

        What the runner answers for a call it did not make is waited out within the
        call's window (``retry_for``, else the client's), whatever the call: a lost holder
        (``HolderLost``), a store that did not answer (``StoreUnavailable``: nothing was
        written) and a runner making a new incarnation of itself (``RunnerRestarting``).
        The call is asked again after the answer's ``Retry-After`` (``CLIENT_RETRY_AFTER``
        without one), at most every ``CLIENT_MAX_BACKOFF`` seconds, and never past the
        window: a wait that would end past it raises the last answer at once.

        Raises:
            RunnerLostError: The holder stayed lost for the whole window; says when the
                takeover is due.
            StoreUnavailableError: The runner's store did not answer for the whole
                window; the detail names the runner's URL, the wait and its cause.
            RunnerRestartingError: The runner was restarting for the whole window; the
                detail names its URL, the wait and why it restarts.
            RunnerUnreachableError: This runner, or the holder it named, did not answer
                (also after it answered one of the above: a note says so).
            MisdirectedError: A 421 that cannot be followed (see :meth:`_follow`).
            SupervisorError: Any other problem the runner answered, as its class.
        """
        window = self.retry_for if retry_for is None else retry_for
        started = trio.current_time()
        deadline = started + window
        backoff = CLIENT_FIRST_BACKOFF
        # The runner's last answer that it did not make the call, and who answered it.
        unavailable: tuple[Unavailable, str] | None = None
        while True:
            holder = self._holders.get(token, "") if token else ""
            try:
                response = await self.send(method, holder, path, retry_for, **request)
            except RunnerUnreachableError as failed:
                if not holder:
                    note_before(failed, unavailable)
                    raise
                self._holders.pop(token or "", None)
                continue  # the holder known is gone: ask where the call came from
            if holder and response.status_code == 421:
                self._holders.pop(token or "", None)
                continue  # it holds the session no more: ask where the call came from
            if response.status_code == 421:
                try:
                    response = await self._follow(
                        response,
                        lambda location: self.send(method, location, path, retry_for, **request),
                        token,
                    )
                except RunnerUnreachableError as failed:
                    # Named, and not answering: until the fleet tells it lost (its row
                    # expires), ask again where the call came from.
                    if trio.current_time() + backoff >= deadline:
                        note_before(failed, unavailable)
                        raise
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, CLIENT_MAX_BACKOFF)
                    continue
            if response.status_code == 200:
                return response
            error = error_of(response)
            if not isinstance(
                error, RunnerLostError | StoreUnavailableError | RunnerRestartingError
            ):
                raise error
            if isinstance(error, RunnerLostError):
                if token:
                    self._holders.pop(token, None)
            else:
                unavailable = error, _runner_of(response, path)
            wait = min(error.retry_after or CLIENT_RETRY_AFTER, CLIENT_MAX_BACKOFF)
            if trio.current_time() + wait < deadline:
                await trio.sleep(wait)
                continue
            if isinstance(error, RunnerLostError):
                raise error
            raise still_unavailable(
                error, _runner_of(response, path), trio.current_time() - started, window
            )

    async def send(
        self, method: str, where: str, path: str, retry_for: float | None, **request: Any
    ) -> httpx.Response:
        """``method path`` at the runner at ``where`` ("": the client's), its connection
        retried with backoff: a refused one (nothing was sent) within ``connect_for``, any
        other within ``retry_for`` (None: never). Another runner (``where``: a session's
        holder) gets one try at a connection: where the call came from knows better.

        Raises:
            RunnerUnreachableError: No answer within those windows, or a TLS handshake
                that failed (no retry mends that); the transport's error is its cause.
        """
        started = trio.current_time()
        backoff = CLIENT_FIRST_BACKOFF
        while True:
            try:
                outgoing = self._client.build_request(method, where + path, **request)
                if isinstance(outgoing.stream, httpx.ByteStream):
                    outgoing.stream = _Body(outgoing.content)
                return await self._client.send(outgoing)
            except httpx.TransportError as error:
                unsent = isinstance(error, httpx.ConnectError | httpx.ConnectTimeout)
                if unsent:
                    window: float | None = 0.0 if where else self.connect_for
                else:
                    window = retry_for
                elapsed = trio.current_time() - started
                if window is None or elapsed >= window or refused_by_tls(error):
                    raise unreachable(where or self.url, error, elapsed) from error
                await trio.sleep(min(backoff, window - elapsed))  # the last try at its end
                backoff = min(backoff * 2, CLIENT_MAX_BACKOFF)

    async def _follow(
        self,
        misdirected: httpx.Response,
        again: Callable[[str], Awaitable[httpx.Response]],
        token: str | None,
    ) -> httpx.Response:
        """The answer of the runner a 421 names: ``again`` at its URL, once; that URL is
        remembered as the holder of ``token``'s session when it answers as the holder.

        Raises:
            MisdirectedError: The 421 named no URL, or the runner it named answered 421
                too (the detail names both runners).
            RunnerUnreachableError: The runner named did not answer.
        """
        here = self.url
        owner, location = misdirection(misdirected)
        if not location:
            raise MisdirectedError(
                f"the runner at {here} says the runner {owner!r} holds the session, but not "
                "where it is reached (its --advertise URL)"
            )
        location = location.rstrip("/")
        try:
            answer = await again(location)
        except RunnerUnreachableError as error:
            raise RunnerUnreachableError(
                f"the runner at {here} says the runner {owner!r} at {location} holds the "
                f"session, and it is not answering ({error.detail})",
                url=location,
            ) from error
        if answer.status_code == 421:
            other, elsewhere = misdirection(answer)
            if other == owner:
                raise MisdirectedError(
                    f"the runner at {here} and the one at {location} both say the runner "
                    f"{owner!r} holds the session and is reached at {elsewhere or 'no URL'}, "
                    f"which is not where {owner!r} answers: its --advertise URL is wrong"
                )
            raise MisdirectedError(
                f"the runner at {here} sent the call to the runner {owner!r} at {location}, "
                f"which sent it on to the runner {other!r} at {elsewhere or 'no URL'}: the "
                "runners disagree on who holds the session; followed once only"
            )
        if token and answer.status_code != 503:
            self._remember(token, location)
        return answer

    def _remember(self, token: str, location: str) -> None:
        """Remember where ``token``'s session lives (the oldest forgotten past
        ``CLIENT_MAX_HOLDERS``)."""
        self._holders.pop(token, None)
        self._holders[token] = location
        if len(self._holders) > CLIENT_MAX_HOLDERS:
            del self._holders[next(iter(self._holders))]


def _runner_of(response: httpx.Response, path: str) -> str:
    """The URL of the runner that gave ``response`` to the call of ``path``."""
    url = str(response.request.url.copy_with(query=None))
    return url.removesuffix(path).rstrip("/")


class _Body(httpx.AsyncByteStream):
    """A request's body, sent whole, by an iterator object. httpx's own (``ByteStream``) is
    an async generator, which a send that fails midway leaves unfinished, and Trio then
    warns as it collects it (encode/httpx#3686): a host under load would see a
    ``ResourceWarning`` for each such retry."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _Once(self._data)


class _Once:
    """Iterates over one chunk."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> _Once:
        return self

    async def __anext__(self) -> bytes:
        data, self._data = self._data, None
        if data is None:
            raise StopAsyncIteration
        return data
