"""The pure lifecycle, driven without Trio, clocks or stores."""

from __future__ import annotations

import itertools

import pytest

from trio_supervisor import (
    ChildIdentity,
    CodeIdentity,
    Disposed,
    Exited,
    ExitStatus,
    Expired,
    Handle,
    Key,
    Limits,
    Load,
    LoadedRecord,
    LoadingRecord,
    OpenRecord,
    Phase,
    Recovery,
    StoppedRecord,
    StoppingRecord,
    Termination,
)
from trio_supervisor._core.lifecycle import _TRANSITIONS, Event, Lifecycle
from trio_supervisor.errors import (
    ExecutionError,
    LeaseExpiredError,
    SessionConflictError,
    SessionStoppedError,
)
from trio_supervisor.model import recovered

HANDLE = Handle(key=Key(identity="p", instance="a"), token="t" * 32, generation=1)
OPEN = OpenRecord(handle=HANDLE, request_id="r", lease=5.0, limits=Limits())
LOAD = Load(specifier="plugin:main")
CHILD = ChildIdentity(adapter="fake", ref="1")
CODE = CodeIdentity(specifier="plugin:main")
DONE = Termination(kind="exited", exit=ExitStatus(code=0))


def in_phase(phase: Phase, *, child: bool = True) -> Lifecycle:
    """A lifecycle at time 0, lease 5, brought to ``phase`` the legal way."""
    lifecycle = Lifecycle(OPEN, deadline=5.0)
    if phase is Phase.OPEN:
        return lifecycle
    lifecycle.begin_load(LOAD, now=0.0)
    if child:
        lifecycle.child_record(CHILD, now=0.0)
        lifecycle.register(CHILD)
    if phase is Phase.LOADING:
        return lifecycle
    if phase is Phase.LOADED:
        lifecycle.loaded_record(CODE, now=0.0)
        lifecycle.loaded(CODE)
        return lifecycle
    lifecycle.request_stop(Disposed())
    if phase is Phase.STOPPED:
        lifecycle.finish(lifecycle.stopped_record(DONE))
    return lifecycle


def phase_of(lifecycle: Lifecycle) -> Phase:
    # Read through a call, so the type checker does not keep an old phase in mind.
    return lifecycle.phase


def test_a_session_moves_open_loading_loaded_stopping_stopped() -> None:
    lifecycle = Lifecycle(OPEN, deadline=5.0)
    assert lifecycle.active() == OPEN
    assert lifecycle.begin_load(LOAD, now=1.0) is True
    assert lifecycle.phase is Phase.LOADING
    assert lifecycle.active() == LoadingRecord(
        handle=HANDLE, request_id="r", lease=5.0, limits=Limits(), load=LOAD
    )
    with_child = lifecycle.child_record(CHILD, now=1.0)
    assert with_child.child == CHILD
    assert lifecycle.child is None, "asking for the record changes nothing"
    assert lifecycle.active().child is None  # type: ignore[union-attr]
    lifecycle.register(CHILD)
    # The active record is built once per change, and each change shows in it.
    assert lifecycle.active() == with_child
    assert lifecycle.active() is lifecycle.active()
    loaded = lifecycle.loaded_record(CODE, now=1.0)
    lifecycle.loaded(CODE)
    assert phase_of(lifecycle) is Phase.LOADED
    assert lifecycle.active() == loaded
    assert lifecycle.request_stop(Disposed()) is True
    assert lifecycle.stopping_record() == StoppingRecord.of(loaded, Disposed())
    stopped = lifecycle.stopped_record(DONE)
    lifecycle.finish(stopped)
    assert phase_of(lifecycle) is Phase.STOPPED
    assert lifecycle.stopped == StoppedRecord.of(loaded, Disposed(), DONE)


def test_the_record_saved_for_a_fact_is_the_active_record_once_taken_in() -> None:
    # Not built again for the stop's records (P2, P5): the very record the store holds.
    lifecycle = in_phase(Phase.LOADING, child=False)
    with_child = lifecycle.child_record(CHILD, now=0.0)
    lifecycle.register(CHILD)
    assert lifecycle.active() is with_child
    loaded = lifecycle.loaded_record(CODE, now=0.0)
    lifecycle.loaded(CODE)
    assert lifecycle.active() is loaded
    lifecycle.request_stop(Disposed())
    assert lifecycle.stopping_record().previous is loaded


def test_a_fact_other_than_the_record_asked_for_is_taken_in_as_it_is() -> None:
    other_child = ChildIdentity(adapter="fake", ref="2")
    lifecycle = in_phase(Phase.LOADING, child=False)
    lifecycle.child_record(CHILD, now=0.0)
    lifecycle.register(other_child)
    assert lifecycle.active().child == other_child  # type: ignore[union-attr]
    other_code = CodeIdentity(specifier="plugin:main", version="2")
    lifecycle.loaded_record(CODE, now=0.0)
    lifecycle.loaded(other_code)
    assert lifecycle.active() == LoadedRecord(
        handle=HANDLE,
        request_id="r",
        lease=5.0,
        limits=Limits(),
        load=LOAD,
        code=other_code,
        child=other_child,
    )


def test_the_first_stop_request_fixes_the_reason() -> None:
    lifecycle = in_phase(Phase.LOADED)
    assert lifecycle.request_stop(Exited(), ExitStatus(code=3)) is True
    assert lifecycle.request_stop(Disposed()) is False
    assert lifecycle.request_stop(Expired()) is False
    assert (lifecycle.reason, lifecycle.exit) == (Exited(), ExitStatus(code=3))


def test_renew_moves_the_deadline_by_the_lease() -> None:
    lifecycle = in_phase(Phase.OPEN)
    assert lifecycle.renew(now=4.0) == 9.0
    assert lifecycle.deadline == 9.0


def test_the_deadline_is_checked_against_now_not_a_timer() -> None:
    lifecycle = in_phase(Phase.OPEN)
    with pytest.raises(LeaseExpiredError):
        lifecycle.renew(now=5.0)
    with pytest.raises(LeaseExpiredError):
        lifecycle.begin_load(LOAD, now=5.0)
    assert lifecycle.deadline == 5.0


def test_a_stopped_session_says_why() -> None:
    expired = in_phase(Phase.OPEN)
    expired.request_stop(Expired())
    with pytest.raises(LeaseExpiredError):
        expired.check_live(now=0.0)
    disposed = in_phase(Phase.OPEN)
    disposed.request_stop(Disposed())
    with pytest.raises(SessionStoppedError, match="Disposed"):
        disposed.check_live(now=0.0)


def test_load_of_the_same_specifier_joins_and_another_conflicts() -> None:
    lifecycle = in_phase(Phase.LOADING)
    assert (
        lifecycle.begin_load(Load(specifier=LOAD.specifier, config={"other": 1}), now=0.0) is False
    )
    with pytest.raises(SessionConflictError, match="'other:main'"):
        lifecycle.begin_load(Load(specifier="other:main"), now=0.0)


def test_a_second_child_is_an_execution_error() -> None:
    lifecycle = in_phase(Phase.LOADING)
    with pytest.raises(ExecutionError, match="more than one child"):
        lifecycle.child_record(ChildIdentity(adapter="fake", ref="2"), now=0.0)


def test_loaded_without_a_child_is_an_execution_error() -> None:
    lifecycle = in_phase(Phase.LOADING, child=False)
    with pytest.raises(ExecutionError, match="without registering"):
        lifecycle.loaded_record(CODE, now=0.0)


def test_a_write_in_flight_when_the_stop_came_is_still_taken_in() -> None:
    lifecycle = in_phase(Phase.LOADING, child=False)
    record = lifecycle.child_record(CHILD, now=0.0)
    lifecycle.request_stop(Expired())
    lifecycle.register(CHILD)  # the Loading record with the child was durable
    assert lifecycle.stopping_record().previous == record
    with pytest.raises(LeaseExpiredError):
        lifecycle.loaded_record(CODE, now=0.0)


# The legal moves, written out from docs/design.md rather than read from the code, so
# that a move added to the table by mistake shows up as a failure below.
LEGAL = {
    (Phase.OPEN, Event.BEGIN_LOAD): Phase.LOADING,
    (Phase.LOADING, Event.REGISTER): Phase.LOADING,
    (Phase.LOADING, Event.LOADED): Phase.LOADED,
    # L3, F9: a fleet's store refused the first Loading record (a quota).
    (Phase.LOADING, Event.REFUSED): Phase.OPEN,
    (Phase.OPEN, Event.STOP): Phase.STOPPING,
    (Phase.LOADING, Event.STOP): Phase.STOPPING,
    (Phase.LOADED, Event.STOP): Phase.STOPPING,
    # Facts whose write was in flight when the stop came are still taken in.
    (Phase.STOPPING, Event.REGISTER): Phase.STOPPING,
    (Phase.STOPPING, Event.LOADED): Phase.STOPPING,
    (Phase.STOPPING, Event.STOPPED): Phase.STOPPED,
}
ILLEGAL = [move for move in itertools.product(Phase, Event) if move not in LEGAL]


def test_the_table_holds_the_documented_moves_and_no_other() -> None:
    assert dict(_TRANSITIONS) == LEGAL


@pytest.mark.parametrize(("phase", "event"), ILLEGAL)
def test_every_move_outside_the_table_is_refused(phase: Phase, event: Event) -> None:
    # _next is the lifecycle's one refusal point, which the public methods all call;
    # several of them check other rules first, so the table is driven here directly.
    lifecycle = in_phase(phase)
    expected: type[Exception]
    if phase in (Phase.STOPPING, Phase.STOPPED) and event is not Event.STOPPED:
        expected = SessionStoppedError
    elif event in (Event.REGISTER, Event.LOADED):
        expected = ExecutionError
    else:
        expected = RuntimeError
    with pytest.raises(expected):
        lifecycle._next(event)


def test_stop_requests_beyond_the_first_are_joins_not_errors() -> None:
    for phase in (Phase.STOPPING, Phase.STOPPED):
        assert in_phase(phase).request_stop(Disposed()) is False


def test_recovered_records_keep_the_active_snapshot() -> None:
    loaded = LoadedRecord(
        handle=HANDLE, request_id="r", lease=5.0, limits=Limits(), load=LOAD, code=CODE, child=CHILD
    )
    assert recovered(loaded, DONE) == StoppedRecord.of(loaded, Recovery(), DONE)
    stopping = StoppingRecord.of(loaded, Expired())
    assert recovered(stopping, DONE).previous == loaded
    with pytest.raises(ValueError, match="no recovery"):
        recovered(StoppedRecord.of(loaded, Expired(), DONE), DONE)


def test_f9_a_load_refused_over_a_quota_leaves_the_session_open_to_load_again() -> None:
    lifecycle = in_phase(Phase.LOADING, child=False)
    lifecycle.refused()
    assert phase_of(lifecycle) is Phase.OPEN
    assert lifecycle.load is None
    assert lifecycle.active() == OPEN
    # Another specifier is no conflict: nothing of the refused load remains.
    assert lifecycle.begin_load(Load(specifier="other"), now=0.0)
    assert phase_of(lifecycle) is Phase.LOADING


def test_f9_a_refusal_after_a_stop_request_or_a_child_is_refused() -> None:
    stopping = in_phase(Phase.LOADING, child=False)
    stopping.request_stop(Disposed())
    with pytest.raises(SessionStoppedError):
        stopping.refused()
    with pytest.raises(RuntimeError) as registered:
        in_phase(Phase.LOADING).refused()
    assert str(registered.value) == "a load whose child is registered cannot be refused"
