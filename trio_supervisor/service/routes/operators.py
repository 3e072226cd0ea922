"""The operators' calls on sessions: the listing, a child's log, an operator's dispose,
the drain, and the events stream (docs/service.md sections B and C).

* ``GET /v1/sessions``: the fleet's sessions, the newest retained generation of each key
  (every retained record with ``all_generations=true``), a page at a time (``after``: the
  cursor the last page gave), each with its runner, its age and its lease left while it
  runs.
* ``GET /v1/logs``: a child's output, as the execution keeps it (:class:`Logs`): all of
  it, or its last lines (``tail``) or bytes (``tail_bytes``).
* ``POST /v1/admin/dispose``: an operator stops a session named by key and generation.
* ``POST /v1/admin/drain``: the runner drains (``drain.py``).
* ``GET /v1/events``: server-sent events, one per record the supervisor makes durable
  (``event: record``, the record as ``/v1/sessions`` lists it, tokens left out, with this
  runner's id as its ``runner``), and ``event: overflow`` when this reader fell behind
  and lost some: it should list the sessions afresh. A reader that never reads does not
  slow the supervisor (``_core/events.py``: bounded buffers, publishing never waits).

A tenant may list, read logs and follow events too, of its own keys alone.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import logging
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

import attrs
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ... import _defaults as defaults
from ..._core.events import Overflow, Watch
from ...codec import converter
from ...errors import ProblemCode, StaleSessionError
from ...model import FleetRecord, Handle, Key, Phase, log_fields
from ...realtime import outside_the_run
from ..callers import Gate
from ..calls import by_name
from ..drain import Drain
from ..fleet import Fleet
from ..log_tail import read_log
from ..served import ServedSupervisor
from ..wire import AdminDisposeBody, DrainBody, Problem, public_record
from . import Endpoint
from .request import body, key_of, names

__all__ = ["EVENT_BUFFER", "Logs", "OperatorCalls"]

logger = logging.getLogger(__name__)

EVENT_BUFFER: Final = defaults.EVENT_BUFFER

_SESSIONS: Final = by_name("sessions")
_LOGS: Final = by_name("logs")


@runtime_checkable
class Logs(Protocol):
    """An execution that keeps its children's output in files (``SubprocessExecution``
    does): the service reads their ends itself (``log_tail.py``)."""

    def log_path(self, handle: Handle) -> Path: ...


@attrs.frozen(kw_only=True)
class OperatorCalls:
    """The operators' calls on sessions, over the parts they use.

    Attributes:
        supervisor: Whose records are listed, watched and disposed.
        gate: Which keys the caller sees (a tenant its own).
        fleet: The fleet's records, and this runner's id.
        drain: What ``POST /v1/admin/drain`` begins.
        logs: Where a child's output is read; None: no logs are kept.
        streams: The events streams open now: :meth:`end_streams` ends them.
    """

    supervisor: ServedSupervisor
    gate: Gate
    fleet: Fleet
    drain: Drain
    logs: Logs | None
    streams: set[Watch] = attrs.field(factory=set)

    def handlers(self) -> dict[str, Endpoint]:
        """The handlers, by their calls' names."""
        return {
            "sessions": self.sessions,
            "logs": self.session_logs,
            "admin_dispose": self.admin_dispose,
            "admin_drain": self.admin_drain,
            "events": self.events,
        }

    def end_streams(self) -> None:
        """End every events stream: the server is stopping and will not wait for them."""
        for watch in list(self.streams):
            watch.close()

    async def sessions(self, request: Request) -> Response:
        query = request.query_params
        phase = _phase(_SESSIONS.param("phase").read(query))
        identity = _SESSIONS.param("identity").read(query)
        instance = _SESSIONS.param("instance").read(query)
        every = _SESSIONS.param("all_generations").read(query)
        limit = _SESSIONS.param("limit").read(query)
        after = _cursor(_SESSIONS.param("after").read(query))
        visible = self.gate.sees(request)
        with self.gate.admitted(request, _SESSIONS, None):
            held = await self.fleet.records(self.supervisor.records())
        mine = (
            one
            for one in held
            if (identity is None or one.record.handle.key.identity == identity)
            and (instance is None or one.record.handle.key.instance == instance)
            and visible(one.record.handle.key.identity)
        )
        # A key's newest generation is its session now, or how its last one ended; the
        # phase then filters what is listed, so a key is shown as it is now or not at all.
        chosen = sorted(
            (
                one
                for one in (mine if every else _newest(mine))
                if phase is None or one.record.phase is phase
            ),
            key=_order,
        )
        if after is not None:
            chosen = [one for one in chosen if _order(one) > after]
        page = chosen[:limit]
        more = len(chosen) > limit
        return JSONResponse(
            {
                "sessions": [self._listed(one) for one in page],
                "next": _encode_cursor(_order(page[-1])) if more else None,
                "runner": self.fleet.runner_id,  # who answers: the sessions it does not hold
            }
        )

    def _listed(self, held: FleetRecord) -> dict[str, Any]:
        """A record as operators see it, with its runner, and its age and lease left
        while it runs: this runner's own, or as the fleet's store has them."""
        record = held.record
        times = self.supervisor.times(record.handle)
        age, lease_left = times if times is not None else (held.age, held.lease_left)
        return {
            **public_record(record),
            "runner": held.runner_id,
            "age": age,
            "lease_left": lease_left,
        }

    async def session_logs(self, request: Request) -> Response:
        query = request.query_params
        key = key_of(_LOGS.param("identity").read(query), _LOGS.param("instance").read(query))
        generation = _LOGS.param("generation").read(query)
        lines = _LOGS.param("tail").read(query)
        size = _LOGS.param("tail_bytes").read(query)
        if lines is not None and size is not None:
            raise Problem(
                422,
                ProblemCode.INVALID,
                "the query parameters 'tail' (lines) and 'tail_bytes' (bytes) may not be "
                "given together",
            )
        with self.gate.admitted(request, _LOGS, key):
            record = self.supervisor.find(*names(request, (key, generation)))
            if record is None:
                raise StaleSessionError(
                    f"{key.identity}/{key.instance} has no retained generation {generation}"
                )
            if self.logs is None:
                return PlainTextResponse("")
            path = self.logs.log_path(record.handle)
            # A file read, off the event loop: its end only, when a tail is asked for.
            with outside_the_run():
                text = await trio.to_thread.run_sync(
                    functools.partial(read_log, path, lines=lines, size=size)
                )
            return PlainTextResponse(text)

    async def admin_dispose(self, request: Request) -> Response:
        asked = await body(request, AdminDisposeBody)
        record = self.supervisor.find(*names(request, (asked.key, asked.generation)))
        if record is None:
            raise StaleSessionError(
                f"{asked.key.identity}/{asked.key.instance} has no retained generation "
                f"{asked.generation}"
            )
        logger.info(
            "an operator disposes %s/%s generation %d",
            asked.key.identity,
            asked.key.instance,
            asked.generation,
            extra=log_fields(asked.key, asked.generation),
        )
        termination = await self.supervisor.dispose(record.handle)
        return JSONResponse({"termination": converter.unstructure(termination)})

    async def admin_drain(self, request: Request) -> Response:
        asked = await body(request, DrainBody)
        logger.info("an operator drains the runner (deadline %g s)", asked.deadline)
        until = await self.drain.begin(asked.deadline)
        left = len(self.supervisor.live_records())
        return JSONResponse({"draining": True, "until": until, "sessions": left})

    async def events(self, request: Request) -> Response:
        visible = self.gate.sees(request)
        runner_id = self.fleet.runner_id
        watch = self.supervisor.watch(EVENT_BUFFER)
        streams = self.streams
        streams.add(watch)

        async def stream() -> AsyncIterator[str]:
            try:
                async with watch:
                    yield ": trio_supervisor events\n\n"  # headers out: the reader knows
                    async for event in watch:
                        if isinstance(event, Overflow):
                            lost = json.dumps({"lost": event.lost})
                            yield f"event: overflow\ndata: {lost}\n\n"
                        elif visible(event.handle.key.identity):
                            record = json.dumps({**public_record(event), "runner": runner_id})
                            yield f"event: record\ndata: {record}\n\n"
            finally:
                streams.discard(watch)

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )


# -- the listing's query ----------------------------------------------------------------


def _phase(value: str | None) -> Phase | None:
    # Its call's parameter has checked that it names a phase.
    return None if value is None else Phase(value)


def _newest(records: Iterable[FleetRecord]) -> list[FleetRecord]:
    """The newest retained generation of each key among ``records``."""
    newest: dict[Key, FleetRecord] = {}
    for one in records:
        key = one.record.handle.key
        known = newest.get(key)
        if known is None or one.record.handle.generation > known.record.handle.generation:
            newest[key] = one
    return list(newest.values())


_Order = tuple[str, str, int]


def _order(held: FleetRecord) -> _Order:
    handle = held.record.handle
    return (handle.key.identity, handle.key.instance, handle.generation)


def _encode_cursor(order: _Order) -> str:
    return base64.urlsafe_b64encode(json.dumps(order).encode()).decode()


def _cursor(value: str | None) -> _Order | None:
    if not value:
        return None
    try:
        identity, instance, generation = json.loads(base64.urlsafe_b64decode(value.encode()))
        if not (
            isinstance(identity, str) and isinstance(instance, str) and isinstance(generation, int)
        ):
            raise ValueError(value)
    except (ValueError, TypeError, binascii.Error):
        raise Problem(
            422,
            ProblemCode.INVALID,
            "the query parameter 'after' is not a cursor this runner gave",
        ) from None
    return (identity, instance, generation)
