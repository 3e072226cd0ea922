"""The client of the runner service: the supervisor's API, over HTTP.

``connect(url, token=...)`` gives a :class:`RemoteSupervisor` whose methods have the
embedded :class:`~trio_supervisor.Supervisor`'s names, signatures, values and errors (an
error's wire code maps back to its class), so code moves from embedded to remote by
changing one line. :meth:`RemoteSupervisor.session` adds what a host needs on a
network: it opens a session, renews its lease in the background every third of the
lease, and disposes it when the block ends, however it ends. If the lease is lost for
good (expired, stopped, superseded, stale), the block is cancelled and
:class:`SessionLostError` says why.

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
session's own renewals, what is left of its lease). What is not mended in time is the runner's
last answer, :class:`StoreUnavailableError` or :class:`RunnerRestartingError`, whose
detail names the runner's URL, how long the client waited and the runner's cause
(docs/service.md section E). A runner that stops taking connections meanwhile (its
process restarted by its service manager) is still one :class:`RunnerUnreachableError`,
with a note of what it answered before.

The client imports only the package's values, errors and codec (and its
background-nursery helper), never the service. Its errors (:class:`SessionLostError`,
:class:`RunnerAccessError`, :class:`ForbiddenError`, :class:`OperatorsOnlyError`) and the
admission's refusals (:class:`QuotaExceededError`, :class:`ThrottledError`,
:class:`RunnerFullError`, each with the ``retry_after`` the runner gave) live in
:mod:`trio_supervisor.errors` with the others, and are re-exported here. The wire it
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

import contextlib
import json
import math
import ssl
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final, Self, TypeVar

import trio

from ._extras import needs_extra

with needs_extra("client", "trio_supervisor.client", "httpx"):
    import httpx

from ._background import open_background_nursery
from ._routes import ROUTES
from .codec import converter
from .errors import (
    BY_CODE,
    REFUSED_AS_INVALID,
    ForbiddenError,
    LeaseExpiredError,
    MisdirectedError,
    OperatorsOnlyError,
    QuotaExceededError,
    RunnerAccessError,
    RunnerDrainingError,
    RunnerFullError,
    RunnerLostError,
    RunnerRestartingError,
    RunnerUnreachableError,
    SessionLostError,
    SessionStoppedError,
    StaleSessionError,
    StoreUnavailableError,
    SupervisorError,
    ThrottledError,
)
from .model import (
    CodeIdentity,
    Handle,
    Key,
    Limits,
    Load,
    RunnerInfo,
    SessionRecord,
    Termination,
)

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

_T = TypeVar("_T")

# A renew that fails with one of these failed for good: the session is gone.
_LOST: Final = (LeaseExpiredError, SessionStoppedError, StaleSessionError)
# A runner answering one of these did nothing of the call, and will answer it later: any
# call is asked again within its window (docs/service.md section E).
_UNAVAILABLE: Final = (StoreUnavailableError, RunnerRestartingError)
FIRST_BACKOFF: Final = 0.05  # seconds before the first retry; doubled each time
MAX_BACKOFF: Final = 2.0
RETRY_FOR: Final = 15.0  # seconds a repeatable call made directly is retried
CONNECT_FOR: Final = 5.0  # seconds a refused connection is tried again, any call
MAX_HOLDERS: Final = 10_000  # sessions whose holder the client remembers


def _error_of(response: httpx.Response) -> Exception:
    """The exception a problem answer stands for."""
    try:
        problem = response.json()
        code, detail = str(problem["code"]), str(problem["detail"])
    except (ValueError, KeyError, TypeError):
        return SupervisorError(f"the runner answered {response.status_code}: {response.text:.200}")
    if response.status_code == 401:
        return RunnerAccessError(detail)
    if response.status_code == 403:
        return (OperatorsOnlyError if problem.get("operators_only") else ForbiddenError)(detail)
    if code in REFUSED_AS_INVALID:
        return ValueError(detail)
    kind = BY_CODE.get(code, SupervisorError)
    error: SupervisorError
    if issubclass(kind, RunnerLostError):
        error = kind(
            detail,
            _retry_after(response),
            owner=str(problem.get("owner", "")),
            location=str(problem.get("location", "")),
            lease_until=_seconds(problem.get("lease_until")),
            takeover_at=_seconds(problem.get("takeover_at")),
        )
    elif issubclass(kind, QuotaExceededError):
        error = kind(
            detail,
            _retry_after(response),
            quota=str(problem.get("quota", "")),
            requested=_number(problem.get("requested")),
            used=_number(problem.get("used")),
            hard=_number(problem.get("hard")),
        )
    elif issubclass(
        kind,
        ThrottledError
        | RunnerFullError
        | RunnerDrainingError
        | StoreUnavailableError
        | RunnerRestartingError,
    ):
        error = kind(detail, _retry_after(response))
    else:
        error = kind(detail)
    notes = problem.get("notes")
    if isinstance(notes, list):
        for note in notes:
            error.add_note(str(note))
    return error


def _retry_after(response: httpx.Response) -> float | None:
    """The seconds of the answer's ``Retry-After``, if it gives a number of them."""
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def _number(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _seconds(value: object) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _unreachable(url: str, error: httpx.TransportError, elapsed: float) -> RunnerUnreachableError:
    """The client's error for a runner at ``url`` that did not answer for ``elapsed`` s."""
    why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    if _refused_by_tls(error):
        what = "refused the TLS handshake"
    elif isinstance(error, httpx.ConnectError | httpx.ConnectTimeout):
        what = "is not answering" + (f" (tried for {elapsed:.1f} s)" if elapsed >= 0.1 else "")
    else:
        what = "stopped answering the call"
    return RunnerUnreachableError(f"the runner at {url} {what}: {why}", url=url)


def _still_unavailable(
    error: StoreUnavailableError | RunnerRestartingError, url: str, waited: float, window: float
) -> StoreUnavailableError | RunnerRestartingError:
    """The error raised for a runner at ``url`` that answered ``error`` until the call's
    ``window`` ended, ``waited`` s after it began: of the same class, its detail naming
    the runner, the wait and the runner's cause."""
    what = (
        "could not reach its store" if isinstance(error, StoreUnavailableError) else "is restarting"
    )
    if waited >= 0.1:
        how_long = f"waited {waited:.1f} s of the call's {window:g} s window"
    else:
        how_long = f"not waited: the call's window is {window:g} s"
    again = type(error)(
        f"the runner at {url} {what} ({how_long}; the call changed nothing): {error.detail}"
    )
    again.retry_after = error.retry_after
    for note in getattr(error, "__notes__", ()):
        again.add_note(note)
    return again


def _note_before(
    error: RunnerUnreachableError,
    unavailable: tuple[StoreUnavailableError | RunnerRestartingError, str] | None,
) -> None:
    """Note on ``error`` what a runner answered the call before it stopped answering."""
    if unavailable is not None:
        answer, url = unavailable
        error.add_note(f"before, the runner at {url} answered {answer.code}: {answer.detail}")


def _runner_of(response: httpx.Response, path: str) -> str:
    """The URL of the runner that gave ``response`` to the call of ``path``."""
    url = str(response.request.url.copy_with(query=None))
    return url.removesuffix(path).rstrip("/")


def _misdirection(response: httpx.Response) -> tuple[str, str]:
    """The runner a 421 names, and its URL ("" when it names none)."""
    try:
        problem = response.json()
        return str(problem.get("owner", "")), str(problem.get("location", ""))
    except (ValueError, AttributeError):
        return "", ""


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


def _refused_by_tls(error: BaseException) -> bool:
    """Whether a failed connection failed in the TLS handshake (no retry mends that)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ssl.SSLError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _check(value: object, kind: type, name: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, not {type(value).__name__}")


class RemoteSupervisor:
    """A runner's supervisor, reached over HTTP. Made by :func:`connect`.

    It satisfies :class:`trio_supervisor.abc.SupervisorAPI`: ``open``, ``renew``,
    ``load``, ``dispose``, ``status`` and ``high_water`` take and return what the
    embedded supervisor's do, and raise the same error classes.

    Each call waits out, within ``retry_for``, what the runner answers for a call it did
    not make: ``HolderLost`` (raised as :class:`RunnerLostError`), ``StoreUnavailable``
    and ``RunnerRestarting`` (raised as :class:`StoreUnavailableError` and
    :class:`RunnerRestartingError`, naming the runner's URL, the wait and the cause).
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        retry_for: float = RETRY_FOR,
        connect_for: float = CONNECT_FOR,
    ) -> None:
        self._client = client
        self._retry_for = retry_for
        self._connect_for = connect_for
        # Where each session called lately lives, when another runner of the fleet holds
        # it than the one at the client's URL: token -> that runner's URL.
        self._holders: dict[str, str] = {}

    async def aclose(self) -> None:
        """Close the connections."""
        await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- the calls -----------------------------------------------------------------------

    async def _call(
        self,
        name: str,
        body: Mapping[str, Any],
        *,
        retry_for: float | None = None,
        token: str | None = None,
    ) -> Any:
        """The call ``name`` (``_routes.ROUTES``) with ``body``; the answer's JSON, or the
        error it stands for (see :meth:`_exchange`).

        Args:
            retry_for: Seconds within which a failed call that is safe to repeat is
                retried; None: only what the runner did not make (a refused connection,
                a lost holder, a store that did not answer, a runner restarting) is
                tried again, within the client's windows.
            token: The token of the session the call names, if it names one.
        """
        method, path = ROUTES[name]
        response = await self._exchange(method, path, retry_for, token, json=body)
        return response.json()

    async def _get(self, name: str, **params: Any) -> httpx.Response:
        """The call ``name`` with its query ``params`` (None: left out)."""
        method, path = ROUTES[name]
        query = {key: value for key, value in params.items() if value is not None}
        return await self._exchange(method, path, self._retry_for, None, params=query)

    async def _exchange(
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
        The call is asked again after the answer's ``Retry-After`` (one second without
        one), at most every two seconds, and never past the window: a wait that would end
        past it raises the last answer at once.

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
        window = self._retry_for if retry_for is None else retry_for
        started = trio.current_time()
        deadline = started + window
        backoff = FIRST_BACKOFF
        # The runner's last answer that it did not make the call, and who answered it.
        unavailable: tuple[StoreUnavailableError | RunnerRestartingError, str] | None = None
        while True:
            holder = self._holders.get(token, "") if token else ""
            try:
                response = await self._send(method, holder, path, retry_for, **request)
            except RunnerUnreachableError as unreachable:
                if not holder:
                    _note_before(unreachable, unavailable)
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
                        lambda location: self._send(method, location, path, retry_for, **request),
                        token,
                    )
                except RunnerUnreachableError as unreachable:
                    # Named, and not answering: until the fleet tells it lost (its row
                    # expires), ask again where the call came from.
                    if trio.current_time() + backoff >= deadline:
                        _note_before(unreachable, unavailable)
                        raise
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF)
                    continue
            if response.status_code == 200:
                return response
            error = _error_of(response)
            if not isinstance(
                error, RunnerLostError | StoreUnavailableError | RunnerRestartingError
            ):
                raise error
            if isinstance(error, RunnerLostError):
                if token:
                    self._holders.pop(token, None)
            else:
                unavailable = error, _runner_of(response, path)
            wait = min(error.retry_after or 1.0, MAX_BACKOFF)
            if trio.current_time() + wait < deadline:
                await trio.sleep(wait)
                continue
            if isinstance(error, RunnerLostError):
                raise error
            raise _still_unavailable(
                error, _runner_of(response, path), trio.current_time() - started, window
            )

    async def _send(
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
        backoff = FIRST_BACKOFF
        while True:
            try:
                outgoing = self._client.build_request(method, where + path, **request)
                if isinstance(outgoing.stream, httpx.ByteStream):
                    outgoing.stream = _Body(outgoing.content)
                return await self._client.send(outgoing)
            except httpx.TransportError as error:
                unsent = isinstance(error, httpx.ConnectError | httpx.ConnectTimeout)
                if unsent:
                    window: float | None = 0.0 if where else self._connect_for
                else:
                    window = retry_for
                elapsed = trio.current_time() - started
                if window is None or elapsed >= window or _refused_by_tls(error):
                    raise _unreachable(where or self._url, error, elapsed) from error
                await trio.sleep(min(backoff, window - elapsed))  # the last try at its end
                backoff = min(backoff * 2, MAX_BACKOFF)

    @property
    def _url(self) -> str:
        """The URL of the runner the client was given."""
        return str(self._client.base_url).rstrip("/")

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
        here = self._url
        owner, location = _misdirection(misdirected)
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
            other, elsewhere = _misdirection(answer)
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
        """Remember where ``token``'s session lives (the oldest forgotten past a bound)."""
        self._holders.pop(token, None)
        self._holders[token] = location
        if len(self._holders) > MAX_HOLDERS:
            del self._holders[next(iter(self._holders))]

    async def open(
        self,
        key: Key,
        request_id: str,
        *,
        expected_generation: int | None = None,
        lease: float | None = None,
        limits: Limits | None = None,
    ) -> SessionRecord:
        """Open the next generation of ``key`` (O1-O11); see ``Supervisor.open``.

        Retried on a failed connection, and while the runner answers ``StoreUnavailable``
        or ``RunnerRestarting`` (within the lease when one is given): the request id
        makes a repeated open return the record of the first (O3).
        """
        _check(key, Key, "key")
        if limits is not None:
            _check(limits, Limits, "limits")
        body = {
            "key": converter.unstructure(key),
            "request_id": request_id,
            "expected_generation": expected_generation,
            "lease": lease,
            "limits": None if limits is None else converter.unstructure(limits),
        }
        answer = await self._call(
            "open", body, retry_for=lease if lease is not None else self._retry_for
        )
        record: SessionRecord = _structure(answer["record"], SessionRecord)
        return record

    async def renew(self, handle: Handle) -> float:
        """Renew the session's lease (R1-R6); see ``Supervisor.renew``.

        Retried on a failed connection (renewing twice is renewing once, later), and
        while the runner answers ``StoreUnavailable`` or ``RunnerRestarting``.
        """
        return await self._renew(handle, self._retry_for)

    async def _renew(self, handle: Handle, retry_for: float) -> float:
        answer = await self._call("renew", _handle(handle), retry_for=retry_for, token=handle.token)
        return float(answer["lease"])

    async def load(self, handle: Handle, load: Load) -> CodeIdentity:
        """Load code into the session's child (L1-L6); see ``Supervisor.load``.

        Asked again while the runner answers ``StoreUnavailable`` or ``RunnerRestarting``
        (it made nothing of the load, and a load is idempotent by specifier, L2), but
        never once it was sent and its answer lost: the child may be loading it.
        """
        _check(load, Load, "load")
        body = {**_handle(handle), "load": converter.unstructure(load)}
        answer = await self._call("load", body, token=handle.token)
        code: CodeIdentity = _structure(answer["code"], CodeIdentity)
        return code

    async def dispose(self, handle: Handle) -> Termination:
        """Stop the session (D1-D5); see ``Supervisor.dispose``.

        Retried on a failed connection, and while the runner answers
        ``StoreUnavailable`` or ``RunnerRestarting``: disposing a stopped session returns
        its termination again (D4).
        """
        return await self._dispose(handle, self._retry_for)

    async def _dispose(self, handle: Handle, retry_for: float) -> Termination:
        answer = await self._call(
            "dispose", _handle(handle), retry_for=retry_for, token=handle.token
        )
        self._holders.pop(handle.token, None)  # stopped: no call need find it quickly
        termination: Termination = _structure(answer["termination"], Termination)
        return termination

    async def status(self, handle: Handle) -> SessionRecord:
        """The session's last durable record (S1); see ``Supervisor.status``.

        Retried on a failed connection, and while the runner answers ``StoreUnavailable``
        or ``RunnerRestarting``.
        """
        answer = await self._call(
            "status", _handle(handle), retry_for=self._retry_for, token=handle.token
        )
        record: SessionRecord = _structure(answer["record"], SessionRecord)
        return record

    async def high_water(self, key: Key) -> int | None:
        """The highest generation ever opened for ``key`` (S2).

        Retried on a failed connection, and while the runner answers ``StoreUnavailable``
        or ``RunnerRestarting``.
        """
        _check(key, Key, "key")
        answer = await self._call(
            "high_water",
            {"key": converter.unstructure(key)},
            retry_for=self._retry_for,
        )
        generation = answer["generation"]
        return None if generation is None else int(generation)

    # -- the operators' calls (the operators' token) -----------------------------------

    async def sessions(
        self, *, phase: str | None = None, identity: str | None = None
    ) -> list[dict[str, Any]]:
        """Every retained record of the fleet, tokens left out, ordered by key and
        generation.

        Each is the record's JSON (``handle`` without its token), with ``runner`` (the
        id of the runner holding it), and ``age`` and ``lease_left`` in seconds while its
        session runs (else null; docs/service.md section A).
        """
        found: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            page = (await self._get("sessions", phase=phase, identity=identity, after=after)).json()
            found.extend(page["sessions"])
            after = page["next"]
            if after is None:
                return found

    async def runners(self) -> list[RunnerInfo]:
        """The fleet's runners (this runner alone when it has no fleet), by id."""
        answer = (await self._get("runners")).json()
        found: list[RunnerInfo] = _structure(answer["runners"], list[RunnerInfo])
        return found

    async def logs(self, key: Key, generation: int, *, tail: int | None = None) -> str:
        """What a session's child wrote (its last ``tail`` bytes)."""
        _check(key, Key, "key")
        response = await self._get(
            "logs",
            identity=key.identity,
            instance=key.instance,
            generation=generation,
            tail=tail,
        )
        return response.text

    async def admin_dispose(self, key: Key, generation: int) -> Termination:
        """Dispose a session by key and generation, without its token (operators)."""
        _check(key, Key, "key")
        body = {"key": converter.unstructure(key), "generation": generation}
        answer = await self._call("admin_dispose", body)
        termination: Termination = _structure(answer["termination"], Termination)
        return termination

    async def drain(self, deadline: float | None = None) -> dict[str, Any]:
        """Drain the runner (operators): no new sessions or children; it stops once its
        sessions ended, or ``deadline`` seconds from now (an hour by default).

        Returns:
            ``{"draining": true, "until": <Unix seconds>, "sessions": <left>}``.
        """
        body = {} if deadline is None else {"deadline": deadline}
        answer: dict[str, Any] = await self._call("admin_drain", body)
        return answer

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        """Each record the runner makes durable (tokens left out), as it happens.

        An ``{"event": "overflow"}`` item means the runner dropped some for this reader:
        list the sessions afresh. Ends when the runner shuts down.
        """
        async with contextlib.AsyncExitStack() as stack:
            try:
                response = await stack.enter_async_context(
                    self._client.stream(*ROUTES["events"], timeout=None)
                )
            except httpx.TransportError as error:
                raise _unreachable(self._url, error, 0.0) from error
            if response.status_code != 200:
                await response.aread()
                raise _error_of(response)
            kind = "record"
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    kind = line.partition(":")[2].strip()
                elif line.startswith("data:"):
                    data = json.loads(line.partition(":")[2])
                    yield {"event": kind, **data} if kind == "overflow" else data
                    kind = "record"

    async def health(self) -> dict[str, Any]:
        """``/readyz``: ``{"status": "ready"}``, or the problem saying why not."""
        method, path = ROUTES["readyz"]
        response = await self._send(method, "", path, None)
        answer: dict[str, Any] = response.json()
        return answer

    # -- a session that keeps itself alive ---------------------------------------------

    @contextlib.asynccontextmanager
    async def session(
        self,
        key: Key,
        *,
        expected_generation: int | None = None,
        request_id: str | None = None,
        lease: float | None = None,
        limits: Limits | None = None,
    ) -> AsyncIterator[RemoteSession]:
        """Open a session, keep its lease alive, and dispose it when the block ends.

        The lease is renewed every third of its length in a background task; a renew that
        meets a failed connection, ``StoreUnavailable`` or ``RunnerRestarting`` is asked
        again within what is left of the lease (``RemoteSession.last_error`` keeps what
        was not mended). If a renew fails for good, the block is cancelled and
        :class:`SessionLostError` is raised with the cause. Leaving the block disposes the
        session, also when the block raised or was cancelled; the dispose is shielded and
        bounded by the lease.

        Raises:
            SessionLostError: The session's lease was lost while the block ran.
        """
        record = await self.open(
            key,
            request_id or f"session-{uuid.uuid4()}",
            expected_generation=expected_generation,
            lease=lease,
            limits=limits,
        )
        session = RemoteSession(self, record)
        lost: list[SupervisorError] = []
        try:
            async with open_background_nursery() as nursery:
                nursery.start_soon(self._keep_alive, session, lost, nursery.cancel_scope)
                try:
                    yield session
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            # Shielded: the session must not outlive the block, even a cancelled one;
            # bounded: a runner that does not answer within the lease lets it expire.
            with trio.move_on_after(record.lease, shield=True):
                with contextlib.suppress(SupervisorError, httpx.HTTPError):
                    session.termination = await self._dispose(record.handle, record.lease)
        if lost:
            raise SessionLostError(
                f"the session {key.identity}/{key.instance} generation "
                f"{record.handle.generation} was lost: {lost[0].detail}",
                lost[0],
            ) from lost[0]

    async def _keep_alive(
        self, session: RemoteSession, lost: list[SupervisorError], body: trio.CancelScope
    ) -> None:
        lease = session.record.lease
        every = lease / 3
        renewed = trio.current_time()  # the lease runs from about then
        while True:
            await trio.sleep(every)
            try:
                # Retried, and a runner that did not make it (StoreUnavailable,
                # RunnerRestarting) asked again, within what is left of the lease.
                lease = await self._renew(
                    session.handle, max(renewed + lease - trio.current_time(), 0.0)
                )
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


class RemoteSession:
    """A session opened by :meth:`RemoteSupervisor.session`, renewed in the background.

    Attributes:
        record: The Open record the session began with.
        handle: Its handle.
        termination: How its child ended, once the block disposed it (else None).
        last_error: The last renew that failed without losing the session, if any.
    """

    def __init__(self, runner: RemoteSupervisor, record: SessionRecord) -> None:
        self._runner = runner
        self.record = record
        self.handle = record.handle
        self.termination: Termination | None = None
        self.last_error: Exception | None = None

    async def load(self, load: Load) -> CodeIdentity:
        """Load code into the session (L1-L6)."""
        return await self._runner.load(self.handle, load)

    async def renew(self) -> float:
        """Renew now, besides the background renewal."""
        return await self._runner.renew(self.handle)

    async def status(self) -> SessionRecord:
        """The session's last durable record."""
        return await self._runner.status(self.handle)


def _handle(handle: Handle) -> dict[str, Any]:
    _check(handle, Handle, "handle")
    return {"handle": converter.unstructure(handle)}


def _structure(data: Any, kind: Any) -> Any:
    """A value of the answer, read as strictly as a stored record is."""
    try:
        return converter.structure(data, kind)
    except Exception as error:
        raise SupervisorError(f"the runner's answer is not a valid {kind}: {error}") from error


@contextlib.asynccontextmanager
async def connect(
    url: str,
    *,
    token: str,
    request_timeout: float = 60.0,
    verify: bool | str = True,
    transport: httpx.AsyncBaseTransport | None = None,
    retry_for: float = RETRY_FOR,
    connect_for: float = CONNECT_FOR,
) -> AsyncIterator[RemoteSupervisor]:
    """Connect to a runner.

    Nothing is sent until the first call. A runner that does not take the connection
    (down, its process restarting, or not at ``url``) is tried again for ``connect_for``
    seconds, then the call raises :class:`RunnerUnreachableError` naming the URL. A
    runner that answers it is restarting (``RunnerRestarting``: its listener stays up
    while it makes a new incarnation of itself) or that its store did not answer
    (``StoreUnavailable``) is waited out within ``retry_for``.

    Args:
        url: The runner's URL, as its ``listening on`` line says.
        token: The hosts' (or the operators') bearer token.
        request_timeout: Seconds any one request may take (a load waits for its child).
        verify: TLS verification: True, False, or a CA bundle's path.
        transport: An httpx transport, for tests.
        retry_for: Seconds within which a call that is safe to repeat (open by request
            id, renew, dispose, status, high-water) is retried when its connection
            fails mid-call; 0: never. An open with a lease is retried within that
            lease. It is also how long any call (a load too) waits out what a runner
            answers for a call it did not make, asking again as its ``Retry-After``
            says (at most every 2 s): a fleet's ``HolderLost`` (its session's runner is
            lost, and the takeover is due), raised then as :class:`RunnerLostError`; a
            store that did not answer (``StoreUnavailable``) and a runner making a new
            incarnation of itself (``RunnerRestarting``), raised then as
            :class:`StoreUnavailableError` and :class:`RunnerRestartingError`, whose
            detail names the runner's URL, how long the client waited, and the cause.
        connect_for: Seconds within which a refused connection is tried again, for any
            call (nothing reached the runner); 0: never. The default is 5 s.
    """
    if not isinstance(token, str) or not token:
        raise ValueError("token must be a non-empty str")
    for name, seconds in (("retry_for", retry_for), ("connect_for", connect_for)):
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not 0 <= seconds < math.inf
        ):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {seconds!r}")
    client = httpx.AsyncClient(
        base_url=url,
        headers={"Authorization": f"Bearer {token}"},
        timeout=httpx.Timeout(request_timeout, connect=min(request_timeout, 10.0)),
        # A CA bundle's path becomes an SSL context: httpx no longer takes a path.
        verify=ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify,
        transport=transport,
    )
    async with RemoteSupervisor(client, retry_for=retry_for, connect_for=connect_for) as runner:
        yield runner
