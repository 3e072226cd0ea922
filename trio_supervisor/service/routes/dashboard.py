"""The operators' dashboard, and signing in to it.

* ``GET /``: one page with no external assets (``service/dashboard.html``). It asks for
  the operators' token once (it names no file: the page is anyone's to load) and keeps it
  in the tab's ``sessionStorage``; opened as a sign-in link (``/?code=CODE``) it trades
  the code instead, and keeps the sign-in token it gets.
* ``POST /v1/dashboard/codes``: an operator's one-time code for such a link
  (``sign_in.py``).
* ``POST /v1/dashboard/sign-in``: a code traded, once, for a sign-in token; a code that
  is wrong, spent or expired is a 401 in words the page shows on its sign-in.
"""

from __future__ import annotations

from importlib import resources
from typing import Final

import attrs
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from ...errors import RunnerAccessError
from ..sign_in import REFUSED, SignIns
from ..wire import SignInBody
from . import Endpoint
from .request import body

__all__ = ["Dashboard", "dashboard_page", "dashboard_response"]

_PAGE: Final = "dashboard.html"


def dashboard_page() -> str:
    """The dashboard's page."""
    page = resources.files("trio_supervisor.service").joinpath(_PAGE)
    return page.read_text(encoding="utf-8")


def dashboard_response(page: str) -> Response:
    """The dashboard's page as it is served: nothing outside the runner is reachable
    from it, nothing else may run in it, and a sign-in link's code in its address is
    sent to no other site."""
    return HTMLResponse(
        page,
        headers={
            "Content-Security-Policy": (
                "default-src 'self'; script-src 'unsafe-inline'; style-src "
                "'unsafe-inline'; connect-src 'self'; img-src 'self' data:"
            ),
            "Cache-Control": "no-store",
            "Referrer-Policy": "no-referrer",
        },
    )


@attrs.frozen(kw_only=True)
class Dashboard:
    """The dashboard's calls: its page (made once), and its sign-in links.

    Attributes:
        page: The page.
        sign_ins: The codes and sign-ins (the runner's: they outlive an incarnation).
    """

    page: str
    sign_ins: SignIns

    def handlers(self) -> dict[str, Endpoint]:
        """The handlers, by their calls' names."""
        return {
            "dashboard": self.dashboard,
            "dashboard_codes": self.codes,
            "dashboard_sign_in": self.sign_in,
        }

    async def dashboard(self, request: Request) -> Response:
        return dashboard_response(self.page)

    async def codes(self, request: Request) -> Response:
        code = self.sign_ins.mint()
        return JSONResponse(
            {"code": code, "path": f"/?code={code}", "expires_in": self.sign_ins.code_for},
            headers={"Cache-Control": "no-store"},
        )

    async def sign_in(self, request: Request) -> Response:
        asked = await body(request, SignInBody)
        token = self.sign_ins.spend(asked.code)
        if token is None:
            raise RunnerAccessError(REFUSED)
        return JSONResponse(
            {"token": token, "expires_in": self.sign_ins.session_for},
            headers={"Cache-Control": "no-store"},
        )
