"""The errors page's tables (docs/reference/errors.md), made from the code.

Every error class of ``trio_supervisor.errors``, with its wire code (``code``), the HTTP
status a runner answers it with (``service/wire.py``'s ``STATUS``, and a call's own
status from ``service/calls.py``'s ``CALLS``), the calls that may answer it, what its
problem body adds (``problem_fields``), and when it happens (its docstring). Then the
codes the service answers before a call reaches the supervisor (``ProblemCode``).
"""

from __future__ import annotations

import inspect

from trio_supervisor import errors
from trio_supervisor.service import calls as calls_module
from trio_supervisor.service import openapi, wire

# Statuses the service's guard answers before a call runs, so no table of the code holds
# them: a missing or unknown token (guard.py) and a session another runner of the fleet
# holds (fleet.py). Checked against the OpenAPI document below.
_GUARD_STATUS = {errors.RunnerAccessError: 401, errors.MisdirectedError: 421}
# Errors no runner answers: the client raises them itself.
_CLIENT_ONLY = (errors.RunnerUnreachableError, errors.SessionLostError)

# What each code the service answers on its own means, and its status. A code added to
# ProblemCode without a line here fails the build.
_PROBLEM_CODES = {
    errors.ProblemCode.MALFORMED: (
        400,
        "The body is not JSON, is nested too deeply, or its Content-Length is not a number.",
    ),
    errors.ProblemCode.INVALID: (
        422,
        "A body field or a query parameter is missing, of the wrong type or out of bounds; "
        "the detail names it. The client raises `ValueError`, as the embedded call would.",
    ),
    errors.ProblemCode.TOO_LARGE: (413, f"The body is over {wire.MAX_BODY} bytes."),
    errors.ProblemCode.NOT_FOUND: (404, "No call is served at this path."),
    errors.ProblemCode.METHOD_NOT_ALLOWED: (405, "The path is served with another method."),
    errors.ProblemCode.INTERNAL: (500, "The runner failed, not the call; its log says why."),
}


def _public_classes() -> list[type[errors.SupervisorError]]:
    """Every public error class, each documented class of a code followed by its
    subclasses that share that code."""
    public = [
        getattr(errors, name)
        for name in errors.__all__
        if inspect.isclass(getattr(errors, name))
        and issubclass(getattr(errors, name), errors.SupervisorError)
    ]
    ordered: list[type[errors.SupervisorError]] = []
    for kind in errors.BY_CODE.values():
        ordered.append(kind)
        ordered += [
            other
            for other in public
            if other not in errors.BY_CODE.values()
            and other not in ordered
            and kind in other.__mro__[1:]
            and not any(
                parent in errors.BY_CODE.values() and issubclass(parent, kind)
                for parent in other.__mro__[1:]
                if parent is not kind
            )
        ]
    missing = [kind.__name__ for kind in public if kind not in ordered]
    assert not missing, f"error classes the errors page does not place: {missing}"
    return ordered


def _first_sentence(kind: type) -> str:
    text = " ".join(inspect.getdoc(kind).split("\n\n")[0].split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _answered_by(kind: type[errors.SupervisorError]) -> dict[int, list[str]]:
    """The calls that may answer ``kind``, by status."""
    by_status: dict[int, list[str]] = {}
    for call in calls_module.CALLS:
        statuses: set[int] = set()
        if kind in call.errors or kind in call.overrides:
            override = call.overrides.get(kind)
            status = override[0] if override else wire.status_for(kind)
            assert status is not None, (call.name, kind)
            statuses.add(status)
        if kind is errors.RunnerAccessError and call.role is not None:
            statuses.add(401)
        if kind is errors.OperatorsOnlyError and call.role == "operators":
            statuses.add(403)
        if call.routed and kind is errors.MisdirectedError:
            statuses.add(421)
        if call.routed and kind is errors.RunnerLostError:
            statuses.add(503)
        document = openapi.document()["paths"][call.path][call.method.lower()]["responses"]
        for status in statuses:
            assert str(status) in document, (call.name, status, "not in the OpenAPI document")
            by_status.setdefault(status, []).append(call.name)
    return by_status


def _status(kind: type[errors.SupervisorError]) -> str:
    if kind in _CLIENT_ONLY:
        return "none: the client's own"
    if kind is errors.SupervisorError:
        return "500; 503 while the supervisor is poisoned"
    statuses = set(_answered_by(kind))
    base = _GUARD_STATUS.get(kind) or wire.status_for(kind)
    assert base is not None, kind
    others = sorted(statuses - {base})
    text = str(base)
    for status in others:
        names = ", ".join(f"`{name}`" for name in _answered_by(kind)[status])
        text += f"; {status} from {names}"
    return text


def _calls(kind: type[errors.SupervisorError]) -> str:
    names = sorted({name for names in _answered_by(kind).values() for name in names})
    if not names:
        return "—"
    if len(names) == len(calls_module.CALLS) - sum(
        1 for call in calls_module.CALLS if call.role is None
    ):
        return "every call with a token"
    return ", ".join(f"{{ref}}`{name} <wire-call-{name}>`" for name in names)


def _adds(kind: type[errors.SupervisorError]) -> str:
    if kind in _CLIENT_ONLY:
        return "—"
    parts = [f"`{name}`" for name in kind("").problem_fields()]
    retryable = issubclass(kind, errors._Retryable)
    if retryable:
        parts.append("`Retry-After` header")
    return ", ".join(parts) or "—"


def error_table() -> str:
    """A table of every error class, then each class's reference."""
    for kind, status in _GUARD_STATUS.items():
        assert wire.TITLES.get(status), (kind, status)
    rows = [
        "| Error | Code | HTTP status | Answered by | Adds to the body | When |",
        "|---|---|---|---|---|---|",
    ]
    for kind in _public_classes():
        rows.append(
            f"| {{py:exc}}`~trio_supervisor.{kind.__name__}` | `{kind.code}` | {_status(kind)} "
            f"| {_calls(kind)} | {_adds(kind)} | {_first_sentence(kind)} |"
        )
    sections = ["\n".join(rows), "", "## Each error", ""]
    for kind in _public_classes():
        sections += [
            "```{eval-rst}",
            f".. autoexception:: trio_supervisor.{kind.__name__}",
            "   :members:",
            "```",
            "",
        ]
    return "\n".join(sections)


def problem_codes() -> str:
    """A table of the codes the service answers before a call reaches the supervisor."""
    assert set(_PROBLEM_CODES) == set(errors.ProblemCode), set(errors.ProblemCode) ^ set(
        _PROBLEM_CODES
    )
    rows = ["| Code | HTTP status | When |", "|---|---|---|"]
    for code in errors.ProblemCode:
        status, meaning = _PROBLEM_CODES[code]
        rows.append(f"| `{code.value}` | {status} {wire.TITLES[status]} | {meaning} |")
    return "\n".join(rows)
