"""The supervisor's API over HTTP: :class:`RemoteSupervisor`'s calls, each with the
embedded supervisor's name, signature, values and errors, and :func:`connect`, which
makes one.

Each call says which route it takes (``_routes.ROUTES``), what it sends, and how long it
may be retried; the transport (``_transport.py``) reaches the runner and keeps trying.
"""

from __future__ import annotations

import contextlib
import json
import math
import ssl
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any, Self

import httpx

from .._defaults import (
    CLIENT_CONNECT_FOR,
    CLIENT_CONNECT_TIMEOUT,
    CLIENT_REQUEST_TIMEOUT,
    CLIENT_RETRY_FOR,
)
from .._routes import ROUTES
from ..codec import converter
from ..errors import SupervisorError
from ..model import (
    CodeIdentity,
    Handle,
    Key,
    Limits,
    Load,
    RunnerInfo,
    SessionRecord,
    Termination,
)
from ._problems import error_of, unreachable
from ._session import RemoteSession, kept_alive
from ._transport import Transport


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

    Args:
        client: The httpx client of the runner's URL (its ``base_url``), with the token.
        retry_for: See :func:`connect`; 15 s by default (``CLIENT_RETRY_FOR``).
        connect_for: See :func:`connect`; 5 s by default (``CLIENT_CONNECT_FOR``).
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        retry_for: float = CLIENT_RETRY_FOR,
        connect_for: float = CLIENT_CONNECT_FOR,
    ) -> None:
        self._client = client
        self._transport = Transport(client, retry_for=retry_for, connect_for=connect_for)

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
        error it stands for (see :meth:`Transport.exchange <._transport.Transport.exchange>`).

        Args:
            retry_for: Seconds within which a failed call that is safe to repeat is
                retried; None: only what the runner did not make (a refused connection,
                a lost holder, a store that did not answer, a runner restarting) is
                tried again, within the client's windows.
            token: The token of the session the call names, if it names one.
        """
        method, path = ROUTES[name]
        response = await self._transport.exchange(method, path, retry_for, token, json=body)
        return response.json()

    async def _get(self, name: str, **params: Any) -> httpx.Response:
        """The call ``name`` with its query ``params`` (None: left out)."""
        method, path = ROUTES[name]
        query = {key: value for key, value in params.items() if value is not None}
        retry_for = self._transport.retry_for
        return await self._transport.exchange(method, path, retry_for, None, params=query)

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

        Implements :meth:`trio_supervisor.abc.SupervisorAPI.open`, whose errors it raises.

        Raises:
            TypeError: ``key`` or ``limits`` is not of its class.
            RunnerUnreachableError: No runner answered within the client's windows.
            RunnerRestartingError, StoreUnavailableError: The runner still answered so
                once the call's retry window was spent.
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
            "open", body, retry_for=lease if lease is not None else self._transport.retry_for
        )
        record: SessionRecord = _structure(answer["record"], SessionRecord)
        return record

    async def renew(self, handle: Handle) -> float:
        """Renew the session's lease (R1-R6); see ``Supervisor.renew``.

        Retried on a failed connection (renewing twice is renewing once, later), and
        while the runner answers ``StoreUnavailable`` or ``RunnerRestarting``.

        Implements :meth:`trio_supervisor.abc.SupervisorAPI.renew`, whose errors it raises.

        Raises:
            TypeError: ``handle`` is not a :class:`~trio_supervisor.model.Handle`.
            RunnerUnreachableError: No runner answered within the client's windows.
            RunnerRestartingError, StoreUnavailableError: The runner still answered so
                once the call's retry window was spent.
        """
        return await self._renew(handle, self._transport.retry_for)

    async def _renew(self, handle: Handle, retry_for: float) -> float:
        answer = await self._call("renew", _handle(handle), retry_for=retry_for, token=handle.token)
        return float(answer["lease"])

    async def load(self, handle: Handle, load: Load) -> CodeIdentity:
        """Load code into the session's child (L1-L6); see ``Supervisor.load``.

        Asked again while the runner answers ``StoreUnavailable`` or ``RunnerRestarting``
        (it made nothing of the load, and a load is idempotent by specifier, L2), but
        never once it was sent and its answer lost: the child may be loading it.

        Implements :meth:`trio_supervisor.abc.SupervisorAPI.load`, whose errors it raises.

        Raises:
            TypeError: ``handle`` or ``load`` is not of its class.
            RunnerFullError, QuotaExceededError, ThrottledError: The runner's
                admission refused the child (docs/service.md section D).
            RunnerUnreachableError: No runner answered within the client's windows.
            RunnerRestartingError, StoreUnavailableError: The runner still answered so
                once the call's retry window was spent.
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
        its termination again (D3).

        Implements :meth:`trio_supervisor.abc.SupervisorAPI.dispose`, whose errors it
        raises.

        Raises:
            TypeError: ``handle`` is not a :class:`~trio_supervisor.model.Handle`.
            RunnerUnreachableError: No runner answered within the client's windows.
            RunnerRestartingError, StoreUnavailableError: The runner still answered so
                once the call's retry window was spent.
        """
        return await self._dispose(handle, self._transport.retry_for)

    async def _dispose(self, handle: Handle, retry_for: float) -> Termination:
        answer = await self._call(
            "dispose", _handle(handle), retry_for=retry_for, token=handle.token
        )
        self._transport.forget(handle.token)  # stopped: no call need find it quickly
        termination: Termination = _structure(answer["termination"], Termination)
        return termination

    async def status(self, handle: Handle) -> SessionRecord:
        """The session's last durable record (S1); see ``Supervisor.status``.

        Retried on a failed connection, and while the runner answers ``StoreUnavailable``
        or ``RunnerRestarting``.

        Implements :meth:`trio_supervisor.abc.SupervisorAPI.status`, whose errors it
        raises.
        """
        answer = await self._call(
            "status", _handle(handle), retry_for=self._transport.retry_for, token=handle.token
        )
        record: SessionRecord = _structure(answer["record"], SessionRecord)
        return record

    async def high_water(self, key: Key) -> int | None:
        """The highest generation ever opened for ``key`` (S2).

        Retried on a failed connection, and while the runner answers ``StoreUnavailable``
        or ``RunnerRestarting``.

        Implements :meth:`trio_supervisor.abc.SupervisorAPI.high_water`.
        """
        _check(key, Key, "key")
        answer = await self._call(
            "high_water",
            {"key": converter.unstructure(key)},
            retry_for=self._transport.retry_for,
        )
        generation = answer["generation"]
        return None if generation is None else int(generation)

    # -- the operators' calls (the operators' token) -----------------------------------

    async def sessions(
        self,
        *,
        phase: str | None = None,
        identity: str | None = None,
        instance: str | None = None,
        all_generations: bool = False,
    ) -> list[dict[str, Any]]:
        """The fleet's sessions, tokens left out, ordered by key and generation: the
        newest retained generation of each key, or with ``all_generations`` every
        retained record.

        Each is the record's JSON (``handle`` without its token), with ``runner`` (the
        id of the runner holding it), and ``age`` and ``lease_left`` in seconds while its
        session runs (else null; docs/service.md section A). ``phase``, ``identity`` and
        ``instance`` filter (the phase: of the generation listed).

        Args:
            phase: Only sessions in this phase (``Open`` ... ``Stopped``).
            identity: Only sessions of keys with this identity.
            instance: Only sessions of keys with this instance.
            all_generations: Every retained generation of each key, not only the newest.

        Returns:
            The sessions, every page of them.

        Raises:
            ForbiddenError: The client's token is not the operators'.
        """
        found: list[dict[str, Any]] = []
        after: str | None = None
        every = "true" if all_generations else None
        while True:
            page = (
                await self._get(
                    "sessions",
                    phase=phase,
                    identity=identity,
                    instance=instance,
                    all_generations=every,
                    after=after,
                )
            ).json()
            found.extend(page["sessions"])
            after = page["next"]
            if after is None:
                return found

    async def runners(self) -> list[RunnerInfo]:
        """The fleet's runners (this runner alone when it has no fleet), by id."""
        answer = (await self._get("runners")).json()
        found: list[RunnerInfo] = _structure(answer["runners"], list[RunnerInfo])
        return found

    async def tenants(self) -> dict[str, Any]:
        """The tenants and what each holds (``GET /v1/tenants``: operators see every
        tenant, a tenant itself): ``{"tenants": [...], "unlimited_cpu_percent": N}``."""
        answer: dict[str, Any] = (await self._get("tenants")).json()
        return answer

    async def logs(
        self,
        key: Key,
        generation: int,
        *,
        tail: int | None = None,
        tail_bytes: int | None = None,
    ) -> str:
        """What a session's child wrote: all of it, or its last ``tail`` lines (a last
        line without a newline counts), or its last ``tail_bytes`` bytes.

        Args:
            key: The session's key.
            generation: The session's generation.
            tail: How many lines from the end.
            tail_bytes: How many bytes from the end.

        Returns:
            The log's text.

        Raises:
            ValueError: Both ``tail`` and ``tail_bytes`` are given.
            ForbiddenError: The client's token is not the operators'.
        """
        _check(key, Key, "key")
        if tail is not None and tail_bytes is not None:
            raise ValueError("give tail (lines) or tail_bytes (bytes), not both")
        response = await self._get(
            "logs",
            identity=key.identity,
            instance=key.instance,
            generation=generation,
            tail=tail,
            tail_bytes=tail_bytes,
        )
        return response.text

    async def admin_dispose(self, key: Key, generation: int) -> Termination:
        """Dispose a session by key and generation, without its token (operators).

        Args:
            key: The session's key.
            generation: The session's generation.

        Returns:
            How the session's child ended (D3, D5).

        Raises:
            ForbiddenError: The client's token is not the operators'.
            StaleSessionError: No retained session has this key and generation.
        """
        _check(key, Key, "key")
        body = {"key": converter.unstructure(key), "generation": generation}
        answer = await self._call("admin_dispose", body)
        termination: Termination = _structure(answer["termination"], Termination)
        return termination

    async def dashboard_code(self) -> dict[str, Any]:
        """A one-time code for a dashboard sign-in link (operators): ``{"code", "path":
        "/?code=CODE", "expires_in": seconds}``; the link is the runner's URL and path."""
        answer: dict[str, Any] = await self._call("dashboard_codes", {})
        return answer

    async def drain(self, deadline: float | None = None) -> dict[str, Any]:
        """Drain the runner (operators): no new sessions or children; it stops once its
        sessions ended, or ``deadline`` seconds from now (an hour by default).

        Args:
            deadline: Seconds from now after which the runner stops whatever is left.

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
                raise unreachable(self._transport.url, error, 0.0) from error
            if response.status_code != 200:
                await response.aread()
                raise error_of(response)
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
        response = await self._transport.send(method, "", path, None)
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

        Args:
            key: What the session is for.
            expected_generation: As for :meth:`open`.
            request_id: As for :meth:`open`; a fresh one by default.
            lease: As for :meth:`open`.
            limits: As for :meth:`open`.

        Yields:
            The session, with its handle and the errors of its renews.

        Raises:
            SessionLostError: The session's lease was lost while the block ran.
            StaleSessionError, RunnerClosingError, StateStorageError: The open
                failed, as for :meth:`open`.
        """
        record = await self.open(
            key,
            request_id or f"session-{uuid.uuid4()}",
            expected_generation=expected_generation,
            lease=lease,
            limits=limits,
        )
        async with kept_alive(self, record, self._renew, self._dispose) as session:
            yield session


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
    token: str | None,
    request_timeout: float = CLIENT_REQUEST_TIMEOUT,
    verify: bool | str = True,
    transport: httpx.AsyncBaseTransport | None = None,
    retry_for: float = CLIENT_RETRY_FOR,
    connect_for: float = CLIENT_CONNECT_FOR,
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
        token: The hosts' (or the operators') bearer token; None for a client that
            only asks what needs none (:meth:`RemoteSupervisor.health`): every other
            call is then refused with :class:`RunnerAccessError`.
        request_timeout: Seconds any one request may take (a load waits for its child);
            60 s by default (``CLIENT_REQUEST_TIMEOUT``). A connection may take at most
            this, and never more than 10 s (``CLIENT_CONNECT_TIMEOUT``).
        verify: TLS verification: True, False, or a CA bundle's path.
        transport: An httpx transport, for tests.
        retry_for: Seconds within which a call that is safe to repeat (open by request
            id, renew, dispose, status, high-water) is retried when its connection
            fails mid-call; 0: never. An open with a lease is retried within that
            lease. It is also how long any call (a load too) waits out what a runner
            answers for a call it did not make, asking again as its ``Retry-After``
            says (1 s when it says nothing, ``CLIENT_RETRY_AFTER``; at most every 2 s,
            ``CLIENT_MAX_BACKOFF``): a fleet's ``HolderLost`` (its session's runner is
            lost, and the takeover is due), raised then as :class:`RunnerLostError`; a
            store that did not answer (``StoreUnavailable``) and a runner making a new
            incarnation of itself (``RunnerRestarting``), raised then as
            :class:`StoreUnavailableError` and :class:`RunnerRestartingError`, whose
            detail names the runner's URL, how long the client waited, and the cause.
            The default is 15 s (``CLIENT_RETRY_FOR``). A failed connection is tried
            again after 0.05 s (``CLIENT_FIRST_BACKOFF``), then after twice as long
            each time, at most 2 s.
        connect_for: Seconds within which a refused connection is tried again, for any
            call (nothing reached the runner); 0: never. The default is 5 s
            (``CLIENT_CONNECT_FOR``).

    Yields:
        The client, whose connections close when the block ends.

    Raises:
        ValueError: ``token`` is given but empty or not a string, or ``retry_for`` or
            ``connect_for`` is not a finite number of seconds >= 0.
    """
    if token is not None and (not isinstance(token, str) or not token):
        raise ValueError("token must be a non-empty str, or None for the calls that need none")
    for name, seconds in (("retry_for", retry_for), ("connect_for", connect_for)):
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not 0 <= seconds < math.inf
        ):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {seconds!r}")
    client = httpx.AsyncClient(
        base_url=url,
        headers={} if token is None else {"Authorization": f"Bearer {token}"},
        timeout=httpx.Timeout(
            request_timeout, connect=min(request_timeout, CLIENT_CONNECT_TIMEOUT)
        ),
        # A CA bundle's path becomes an SSL context: httpx no longer takes a path.
        verify=ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify,
        transport=transport,
    )
    async with RemoteSupervisor(client, retry_for=retry_for, connect_for=connect_for) as runner:
        yield runner
