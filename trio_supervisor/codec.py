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
orjson, or ``json`` where orjson could read the text otherwise (see ``_parse``), and
the converter.
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

#: The version every record is written with (``"version": 1``); the reader refuses others.
VERSION: Final = 1

#: The one converter of records, for storage and the wire: a hook registered on it
#: applies to both.
converter: Final = cattrs.Converter(forbid_extra_keys=True)

_T = TypeVar("_T")


# -- strict scalars: JSON gives us the right types, or the record is corrupt ------------


def _strict(kind: type[_T], *accepted: type) -> Callable[[object, type], _T]:
    allowed = accepted or (kind,)

    def structure_scalar(value: object, _: type) -> _T:
        if value.__class__ is kind:  # what JSON gives for nearly every field
            return value
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


def _array(kind: Any, target: cattrs.Converter) -> Callable[[Any], list[Any]]:
    # cattrs' own hook builds the list from a generator, which costs more than the items
    # of the short arrays a record holds (a termination's cause is nearly always empty).
    item = target.get_unstructure_hook(typing.get_args(kind)[0], cache_result=False)

    def unstructure_array(value: tuple[Any, ...]) -> list[Any]:
        return [item(each) for each in value]

    return unstructure_array


# -- Limits: one object for every record without limits ------------------------------


def _limits(_: Any, target: cattrs.Converter) -> Callable[[Any, Any], Limits]:
    # cattrs' own hook, but the record of a session without limits (most records, and
    # the ``previous`` of their Stopping and Stopped ones) gets the one Limits() it
    # makes for them, not one each: reading 10,000 records made 10,000 equal ones.
    # Limits is frozen, so the records cannot tell.
    generated = target.gen_structure_attrs_fromdict(Limits)
    unset = target.unstructure(Limits())
    if not isinstance(unset, dict) or any(value is not None for value in unset.values()):
        return generated  # a hook of the user's writes limits otherwise
    made: list[Limits] = []

    def structure_limits(value: Any, as_type: Any) -> Limits:
        if value != unset:  # null compares equal to nothing else
            return generated(value, as_type)
        if not made:
            made.append(generated(value, as_type))
        return made[0]

    return structure_limits


def _last_limits(
    unstructure: Callable[[Limits], dict[str, Any]],
) -> Callable[[Limits], dict[str, Any]]:
    # ``unstructure``, remembering the last Limits it wrote: a record's limits are its
    # ``previous``'s too, and a supervisor's sessions mostly share theirs (recovery's
    # all share one, see _limits). Limits is frozen; its form holds ints and None only,
    # so each caller gets a copy of its own.
    last: tuple[Limits | None, dict[str, Any]] = (None, {})

    def unstructure_limits(limits: Limits) -> dict[str, Any]:
        nonlocal last
        seen, written = last  # one read: another thread may write it meanwhile
        if limits is not seen:
            written = unstructure(limits)
            last = (limits, written)
        return dict(written)

    return unstructure_limits


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
        fields = dict(value)
        del fields[tag_name]
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


def _unless_default(
    target: cattrs.Converter, kind: type[_T], *fields: str
) -> Callable[[_T], dict[str, Any]]:
    """How ``target`` writes a ``kind``, leaving out each of ``fields`` while it holds its
    default."""
    overrides: dict[str, Any] = {field: override(omit_if_default=True) for field in fields}
    return make_dict_unstructure_fn(kind, target, **overrides)


def _configure(target: cattrs.Converter) -> cattrs.Converter:
    """Teach a converter the record format: strict scalars and arrays, Load, the unions."""
    target.register_structure_hook(str, _strict(str))
    target.register_structure_hook(int, _strict(int))
    target.register_structure_hook(float, _strict(float, int, float))
    target.register_structure_hook(bool, _strict(bool))
    target.register_structure_hook_factory(_is_array, _strict_array)
    target.register_unstructure_hook_factory(_is_array, _array)
    target.register_unstructure_hook(
        Load, make_dict_unstructure_fn(Load, target, config=override(unstruct_hook=thaw))
    )
    # Written only when set: the records of a runner alone, without tree limits, read
    # as they always did.
    target.register_unstructure_hook(
        ExitStatus, _unless_default(target, ExitStatus, "runner_lost", "oom_limit")
    )
    target.register_unstructure_hook(
        Limits, _last_limits(_unless_default(target, Limits, "processes", "cpu_percent"))
    )
    target.register_unstructure_hook(
        ChildIdentity, _unless_default(target, ChildIdentity, "cgroup", "uid")
    )
    target.register_structure_hook_factory(lambda kind: kind is Limits, _limits)
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

    Args:
        error: One error cattrs met while structuring.
        kind: The type it was structuring, if known.

    Returns:
        A sentence for the error's message.
    """
    if isinstance(error, ValueError | TypeError) and str(error):
        return str(error)
    return cattrs.v.format_exception(error, kind)


def unstructure(record: SessionRecord) -> dict[str, Any]:
    """Return the versioned JSON-ready form of a record.

    Args:
        record: Any record.

    Returns:
        Its fields as plain JSON values, tagged, with ``"version"``.
    """
    data: dict[str, Any] = converter.get_unstructure_hook(SessionRecord)(record)
    data["version"] = VERSION
    return data


def structure(data: object) -> SessionRecord:
    """Build a record from its versioned JSON form.

    Args:
        data: What JSON text parsed to.

    Returns:
        The record.

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
    fields = dict(data)
    del fields["version"]
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
    """Return a record as compact versioned JSON text.

    Args:
        record: Any record.

    Returns:
        The JSON text that :func:`decode` reads back as the same record.
    """
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

    Args:
        text: JSON text, as ``str`` or UTF-8 ``bytes``.

    Returns:
        The record.

    Raises:
        RecordFormatError: The text is not JSON, or not a version 1 record.
    """
    try:
        data = _parse(text)
    except ValueError as error:  # UnicodeDecodeError too, for bytes
        raise RecordFormatError(f"a stored record is not valid JSON: {error}") from error
    return structure(data)


# Every byte to "x", but ASCII digits to "0": a text holds a run of 19 digits if its
# translation holds _LONG.
_DIGITS: Final = bytes(ord("0") if chr(byte) in "0123456789" else ord("x") for byte in range(256))
_LONG: Final = b"0" * 19


def _parse(text: str | bytes) -> Any:
    """``json.loads(text)``, at about half its cost where orjson reads the text alike.

    orjson reads an integer beyond 64 bits as a float, and refuses what ``json`` takes
    beyond the standard (NaN, a lone surrogate). So orjson reads a text without a run of
    19 digits (every integer in it then has 18 digits at most, well within 64 bits), and
    ``json`` the rest, as well as what orjson refuses: ``json`` has the last word, on the
    value and on the error.
    """
    try:
        data = text.encode() if isinstance(text, str) else text
    except UnicodeEncodeError:  # a lone surrogate
        return json.loads(text)
    if _LONG not in data.translate(_DIGITS):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)
