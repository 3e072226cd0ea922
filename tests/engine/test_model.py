"""Values refuse bad input at construction, naming the field; limits negotiate down."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import given

from trio_supervisor import (
    Disposed,
    Exited,
    ExitStatus,
    Expired,
    Fault,
    Handle,
    Key,
    Limits,
    Load,
    LoadFailed,
    OpenRecord,
    Recovery,
    Shutdown,
    StoppedRecord,
    StoppingRecord,
    Superseded,
    Termination,
    negotiate,
)
from trio_supervisor.errors import TerminationUnconfirmedError
from trio_supervisor.testing.strategies import limits

from ..support.sessions import KEY

HANDLE = Handle(key=KEY, token="0" * 32, generation=1)


def open_record(**changes: Any) -> OpenRecord:
    fields: dict[str, Any] = {"handle": HANDLE, "request_id": "r", "lease": 5.0, "limits": Limits()}
    fields.update(changes)
    return OpenRecord(**fields)


@pytest.mark.parametrize(
    ("build", "kind", "words"),
    [
        (lambda: Key(identity="", instance="a"), ValueError, "Key.identity must not be empty"),
        (lambda: Key(identity="a", instance=""), ValueError, "Key.instance must not be empty"),
        (lambda: Key(identity=3, instance="a"), TypeError, "Key.identity must be a str"),  # type: ignore[arg-type]
        (
            lambda: Key(identity="i" * 129, instance="a"),
            ValueError,
            "Key.identity must be at most 128 characters, got 129",
        ),
        (
            lambda: Key(identity="a", instance="i" * 500),
            ValueError,
            "Key.instance must be at most 128 characters, got 500",
        ),
        (lambda: Handle(key=KEY, token="", generation=1), ValueError, "Handle.token"),
        (
            lambda: Handle(key=KEY, token="t", generation=0),
            ValueError,
            "Handle.generation must be >= 1",
        ),
        (lambda: Handle(key=KEY, token="t", generation=True), TypeError, "Handle.generation"),
        (lambda: Limits(memory_bytes=-1), ValueError, "Limits.memory_bytes"),
        (lambda: Limits(open_files=1.5), TypeError, "Limits.open_files must be an int"),  # type: ignore[arg-type]
        (lambda: Load(specifier=""), ValueError, "Load.specifier must not be empty"),
        (lambda: Load(specifier="x", config={"a": {1, 2}}), TypeError, "Load.config['a']"),
        (lambda: Load(specifier="x", config={"a": math.inf}), ValueError, "JSON cannot represent"),
        (lambda: Load(specifier="x", config={1: "a"}), TypeError, "keys are strings"),
        (
            lambda: open_record(lease=0),
            ValueError,
            "OpenRecord.lease must be a finite number of seconds > 0",
        ),
        (
            lambda: open_record(lease=-1.0),
            ValueError,
            "OpenRecord.lease must be a finite number of seconds > 0",
        ),
        (
            lambda: open_record(lease=math.nan),
            ValueError,
            "OpenRecord.lease must be a finite number of seconds > 0",
        ),
        (
            lambda: open_record(lease=math.inf),
            ValueError,
            "OpenRecord.lease must be a finite number of seconds > 0",
        ),
        (lambda: open_record(lease="5"), TypeError, "number of seconds"),
        (lambda: open_record(request_id=""), ValueError, "OpenRecord.request_id"),
        (lambda: Termination(kind="gone", exit=ExitStatus()), ValueError, "kind"),  # type: ignore[arg-type]
    ],
)
def test_values_refuse_bad_input_naming_the_field(
    build: Any, kind: type[Exception], words: str
) -> None:
    with pytest.raises(kind, match=words.replace("[", r"\[").replace("]", r"\]")):
        build()


def test_the_bounds_themselves_are_accepted() -> None:
    key = Key(identity="i" * 128, instance="j" * 128)  # MAX_KEY_LENGTH, each
    assert (len(key.identity), len(key.instance)) == (128, 128)
    # A record holds whatever lease was granted: the minimum bounds what a caller asks for,
    # so a record stored before it existed still reads.
    assert open_record(lease=0.01).lease == 0.01


def test_values_are_frozen_and_slotted() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        KEY.identity = "other"  # type: ignore[misc]
    assert not hasattr(KEY, "__dict__")


def test_load_config_is_an_immutable_copy() -> None:
    source: dict[str, Any] = {"a": [1, {"b": 2}]}
    load = Load(specifier="x", config=source)
    source["a"].append(3)
    assert load.config == {"a": (1, {"b": 2})}
    with pytest.raises(TypeError):
        load.config["c"] = 1  # type: ignore[index]
    assert hash(load) == hash(Load(specifier="x", config={"z": 1}))


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        (Expired(), "Expired"),
        (Disposed(), "Disposed"),
        (Exited(), "Exited"),
        (LoadFailed(cause=(Fault(type="KeyError", message="'x'"),)), "LoadFailed"),
        (Superseded(), "Superseded"),
        (Shutdown(), "Shutdown"),
        (Recovery(), "Recovery"),
    ],
)
def test_stop_reasons_know_their_kind(reason: object, kind: str) -> None:
    assert reason.kind == kind  # type: ignore[attr-defined]


def test_stopping_record_must_belong_to_its_previous_session() -> None:
    other = attrs.evolve(HANDLE, generation=2)
    with pytest.raises(ValueError, match="belongs to another session"):
        StoppingRecord(
            handle=other,
            request_id="r",
            lease=5.0,
            limits=Limits(),
            previous=open_record(),
            reason=Superseded(),
        )


def test_stopped_record_copies_the_session_fields_of_previous() -> None:
    previous = open_record(lease=7.0, limits=Limits(open_files=3))
    termination = Termination(kind="exited", exit=ExitStatus(code=0))
    record = StoppedRecord.of(previous, Superseded(), termination)
    assert (record.handle, record.lease, record.limits) == (HANDLE, 7.0, Limits(open_files=3))


def test_fault_describes_an_exception() -> None:
    assert Fault.of(KeyError("x")) == Fault(type="KeyError", message="'x'")
    fault = Fault.of(TerminationUnconfirmedError("lost"))
    assert fault == Fault(type="trio_supervisor.errors.TerminationUnconfirmedError", message="lost")


FIELDS = tuple(field.name for field in attrs.fields(Limits))


@given(supervisor=limits, requested=limits)
def test_limits_negotiate_never_raises_a_ceiling(supervisor: Limits, requested: Limits) -> None:
    agreed = negotiate(supervisor, requested)
    for field in FIELDS:
        ceiling, asked, got = (getattr(value, field) for value in (supervisor, requested, agreed))
        if ceiling is not None:
            assert got is not None
            assert got <= ceiling
        if asked is not None:
            assert got is not None
            assert got <= asked
        assert got in (ceiling, asked)


def test_limits_negotiate_takes_the_fieldwise_minimum_with_none_as_infinite() -> None:
    supervisor = Limits(memory_bytes=100, cpu_seconds=None, open_files=10)
    requested = Limits(memory_bytes=50, cpu_seconds=7, open_files=None, output_bytes=0)
    assert negotiate(supervisor, requested) == Limits(
        memory_bytes=50, cpu_seconds=7, open_files=10, output_bytes=0
    )
    assert negotiate(supervisor, Limits()) == supervisor


def test_the_tree_limits_negotiate_and_allow_no_zero() -> None:
    supervisor = Limits(processes=50, cpu_percent=None)
    requested = Limits(processes=100, cpu_percent=50)
    assert negotiate(supervisor, requested) == Limits(processes=50, cpu_percent=50)
    for name in ("processes", "cpu_percent"):
        with pytest.raises(ValueError, match=f"Limits.{name} must be None .* or >= 1, got 0"):
            Limits(**{name: 0})


@pytest.mark.parametrize(
    ("kind", "status", "text"),
    [
        (
            "killed",
            ExitStatus(signal=9, oom_limit=256 << 20),
            "killed (out of memory, limit 256 MiB)",
        ),
        (
            "exited",
            ExitStatus(code=0, oom_limit=3 << 29, descendants_killed=1),
            "exited (code 0; out of memory, limit 1.5 GiB; 1 descendant killed)",
        ),
        (
            "exited",
            ExitStatus(signal=15, oom_limit=1000),
            "exited (SIGTERM; out of memory, limit 1000 bytes)",
        ),
        ("killed", ExitStatus(signal=9), "killed (SIGKILL)"),
    ],
)
def test_an_oom_kill_is_described_with_the_limit(kind: Any, status: ExitStatus, text: str) -> None:
    assert Termination(kind=kind, exit=status).describe() == text
