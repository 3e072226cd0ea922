"""The codec: every record round-trips; bad data is refused with the field's path."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given

from trio_supervisor import RecordFormatError, SessionRecord, codec
from trio_supervisor.testing.strategies import records


@given(record=records())
def test_every_record_round_trips(record: SessionRecord) -> None:
    text = codec.encode(record)
    assert json.loads(text)["version"] == 1
    assert codec.decode(text) == record


@given(record=records())
def test_encode_writes_exactly_the_json_of_the_converters_form(record: SessionRecord) -> None:
    # encode writes text straight from the record; the converter's dicts are the reference.
    reference = json.dumps(codec.unstructure(record), separators=(",", ":"), allow_nan=False)
    assert codec.encode(record) == reference


def test_a_field_type_the_writer_does_not_know_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="cannot write <class 'bytes'>"):
        codec._writer(bytes)


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
            r"StoppedRecord.lease must be a positive finite number of seconds, got -1.0 @ \$",
        ),
        (lambda d: d["termination"].update(kind="vanished"), r"@ \$.termination.kind"),
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


@given(record=records())
def test_the_fast_reader_accepts_and_refuses_exactly_what_the_detailed_one_does(
    record: SessionRecord,
) -> None:
    # Reading tries a converter without detailed validation first; it must never accept
    # what the detailed one refuses, nor build something else.
    fields = codec.unstructure(record)
    del fields["version"]
    for variant in _corruptions(fields)[:400]:
        detailed: object = None
        fast: object = None
        with contextlib.suppress(Exception):
            detailed = codec.converter.structure(variant, SessionRecord)  # type: ignore[arg-type]
        with contextlib.suppress(Exception):
            fast = codec._fast.structure(variant, SessionRecord)  # type: ignore[arg-type]
        assert fast == detailed, variant
