"""One cattrs converter for records, in storage and later on the wire.

A record is stored as a JSON object with ``"version": 1`` next to its fields. Phases and
stop reasons are tagged unions: a record carries ``"phase": "Loaded"``, a reason
``"kind": "Expired"``. A termination's cause is a list of ``{"type", "message"}``.

Reading is strict: an unknown version, an unknown tag, a missing or extra field, or a
value of the wrong JSON type raises :class:`~trio_supervisor.errors.RecordFormatError`
naming the field by its path (``$.previous.handle.generation``). Nothing is coerced: a
generation stored as ``"3"`` is an error, not 3.

:func:`encode` and :func:`decode` both go through :data:`converter`, so a hook
registered on it (for :class:`~trio_supervisor.model.Limits`, say) takes effect in
storage too. Writing is cattrs' generated unstructure functions and orjson; reading is
``json`` and the converter (orjson would read an integer beyond 64 bits as a float).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from typing import Any, Final, TypeVar

import cattrs
import orjson
from cattrs.cols import list_structure_factory
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from .errors import RecordFormatError
from .model import (
    ActiveRecord,
    ChildIdentity,
    ExitStatus,
    Limits,
    Load,
    Phase,
    SessionRecord,
    StopReason,
    thaw,
)

__all__ = [
    "TAGGED_UNIONS",
    "VERSION",
    "converter",
    "decode",
    "describe_error",
    "encode",
    "structure",
    "unstructure",
]

VERSION: Final = 1

converter: Final = cattrs.Converter(forbid_extra_keys=True)

_T = TypeVar("_T")


# -- strict scalars: JSON gives us the right types, or the record is corrupt ------------


def _strict(kind: type[_T], *accepted: type) -> Callable[[object, type], _T]:
    allowed = accepted or (kind,)

    def structure_scalar(value: object, _: type) -> _T:
        if isinstance(value, bool) and kind is not bool:
            raise TypeError(f"expected {kind.__name__}, got a boolean")
        if not isinstance(value, allowed):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return kind(value)  # type: ignore[call-arg]

    return structure_scalar


def _is_array(kind: Any) -> bool:
    """Whether ``kind`` is ``tuple[X, ...]``, which is stored as a JSON array."""
    return typing.get_origin(kind) is tuple and typing.get_args(kind)[1:] == (Ellipsis,)


def _strict_array(kind: Any, target: cattrs.Converter) -> Callable[[object, Any], Any]:
    # cattrs reads any iterable as a tuple: {} or "" would be read as (). Its list
    # factory names a bad item by its index, as its tuple hooks do.
    items = list_structure_factory(kind, target)

    def structure_array(value: object, as_type: Any) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise TypeError(f"expected an array, got {type(value).__name__}")
        return tuple(items(value, as_type))

    return structure_array


# -- Load.config: an immutable JSON value in memory, plain JSON in storage ---------------


def _config_as_is(value: object, _: object) -> object:
    # Load's own converter checks and freezes it, with an error naming the bad entry.
    return value


# -- tagged unions ---------------------------------------------------------------------


def _tagged(
    target: cattrs.Converter, union: Any, tag_name: str, tag_of: Callable[[type], str]
) -> None:
    """Un/structure ``union`` with a tag field, refusing unknown or missing tags by name."""
    members: tuple[type, ...] = union.__args__
    tags = {member: tag_of(member) for member in members}
    by_tag = {tag: member for member, tag in tags.items()}
    known = ", ".join(sorted(by_tag))

    # A factory, so that cattrs makes the hook again (with the members' hooks of the
    # moment) whenever a hook is registered: a user's hook counts from then on, even
    # after records were written.
    def unstructure_factory(_: Any) -> Callable[[Any], dict[str, Any]]:
        hooks = {member: target.get_unstructure_hook(member) for member in members}

        def unstructure_tagged(value: Any) -> dict[str, Any]:
            member = type(value)
            data: dict[str, Any] = hooks[member](value)
            data[tag_name] = tags[member]
            return data

        return unstructure_tagged

    def structure_tagged(value: object, _: object) -> Any:
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        if tag_name not in value:
            raise ValueError(f"the {tag_name!r} field is missing (one of {known})")
        tag = value[tag_name]
        member = by_tag.get(tag) if isinstance(tag, str) else None
        if member is None:
            raise ValueError(f"unknown {tag_name} {tag!r} (expected one of {known})")
        fields = {name: item for name, item in value.items() if name != tag_name}
        return target.structure(fields, member)

    target.register_unstructure_hook_factory(lambda kind: kind == union, unstructure_factory)
    target.register_structure_hook(union, structure_tagged)


def _phase_of(member: Any) -> str:
    phase: Phase = member.phase
    return phase.value


def _kind_of(member: type) -> str:
    return member.__name__


TAGGED_UNIONS: Final[tuple[tuple[Any, str, Callable[[Any], str]], ...]] = (
    (StopReason, "kind", _kind_of),
    (ActiveRecord, "phase", _phase_of),
    (SessionRecord, "phase", _phase_of),
)
"""Each tagged union, the field that names its member, and how a member is named; the
runner's OpenAPI document describes the unions from this table too."""


def _configure(target: cattrs.Converter) -> cattrs.Converter:
    """Teach a converter the record format: strict scalars and arrays, Load, the unions."""
    target.register_structure_hook(str, _strict(str))
    target.register_structure_hook(int, _strict(int))
    target.register_structure_hook(float, _strict(float, int, float))
    target.register_structure_hook(bool, _strict(bool))
    target.register_structure_hook_factory(_is_array, _strict_array)
    target.register_unstructure_hook(
        Load, make_dict_unstructure_fn(Load, target, config=override(unstruct_hook=thaw))
    )
    # Written only when set: the records of a runner alone, without tree limits, read
    # as they always did.
    target.register_unstructure_hook(
        ExitStatus,
        make_dict_unstructure_fn(
            ExitStatus,
            target,
            runner_lost=override(omit_if_default=True),
            oom_limit=override(omit_if_default=True),
        ),
    )
    target.register_unstructure_hook(
        Limits,
        make_dict_unstructure_fn(
            Limits,
            target,
            processes=override(omit_if_default=True),
            cpu_percent=override(omit_if_default=True),
        ),
    )
    target.register_unstructure_hook(
        ChildIdentity,
        make_dict_unstructure_fn(
            ChildIdentity,
            target,
            cgroup=override(omit_if_default=True),
            uid=override(omit_if_default=True),
        ),
    )
    target.register_structure_hook(
        Load,
        make_dict_structure_fn(
            Load, target, _cattrs_forbid_extra_keys=True, config=override(struct_hook=_config_as_is)
        ),
    )
    for union, tag_name, tag_of in TAGGED_UNIONS:
        _tagged(target, union, tag_name, tag_of)
    return target


_configure(converter)


# -- the record face -------------------------------------------------------------------


def describe_error(error: BaseException, kind: type | None) -> str:
    """One problem of a structuring error, for ``cattrs.transform_error``.

    Our validators and hooks word their errors for a reader; cattrs words the rest (a
    missing field, an extra one).
    """
    if isinstance(error, ValueError | TypeError) and str(error):
        return str(error)
    return cattrs.v.format_exception(error, kind)


def unstructure(record: SessionRecord) -> dict[str, Any]:
    """Return the versioned JSON-ready form of a record."""
    data: dict[str, Any] = converter.get_unstructure_hook(SessionRecord)(record)
    data["version"] = VERSION
    return data


def structure(data: object) -> SessionRecord:
    """Build a record from its versioned JSON form.

    Raises:
        RecordFormatError: The data is not a version 1 record; the message names the
            field that is wrong.
    """
    if not isinstance(data, dict):
        raise RecordFormatError(f"a stored record must be a JSON object, not {type(data).__name__}")
    version = data.get("version")
    if version != VERSION or isinstance(version, bool):
        raise RecordFormatError(
            f"unsupported record version {version!r} @ $.version "
            f"(this library reads version {VERSION})"
        )
    fields = {name: item for name, item in data.items() if name != "version"}
    try:
        record: SessionRecord = converter.structure(fields, SessionRecord)  # type: ignore[arg-type]
    except Exception as error:
        problems = cattrs.transform_error(error, "$", describe_error)
        raise RecordFormatError("malformed session record: " + "; ".join(problems)) from error
    return record


# ``encode``'s fallback, for what orjson refuses. Its text is orjson's but for non-ASCII
# characters, which it escapes where orjson writes them as UTF-8; readers take both.
# (json.dumps with options would build a new encoder per call; a record is a tree of
# fresh dicts, so there are no cycles to look for.)
_encoder: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False, check_circular=False)


def encode(record: SessionRecord) -> str:
    """Return a record as compact versioned JSON text."""
    data = unstructure(record)
    try:
        # No record holds a float that is not finite, which orjson would write as null.
        return orjson.dumps(data).decode()
    except orjson.JSONEncodeError:
        # What orjson refuses and json writes: an int beyond 64 bits (a limit may be
        # one) or a str with a lone surrogate (an OS error's message may hold one).
        return _encoder.encode(data)


def decode(text: str | bytes) -> SessionRecord:
    """Read a record from versioned JSON text.

    Raises:
        RecordFormatError: The text is not JSON, or not a version 1 record.
    """
    try:
        data = json.loads(text)
    except ValueError as error:  # UnicodeDecodeError too, for bytes
        raise RecordFormatError(f"a stored record is not valid JSON: {error}") from error
    return structure(data)
