"""The configuration files page's tables (docs/reference/config-files.md), made from the
code.

``serve --config FILE``: each key is a field of ``RunnerConfig`` (``service/config.py``),
whose metadata holds its flag's help; its type is the field's, its default the field's.
``[limits]`` (the config file's, and each tenant's) holds ``default`` and ``max``, each
with the fields of ``Limits``. ``serve --tenants FILE``: the keys of a tenant's table
are those the reader (``service/tenants_file.py``) accepts, asked of the reader itself;
each key's meaning is its class's docstring (``Attributes:``).
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from trio_supervisor.model import Limits
from trio_supervisor.service import tenants_file
from trio_supervisor.service.config import FLAG, RunnerConfig
from trio_supervisor.service.tenants import Fairness, Quota, Tenant, TenantsError


def attributes(kind: type) -> dict[str, str]:
    """The ``Attributes:`` section of a class's Google-style docstring, by name (``a, b:
    text`` gives each of ``a`` and ``b`` the text)."""
    lines = (inspect.getdoc(kind) or "").splitlines()
    found: dict[str, str] = {}
    inside, names = False, []
    for line in lines:
        if line.strip() == "Attributes:":
            inside = True
            continue
        if not inside:
            continue
        if line and not line.startswith(" "):
            break  # the next section
        entry = re.match(r"^    ([\w, ]+):(?: (.*))?$", line)
        if entry:
            names = [name.strip() for name in entry[1].split(",")]
            for name in names:
                found[name] = entry[2] or ""
        elif line.strip():
            for name in names:
                found[name] += " " + line.strip()
    return {name: " ".join(text.split()) for name, text in found.items()}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _toml_type(hint: Any, name: str) -> str:
    """The TOML type a key of this hint takes."""
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = args[0]
    if name == "retain_for":
        return "number (seconds) or string (`90s`, `30m`, `1h`, `2d`)"
    if name == "child_users":
        return "string `FIRST-LAST`"
    if hint is bool:
        return "boolean"
    if hint is int:
        return "integer"
    if hint is float:
        return "number"
    if hint in (str, Path):
        return "string" + (" (a path)" if hint is Path else "")
    if typing.get_origin(hint) is Literal:
        return "string: " + ", ".join(f"`{value}`" for value in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return "array of strings" + (" (paths)" if typing.get_args(hint)[0] is Path else "")
    if typing.get_origin(hint) is Mapping:
        return "table: `NAME = [ARGV, ...]`"
    if attrs.has(hint):
        return "table"
    raise TypeError(f"no TOML type for {name}: {hint!r}")


def _default(field: attrs.Attribute[Any], help_text: str) -> str:
    said = re.search(r"\[default: ([^\]]*)\]", help_text)
    if said:
        return said[1]
    if isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
        made = field.default.factory()
        return "none" if not made else f"`{made}`"
    value = field.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str | Path):
        return f'`"{value}"`'
    if isinstance(value, tuple):
        return "`[]`" if not value else f"`{list(value)}`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def config_keys() -> str:
    """A table of the keys of ``serve --config``'s TOML file."""
    hints = typing.get_type_hints(RunnerConfig)
    described = attributes(RunnerConfig)
    rows = ["| Key | Flag | Type | Default | Meaning |", "|---|---|---|---|---|"]
    for field in attrs.fields(RunnerConfig):
        meta = field.metadata.get(FLAG)
        if meta is None:
            flag = "—"
            help_text = described.get(field.name, "")
            assert help_text, f"RunnerConfig.{field.name}: no flag and no Attributes entry"
            if field.name == "limits":
                help_text += " See [`[limits]`](#limits)."
        else:
            flag = f"`{meta['flag'] or '--' + field.name.replace('_', '-')}`"
            help_text = meta["help"]
        meaning = re.sub(r"\s*\[default: [^\]]*\]", "", help_text)
        rows.append(
            f"| `{field.name}` | {flag} | {_cell(_toml_type(hints[field.name], field.name))} "
            f"| {_cell(_default(field, help_text))} | {_cell(meaning)} |"
        )
    return "\n".join(rows)


def _fields_table(kind: type, unit: str = "") -> list[str]:
    """A table of an attrs class's fields as TOML keys: type, default, meaning."""
    described = attributes(kind)
    hints = typing.get_type_hints(kind)
    rows = ["| Key | Type | Meaning |", "|---|---|---|"]
    for field in attrs.fields(kind):
        meaning = described.get(field.name)
        assert meaning, f"{kind.__name__}.{field.name} has no Attributes entry to show"
        rows.append(
            f"| `{field.name}` | {_cell(_toml_type(hints[field.name], field.name))} "
            f"| {_cell(meaning)} |"
        )
    return rows


def limits_keys() -> str:
    """A table of the keys of a ``[limits.default]`` or ``[limits.max]`` table."""
    return "\n".join(_fields_table(Limits))


def _accepted(table: dict[str, Any]) -> list[str]:
    """The keys the tenants file's reader accepts where ``table`` has an unknown key, as
    the reader itself says when it refuses that key."""
    refusal = ""
    try:
        tenants_file.parse(table, "f")
    except TenantsError as error:
        refusal = str(error)
    said = re.search(r"\(the keys are ([^)]*)\)", refusal)
    if said is None:
        raise AssertionError(f"the tenants file's reader did not name its keys: {refusal!r}")
    return said[1].split(", ")


def tenants_keys() -> str:
    """The tables of a tenants file: a tenant's keys, then its quota's and fairness's."""
    tenant = _accepted({"tenants": {"t": {"?": 1}}})
    described = attributes(Tenant)
    hints = typing.get_type_hints(Tenant)
    assert set(tenant) == {field.name for field in attrs.fields(Tenant)} - {"name"}, tenant
    rows = ["| Key | Type | Required | Meaning |", "|---|---|---|---|"]
    for name in tenant:
        field = attrs.fields_dict(Tenant)[name]
        kind = "string (64 hex digits)" if name == "token_sha256" else _toml_type(hints[name], name)
        required = "yes" if field.default is attrs.NOTHING else "no"
        more = {
            "quota": " See [quota](#tenant-quota).",
            "limits": " `default` and `max`, as [`[limits]`](#limits).",
            "fairness": " See [fairness](#tenant-fairness).",
        }.get(name, "")
        rows.append(f"| `{name}` | {_cell(kind)} | {required} | {_cell(described[name])}{more} |")
    out = ["\n".join(rows), "", "(tenant-quota)=", "### `quota`", ""]
    base = {"token_sha256": "0" * 64, "identities": ["a"]}
    for part, kind in (("quota", Quota), ("fairness", Fairness)):
        keys = _accepted({"tenants": {"t": {**base, part: {"?": 1}}}})
        assert keys == [field.name for field in attrs.fields(kind)], (part, keys)
        if part == "fairness":
            out += ["(tenant-fairness)=", "### `fairness`", ""]
        out += [*_fields_table(kind), ""]
    limits = _accepted({"tenants": {"t": {**base, "limits": {"?": 1}}}})
    assert limits == ["default", "max"], limits
    return "\n".join(out)
