"""The runner's handlers, one module per concern; ``app.py`` serves each under its call.

* ``sessions.py``: the hosts' calls, one per supervisor method (open ... high-water);
* ``operators.py``: the sessions listing, a child's log, an operator's dispose, the
  drain, and the events stream;
* ``tenants.py``: the tenants and what each uses;
* ``fleet.py``: the fleet's runners;
* ``health.py``: ``/healthz``, ``/readyz``, ``/metrics`` and the OpenAPI document;
* ``dashboard.py``: the operators' page.

Each concern is a small frozen class made from the parts its calls use, and nothing
else (the supervisor, the gate, the admission, the drain, the fleet, ...); its
``handlers()`` names each handler by its call (``calls.py``). What every call shares
(the token, the role, the answer to an error, the count) is ``guard.py``'s; what a
handler reads of its request is ``request.py``'s.
"""

from collections.abc import Awaitable, Callable
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response

__all__ = ["Concern", "Endpoint"]

Endpoint = Callable[[Request], Awaitable[Response]]
"""A handler: a request in, its answer out."""


class Concern(Protocol):
    """A group of handlers made from the parts they use."""

    def handlers(self) -> dict[str, Endpoint]:
        """The handlers, by their calls' names (``calls.py``)."""
        ...
