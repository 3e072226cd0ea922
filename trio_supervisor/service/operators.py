"""What operators get on top of the session calls: events, metrics and a dashboard.

* ``GET /v1/events`` (operators): server-sent events, one per record the supervisor
  makes durable (``event: record``, the record as ``/v1/sessions`` lists it, tokens left
  out, with this runner's id as its ``runner``), and ``event: overflow`` when this reader
  fell behind and lost some: it should list the sessions afresh. A reader that never
  reads does not slow the supervisor (``events.py``: bounded buffers, publishing never
  waits).
* ``GET /metrics`` (operators): the Prometheus text format of ``metrics.py``.
* ``GET /``: the dashboard, one page with no external assets; it asks for the
  operators' token once (saying which file of the runner's holds it) and keeps it in the
  tab's ``sessionStorage``.
"""

from __future__ import annotations

import html
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Final

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse

from .._core.events import Overflow, Watch
from .._core.supervisor import Supervisor
from .metrics import Metrics
from .wire import public_record

__all__ = ["dashboard_page", "dashboard_response", "metrics_response", "operator_handlers"]

Endpoint = Callable[[Request], Awaitable[Response]]
EVENT_BUFFER: Final = 1024  # records one events reader may fall behind before overflow
HEARTBEAT: Final = 15.0  # seconds between comments that keep an idle stream open


# Where the dashboard's sign-in says the operators' token is (once, in its markup).
_TOKEN_WHERE: Final = "<!-- where the operators' token is -->"


def dashboard_page(token_file: Path | None = None) -> str:
    """The dashboard's page, its sign-in naming ``token_file`` (None: a token given
    otherwise, which the runner's owner has)."""
    page = resources.files(__package__).joinpath("dashboard.html").read_text(encoding="utf-8")
    assert page.count(_TOKEN_WHERE) == 1, "the dashboard says once where the token is"
    if token_file is None:
        where = "the runner's owner has it"
    else:
        where = f"it is in <code>{html.escape(str(token_file))}</code> on the runner's machine"
    return page.replace(_TOKEN_WHERE, where)


def dashboard_response(page: str) -> Response:
    """The dashboard's page as it is served: nothing outside the runner is reachable
    from it, and nothing else may run in it."""
    return HTMLResponse(
        page,
        headers={
            "Content-Security-Policy": (
                "default-src 'self'; script-src 'unsafe-inline'; style-src "
                "'unsafe-inline'; connect-src 'self'; img-src 'self' data:"
            ),
            "Cache-Control": "no-store",
        },
    )


def metrics_response(metrics: Metrics) -> Response:
    """``GET /metrics``: the Prometheus text format of ``metrics``."""
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def operator_handlers(
    supervisor: Supervisor,
    metrics: Metrics,
    runner_id: str,
    sees: Callable[[Request], Callable[[str], bool]] | None = None,
    *,
    token_file: Path | None = None,
) -> tuple[dict[str, Endpoint], Callable[[], None]]:
    """The handlers of events, metrics and the dashboard, by their calls' names
    (``calls.py`` says where each is served, and to whom), and what ends the event
    streams.

    Args:
        supervisor: What the events come from.
        metrics: The series ``/metrics`` renders.
        runner_id: This runner's id in its fleet: every record it publishes is its own.
        sees: For a request, whether its caller may see a key of an identity (a tenant
            reads the events of its own keys alone); None: every caller sees every key.
        token_file: Where the operators' token is kept: the dashboard's sign-in says so.
    """
    page = dashboard_page(token_file)
    streams: set[Watch] = set()

    def end_streams() -> None:
        """End every events stream: the server is stopping and will not wait for them."""
        for watch in list(streams):
            watch.close()

    async def events(request: Request) -> Response:
        visible = sees(request) if sees is not None else None
        watch = supervisor.watch(EVENT_BUFFER)
        streams.add(watch)

        async def stream() -> AsyncIterator[str]:
            try:
                async with watch:
                    yield ": trio_supervisor events\n\n"  # headers out: the reader knows
                    async for event in watch:
                        if isinstance(event, Overflow):
                            lost = json.dumps({"lost": event.lost})
                            yield f"event: overflow\ndata: {lost}\n\n"
                        elif visible is None or visible(event.handle.key.identity):
                            record = json.dumps({**public_record(event), "runner": runner_id})
                            yield f"event: record\ndata: {record}\n\n"
            finally:
                streams.discard(watch)

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def render_metrics(request: Request) -> Response:
        return metrics_response(metrics)

    async def dashboard(request: Request) -> Response:
        return dashboard_response(page)

    handlers: dict[str, Endpoint] = {
        "events": events,
        "dashboard": dashboard,
        "metrics": render_metrics,
    }
    return handlers, end_streams
