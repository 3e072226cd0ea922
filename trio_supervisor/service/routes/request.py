"""What a handler reads of its request: its body, capped, and the session it names.

A body is read whole up to :data:`~trio_supervisor.service.wire.MAX_BODY` bytes, then
parsed by the wire's one converter. A call that names a session says so
(:func:`names`), so that the guard can look for a session this runner does not know in
the fleet (the 421 of docs/service.md section C).
"""

from __future__ import annotations

from typing import Final, TypeVar

from starlette.requests import ClientDisconnect, Request

from ...errors import ProblemCode
from ...model import Handle, Key
from ..wire import MAX_BODY, Problem, read_body

__all__ = ["DRAIN", "body", "key_of", "named", "names"]

DRAIN: Final = 8 << 20  # bytes of an oversized body read (and dropped) before the 413

_T = TypeVar("_T")
_Named = TypeVar("_Named", Handle, tuple[Key, int])


async def body(request: Request, kind: type[_T]) -> _T:
    """The request's body as a ``kind``.

    Raises:
        Problem: 400 (not JSON, or cut short), 413 (over the cap), 422 (not a valid
            ``kind``).
    """
    return read_body(await _capped(request), kind)


async def _capped(request: Request) -> bytes:
    """The request's body, refused past :data:`MAX_BODY` bytes.

    What is over the cap is read and dropped (up to :data:`DRAIN` bytes) before the 413,
    so that a client still sending its body reads the answer instead of a reset
    connection; past that, the connection is simply dropped.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise Problem(400, ProblemCode.MALFORMED, "Content-Length is not a number") from None
        if size > DRAIN:
            raise Problem(413, ProblemCode.TOO_LARGE, f"the body is over {MAX_BODY} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAIN:
                break
            if size <= MAX_BODY:
                chunks.append(chunk)
    except ClientDisconnect:
        # The client went away mid-body (it gave up, or retries on a new connection):
        # nothing was done, and the answer reaches no one. Not the runner's failure.
        raise Problem(
            400, ProblemCode.MALFORMED, "the client went away before its body was whole"
        ) from None
    if size > MAX_BODY:
        raise Problem(413, ProblemCode.TOO_LARGE, f"the body is over {MAX_BODY} bytes")
    return b"".join(chunks)


def names(request: Request, session: _Named) -> _Named:
    """Say which session a routed call names (by handle, or by key and generation), so
    that one this runner does not know is looked for in the fleet; returns it."""
    request.state.session = session
    return session


def named(request: Request) -> Handle | tuple[Key, int] | None:
    """The session the request's handler named (:func:`names`), if it named one."""
    session: Handle | tuple[Key, int] | None = getattr(request.state, "session", None)
    return session


def key_of(identity: str, instance: str) -> Key:
    """A key given as query parameters.

    Raises:
        Problem: 422, naming what is wrong with it.
    """
    try:
        return Key(identity=identity, instance=instance)
    except (ValueError, TypeError) as error:
        raise Problem(422, ProblemCode.INVALID, f"{error} (query parameters)") from None
