"""The codec: every record round-trips; bad data is refused with the field's path."""

from __future__ import annotations

import json
import re
from typing import Any

import attrs
import cattrs
import pytest
from hypothesis import given

from trio_supervisor import (
    ChildIdentity,
    CodeIdentity,
    ExitStatus,
    Fault,
    Handle,
    Key,
    Limits,
    Load,
    LoadedRecord,
    LoadFailed,
    OpenRecord,
    RecordFormatError,
    SessionRecord,
    StoppedRecord,
    Termination,
    codec,
)
from trio_supervisor.testing.strategies import records


@given(record=records())
def test_every_record_round_trips(record: SessionRecord) -> None:
    text = codec.encode(record)
    assert json.loads(text)["version"] == 1
    assert codec.decode(text) == record


def _outside_strings(text: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


@given(record=records())
def test_encode_writes_the_converters_form_compactly_and_in_field_order(
    record: SessionRecord,
) -> None:
    text = codec.encode(record)
    # The same values in the same order (json keeps it): written again by one writer,
    # the two are the same text.
    rewrite = codec._encoder.encode
    assert rewrite(json.loads(text)) == rewrite(codec.unstructure(record))
    assert not re.search(r"\s", _outside_strings(text)), "compact separators"


def _loaded_then_stopped(*, limits: Limits, fault: Fault, exit: ExitStatus) -> StoppedRecord:
    handle = Handle(key=Key(identity="p", instance="a"), token="t" * 32, generation=3)
    previous = LoadedRecord(
        handle=handle,
        request_id="r",
        lease=5.0,
        limits=limits,
        load=Load(specifier="pkg:main", config={"n": 1, "xs": [1.5, None, True]}),
        code=CodeIdentity(specifier="pkg:main", digest="sha256:ab"),
        child=ChildIdentity(adapter="subprocess", ref="c1", pid=10, pgid=10),
    )
    termination = Termination(kind="killed", exit=exit, cause=(fault,))
    return StoppedRecord.of(previous, LoadFailed(cause=()), termination)


# Written by the codec before it used orjson; a file holds records like it.
STORED_STOPPED = (
    '{"handle":{"key":{"identity":"p","instance":"a"},"token":"tttttttttttttttttttttttttttttttt",'
    '"generation":3},"request_id":"r","lease":5.0,"limits":{"memory_bytes":1024,'
    '"cpu_seconds":null,"open_files":null,"file_size_bytes":null,"output_bytes":null},'
    '"previous":{"handle":{"key":{"identity":"p","instance":"a"},'
    '"token":"tttttttttttttttttttttttttttttttt","generation":3},"request_id":"r","lease":5.0,'
    '"limits":{"memory_bytes":1024,"cpu_seconds":null,"open_files":null,"file_size_bytes":null,'
    '"output_bytes":null},"load":{"specifier":"pkg:main","config":{"n":1,"xs":[1.5,null,true]}},'
    '"code":{"specifier":"pkg:main","origin":null,"digest":"sha256:ab","version":null},'
    '"child":{"adapter":"subprocess","ref":"c1","pid":10,"pgid":10,"start_time":null,'
    '"boot_id":null},"phase":"Loaded"},"reason":{"cause":[],"kind":"LoadFailed"},'
    '"termination":{"kind":"killed","exit":{"code":null,"signal":9,"cancelled":false,'
    '"descendants_killed":2},"cause":[{"type":"OSError","message":"gone"}]},"phase":"Stopped",'
    '"version":1}'
)


def test_the_stored_text_of_a_record_is_unchanged() -> None:
    record = _loaded_then_stopped(
        limits=Limits(memory_bytes=1024),
        fault=Fault(type="OSError", message="gone"),
        exit=ExitStatus(signal=9, descendants_killed=2),
    )
    assert codec.encode(record) == STORED_STOPPED
    assert codec.decode(STORED_STOPPED) == record


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (Limits(memory_bytes=2**70), "gone"),  # beyond 64 bits: json writes it, not orjson
        (Limits(), "no such file: b'\udcff'"),  # a lone surrogate, as os.fsdecode makes
        (Limits(), "fichier supprimé 🗑"),  # not ASCII: orjson writes UTF-8
    ],
)
def test_values_orjson_cannot_write_or_writes_differently_round_trip(
    limits: Limits, message: str
) -> None:
    record = _loaded_then_stopped(
        limits=limits, fault=Fault(type="OSError", message=message), exit=ExitStatus(code=1)
    )
    text = codec.encode(record)
    assert codec.decode(text) == record
    # The text of the writer before orjson reads the same.
    assert codec.decode(codec._encoder.encode(codec.unstructure(record))) == record


@pytest.mark.parametrize(
    "text",
    [
        '{"n":18446744073709551616}',  # beyond 64 bits: orjson would read a float
        '{"n":-9223372036854775809}',
        '{"n":123456789012345678901234567890,"m":1.5}',
        '{"n":999999999999999999,"m":-999999999999999999}',  # 18 digits: orjson's
        '{"f":0.1234567890123456789,"g":1e-400,"h":-0.0}',
        '{"a":1,"a":2}',  # the last one counts, for both
        '{"s":"\\ud800"}',  # a lone surrogate, escaped: json's alone
        '{"s":"\ud800"}',  # the same, unescaped in a str
        '{"n":NaN}',  # beyond the standard: json's alone
        '{"s":"fichier supprim\u00e9 \ud83d\uddd1"}',
        b'{"s":"\xc3\xa9"}',
        b"\xef\xbb\xbf{}",  # a byte order mark: json reads it, orjson does not
        b'{"s":"\xff"}',  # not UTF-8
        "[1,]",
        '{"s":"\x01"}',
        "",
    ],
)
def test_text_is_read_as_json_reads_it(text: str | bytes) -> None:
    # codec._parse reads with orjson where it reads the same as json, and with json
    # otherwise: the value (and the type of every number) or the error is json's.
    try:
        expected: object = json.loads(text)
    except ValueError as error:
        with pytest.raises(type(error)):
            codec._parse(text)
    else:
        parsed = codec._parse(text)
        assert repr(parsed) == repr(expected)


def test_records_without_limits_share_one() -> None:
    # A record without limits reads back with the converter's one Limits() (Limits is
    # frozen): 10,000 records read at recovery do not make 10,000 equal ones.
    first, second = (
        OpenRecord(
            handle=Handle(key=Key(identity="p", instance=name), token=name * 32, generation=1),
            request_id="r",
            lease=5.0,
            limits=limits,
        )
        for name, limits in (("a", Limits()), ("b", Limits()))
    )
    read = [codec.decode(codec.encode(record)) for record in (first, second)]
    assert read == [first, second]
    assert read[0].limits is read[1].limits
    limited = attrs.evolve(first, limits=Limits(cpu_seconds=9))
    assert codec.decode(codec.encode(limited)).limits == Limits(cpu_seconds=9)


def test_an_exit_status_round_trips_its_flag_and_count() -> None:
    record = _loaded_then_stopped(
        limits=Limits(),
        fault=Fault(type="Cancelled", message=""),
        exit=ExitStatus(cancelled=True, descendants_killed=3),
    )
    text = codec.encode(record)
    assert '"exit":{"code":null,"signal":null,"cancelled":true,"descendants_killed":3}' in text
    assert codec.decode(text) == record


def test_an_oom_limit_a_cgroup_and_the_tree_limits_are_written_only_when_set() -> None:
    limits = Limits(processes=20, cpu_percent=50)
    assert codec.converter.unstructure(limits)["processes"] == 20
    assert "cpu_percent" not in codec.converter.unstructure(Limits(processes=20))
    assert codec.converter.structure(codec.converter.unstructure(limits), Limits) == limits
    status = ExitStatus(signal=9, oom_limit=256 << 20)
    assert codec.converter.unstructure(status)["oom_limit"] == 256 << 20
    assert "oom_limit" not in codec.converter.unstructure(ExitStatus(signal=9))
    assert codec.converter.structure(codec.converter.unstructure(status), ExitStatus) == status
    child = ChildIdentity(adapter="subprocess", ref="1:2", cgroup="trio_supervisor/x/1-2")
    assert codec.converter.unstructure(child)["cgroup"] == "trio_supervisor/x/1-2"
    assert "cgroup" not in codec.converter.unstructure(attrs.evolve(child, cgroup=None))
    assert codec.converter.structure(codec.converter.unstructure(child), ChildIdentity) == child


@pytest.fixture
def converter(monkeypatch: pytest.MonkeyPatch) -> cattrs.Converter:
    """``codec.converter`` for one test: a user's hooks on it stay in that test."""
    fresh = codec._configure(cattrs.Converter(forbid_extra_keys=True))
    monkeypatch.setattr(codec, "converter", fresh)
    return fresh


def test_hooks_registered_on_the_converter_take_effect_in_encode_and_decode(
    converter: cattrs.Converter,
) -> None:
    handle = Handle(key=Key(identity="p", instance="a"), token="t" * 32, generation=1)
    record = OpenRecord(handle=handle, request_id="r", lease=5.0, limits=Limits(cpu_seconds=9))
    assert '"limits":{"memory_bytes":null,"cpu_seconds":9,' in codec.encode(record)

    # A user who stores limits as a list; registered after a record was written, so
    # nothing may hold on to the hooks of that first write.
    def unstructure_limits(limits: Limits) -> list[int | None]:
        return list(attrs.astuple(limits))

    def structure_limits(data: Any, _: type) -> Limits:
        return Limits(**dict(zip(attrs.fields_dict(Limits), data, strict=True)))

    converter.register_unstructure_hook(Limits, unstructure_limits)
    text = codec.encode(record)
    assert '"limits":[null,9,null,null,null,null,null],' in text
    with pytest.raises(RecordFormatError, match=r"@ \$.limits"):
        codec.decode(text)  # the default reader wants an object
    converter.register_structure_hook(Limits, structure_limits)
    assert codec.decode(text) == record


@given(record=records())
def test_records_are_tagged_by_phase_and_reason_kind(record: SessionRecord) -> None:
    data = codec.unstructure(record)
    assert data["phase"] == record.phase.value
    if "reason" in data:
        assert data["reason"]["kind"] == type(record.reason).__name__  # type: ignore[union-attr]


def stored(record: SessionRecord) -> dict[str, object]:
    return json.loads(codec.encode(record))  # type: ignore[no-any-return]


@pytest.fixture
def stopped() -> dict[str, object]:
    from trio_supervisor import (
        ExitStatus,
        Fault,
        Handle,
        Key,
        Limits,
        LoadFailed,
        OpenRecord,
        StoppedRecord,
        Termination,
    )

    handle = Handle(key=Key(identity="p", instance="a"), token="t" * 32, generation=3)
    previous = OpenRecord(handle=handle, request_id="r", lease=5.0, limits=Limits())
    termination = Termination(
        kind="killed", exit=ExitStatus(signal=9), cause=(Fault(type="OSError", message="gone"),)
    )
    return stored(StoppedRecord.of(previous, LoadFailed(cause=()), termination))


def test_a_termination_cause_is_stored_as_type_and_message(stopped: dict[str, object]) -> None:
    assert stopped["termination"]["cause"] == [{"type": "OSError", "message": "gone"}]  # type: ignore[index]


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda d: d.update(version=2), r"unsupported record version 2 @ \$.version"),
        (lambda d: d.pop("version"), r"unsupported record version None"),
        (lambda d: d.update(phase="Paused"), r"unknown phase 'Paused'"),
        (lambda d: d.pop("phase"), r"'phase' field is missing"),
        (lambda d: d["reason"].update(kind="Bored"), r"unknown kind 'Bored'.* @ \$.reason"),
        (
            lambda d: d["handle"].update(generation="3"),
            r"expected int, got str @ \$.handle.generation",
        ),
        (lambda d: d["handle"].update(generation=True), r"got a boolean @ \$.handle.generation"),
        (
            lambda d: d["handle"]["key"].update(identity=""),
            r"Key.identity must not be empty @ \$.handle.key",
        ),
        (
            lambda d: d["previous"].pop("request_id"),
            r"required field missing @ \$.previous.request_id",
        ),
        (lambda d: d.update(extra=1), r"extra fields found \(extra\)"),
        (
            lambda d: d.update(lease=-1),
            r"StoppedRecord.lease must be a finite number of seconds > 0, got -1.0 @ \$",
        ),
        (lambda d: d["termination"].update(kind="vanished"), r"@ \$.termination.kind"),
        (
            lambda d: d["termination"].update(cause={}),
            r"expected an array, got dict @ \$.termination.cause",
        ),
        (
            lambda d: d["termination"]["cause"][0].update(type=""),
            r"Fault.type must not be empty @ \$.termination.cause\[0\]",
        ),
        (
            lambda d: d["termination"]["exit"].update(cancelled=1),
            r"expected bool, got int @ \$.termination.exit.cancelled",
        ),
        (
            lambda d: d["termination"]["exit"].update(descendants_killed=True),
            r"got a boolean @ \$.termination.exit.descendants_killed",
        ),
    ],
)
def test_malformed_records_name_the_field(
    stopped: dict[str, object], damage: object, words: str
) -> None:
    damage(stopped)  # type: ignore[operator]
    with pytest.raises(RecordFormatError, match=words):
        codec.decode(json.dumps(stopped))


def test_text_that_is_not_json_is_refused() -> None:
    with pytest.raises(RecordFormatError, match="not valid JSON"):
        codec.decode("{")
    with pytest.raises(RecordFormatError, match="must be a JSON object"):
        codec.decode("[1]")


def _corruptions(data: object) -> list[object]:
    """Copies of ``data`` with one value replaced, removed or added, everywhere in it."""
    variants: list[object] = []
    if isinstance(data, dict):
        for name, value in data.items():
            replacements: list[object] = [None, "3", 3, 1.5, True, [], {}]
            variants.extend({**data, name: replacement} for replacement in replacements)
            variants.append({key: item for key, item in data.items() if key != name})
            variants.extend({**data, name: inner} for inner in _corruptions(value))
        variants.append({**data, "extra": 1})
    elif isinstance(data, list):
        for index, value in enumerate(data):
            variants.extend(
                [*data[:index], inner, *data[index + 1 :]] for inner in _corruptions(value)
            )
    return variants


def _says(full: object, partial: object) -> bool:
    """Whether ``full`` holds every value of ``partial`` (and may have more: defaults).

    A None that ``full`` leaves out is held too: fields written only when set."""
    if isinstance(partial, dict):
        return isinstance(full, dict) and all(
            (name in full and _says(full[name], item)) or (item is None and name not in full)
            for name, item in partial.items()
        )
    if isinstance(partial, list):
        return (
            isinstance(full, list) and len(full) == len(partial) and all(map(_says, full, partial))
        )
    # A float field takes a JSON integer (5 seconds is 5.0); nothing else changes type.
    same_kind = type(full) is type(partial) or (type(full), type(partial)) == (float, int)
    return same_kind and full == partial


@given(record=records())
def test_a_corrupt_record_is_refused_by_name_or_read_as_written(record: SessionRecord) -> None:
    # Whatever is replaced, removed or added, reading either refuses it with a
    # RecordFormatError (never another error) or builds the record the text says: nothing
    # coerced, a missing field only where the field has a default.
    fields = codec.unstructure(record)
    for variant in _corruptions(fields)[:400]:
        text = json.dumps(variant)
        try:
            read = codec.decode(text)
        except RecordFormatError:
            continue
        assert _says(json.loads(codec.encode(read)), json.loads(text)), variant
