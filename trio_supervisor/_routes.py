"""Where each call of the runner is served, by the call's name: the one table the
service's calls (``service/calls.py``: their statuses, bodies and roles) and the client
(``client/``) both read, so that neither spells a path of its own.
"""

from __future__ import annotations

from typing import Final, Literal, NamedTuple

__all__ = ["ROUTES", "Route"]


class Route(NamedTuple):
    """A call's HTTP method and path."""

    method: Literal["GET", "POST"]
    path: str


ROUTES: Final = {
    "open": Route("POST", "/v1/open"),
    "renew": Route("POST", "/v1/renew"),
    "load": Route("POST", "/v1/load"),
    "dispose": Route("POST", "/v1/dispose"),
    "status": Route("POST", "/v1/status"),
    "high_water": Route("POST", "/v1/high-water"),
    "sessions": Route("GET", "/v1/sessions"),
    "logs": Route("GET", "/v1/logs"),
    "events": Route("GET", "/v1/events"),
    "admin_dispose": Route("POST", "/v1/admin/dispose"),
    "admin_drain": Route("POST", "/v1/admin/drain"),
    "runners": Route("GET", "/v1/runners"),
    "tenants": Route("GET", "/v1/tenants"),
    "metrics": Route("GET", "/metrics"),
    "healthz": Route("GET", "/healthz"),
    "readyz": Route("GET", "/readyz"),
    "openapi": Route("GET", "/openapi.json"),
    "dashboard": Route("GET", "/"),
    "dashboard_codes": Route("POST", "/v1/dashboard/codes"),
    "dashboard_sign_in": Route("POST", "/v1/dashboard/sign-in"),
}
