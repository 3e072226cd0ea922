"""The wire API page (docs/reference/wire.md), made from the OpenAPI document a runner
serves (``trio_supervisor.service.openapi.document``, ``GET /openapi.json``).

Each call: its method and path, who may make it, its query parameters, its body and its
answers, status by status; then each schema the calls name, field by field. Nothing here
describes the API: it only lays the document out for reading.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from trio_supervisor.errors import BY_CODE
from trio_supervisor.service import calls as calls_module
from trio_supervisor.service.openapi import document

_REF = "#/components/schemas/"
_WHO = {
    "hosts": "a host's token (or the operators')",
    "operators": "the operators' token",
    None: "no token",
}
# "Code: meaning; Code: meaning": where one error's meaning ends and the next begins.
_NEXT_CODE = re.compile("; (?=(?:" + "|".join(map(re.escape, BY_CODE)) + "): )")
_CODE = re.compile("^(" + "|".join(map(re.escape, BY_CODE)) + "): ")


def cell(text: str) -> str:
    """``text`` made safe for a cell of a Markdown table."""
    return " ".join(text.split()).replace("|", "\\|")


def _schema_link(name: str) -> str:
    return f"{{ref}}`{name} <wire-schema-{name}>`"


def type_of(schema: Mapping[str, Any]) -> str:
    """A JSON Schema in a few words, its named schemas linked."""
    if "$ref" in schema:
        return _schema_link(schema["$ref"].removeprefix(_REF))
    for union in ("oneOf", "anyOf"):
        if union in schema:
            text = " or ".join(type_of(choice) for choice in schema[union])
            tag = schema.get("discriminator", {}).get("propertyName")
            return f"{text} (by `{tag}`)" if tag else text
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return "one of " + ", ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    kind = schema.get("type", "any JSON value")
    if kind == "array":
        kind = "array of " + type_of(schema.get("items", {}))
    bounds = _bounds(schema)
    return f"{kind} ({bounds})" if bounds else kind


def _bounds(schema: Mapping[str, Any]) -> str:
    parts = []
    for key, word in (
        ("minimum", "≥"),
        ("exclusiveMinimum", ">"),
        ("maximum", "≤"),
        ("exclusiveMaximum", "<"),
    ):
        if key in schema:
            parts.append(f"{word} {schema[key]:g}")
    if "minLength" in schema or "maxLength" in schema:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        parts.append(f"{low} to {high} characters" if high else f"{low} characters at least")
    if "pattern" in schema:
        parts.append(f"matching `{schema['pattern']}`")
    return ", ".join(parts)


def _fields(schema: Mapping[str, Any]) -> list[str]:
    """A table of an object schema's fields; a sentence for any other schema."""
    if schema.get("type") != "object" or "properties" not in schema:
        return [f"A {type_of(schema)}.", ""]
    required = set(schema.get("required", ()))
    rows = ["| Field | Type | Required | Meaning |", "|---|---|---|---|"]
    for name, field in schema["properties"].items():
        rows.append(
            f"| `{name}` | {cell(type_of(field))} | {'yes' if name in required else 'no'} "
            f"| {cell(field.get('description', ''))} |"
        )
    if not schema.get("properties"):
        return ["A JSON object.", ""]
    return [*rows, ""]


def _answer(status: str, answer: Mapping[str, Any]) -> list[str]:
    lines = []
    for media, content in answer.get("content", {}).items():
        schema = content.get("schema", {})
        if status == "200":
            lines += [f"**200** (`{media}`):", ""]
            lines += _fields(schema) if media == "application/json" else [f"{media} text.", ""]
            return lines
    meanings = _NEXT_CODE.split(answer["description"])
    lines.append(f"**{status}** (`application/problem+json`, {_schema_link('Problem')}):")
    lines.append("")
    for meaning in meanings:
        found = _CODE.match(meaning)
        if found:
            kind = BY_CODE[found[1]]
            meaning = (
                f"`{found[1]}` ({{py:exc}}`~trio_supervisor.{kind.__name__}`): "
                + meaning[found.end() :]
            )
        lines.append(f"- {' '.join(meaning.split())}")
    return [*lines, ""]


def calls() -> str:
    """Each call of the document, in the order of the service's table of calls."""
    paths = document()["paths"]
    out: list[str] = []
    for call in calls_module.CALLS:
        operation = paths[call.path][call.method.lower()]
        assert operation["operationId"] == call.name
        out += [
            f"(wire-call-{call.name})=",
            f"### `{call.method} {call.path}`",
            "",
            operation["summary"],
            "",
            f"Call name `{call.name}`; needs {_WHO[call.role]}.",
            "",
        ]
        if "parameters" in operation:
            out += ["Query parameters:", ""]
            out += ["| Name | Type | Required | Meaning |", "|---|---|---|---|"]
            for param in operation["parameters"]:
                out.append(
                    f"| `{param['name']}` | {cell(type_of(param['schema']))} "
                    f"| {'yes' if param['required'] else 'no'} "
                    f"| {cell(param.get('description', ''))} |"
                )
            out.append("")
        if "requestBody" in operation:
            schema = operation["requestBody"]["content"]["application/json"]["schema"]
            out += [f"Body (`application/json`): {type_of(schema)}.", ""]
        out += ["Answers:", ""]
        for status, answer in operation["responses"].items():
            out += _answer(status, answer)
    return "\n".join(out)


def schemas() -> str:
    """Each schema of the document's components, field by field."""
    components = document()["components"]["schemas"]
    out: list[str] = []
    for name in sorted(components):
        schema = components[name]
        out += [f"(wire-schema-{name})=", f"### {name}", ""]
        if "description" in schema:
            out += [schema["description"], ""]
        out += _fields(schema)
    return "\n".join(out)
