"""The OpenAPI 3.1 document of the runner service (``GET /openapi.json``).

The schemas are generated from the value classes themselves (their attrs fields and
type hints, and the checks their validators make), so the document cannot drift from
what the converter reads and writes. The paths are written out: each is one call of
docs/service.md section A, with the statuses it may answer.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

import attrs

from .. import __version__
from ..model import (
    ActiveRecord,
    CodeIdentity,
    Limits,
    SessionRecord,
    StopReason,
    Termination,
)
from .wire import MAX_LEASE, AdminDisposeBody, HandleBody, KeyBody, LoadBody, OpenBody

__all__ = ["document"]

_REF = "#/components/schemas/"

# Checks the validators make, as JSON Schema keywords: (class, field) -> keywords.
_CHECKS: Final[Mapping[tuple[str, str], Mapping[str, Any]]] = {
    # No NUL: a key goes into the child's environment (wire.py refuses it).
    ("Key", "identity"): {"minLength": 1, "pattern": "^[^\\x00]*$"},
    ("Key", "instance"): {"minLength": 1, "pattern": "^[^\\x00]*$"},
    ("Handle", "token"): {"minLength": 1},
    ("Handle", "generation"): {"minimum": 1},
    ("Load", "specifier"): {"minLength": 1},
    ("CodeIdentity", "specifier"): {"minLength": 1},
    ("ChildIdentity", "adapter"): {"minLength": 1},
    ("ChildIdentity", "ref"): {"minLength": 1},
    ("Fault", "type"): {"minLength": 1},
    ("ExitStatus", "descendants_killed"): {"minimum": 0},
    ("OpenBody", "request_id"): {"minLength": 1},
    ("OpenBody", "expected_generation"): {"minimum": 0},
    ("OpenBody", "lease"): {"exclusiveMinimum": 0, "maximum": MAX_LEASE},
    ("AdminDisposeBody", "generation"): {"minimum": 1},
    **{("Limits", name): {"minimum": 0} for name in attrs.fields_dict(Limits)},
    **{
        (record, name): rule
        for record in (
            "OpenRecord",
            "LoadingRecord",
            "LoadedRecord",
            "StoppingRecord",
            "StoppedRecord",
        )
        for name, rule in (("request_id", {"minLength": 1}), ("lease", {"exclusiveMinimum": 0}))
    },
}


def _phase_of(member: Any) -> str:
    return str(member.phase.value)


def _name_of(member: Any) -> str:
    return str(member.__name__)


# Tagged unions: the field that names the member, and how a member is named.
_UNIONS: Final[tuple[tuple[Any, str, Callable[[Any], str]], ...]] = (
    (SessionRecord, "phase", _phase_of),
    (ActiveRecord, "phase", _phase_of),
    (StopReason, "kind", _name_of),
)


class _Schemas:
    """Collects the component schemas a document refers to."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {}

    def of(self, kind: Any) -> dict[str, Any]:
        """The schema of a type, registering the classes it refers to."""
        for union, tag, name_of in _UNIONS:
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
            checks = _CHECKS.get((name, field.name))
            if checks:
                schema = _with(schema, checks)
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


_ERRORS: Final = {
    400: "The body is not JSON (or is nested too deeply), or Content-Length is not a number.",
    401: "No valid bearer token.",
    413: "The body is over 1 MiB.",
    422: (
        "A field is missing, of the wrong type or invalid (a string holding a lone "
        "surrogate, a key holding a NUL); the detail names it."
    ),
    503: "The runner is poisoned (StateStorageError) or shutting down (RunnerClosing).",
}


def _call(
    summary: str,
    body: type | None,
    answer: Mapping[str, Any],
    statuses: Mapping[int, str],
    *,
    operators: bool = False,
) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {
            "description": "Done.",
            "content": {"application/json": {"schema": dict(answer)}},
        }
    }
    errors = {**_ERRORS, **statuses}
    if operators:
        errors[403] = "The hosts' token may not make operator calls."
    if body is None:
        errors.pop(400)
        errors.pop(413)
    for status, description in sorted(errors.items()):
        responses[str(status)] = {
            "description": description,
            "content": {"application/problem+json": {"schema": {"$ref": _REF + "Problem"}}},
        }
    operation: dict[str, Any] = {
        "summary": summary,
        "security": [{"bearer": []}],
        "responses": responses,
    }
    if body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF + body.__name__}}},
        }
    return operation


def _answer(schemas: _Schemas, **fields: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: schemas.of(kind) for name, kind in fields.items()},
        "required": list(fields),
    }


_SESSION_ERRORS: Final = {
    404: "StaleSession: no retained session has this token, key and generation.",
    409: "SessionStopped or SessionConflict.",
    410: "LeaseExpired: the session's lease ran out.",
    500: "ExecutionError or TerminationUnconfirmed: the runner could not act on a child.",
}


@functools.cache
def document() -> dict[str, Any]:
    """The OpenAPI document; built once, on first use."""
    schemas = _Schemas()
    for body in (OpenBody, HandleBody, LoadBody, KeyBody, AdminDisposeBody):
        schemas.of(body)
    record = schemas.of(SessionRecord)
    public = {"$ref": _REF + "PublicRecord"}
    paths: dict[str, Any] = {
        "/v1/open": {
            "post": _call(
                "Open the next generation of a key (O1-O11).",
                OpenBody,
                {"type": "object", "properties": {"record": record}, "required": ["record"]},
                {404: "StaleSession: expected_generation is not the key's high-water."},
            )
        },
        "/v1/renew": {
            "post": _call(
                "Renew a session's lease (R1-R6).",
                HandleBody,
                _answer(schemas, lease=float),
                _SESSION_ERRORS,
            )
        },
        "/v1/load": {
            "post": _call(
                "Load code into a session (L1-L6).",
                LoadBody,
                _answer(schemas, code=CodeIdentity),
                {**_SESSION_ERRORS, 422: "PackageError, or an invalid field."},
            )
        },
        "/v1/dispose": {
            "post": _call(
                "Stop a session and say how its child ended (D1-D5).",
                HandleBody,
                _answer(schemas, termination=Termination),
                _SESSION_ERRORS,
            )
        },
        "/v1/status": {
            "post": _call(
                "A session's last durable record (S1).",
                HandleBody,
                {"type": "object", "properties": {"record": record}, "required": ["record"]},
                {404: _SESSION_ERRORS[404]},
            )
        },
        "/v1/high-water": {
            "post": _call(
                "The highest generation ever opened for a key, or null (S2).",
                KeyBody,
                _answer(schemas, generation=int | None),
                {},
            )
        },
        "/v1/sessions": {
            "get": {
                **_call(
                    "Every retained record, tokens left out, in pages (operators).",
                    None,
                    {
                        "type": "object",
                        "properties": {
                            "sessions": {"type": "array", "items": public},
                            "next": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                        },
                        "required": ["sessions", "next"],
                    },
                    {},
                    operators=True,
                ),
                "parameters": [
                    _query("phase", {"enum": ["Open", "Loading", "Loaded", "Stopping", "Stopped"]}),
                    _query("identity", {"type": "string"}),
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000}),
                    _query("after", {"type": "string"}),
                ],
            }
        },
        "/v1/logs": {
            "get": {
                **_call(
                    "The tail of a child's log (operators).",
                    None,
                    {"type": "string"},
                    {404: "No retained session of this key and generation."},
                    operators=True,
                ),
                "parameters": [
                    _query("identity", {"type": "string", "minLength": 1}, required=True),
                    _query("instance", {"type": "string", "minLength": 1}, required=True),
                    _query("generation", {"type": "integer", "minimum": 1}, required=True),
                    _query("tail", {"type": "integer", "minimum": 0}),
                ],
            }
        },
        "/v1/admin/dispose": {
            "post": _call(
                "Dispose a session by key and generation, with no session token (operators).",
                AdminDisposeBody,
                _answer(schemas, termination=Termination),
                {404: "No retained session of this key and generation.", 500: "As dispose."},
                operators=True,
            )
        },
        "/healthz": {"get": _plain("The process answers.", {"status": {"const": "ok"}})},
        "/readyz": {
            "get": {
                **_plain("The runner takes work.", {"status": {"const": "ready"}}),
                "responses": {
                    **_plain("", {"status": {"const": "ready"}})["responses"],
                    "503": {
                        "description": "Poisoned or shutting down.",
                        "content": {
                            "application/problem+json": {"schema": {"$ref": _REF + "Problem"}}
                        },
                    },
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document.",
                "security": [],
                "responses": {
                    "200": {
                        "description": "The OpenAPI document.",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            }
        },
    }
    paths["/v1/events"] = {
        "get": _call(
            "Each record the runner makes durable, as server-sent events (operators).",
            None,
            {"type": "string"},
            {},
            operators=True,
        )
    }
    paths["/metrics"] = {
        "get": _call(
            "The runner's metrics in Prometheus' text format (operators).",
            None,
            {"type": "string"},
            {},
            operators=True,
        )
    }
    paths["/"] = {
        "get": {
            "summary": "The dashboard: a page for operators (it asks for their token).",
            "security": [],
            "responses": {
                "200": {
                    "description": "The page.",
                    "content": {"text/html": {"schema": {"type": "string"}}},
                }
            },
        }
    }
    # These answer text, not JSON: the logs, an event stream ("event: record" or
    # "event: overflow", then "data: <the record as /v1/sessions lists it>"), metrics.
    for path, media in (
        ("/v1/logs", "text/plain"),
        ("/v1/events", "text/event-stream"),
        ("/metrics", "text/plain"),
    ):
        paths[path]["get"]["responses"]["200"]["content"] = {media: {"schema": {"type": "string"}}}
    paths["/v1/events"]["get"]["responses"].pop("422", None)
    paths["/metrics"]["get"]["responses"].pop("422", None)
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
        },
        "required": ["type", "title", "status", "detail", "code"],
    }
    components["PublicRecord"] = _PUBLIC_RECORD
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


# A record as operators see it: a record whose handles carry no token. Operator answers
# are informational, so they are described loosely rather than as a second copy of every
# record schema.
_PUBLIC_RECORD: Final = {
    "type": "object",
    "properties": {
        "phase": {"enum": ["Open", "Loading", "Loaded", "Stopping", "Stopped"]},
        "handle": {
            "type": "object",
            "properties": {
                "key": {"$ref": _REF + "Key"},
                "generation": {"type": "integer", "minimum": 1},
            },
            "required": ["key", "generation"],
            "additionalProperties": False,
        },
    },
    "required": ["phase", "handle"],
}


def _query(name: str, schema: Mapping[str, Any], *, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": dict(schema)}


def _plain(summary: str, properties: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "summary": summary,
        "security": [],
        "responses": {
            "200": {
                "description": summary or "Ready.",
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": dict(properties),
                            "required": list(properties),
                        }
                    }
                },
            }
        },
    }
