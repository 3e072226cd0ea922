"""The OpenAPI 3.1 document of the runner service (``GET /openapi.json``).

Nothing in it is written twice. The paths, and the statuses each call may answer, are
made from the table of calls (``calls.py``, docs/service.md section A); the schemas from
the value classes themselves: their attrs fields and type hints, the bounds their checks
state (:class:`~trio_supervisor._fields.Check`), the wire's own checks
(``wire.REFINEMENTS``), and the tagged unions of the one converter
(``codec.TAGGED_UNIONS``).
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, Final, Literal

import attrs

from .. import __version__
from .._fields import Check
from ..codec import TAGGED_UNIONS
from ..errors import RunnerLostError, SupervisorError
from ..model import Phase
from .calls import CALLS, Call
from .fleet import MISDIRECTED
from .wire import MAX_BODY, REFINEMENTS, status_for

__all__ = ["document"]

_REF = "#/components/schemas/"


class _Schemas:
    """Collects the component schemas a document refers to."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {}

    def of(self, kind: Any) -> dict[str, Any]:
        """The schema of a type, registering the classes it refers to."""
        for union, tag, name_of in TAGGED_UNIONS:
            if kind == union:
                members = typing.get_args(union)
                for member in members:
                    self._object(member, tag, name_of(member))
                return {
                    "oneOf": [{"$ref": _REF + member.__name__} for member in members],
                    "discriminator": {
                        "propertyName": tag,
                        "mapping": {name_of(m): _REF + m.__name__ for m in members},
                    },
                }
        origin, args = typing.get_origin(kind), typing.get_args(kind)
        if isinstance(kind, types.UnionType) or origin is typing.Union:
            present = [arg for arg in args if arg is not type(None)]
            inner = [self.of(arg) for arg in present]
            choices = inner + ([{"type": "null"}] if len(present) < len(args) else [])
            return choices[0] if len(choices) == 1 else {"anyOf": choices}
        if kind is str:
            return {"type": "string"}
        if kind is bool:
            return {"type": "boolean"}
        if kind is int:
            return {"type": "integer"}
        if kind is float:
            return {"type": "number"}
        if origin is Literal:
            return {"enum": list(args)}
        if origin is tuple:
            return {"type": "array", "items": self.of(args[0])}
        if origin is Mapping or kind is Mapping:
            return {"type": "object"}  # Load.config: any JSON object
        if attrs.has(kind):
            self._object(kind)
            return {"$ref": _REF + kind.__name__}
        raise TypeError(f"no schema for {kind!r}")

    def _object(self, cls: type, tag: str | None = None, tag_value: str | None = None) -> None:
        name = cls.__name__
        if name in self.components:
            return
        self.components[name] = {}  # a placeholder, against recursion
        hints = typing.get_type_hints(cls)
        properties: dict[str, Any] = {}
        required: list[str] = []
        for field in attrs.fields(cls):
            schema = self.of(hints[field.name])
            for check in (field.validator, REFINEMENTS.get((cls, field.name))):
                if isinstance(check, Check):
                    schema = _with(schema, check.schema)
            properties[field.name] = schema
            if field.default is attrs.NOTHING:
                required.append(field.name)
        if tag is not None:
            properties[tag] = {"const": tag_value}
            required.append(tag)
        self.components[name] = {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }


def _with(schema: dict[str, Any], checks: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` with ``checks`` applied to its non-null choice."""
    if "anyOf" in schema:
        return {
            "anyOf": [
                choice if choice.get("type") == "null" else {**choice, **checks}
                for choice in schema["anyOf"]
            ]
        }
    return {**schema, **checks}


# What a status means when no supervisor error is behind it.
_REFUSALS: Final[Mapping[int, str]] = {
    400: "The body is not JSON (or is nested too deeply), or Content-Length is not a number.",
    401: "No valid bearer token.",
    403: "A tenant's token may not make this operator call.",
    413: f"The body is over {MAX_BODY} bytes.",
}
_INVALID_BODY: Final = (
    "a field is missing, of the wrong type or invalid (a string holding a lone surrogate, "
    "a key holding a NUL); the detail names it"
)
_INVALID_QUERY: Final = "a query parameter is invalid; the detail names it"
_MISDIRECTED: Final = (
    f"{MISDIRECTED}: another runner of the fleet holds this session; the problem's "
    "`owner` is its id and `location` its URL, where the same call goes"
)
_PROBLEM: Final = {"application/problem+json": {"schema": {"$ref": _REF + "Problem"}}}


def _meaning(kind: type[SupervisorError]) -> str:
    """An error class in a few words: its code and its docstring's first sentence (which
    may run over several lines)."""
    summary = " ".join((kind.__doc__ or "").strip().split("\n\n")[0].split())
    end = summary.find(". ")
    summary = (summary if end < 0 else summary[:end]).rstrip(".")
    return f"{kind.code}: {summary[:1].lower()}{summary[1:]}"


def _statuses(call: Call) -> dict[int, list[str]]:
    """Every status ``call`` may answer besides 200, with what each means."""
    meanings: dict[int, list[str]] = {}
    if call.role is not None:
        meanings[401] = [_REFUSALS[401]]
    if call.role == "operators" and not call.tenants_see_own:
        meanings[403] = [_REFUSALS[403]]
    if call.body is not None:
        meanings[400] = [_REFUSALS[400]]
        meanings[413] = [_REFUSALS[413]]
        meanings.setdefault(422, []).append(_INVALID_BODY)
    if call.params:
        meanings.setdefault(422, []).append(_INVALID_QUERY)
    if call.routed:
        meanings[421] = [_MISDIRECTED]
        meanings.setdefault(503, []).append(_meaning(RunnerLostError))
    for kind in call.errors:
        if kind in call.overrides:
            status, meaning = call.overrides[kind]
            meanings.setdefault(status, []).append(f"{kind.code}: {meaning}")
            continue
        known = status_for(kind)
        assert known is not None, kind
        meanings.setdefault(known, []).append(_meaning(kind))
    for kind, (status, meaning) in call.overrides.items():
        if kind not in call.errors:
            meanings.setdefault(status, []).append(f"{kind.code}: {meaning}")
    return meanings


def _operation(call: Call, schemas: _Schemas) -> dict[str, Any]:
    if call.answer is None:
        answer: dict[str, Any] = {"type": "string"}
    else:
        answer = {
            "type": "object",
            "properties": {
                name: dict(kind) if isinstance(kind, Mapping) else schemas.of(kind)
                for name, kind in call.answer.items()
            },
            "required": list(call.answer),
        }
    responses: dict[str, Any] = {
        "200": {"description": "Done.", "content": {call.media: {"schema": answer}}}
    }
    for status, meanings in sorted(_statuses(call).items()):
        text = "; ".join(meanings)
        responses[str(status)] = {"description": text[:1].upper() + text[1:], "content": _PROBLEM}
    operation: dict[str, Any] = {
        "operationId": call.name,
        "summary": call.summary,
        "security": [{"bearer": []}] if call.role is not None else [],
        "responses": responses,
    }
    if call.body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schemas.of(call.body)}},
        }
    if call.params:
        operation["parameters"] = [
            {
                "name": param.name,
                "in": "query",
                "required": param.required,
                "schema": dict(param.schema),
                **({"description": param.description} if param.description else {}),
            }
            for param in call.params
        ]
    return operation


@functools.cache
def document() -> dict[str, Any]:
    """The OpenAPI document; built once, on first use."""
    schemas = _Schemas()
    paths: dict[str, Any] = {}
    for call in CALLS:
        paths.setdefault(call.path, {})[call.method.lower()] = _operation(call, schemas)
    components = schemas.components
    components["Problem"] = {
        "type": "object",
        "properties": {
            "type": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "code": {"type": "string"},
            "notes": {"type": "array", "items": {"type": "string"}},
            "owner": {
                "type": "string",
                "description": "421, 503 HolderLost: the runner holding the session",
            },
            "location": {"type": "string", "description": "421, 503 HolderLost: that runner's URL"},
            "lease_until": {
                "type": "number",
                "description": "503 HolderLost: when the holder's lease ran out (Unix seconds)",
            },
            "takeover_at": {
                "type": "number",
                "description": "503 HolderLost: when its sessions may be taken over (Unix seconds)",
            },
        },
        "required": ["type", "title", "status", "detail", "code"],
    }
    components["PublicRecord"] = _public_record(schemas)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "trio_supervisor runner",
            "version": __version__,
            "description": "Sessions, leases and children of a trio_supervisor runner.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def _public_record(schemas: _Schemas) -> dict[str, Any]:
    """A record as operators see it: a record whose handles carry no token.

    Operator answers are informational, so they are described loosely rather than as a
    second copy of every record schema.
    """
    handle = schemas.components["Handle"]
    return {
        "type": "object",
        "properties": {
            "phase": {"enum": [phase.value for phase in Phase]},
            "runner": {"type": "string", "description": "The runner holding the session."},
            "described": {
                "anyOf": [{"type": "string"}, {"type": "null"}],
                "description": "How its child ended, in one line (Termination.describe()); "
                "null until it stopped.",
            },
            "handle": {
                "type": "object",
                "properties": {name: handle["properties"][name] for name in ("key", "generation")},
                "required": ["key", "generation"],
                "additionalProperties": False,
            },
        },
        "required": ["phase", "handle", "runner"],
    }
