"""The reference model's own bookkeeping: what it may not decide alone at one instant
(the order of concurrent saves, the moment a load's loader runs) it takes from the run."""

from __future__ import annotations

import uuid

from trio_supervisor import ExitStatus, Handle, Key
from trio_supervisor.testing.interleavings import Planned, interleave, plan_call
from trio_supervisor.testing.reference import Ending, Model, error, ok
from trio_supervisor.testing.reference_store import Durable, ModelStore, SessionId, refusing

A, B, C = (Key(identity="model", instance=name) for name in "abc")


def _stopped(request_id: str) -> Durable:
    return Durable("Stopped", False, request_id, previous="Open", reason="Shutdown")


def _model() -> Model:
    def exit_status(ending: Ending, code: int) -> ExitStatus:
        return ExitStatus(code=code)

    return Model(
        lease=10.0,
        grace=1.0,
        confirmation=1.0,
        stopped_per_key=1,
        stopped_total=10,
        missing="missing:main",
        broken=None,
        exit_status=exit_status,
    )


def test_the_store_order_of_one_instant_decides_a_later_eviction() -> None:
    # Two sessions stop at one instant (a shutdown); the model saved a first, the run
    # saved b first, and nothing was evicted then. A later Stopped record evicts the
    # older of them in all: the one the store listed first.
    store = ModelStore(stopped_per_key=1, stopped_total=2)
    a, b, c = (A, 1), (B, 1), (C, 1)
    with store.together():
        store.save(a, _stopped("ra"))
        store.save(b, _stopped("rb"))
    store.resolve({b: _stopped("rb"), a: _stopped("ra")})
    assert store.save(c, _stopped("rc")) == [b]
    assert set(store.records) == {a, c}


def test_without_the_store_order_the_models_own_order_stands() -> None:
    store = ModelStore(stopped_per_key=1, stopped_total=2)
    a, b, c = (A, 1), (B, 1), (C, 1)
    with store.together():
        store.save(a, _stopped("ra"))
        store.save(b, _stopped("rb"))
    store.resolve({a: _stopped("ra"), b: _stopped("rb")})
    assert store.save(c, _stopped("rc")) == [a]


def _open(model: Model, key: Key, request_id: str) -> SessionId:
    assert model.open_check() is None
    assert model.open_supersede(key, request_id, None) is None
    outcome = model.open_commit(key, request_id, None)
    assert outcome == ok((1, "Open"))
    return (key, 1)


def _load(ident: SessionId) -> Planned:
    handle = Handle(key=ident[0], token=str(uuid.uuid4()), generation=ident[1])
    return plan_call("load", ident, handle, "good:main")


def test_two_loads_accepted_before_either_fails_both_run_their_loaders() -> None:
    # Both calls are accepted while the supervisor is healthy; each loader's Loading
    # save is refused. The first refusal poisons the supervisor, and the other loader
    # still runs (its call was accepted): both sessions stop, LoadFailed, as the
    # supervisor does it (the loader runs in the session's task, deviation (f)).
    model = _model()
    a, b = _open(model, A, "ra"), _open(model, B, "rb")
    model.store.faults.once += [refusing(a), refusing(b)]
    storage = error("StateStorageError")
    both_stopped = interleave(
        model,
        [_load(a), _load(b)],
        [storage, storage],
        lambda state: all(state.store.records[i].phase == "Stopped" for i in (a, b)),
    )
    assert both_stopped is not None
    assert both_stopped.store.records[b].reason == "LoadFailed"
    assert both_stopped.store.records[b].previous == "Loading"
