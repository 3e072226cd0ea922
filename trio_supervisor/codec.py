"""One cattrs converter for records, in storage and later on the wire.

A record is stored as a JSON object with ``"version": 1`` next to its fields. Phases and
stop reasons are tagged unions: a record carries ``"phase": "Loaded"``, a reason
``"kind": "Expired"``. A termination's cause is a list of ``{"type", "message"}``.

Reading is strict: an unknown version, an unknown tag, a missing or extra field, or a
value of the wrong JSON type raises :class:`~trio_supervisor.errors.RecordFormatError`
naming the field by its path (``$.previous.handle.generation``). Nothing is coerced: a
generation stored as ``"3"`` is an error, not 3.
"""

from __future__ import annotations

import functools
import json
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Final, Literal, TypeVar

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from .errors import RecordFormatError
from .model import (
    ActiveRecord,
    Load,
    Phase,
    SessionRecord,
    StopReason,
    thaw,
)

__all__ = ["VERSION", "converter", "decode", "encode", "structure", "unstructure"]

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

    # Each member's own hook, looked up once: records are encoded on every save.
    hooks: dict[type, Callable[[Any], dict[str, Any]]] = {}

    def unstructure_tagged(value: Any) -> dict[str, Any]:
        member = type(value)
        hook = hooks.get(member)
        if hook is None:
            hook = hooks[member] = target.get_unstructure_hook(member)
        data = hook(value)
        data[tag_name] = tags[member]
        return data

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

    target.register_unstructure_hook(union, unstructure_tagged)
    target.register_structure_hook(union, structure_tagged)


def _phase_of(member: Any) -> str:
    phase: Phase = member.phase
    return phase.value


def _kind_of(member: type) -> str:
    return member.__name__


# Each tagged union: the field that names the member, and the member's name.
_UNIONS: Final[tuple[tuple[Any, str, Callable[[Any], str]], ...]] = (
    (StopReason, "kind", _kind_of),
    (ActiveRecord, "phase", _phase_of),
    (SessionRecord, "phase", _phase_of),
)


def _configure(target: cattrs.Converter) -> cattrs.Converter:
    """Teach a converter the record format: strict scalars, Load, the tagged unions."""
    target.register_structure_hook(str, _strict(str))
    target.register_structure_hook(int, _strict(int))
    target.register_structure_hook(float, _strict(float, int, float))
    target.register_structure_hook(bool, _strict(bool))
    target.register_unstructure_hook(
        Load, make_dict_unstructure_fn(Load, target, config=override(unstruct_hook=thaw))
    )
    target.register_structure_hook(
        Load,
        make_dict_structure_fn(
            Load, target, _cattrs_forbid_extra_keys=True, config=override(struct_hook=_config_as_is)
        ),
    )
    for union, tag_name, tag_of in _UNIONS:
        _tagged(target, union, tag_name, tag_of)
    return target


_configure(converter)
# The same rules without cattrs' detailed validation, which records where every value
# came from: several times faster. Reading tries it first and, only when a record is
# bad, reads it again with ``converter`` to say exactly where.
_fast: Final = _configure(cattrs.Converter(forbid_extra_keys=True, detailed_validation=False))


# -- the record face -------------------------------------------------------------------


def _describe(error: BaseException, kind: type | None) -> str:
    # Our validators and hooks word their errors for a reader; cattrs words the rest.
    if isinstance(error, ValueError | TypeError) and not isinstance(error, KeyError) and str(error):
        return str(error)
    return cattrs.v.format_exception(error, kind)


_unstructure_record: Final = converter.get_unstructure_hook(SessionRecord)


def unstructure(record: SessionRecord) -> dict[str, Any]:
    """Return the versioned JSON-ready form of a record."""
    data: dict[str, Any] = _unstructure_record(record)
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
        fast: SessionRecord = _fast.structure(fields, SessionRecord)  # type: ignore[arg-type]
    except Exception:  # read again below, to name the problem
        pass
    else:
        return fast
    try:
        record: SessionRecord = converter.structure(fields, SessionRecord)  # type: ignore[arg-type]
    except Exception as error:
        problems = cattrs.transform_error(error, "$", _describe)
        raise RecordFormatError("malformed session record: " + "; ".join(problems)) from error
    return record


# One encoder for every record: json.dumps with options builds a new one per call. A
# record is a tree of fresh dicts, so there are no cycles to look for.
_encoder: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False, check_circular=False)


# -- writing JSON text straight from a record ------------------------------------------
#
# ``encode`` runs on every save. Instead of building the dicts of ``unstructure`` and
# handing them to ``json``, each record class gets a generated function that writes its
# text field by field: the same fields in the same order, the same tags, the same
# escaping, so the text is exactly ``_encoder.encode(unstructure(record))`` (the tests
# hold it to that for every kind of record). Load.config, free-form JSON, still goes
# through ``json``.

_Writer = Callable[[Any], str]
_quote: Final[_Writer] = json.encoder.encode_basestring_ascii  # json's own, as _encoder uses


def _finite(value: float) -> str:
    # Records refuse non-finite floats already; refuse them here too, as json would.
    if not math.isfinite(value):
        raise ValueError(f"Out of range float values are not JSON compliant: {value!r}")
    return float.__repr__(value)


def _boolean(value: bool) -> str:
    return "true" if value else "false"


def _config_text(value: Any) -> str:
    return _encoder.encode(thaw(value))


@functools.cache  # each class's writer is generated once, however many records hold it
def _writer(kind: Any) -> _Writer:
    """The function that writes a value of the (resolved) type ``kind``."""
    for union, tag_name, tag_of in _UNIONS:
        if kind == union:
            members = {
                member: _object_writer(member, tag_name, tag_of(member))
                for member in union.__args__
            }
            return lambda value: members[type(value)](value)
    args = typing.get_args(kind)
    origin = typing.get_origin(kind)
    if kind is str or (origin is Literal and all(isinstance(arg, str) for arg in args)):
        return _quote
    if kind is bool:
        return _boolean
    if kind is int:
        return int.__repr__
    if kind is float:
        return _finite
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _writer(args[0])
        return lambda value: "[" + ",".join(map(item, value)) + "]"
    if attrs.has(kind):
        return _object_writer(kind)
    raise TypeError(f"the codec cannot write {kind!r} as JSON")


def _object_writer(cls: type, *tail: object) -> _Writer:
    """Generate the writer of an attrs class; ``tail`` is (name, value) pairs to end with."""
    hints = typing.get_type_hints(cls)
    scope: dict[str, Any] = {}
    parts = []  # each a "name":value of the object, in an f-string
    for index, field in enumerate(attrs.fields(cls)):
        kind, write, read = hints[field.name], f"w{index}", f"value.{field.name}"
        optional = isinstance(kind, types.UnionType) and type(None) in kind.__args__
        if cls is Load and field.name == "config":
            scope[write] = _config_text
        elif optional:
            (present,) = (arg for arg in kind.__args__ if arg is not type(None))
            scope[write] = _writer(present)
        else:
            scope[write] = _writer(kind)
        text = f'"null" if {read} is None else {write}({read})' if optional else f"{write}({read})"
        parts.append(f'"{field.name}":{{{text}}}')
    for index, (name, constant) in enumerate(zip(tail[::2], tail[1::2], strict=True)):
        scope[f"t{index}"] = f"{_quote(str(name))}:{_encoder.encode(constant)}"
        parts.append(f"{{t{index}}}")
    source = "def write(value):\n    return f'{{" + ",".join(parts) + "}}'\n"
    exec(compile(source, f"<trio_supervisor.codec writer of {cls.__qualname__}>", "exec"), scope)
    write_object: _Writer = scope["write"]
    return write_object


# Each made on first use: generating them all would slow every import by a few ms.
_record_writers: Final[dict[type, _Writer]] = {}


def encode(record: SessionRecord) -> str:
    """Return a record as compact versioned JSON text."""
    kind = type(record)
    write = _record_writers.get(kind)
    if write is None:
        write = _object_writer(kind, "phase", _phase_of(kind), "version", VERSION)
        _record_writers[kind] = write
    return write(record)


def decode(text: str | bytes) -> SessionRecord:
    """Read a record from versioned JSON text.

    Raises:
        RecordFormatError: The text is not JSON, or not a version 1 record.
    """
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise RecordFormatError(f"a stored record is not valid JSON: {error}") from error
    return structure(data)
