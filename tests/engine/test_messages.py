"""Errors say what went wrong in words a reader can act on: the exact texts.

Other tests check which error class a rule raises; these pin the message, and for an
adapter's failure, that the original exception is kept as the cause.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import trio
import trio.testing

from trio_supervisor import (
    ChildIdentity,
    CodeIdentity,
    ExecutionError,
    Handle,
    Key,
    LeaseExpiredError,
    Limits,
    Load,
    MemoryStore,
    OpenRecord,
    Retention,
    SessionRecord,
    SessionStoppedError,
    StaleSessionError,
    StateStorageError,
    StoppedRecord,
    Supervisor,
)
from trio_supervisor._core.lifecycle import Lifecycle
from trio_supervisor.model import recovered
from trio_supervisor.testing import FakeExecution
from trio_supervisor.testing.fakes import FakeUnit

from ..support.sessions import KEY, opened, supervise_embedded

# Every lease a caller asks for is refused in these words (the minimum is documented).
LEASE_BOUNDS = "lease must be a finite number of seconds >= 0.1 and <= 1000000000"


def causes(error: BaseException) -> list[BaseException]:
    """The chain of ``__cause__`` below an error."""
    chain = []
    while error.__cause__ is not None:
        error = error.__cause__
        chain.append(error)
    return chain


class Broken(Exception):
    """What a misbehaving adapter raises (not one of the documented errors)."""


class Flawed:
    """A fake unit with one flaw: a method that raises, or a bad identity or code."""

    def __init__(self, unit: FakeUnit, flaw: str) -> None:
        self._unit = unit
        self.flaw = flaw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._unit, name)

    @property
    def identity(self) -> object:
        return "pid 12" if self.flaw == "identity" else self._unit.identity

    @property
    def code(self) -> object:
        return "some code" if self.flaw == "code" else self._unit.code

    async def renew(self, lease: float) -> None:
        if self.flaw == "renew":
            raise Broken("renew")
        await self._unit.renew(lease)

    async def start(self) -> None:
        if self.flaw == "start":
            raise Broken("start")
        await self._unit.start()

    async def wait(self) -> Any:
        if self.flaw == "wait":
            await trio.lowlevel.checkpoint()
            raise Broken("wait")
        return await self._unit.wait()


class FlawedExecution(FakeExecution):
    """Spawns units with the flaw named by the specifier; "spawn" fails to spawn."""

    def __init__(self) -> None:
        super().__init__()
        self.flawed: dict[Handle, Flawed] = {}

    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> Any:
        if load.specifier == "spawn":
            await trio.lowlevel.checkpoint()
            raise Broken("spawn")
        unit = await super().spawn(handle, load, limits)
        self.flawed[handle] = Flawed(unit, load.specifier)
        return self.flawed[handle]


@pytest.fixture
async def flawed() -> Any:
    execution = FlawedExecution()
    async with supervise_embedded(MemoryStore(), execution) as supervisor:
        yield supervisor


async def test_arguments_of_the_wrong_type_are_named(sup: Supervisor) -> None:
    handle = await opened(sup)
    with pytest.raises(TypeError) as key_error:
        await sup.high_water("plugin/a")  # type: ignore[arg-type]
    assert str(key_error.value) == "key must be a Key, not str"
    with pytest.raises(TypeError) as load_error:
        await sup.load(handle, "plugin:main")  # type: ignore[arg-type]
    assert str(load_error.value) == "load must be a Load, not str"
    with pytest.raises(TypeError) as handle_error:
        await sup.status("token")  # type: ignore[arg-type]
    assert str(handle_error.value) == "handle must be a Handle, not str"


async def test_an_unknown_handle_and_a_retired_session_say_so(sup: Supervisor) -> None:
    """Defensive, for the retired half: reachable only by removing the session object.

    A retained record that is not Stopped always has its session object (docs/design.md,
    deviation (g)); the test pops it from ``sup._running._by_token`` to read the message of R2
    and D4, and puts it back.
    """
    handle = await opened(sup)
    stranger = Handle(key=KEY, token="0" * 32, generation=handle.generation)
    with pytest.raises(StaleSessionError) as stale:
        await sup.status(stranger)
    assert stale.value.detail == "no retained session has this token, key and generation"
    session = sup._running._by_token.pop(handle.token)  # as recovery or eviction would leave it
    try:
        for call in (sup.dispose(handle), sup.renew(handle)):
            with pytest.raises(SessionStoppedError) as retired:
                await call
            assert retired.value.detail == "the session was retired by recovery or eviction"
    finally:
        sup._running._by_token[handle.token] = session


async def test_an_expired_lease_says_so_before_and_after_the_stop(
    sup: Supervisor, mock_clock: trio.testing.MockClock
) -> None:
    handle = await opened(sup, lease=5.0)
    mock_clock.jump(5.0)
    with pytest.raises(LeaseExpiredError) as early:
        await sup.renew(handle)  # the timer has not fired yet: the lifecycle says so
    await trio.testing.wait_all_tasks_blocked()
    assert isinstance(await sup.status(handle), StoppedRecord)
    with pytest.raises(LeaseExpiredError) as late:
        await sup.renew(handle)  # stopped by the timer: the stop reason says so
    said = f"the lease of {handle.key.identity}/{handle.key.instance} generation 1 has expired"
    assert early.value.detail == late.value.detail == said


@pytest.mark.parametrize(
    ("specifier", "expected"),
    [
        ("spawn", "spawning the child failed: Broken('spawn')"),
        ("renew", "forwarding the lease to the child failed: Broken('renew')"),
        ("start", "starting the child failed: Broken('start')"),
        ("identity", "the unit's identity is a str, not a ChildIdentity"),
        ("code", "the unit's code is a str, not a CodeIdentity"),
    ],
)
async def test_a_failing_adapter_is_named_with_what_was_being_done(
    flawed: Supervisor, specifier: str, expected: str
) -> None:
    handle = await opened(flawed)
    with pytest.raises(ExecutionError) as caught:
        await flawed.load(handle, Load(specifier=specifier))
    assert caught.value.detail == expected
    broken = [cause for cause in causes(caught.value) if isinstance(cause, Broken)]
    assert [str(cause) for cause in broken] == (
        [specifier] if specifier in ("spawn", "renew", "start") else []
    )


async def test_forwarding_a_renewal_that_fails_names_it() -> None:
    execution = FlawedExecution()
    async with supervise_embedded(MemoryStore(), execution) as sup:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="renew-later"))
        execution.flawed[handle].flaw = "renew"  # the test's own fake, flawed from now on
        with pytest.raises(ExecutionError) as caught:
            await sup.renew(handle)
    assert caught.value.detail == "forwarding the lease to the child failed: Broken('renew')"
    assert [str(cause) for cause in causes(caught.value)] == ["renew"]


async def test_a_watcher_that_fails_poisons_with_the_cause_kept() -> None:
    execution = FlawedExecution()
    poisons: list[BaseException] = []

    async def run() -> None:
        async with supervise_embedded(MemoryStore(), execution) as sup:
            handle = await opened(sup)
            await sup.load(handle, Load(specifier="wait"))
            with pytest.raises(ExecutionError) as caught:
                await sup.wait_failed()
            poisons.append(caught.value)

    with pytest.raises(ExceptionGroup) as group:
        await run()
    [poison] = poisons
    assert str(poison) == "watching the child failed: Broken('wait')"
    assert any(isinstance(cause, Broken) for cause in causes(poison))
    # Z3: the shutdown reports the poisoning.
    assert str(poison) in [str(error) for error in group.value.exceptions]


async def test_a_store_that_cannot_save_what_recovery_found_says_so() -> None:
    class Refusing:
        """A store without save_many, so recovery saves record by record."""

        def __init__(self) -> None:
            self.inner = MemoryStore()
            self.refuse = False

        @property
        def retention(self) -> Retention:
            return self.inner.retention

        async def save(self, record: SessionRecord) -> None:
            if self.refuse:
                await trio.lowlevel.checkpoint()
                raise Broken("disk")
            await self.inner.save(record)

        async def list(self) -> Sequence[SessionRecord]:
            return await self.inner.list()

        async def high_water(self) -> Mapping[Key, int]:
            return await self.inner.high_water()

    store = Refusing()
    await store.save(
        OpenRecord(
            handle=Handle(key=KEY, token="1" * 32, generation=1),
            request_id="r1",
            lease=5.0,
            limits=Limits(),
        )
    )
    store.refuse = True
    with pytest.raises(StateStorageError) as caught:
        async with supervise_embedded(store, FakeExecution()):
            pass
    assert caught.value.detail == "the store failed to save recovered records: Broken('disk')"
    assert [str(cause) for cause in causes(caught.value)] == ["disk"]


async def test_the_lease_forwarded_at_load_is_what_remains_of_it(
    sup: Supervisor, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    handle = await opened(sup, lease=4.0)
    await trio.sleep(3.5)
    await sup.load(handle, Load(specifier="plugin:main"))
    assert fake.unit_of(handle).leases == [pytest.approx(0.5)]


def test_the_lifecycle_names_what_the_driver_got_wrong() -> None:
    record = OpenRecord(
        handle=Handle(key=Key(identity="p", instance="x"), token="2" * 32, generation=1),
        request_id="r",
        lease=5.0,
        limits=Limits(),
    )
    lifecycle = Lifecycle(record, deadline=5.0)
    with pytest.raises(RuntimeError) as not_stopping:
        lifecycle.stopped_record(None)  # type: ignore[arg-type]
    assert str(not_stopping.value) == "the session was not asked to stop"
    assert lifecycle.begin_load(Load(specifier="p:main"), now=0.0)
    lifecycle.active()
    child = ChildIdentity(adapter="fake", ref="1")
    with pytest.raises(ExecutionError) as unregistered:
        lifecycle.loaded_record(CodeIdentity(specifier="p:main"), now=0.0)
    assert unregistered.value.detail == (
        "the execution adapter started without registering its child"
    )
    lifecycle.register(lifecycle.child_record(child, now=0.0).child)  # type: ignore[arg-type]
    with pytest.raises(ExecutionError) as second:
        lifecycle.child_record(ChildIdentity(adapter="fake", ref="2"), now=0.0)
    assert second.value.detail == "the execution adapter registered more than one child"


def test_recovering_a_stopped_record_is_refused_by_name() -> None:
    record = OpenRecord(
        handle=Handle(key=Key(identity="p", instance="x"), token="3" * 32, generation=1),
        request_id="r",
        lease=5.0,
        limits=Limits(),
    )
    from trio_supervisor import ExitStatus, Recovery, Termination

    stopped = recovered(record, Termination(kind="exited", exit=ExitStatus(code=0)))
    assert stopped.reason == Recovery()
    with pytest.raises(ValueError, match=r"^a Stopped record needs no recovery$"):
        recovered(stopped, Termination(kind="exited", exit=ExitStatus(code=0)))


def _task_names(task: trio.lowlevel.Task) -> list[str]:
    names = [task.name]
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            names.extend(_task_names(child))
    return names


async def test_tasks_are_named_after_their_session(sup: Supervisor) -> None:
    # What a debugger or a Trio instrument shows: which session a task belongs to.
    handle = await opened(sup)
    await sup.load(handle, Load(specifier="plugin:main"))
    root = trio.lowlevel.current_root_task()
    assert root is not None
    names = _task_names(root)
    where = f"{handle.key.identity}/{handle.key.instance} #{handle.generation}"
    assert f"trio_supervisor session {where}" in names
    assert f"trio_supervisor exit watcher {where}" in names


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"key": "plugin/a"}, TypeError, "key must be a Key, not str"),
        ({"request_id": ""}, ValueError, "request_id must be a non-empty str, got ''"),
        ({"request_id": 5}, ValueError, "request_id must be a non-empty str, got 5"),
        (
            {"expected_generation": True},
            ValueError,
            "expected_generation must be None or an int >= 0, got True",
        ),
        (
            {"expected_generation": "1"},
            ValueError,
            "expected_generation must be None or an int >= 0, got '1'",
        ),
        ({"lease": -1.0}, ValueError, f"{LEASE_BOUNDS}, got -1.0"),
        ({"lease": 0.099}, ValueError, f"{LEASE_BOUNDS}, got 0.099"),
        ({"limits": {}}, TypeError, "limits must be Limits, not dict"),
    ],
)
async def test_open_names_the_argument_it_refuses(
    sup: Supervisor, arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    call: dict[str, Any] = {"key": KEY, "request_id": "r1", **arguments}
    with pytest.raises(error) as caught:
        await sup.open(call.pop("key"), call.pop("request_id"), **call)
    assert str(caught.value) == message
    assert await sup.high_water(KEY) is None  # and nothing was opened


async def test_key_locks_are_dropped_once_nobody_holds_or_waits(
    sup: Supervisor, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    """A key's lock (O2) and a stopped session's object (P5) go once nobody needs them.

    Defensive pokes: neither is visible through the public API (a kept lock or session
    object changes no answer, only memory), so the test reads ``sup._locks`` and
    ``sup._running._by_token``.
    """
    fake.behave("slow", exit_delay=0.8)
    first = await opened(sup)
    await sup.load(first, Load(specifier="slow"))
    async with trio.open_nursery() as nursery:
        # Superseding waits 0.8 s for the slow child, holding the key's lock; a second
        # open waits for the lock and is cancelled while it waits.
        nursery.start_soon(functools.partial(sup.open, KEY, "r2", expected_generation=1))
        await trio.sleep(0.1)
        with trio.move_on_after(0.1):
            await sup.open(KEY, "r3", expected_generation=1)
        assert list(sup._locks._held) == [KEY]
    assert sup._locks._held == {}
    record = await sup.open(KEY, "r4", expected_generation=2)
    assert record.handle.generation == 3
    assert sup._locks._held == {}
    await sup.dispose(record.handle)
    assert record.handle.token not in sup._running._by_token  # P5: its record answers from now on


async def test_a_troubled_supersede_is_logged_with_the_session(
    sup: Supervisor, fake: FakeExecution, caplog: pytest.LogCaptureFixture
) -> None:
    fake.behave("flaky", interrupt_error=RuntimeError("no signal"))
    first = await opened(sup)
    await sup.load(first, Load(specifier="flaky"))
    with caplog.at_level("WARNING", logger="trio_supervisor"):
        await sup.open(KEY, "r2", expected_generation=1)
    [warning] = [record for record in caplog.records if "superseded" in record.getMessage()]
    assert warning.getMessage() == (
        "terminating the superseded generation 1 of plugin/a had problems: RuntimeError: no signal"
    )
    assert (warning.identity, warning.instance, warning.generation) == ("plugin", "a", 1)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("option", "value", "error", "message"),
    [
        ("lease", 0, ValueError, f"{LEASE_BOUNDS}, got 0"),
        ("lease", -2.5, ValueError, f"{LEASE_BOUNDS}, got -2.5"),
        ("lease", 0.05, ValueError, f"{LEASE_BOUNDS}, got 0.05"),  # under the minimum
        ("lease", 2e9, ValueError, f"{LEASE_BOUNDS}, got 2000000000.0"),
        ("lease", 10**400, ValueError, f"{LEASE_BOUNDS}, got {10**400!r}"),  # past any float
        (
            "lease",
            float("inf"),
            ValueError,
            f"{LEASE_BOUNDS}, got inf",
        ),
        ("lease", True, TypeError, "lease must be a number of seconds, not bool"),
        ("lease", "5", TypeError, "lease must be a number of seconds, not str"),
        ("grace", -0.5, ValueError, "grace must be a finite number of seconds >= 0, got -0.5"),
        (
            "grace",
            float("nan"),
            ValueError,
            "grace must be a finite number of seconds >= 0, got nan",
        ),
        (
            "confirmation_timeout",
            0.0,
            ValueError,
            "confirmation_timeout must be a finite number of seconds > 0, got 0.0",
        ),
        (
            "confirmation_timeout",
            None,
            TypeError,
            "confirmation_timeout must be a number of seconds, not NoneType",
        ),
    ],
)
async def test_open_supervisor_names_the_duration_it_refuses(
    option: str, value: object, error: type[Exception], message: str
) -> None:
    store = MemoryStore()
    left_over = OpenRecord(
        handle=Handle(key=KEY, token="4" * 32, generation=1),
        request_id="r1",
        lease=5.0,
        limits=Limits(),
    )
    await store.save(left_over)  # what a crashed run left: recovery would stop it
    fake = FakeExecution()
    with pytest.raises(error) as caught:
        async with supervise_embedded(store, fake, **{option: value}):
            pytest.fail("a supervisor ran with a bad duration")
    assert str(caught.value) == message
    # Refused before recovery: the left-over record is still Open, nothing was called.
    assert list(await store.list()) == [left_over]
    assert fake.calls == []


async def test_a_zero_grace_is_accepted_and_goes_straight_to_the_kill(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # grace=0 is allowed (>= 0): the interrupt gets no time, the kill follows at once (P3).
    fake = FakeExecution()
    fake.behave("stubborn", ignore_interrupt=True)
    async with supervise_embedded(MemoryStore(), fake, grace=0) as sup:
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="stubborn"))
        started = trio.current_time()
        termination = await sup.dispose(handle)
        assert trio.current_time() == started, "no grace was waited for"
    assert termination.kind == "killed"
    assert fake.units[0].signals == ["interrupt", "kill"]


@pytest.mark.parametrize(
    ("lease", "shown"), [(0, "0"), (-1, "-1"), (float("nan"), "nan"), (0.01, "0.01")]
)
async def test_open_refuses_a_lease_under_the_minimum(
    sup: Supervisor, lease: float, shown: str
) -> None:
    with pytest.raises(ValueError, match=r"^lease must be") as caught:
        await sup.open(KEY, "r1", expected_generation=None, lease=lease)
    assert str(caught.value) == f"{LEASE_BOUNDS}, got {shown}"
    assert await sup.high_water(KEY) is None
