"""What a balancer, a scraper and a reader of the API ask a runner, most without a
token: ``/healthz``, ``/readyz``, ``/metrics`` (operators) and ``/openapi.json``.

``/readyz`` answers 503 while the supervisor is poisoned, shutting down, or while the
runner drains, so that a balancer sends it no new work (docs/service.md section B).
"""

from __future__ import annotations

from typing import Any

import attrs
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...errors import RunnerClosingError, RunnerDrainingError
from ..drain import Drain
from ..metrics import Metrics
from ..openapi import document
from ..problems import problem
from ..served import ServedSupervisor
from . import Endpoint

__all__ = ["HealthCalls", "metrics_response"]


def metrics_response(metrics: Metrics) -> Response:
    """``GET /metrics``: the Prometheus text format of ``metrics``."""
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


@attrs.frozen(kw_only=True)
class HealthCalls:
    """The health, metrics and document calls, over the parts they use.

    Attributes:
        supervisor: Whether it is poisoned or shutting down.
        drain: Whether the runner drains.
        metrics: What ``/metrics`` renders.
        openapi: The OpenAPI document, made once.
    """

    supervisor: ServedSupervisor
    drain: Drain
    metrics: Metrics
    openapi: dict[str, Any] = attrs.field(factory=document)

    def handlers(self) -> dict[str, Endpoint]:
        """The handlers, by their calls' names."""
        return {
            "healthz": self.healthz,
            "readyz": self.readyz,
            "metrics": self.render_metrics,
            "openapi": self.openapi_json,
        }

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        # Answered here, not raised: a poisoning error of any class is a 503 to readyz.
        supervisor = self.supervisor
        if supervisor.poisoned is not None:
            return problem(503, supervisor.poisoned.code, f"poisoned: {supervisor.poisoned}")
        if supervisor.closing:
            return problem(503, RunnerClosingError.code, "the runner is shutting down")
        if self.drain.draining:
            return problem(
                503, RunnerDrainingError.code, "the runner drains: it takes no new sessions"
            )
        return JSONResponse({"status": "ready"})

    async def render_metrics(self, request: Request) -> Response:
        return metrics_response(self.metrics)

    async def openapi_json(self, request: Request) -> Response:
        return JSONResponse(self.openapi)
