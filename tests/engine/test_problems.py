"""An error's problem+json fields, said once in ``errors.py``: what the runner writes of
an error (``problem_fields``) the client reads back as the same error (``from_problem``),
and a body of another version (a field missing, or of another type) still reads."""

from __future__ import annotations

import json

import pytest

from trio_supervisor import errors
from trio_supervisor.errors import (
    OperatorsOnlyError,
    QuotaExceededError,
    RunnerLostError,
    SupervisorError,
)


def error_classes() -> list[type[SupervisorError]]:
    """Every public error class, subclasses of subclasses too."""
    found: list[type[SupervisorError]] = []
    waiting = [SupervisorError]
    while waiting:
        kind = waiting.pop()
        if not kind.__name__.startswith("_"):
            found.append(kind)
        waiting.extend(kind.__subclasses__())
    return sorted(found, key=lambda kind: kind.__name__)


# What each class with fields of its own is made with: none of them a default.
WITH_FIELDS: dict[type[SupervisorError], dict[str, object]] = {
    QuotaExceededError: {"quota": "memory_bytes", "requested": 4096, "used": 1024, "hard": 2048},
    RunnerLostError: {
        "owner": "runner-b",
        "location": "http://10.0.0.2:8470",
        "lease_until": 1_765_000_000.25,
        "takeover_at": 1_765_000_040.5,
    },
}
WIRE_KEYS = {"type", "title", "status", "code", "detail", "notes"}  # the body's own


def example_of(kind: type[SupervisorError]) -> SupervisorError:
    """An error of ``kind``, its ``retry_after`` (if it has one) not its default."""
    error = kind("the detail")
    if hasattr(error, "retry_after"):
        fields = next((f for k, f in WITH_FIELDS.items() if issubclass(kind, k)), {})
        return kind("the detail", 7.5, **fields)  # type: ignore[call-arg]
    return error


@pytest.mark.parametrize("kind", error_classes(), ids=lambda kind: kind.__name__)
def test_an_error_read_back_from_its_problem_is_the_same_error(
    kind: type[SupervisorError],
) -> None:
    error = example_of(kind)
    fields = error.problem_fields()
    assert not fields.keys() & WIRE_KEYS
    problem = json.loads(json.dumps({"code": kind.code, "detail": error.detail, **fields}))
    again = kind.from_problem(problem["detail"], problem, getattr(error, "retry_after", None))
    assert type(again) is kind
    assert vars(again) == vars(error)
    assert again.problem_fields() == fields


def test_the_fields_said_once_are_those_of_the_wire() -> None:
    lost = example_of(RunnerLostError)
    assert set(lost.problem_fields()) == {"owner", "location", "lease_until", "takeover_at"}
    quota = QuotaExceededError.of("acme", "children", 3, 2, 4)
    assert quota.problem_fields() == {"quota": "children", "requested": 3, "used": 2, "hard": 4}
    assert OperatorsOnlyError("for operators").problem_fields() == {"operators_only": True}
    assert errors.ThrottledError("slow down", 2.0).problem_fields() == {}


@pytest.mark.parametrize("kind", [QuotaExceededError, RunnerLostError])
def test_a_problem_with_fields_missing_or_mistyped_reads_as_their_defaults(
    kind: type[SupervisorError],
) -> None:
    default = kind("the detail")
    missing = kind.from_problem("the detail", {}, None)
    assert vars(missing) == vars(default)
    # A bool is no number, a string no count, and a fraction no count either.
    mistyped = {
        "requested": True,
        "used": "3",
        "hard": 2.5,
        "lease_until": False,
        "takeover_at": "soon",
    }
    assert vars(kind.from_problem("the detail", mistyped, None)) == vars(default)


def test_retry_after_comes_from_the_header_not_the_body() -> None:
    for kind in error_classes():
        if hasattr(kind("the detail"), "retry_after"):
            assert kind.from_problem("the detail", {"retry_after": 9}, 3.0).retry_after == 3.0  # type: ignore[attr-defined]
            assert kind.from_problem("the detail", {}, None).retry_after is None  # type: ignore[attr-defined]
