"""The one place an error becomes an HTTP answer: problem+json (RFC 9457; docs/service.md
section A, "Errors").

A refusal of the service's own (a :class:`~trio_supervisor.service.wire.Problem`) keeps
its status and fields; a :class:`~trio_supervisor.errors.SupervisorError` gets its
call's status, its ``Retry-After`` and the fields it says it adds
(:meth:`~trio_supervisor.errors.SupervisorError.problem_fields`, which the client reads
back); an argument the supervisor refused is a 422, anything else a 500. Each refusal of
a caller (401, 403, 429, a full runner) is logged, naming its tenant.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import _defaults as defaults
from ..errors import (
    ProblemCode,
    RunnerClosingError,
    RunnerFullError,
    RunnerRestartingError,
    StateStorageError,
    SupervisorError,
)
from .admission import retry_after_header
from .callers import Caller, tenant_label
from .calls import Call
from .tenants import Tenant
from .wire import Problem, problem_body

__all__ = ["RETRY_AFTER", "outcome", "problem", "problem_of"]

logger = logging.getLogger(__name__)

RETRY_AFTER: Final = f"{defaults.CLOSING_RETRY_AFTER:g}"  # the header's text


def problem(
    status: int, code: str, detail: str, fields: Mapping[str, Any] | None = None, **headers: str
) -> Response:
    """A problem+json answer."""
    return JSONResponse(
        {**problem_body(status, code, detail), **(fields or {})},
        status_code=status,
        media_type="application/problem+json",
        headers=headers or None,
    )


def problem_of(
    error: Exception, request: Request, call: Call, caller: Caller | None, *, poisoned: bool
) -> Response:
    """``error``, met by ``call``, as its answer (``poisoned``: whether the supervisor
    is; a plain ``SupervisorError`` is then its poisoning crash, a 503)."""
    if isinstance(error, Problem):
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
        if error.status in (401, 403):
            _log_refusal(request, caller, error.status, error.detail)
        return problem(error.status, error.code, error.detail, error.fields, **headers)
    restarting: str | None = getattr(request.app.state, "restarting", None)
    if restarting is not None and isinstance(error, RunnerClosingError | StateStorageError):
        # The runner makes a new incarnation (service/healing.py): this call, under way
        # as the old one was poisoned, may be made again of the next (B5).
        error = RunnerRestartingError(restarting)
    if isinstance(error, SupervisorError):
        status = call.status(error, poisoned=poisoned)
        headers = {"Retry-After": RETRY_AFTER} if isinstance(error, RunnerClosingError) else {}
        body = problem_body(status, error.code, error.detail)
        retry_after = getattr(error, "retry_after", None)
        if retry_after is not None:
            headers = {"Retry-After": retry_after_header(retry_after)}
        body.update(error.problem_fields())
        if status in (401, 403, 429) or isinstance(error, RunnerFullError):
            _log_refusal(request, caller, status, error.detail)
        notes = getattr(error, "__notes__", None)
        if notes:
            body["notes"] = [str(note) for note in notes]  # L5: "the supervisor is poisoned"
        return JSONResponse(
            body, status_code=status, media_type="application/problem+json", headers=headers
        )
    if isinstance(error, ValueError | TypeError):
        # The supervisor refused an argument; the message names it.
        return problem(422, ProblemCode.INVALID, str(error))
    logger.exception("%s %s failed", request.method, request.url.path)
    return problem(500, ProblemCode.INTERNAL, f"the runner failed: {type(error).__name__}")


def outcome(answer: Response) -> str:
    """The error code of a problem answer, for the calls' metric."""
    try:
        return str(json.loads(bytes(answer.body))["code"])
    except (ValueError, KeyError, TypeError):
        return str(answer.status_code)


def _log_refusal(request: Request, caller: Caller | None, status: int, detail: str) -> None:
    logger.warning(
        "refused %s %s (%d) for %s: %s",
        request.method,
        request.url.path,
        status,
        f"tenant {caller.name!r}"
        if isinstance(caller, Tenant)
        else caller.name
        if caller
        else "no valid token",
        detail,
        extra={"tenant": tenant_label(caller), "status": status},
    )
