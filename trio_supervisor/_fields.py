"""The checks every value's fields go through, and the freezing of JSON configs.

Each check names the class and the field (``Limits.cpu_seconds must be ...``), so the
error says exactly what was wrong; ``model.py`` puts them on its fields. Nothing here
does I/O or knows about Trio.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import attrs

JSON: TypeAlias = bool | int | float | str | Sequence["JSON"] | Mapping[str, "JSON"] | None


def where(instance: object, attribute: attrs.Attribute[Any]) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def text(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{where(instance, attribute)} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{where(instance, attribute)} must not be empty")


def optional_text(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"{where(instance, attribute)} must be a str or None, not {type(value).__name__}"
        )


def integer(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    # bool is an int to Python, never to us.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{where(instance, attribute)} must be an int, not {type(value).__name__}")


def optional_integer(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        integer(instance, attribute, value)


def at_least(minimum: int) -> Any:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        integer(instance, attribute, value)
        assert isinstance(value, int)
        if value < minimum:
            raise ValueError(f"{where(instance, attribute)} must be >= {minimum}, got {value}")

    return check


def limit(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    integer(instance, attribute, value)
    assert isinstance(value, int)
    if value < 0:
        raise ValueError(
            f"{where(instance, attribute)} must be None (no limit) or >= 0, got {value}"
        )


def cpu_limit(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    limit(instance, attribute, value)
    if value == 0:
        raise ValueError(
            f"{where(instance, attribute)} must be None (no limit) or >= 1, got 0: "
            "a child with no CPU time cannot start"
        )


def as_float(value: object) -> object:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def lease(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, float):
        raise TypeError(
            f"{where(instance, attribute)} must be a number of seconds, not {type(value).__name__}"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{where(instance, attribute)} must be a positive finite number of seconds, "
            f"got {value!r}"
        )


def freeze_json(value: object, where: str = "config") -> Any:
    """Copy a JSON value into an immutable one: mappings become read-only, lists tuples."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} holds {value!r}, which JSON cannot represent")
        return value
    if isinstance(value, Mapping):
        frozen: dict[str, Any] = {}
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{where} has a key {name!r}; JSON object keys are strings")
            frozen[name] = freeze_json(item, f"{where}[{name!r}]")
        return types.MappingProxyType(frozen)
    if isinstance(value, list | tuple):
        return tuple(freeze_json(item, f"{where}[{index}]") for index, item in enumerate(value))
    raise TypeError(f"{where} holds a {type(value).__name__}, which is not a JSON value")


def thaw(value: object) -> Any:
    """The plain JSON form of a frozen JSON value: read-only mappings become dicts,
    tuples (and lists) become lists. The inverse of what ``Load`` does to its config."""
    if isinstance(value, Mapping):
        return {name: thaw(item) for name, item in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(item) for item in value]
    return value


def freeze_config(value: object) -> Mapping[str, JSON]:
    if not isinstance(value, Mapping):
        raise TypeError(f"Load.config must be a mapping, not {type(value).__name__}")
    frozen: Mapping[str, JSON] = freeze_json(value, "Load.config")
    return frozen


def plain_integer(value: object) -> object:
    # A signal number is often a ``signal.Signals`` member; stored, it reads back as a
    # plain int, so it is one from the start (the same value before and after storage).
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else value


def count(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    integer(instance, attribute, value)
    assert isinstance(value, int)
    if value < 0:
        raise ValueError(f"{where(instance, attribute)} must be >= 0, got {value}")


def flag(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where(instance, attribute)} must be a bool, not {type(value).__name__}")
