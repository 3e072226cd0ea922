"""The hosts' session calls, one per supervisor method: open, renew, load, dispose,
status and high-water (docs/service.md section A).

Each reads its body into its request class (``wire.py``), passes the gate (the key's
identity, the tenant's fairness), then the admission (quotas, capacity) and the drain
where it makes new work, calls the one supervisor method it mirrors, and writes the
answer with the same converter. The wire is a translation of the Python API, never a
second implementation of a rule.
"""

from __future__ import annotations

import contextlib
from typing import Any, Final

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...codec import converter
from ...model import SessionRecord
from ..admission import Admission
from ..callers import Gate
from ..calls import by_name
from ..drain import Drain
from ..served import ServedSupervisor
from ..wire import HandleBody, KeyBody, LoadBody, OpenBody
from . import Endpoint
from .request import body, names

__all__ = ["SessionCalls"]

_OPEN: Final = by_name("open")
_RENEW: Final = by_name("renew")
_LOAD: Final = by_name("load")
_DISPOSE: Final = by_name("dispose")
_STATUS: Final = by_name("status")
_HIGH_WATER: Final = by_name("high_water")


@attrs.frozen(kw_only=True)
class SessionCalls:
    """The session calls, over the parts they use.

    Attributes:
        supervisor: Where each call goes.
        gate: The caller's identities and fairness.
        admission: Quotas and capacity, for opens and loads.
        drain: Refuses opens and loads while the runner drains.
    """

    supervisor: ServedSupervisor
    gate: Gate
    admission: Admission
    drain: Drain

    def handlers(self) -> dict[str, Endpoint]:
        """The handlers, by their calls' names."""
        return {
            "open": self.open,
            "renew": self.renew,
            "load": self.load,
            "dispose": self.dispose,
            "status": self.status,
            "high_water": self.high_water,
        }

    async def open(self, request: Request) -> Response:
        asked = await body(request, OpenBody)
        supervisor, admission, drain = self.supervisor, self.admission, self.drain
        with self.gate.admitted(request, _OPEN, asked.key) as tenant:
            # An open repeated (O3) creates nothing: a drain lets it through (looked up
            # only while draining: the common open pays nothing for it).
            repeated = (
                drain.draining
                and supervisor.retained_request(asked.key, asked.request_id) is not None
            )
            limits = admission.limits(tenant, asked.limits)
            with (
                contextlib.nullcontext() if repeated else drain.admitted("sessions"),
                admission.opening(tenant, asked.key, asked.request_id),
            ):
                record = await supervisor.open(
                    asked.key,
                    asked.request_id,
                    expected_generation=asked.expected_generation,
                    lease=asked.lease,
                    limits=limits,
                    quota=admission.claim(tenant),  # a fleet's store counts the fleet's
                )
        return JSONResponse({"record": _record(record)})

    async def renew(self, request: Request) -> Response:
        asked = await body(request, HandleBody)
        with self.gate.admitted(request, _RENEW, asked.handle.key):
            lease = await self.supervisor.renew(names(request, asked.handle))
        return JSONResponse({"lease": lease})

    async def load(self, request: Request) -> Response:
        asked = await body(request, LoadBody)
        handle = asked.handle
        with (
            self.gate.admitted(request, _LOAD, handle.key) as tenant,
            self.drain.admitted("children"),
        ):
            record = self.supervisor.find(handle.key, handle.generation)
            if record is not None and record.handle.token != handle.token:
                record = None  # not this caller's session: the supervisor says so
            with self.admission.loading(tenant, record):
                claim = self.admission.claim(tenant)
                code = await self.supervisor.load(names(request, handle), asked.load, quota=claim)
        return JSONResponse({"code": converter.unstructure(code)})

    async def dispose(self, request: Request) -> Response:
        asked = await body(request, HandleBody)
        with self.gate.admitted(request, _DISPOSE, asked.handle.key):
            termination = await self.supervisor.dispose(names(request, asked.handle))
        return JSONResponse({"termination": converter.unstructure(termination)})

    async def status(self, request: Request) -> Response:
        asked = await body(request, HandleBody)
        with self.gate.admitted(request, _STATUS, asked.handle.key):
            record = await self.supervisor.status(names(request, asked.handle))
        return JSONResponse({"record": _record(record)})

    async def high_water(self, request: Request) -> Response:
        asked = await body(request, KeyBody)
        with self.gate.admitted(request, _HIGH_WATER, asked.key):
            generation = await self.supervisor.high_water(asked.key)
        return JSONResponse({"generation": generation})


def _record(record: SessionRecord) -> Any:
    return converter.unstructure(record, SessionRecord)
