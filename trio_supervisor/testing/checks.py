"""What the conformance machine compares after every step, and how a failure reads.

Each operation's outcome is the model's prediction (:func:`check_outcome`). After each
step the machine observes the run (the store's records and high-water marks, which
children still live, the calls logged on each) and holds it against the model:

* the store holds exactly the records the model says were acknowledged, compared as
  :class:`~.reference_store.Durable` (phase, child, request id, the phase it stopped from,
  the reason, and the termination with its exit status), with retention applied per
  key and in all; and every key's high-water mark, never evicted;
* at most one live record per key;
* every child is alive exactly when the model says, and got exactly the interrupts,
  kills, releases and recoveries the model says (at most one of each of the first three);
* no child was signalled before its session's Stopping record was saved;
* the run's virtual clock agrees with the model's.

Every check here raises ``AssertionError`` with a message that names the promise of
docs/design.md that broke and the session or record it broke on (``conformance/a#2``).
The checks take what the machine observed (:class:`~.world.Observation`) and the
model, and change neither. :func:`agreement` is the same comparison as a predicate, for
the search that explains a concurrent burst; it first lets the model state it is given
take the store's choice among evictions the model could not order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import NoReturn

from ..model import Key, SessionRecord, StoppedRecord, StoppingRecord, Termination
from .incarnation import Log
from .reference import Model, Outcome
from .reference_store import Durable, SessionId
from .world import Observation, Operation

__all__ = [
    "agreement",
    "check_children",
    "check_clock",
    "check_outcome",
    "check_signals_follow_stopping",
    "check_store",
    "child_calls",
    "durable",
    "key_name",
    "session_name",
    "stored",
    "unexplained_burst",
]


def key_name(key: Key) -> str:
    """A key as messages name it: ``conformance/a``."""
    return f"{key.identity}/{key.instance}"


def session_name(ident: SessionId) -> str:
    """A session as messages name it: ``conformance/a#2``."""
    return f"{key_name(ident[0])}#{ident[1]}"


def durable(record: SessionRecord) -> Durable:
    """A stored record as the model describes it (a termination without its cause)."""
    if isinstance(record, StoppingRecord | StoppedRecord):
        previous = record.previous
        termination = None
        if isinstance(record, StoppedRecord):
            ended = record.termination
            termination = Termination(kind=ended.kind, exit=ended.exit)
        return Durable(
            record.phase.value,
            False,
            record.request_id,
            previous=previous.phase.value,
            previous_child=getattr(previous, "child", None) is not None,
            reason=record.reason.kind,
            termination=termination,
        )
    return Durable(
        record.phase.value, getattr(record, "child", None) is not None, record.request_id
    )


def stored(records: Iterable[SessionRecord]) -> dict[SessionId, Durable]:
    """The store's records by session, as the model describes them."""
    return {(r.handle.key, r.handle.generation): durable(r) for r in records}


def child_calls(model: Model) -> dict[SessionId, dict[str, int]]:
    """The calls the model says each child got."""
    return {
        ident: {
            "interrupt": child.interrupts,
            "kill": child.kills,
            "aclose": child.closes,
            "recover": child.recovers,
        }
        for ident, child in model.children.items()
    }


def agreement(seen: Observation) -> Callable[[Model], bool]:
    """Whether a model state agrees with what was seen: store, marks, children, calls.

    The model state takes the store's choice of evictions first, where the model could
    not know the order of the saves (:meth:`~.reference_store.ModelStore.resolve`).
    """
    kept = stored(seen.records)

    def agrees(model: Model) -> bool:
        model.store.resolve(kept)
        return (
            model.store.records == kept
            and model.store.high == seen.marks
            and {ident: child.alive for ident, child in model.children.items()} == seen.living
            and child_calls(model) == seen.calls
        )

    return agrees


# -- the checks -------------------------------------------------------------------------


def check_outcome(
    predicted: Outcome | None,
    actual: Operation,
    *,
    waited: bool = False,
    alike: Collection[str] = (),
) -> None:
    """The operation gave what the model predicts (None: it still waits).

    Args:
        predicted: The model's outcome.
        actual: The operation, with the supervisor's outcome.
        waited: Whether it waited on virtual time, for the message.
        alike: Errors that stand for one another: the supervisor was poisoned by each
            at one instant, and the first of them is its poisoning error.
    """
    if predicted is None:
        assert actual.outcome is None, (
            f"{actual.call}: the model says it still waits, it returned {actual.outcome}"
        )
        return
    got = actual.outcome
    if got is not None and predicted[0] == got[0] == "error" and {predicted[1], got[1]} <= {*alike}:
        return
    assert actual.outcome == predicted, (
        f"{actual.call}{', which waited' if waited else ''}: the model expects {predicted}, "
        f"the supervisor gave {actual.outcome}"
    )


def check_clock(seen: Observation, model: Model) -> None:
    """Every wait of the supervisor ended when the rules say: the clocks agree."""
    assert math.isclose(seen.now, model.now), (
        f"the run's virtual time is {seen.now}, the model's {model.now}: some wait of the "
        "supervisor did not end when the rules say (T1 leases, P3 grace and confirmation)"
    )


def check_store(seen: Observation, model: Model) -> None:
    """The store holds what was acknowledged, with retention, and every high-water mark."""
    records, marks = seen.records, seen.marks
    kept = stored(records)
    assert len(kept) == len(records), (
        "a save replaces its token's earlier record (docs/design.md, Adapters), but the "
        "store lists two records of one session: "
        + ", ".join(sorted(session_name(ident) for ident in kept))
    )
    assert kept == model.store.records, _difference(kept, model.store.records)
    expected = model.store.high
    assert marks == expected, (
        "every key's high-water is kept apart from retention and never evicted (V5, "
        f"section Persistence): the store says {_marks(marks)}, the model "
        f"{_marks(expected)}; "
        + ", ".join(
            f"{key_name(key)}: stored {marks.get(key)}, model {expected.get(key)}"
            + ("" if any(ident[0] == key for ident in kept) else " (no record of it is retained)")
            for key in sorted(set(marks) | set(expected), key=repr)
            if marks.get(key) != expected.get(key)
        )
    )
    live = [r.handle.key for r in records if r.phase.value in ("Open", "Loading", "Loaded")]
    assert len(live) == len(set(live)), (
        "at most one live record per key (O5 supersedes the older): "
        + ", ".join(key_name(key) for key in live)
    )


def check_children(seen: Observation, model: Model) -> None:
    """Each child lives and dies, and gets the calls, the model says; no stray child."""
    expected_calls = child_calls(model)
    for ident, child in model.children.items():
        assert ident in seen.living, (
            f"the child of {session_name(ident)}: the model has one (L4), the execution "
            "never spawned it"
        )
        alive = seen.living[ident]
        assert alive == child.alive, (
            f"the child of {session_name(ident)} is {'alive' if alive else 'gone'}, the model "
            f"says {'alive' if child.alive else 'gone'} (P3: every stop ends its child; X1, V2)"
        )
        counts = seen.calls[ident]
        assert counts == expected_calls[ident], (
            f"the child of {session_name(ident)} got the calls {counts}, the model says "
            f"{expected_calls[ident]} (P3 interrupt then kill, P4 one release, V2 recover)"
        )
        exactly_once = [call for call in ("interrupt", "kill", "aclose") if counts[call] > 1]
        assert not exactly_once, (
            f"the child of {session_name(ident)} got more than one {exactly_once}: a session "
            "is terminated exactly once (P1, section Shape in Trio)"
        )
    for ident in seen.living:
        assert ident in model.children, (
            f"the execution spawned a child for {session_name(ident)} that the model never "
            "asked for (L3, L4)"
        )


def unexplained_burst(seen: Observation, actual: list[Operation], near: Model | None) -> NoReturn:
    """Fail for a burst that no interleaving explains.

    Args:
        seen: The run after the burst.
        actual: The burst's operations, with their outcomes.
        near: The model after an interleaving that gives those outcomes, if any: what
            the run shows is held against it, to name the promise that broke.
    """
    calls = ", ".join(f"{operation.call} -> {operation.outcome}" for operation in actual)
    try:
        if near is not None:
            near.store.resolve(stored(seen.records))
            check_store(seen, near)
            check_children(seen, near)
    except AssertionError as broken:
        raise AssertionError(
            f"after the concurrent burst {calls}, in an order that gives these outcomes: {broken}"
        ) from None
    raise AssertionError(f"no interleaving of the burst explains what happened: {calls}")


def check_signals_follow_stopping(log: Log) -> None:
    """No child was interrupted or killed before its Stopping record was saved (P2, P3)."""
    stopping: set[SessionId] = set()
    for entry in log.entries:
        if entry.kind == "save" and entry.what in ("Stopping", "Stopped"):
            stopping.add(entry.session)
        elif entry.what in ("interrupt", "kill"):
            assert entry.session in stopping, (
                f"the child of {session_name(entry.session)} was sent {entry.what} before "
                "its Stopping record was saved (P2 persists Stopping before P3 signals)"
            )


# -- messages -------------------------------------------------------------------------


def _marks(marks: Mapping[Key, int]) -> str:
    return (
        "{"
        + ", ".join(f"{key_name(key)}: {mark}" for key, mark in sorted(marks.items(), key=repr))
        + "}"
    )


# Which promises a difference in one field of a record breaks.
_FIELD_RULES = {
    "phase": "O8, L3, L4, P2, P5, V3",
    "child": "L4: the child's identity is durable before it starts",
    "request_id": "O3, O7",
    "previous": "P2, P5, V3",
    "previous_child": "P2, P5, V3",
    "reason": "P1: the first stop request decides the reason; V3",
    "termination": "P3: a session without a child ends with code 0, a stopped child with "
    "the status its wait() gave; X1: a child that exits by itself with its own; V2: the "
    "status recover() gave",
}


def _difference(stored: Mapping[SessionId, Durable], expected: Mapping[SessionId, Durable]) -> str:
    lines = [
        "the store must hold exactly the records the supervisor had acknowledged (O8, L3, "
        "L4, P2, P5, V3, with retention: per key, and in all), and it differs:"
    ]
    for ident in sorted(set(stored) | set(expected), key=lambda i: (i[0].instance, i[1])):
        kept, model = stored.get(ident), expected.get(ident)
        if kept == model:
            continue
        lines.append(f"  {session_name(ident)}: stored {kept}, model {model}")
        if kept is None:
            lines.append("    missing: acknowledged and not evicted by retention, yet not kept")
        elif model is None:
            lines.append("    kept, though never acknowledged, or evicted by retention")
        else:
            for field in dataclasses.fields(Durable):
                if getattr(kept, field.name) != getattr(model, field.name):
                    lines.append(f"    its {field.name} differs ({_FIELD_RULES[field.name]})")
    return "\n".join(lines)
