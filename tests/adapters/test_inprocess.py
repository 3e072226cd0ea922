"""InProcessExecution: plugins as Trio tasks, interrupted, killed, recovered."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from trio_supervisor import (
    ChildIdentity,
    ExecutionError,
    Exited,
    ExitStatus,
    Handle,
    InProcessExecution,
    Key,
    Limits,
    Load,
    MemoryStore,
    PackageError,
    PluginContext,
    Recovery,
    StoppedRecord,
    Termination,
    TerminationUnconfirmedError,
)

from ..support.sessions import opened, supervise

seen: list[PluginContext] = []


async def idle(context: PluginContext) -> None:
    seen.append(context)
    await trio.sleep_forever()


async def polite(context: PluginContext) -> int:
    try:
        await trio.sleep_forever()
    except trio.Cancelled:
        # Interrupted: clean up for a moment, then report success.
        with trio.CancelScope(shield=True):
            await trio.sleep(0.3)
        return 0
    raise AssertionError("unreachable")


async def stubborn(context: PluginContext) -> None:
    with trio.CancelScope(shield=True):
        await trio.sleep(1.5)
    await trio.sleep_forever()


async def quits(context: PluginContext) -> int:
    await trio.sleep(1.0)
    return 5


async def crashes(context: PluginContext) -> None:
    await trio.sleep(1.0)
    raise RuntimeError("plugin bug")


not_a_function = 42

FUNCTIONS = {
    "idle": idle,
    "polite": polite,
    "stubborn": stubborn,
    "quits": quits,
    "crashes": crashes,
}


async def test_a_plugin_runs_as_a_task_with_its_context(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen.clear()
    async with (
        InProcessExecution(FUNCTIONS) as execution,
        supervise(MemoryStore(), execution, limits=Limits(open_files=5)) as sup,
    ):
        handle = await opened(sup)
        code = await sup.load(handle, Load(specifier="idle", config={"greeting": "hi"}))
        assert execution.running == 1
        [context] = seen
        assert (context.key, context.generation) == (handle.key, 1)
        assert context.config == {"greeting": "hi"}
        assert context.limits == Limits(open_files=5)
        assert code.origin == "tests.adapters.test_inprocess:idle"
        assert code.digest is not None
        assert code.digest.startswith("sha256:")
        termination = await sup.dispose(handle)
        assert termination == Termination(kind="exited", exit=ExitStatus(cancelled=True))
        assert termination.describe() == "exited (cancelled)"
        assert execution.running == 0


async def test_an_interrupted_plugin_may_clean_up_and_return(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        InProcessExecution(FUNCTIONS) as execution,
        supervise(MemoryStore(), execution) as sup,
    ):
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="polite"))
        started = trio.current_time()
        assert await sup.dispose(handle) == Termination(kind="exited", exit=ExitStatus(code=0))
        assert trio.current_time() - started == pytest.approx(0.3)


async def test_a_plugin_ignoring_the_interrupt_is_killed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        InProcessExecution(FUNCTIONS) as execution,
        supervise(MemoryStore(), execution, grace=1.0, confirmation_timeout=2.0) as sup,
    ):
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="stubborn"))
        termination = await sup.dispose(handle)
        assert termination == Termination(kind="killed", exit=ExitStatus(cancelled=True))
        assert termination.describe() == "killed (did not stop in time; cancelled)"


async def test_a_plugin_that_shields_itself_forever_is_unconfirmed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    released = trio.Event()

    async def immortal(context: PluginContext) -> None:
        with trio.CancelScope(shield=True):
            await released.wait()

    with pytest.RaisesGroup(TerminationUnconfirmedError):
        async with (
            InProcessExecution({"immortal": immortal}) as execution,
            supervise(MemoryStore(), execution) as sup,
        ):
            handle = await opened(sup)
            await sup.load(handle, Load(specifier="immortal"))
            with pytest.raises(TerminationUnconfirmedError):
                await sup.dispose(handle)
            assert execution.running == 1
            released.set()  # only the plugin itself can end it


async def test_a_plugin_that_returns_or_raises_exits_by_itself(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        InProcessExecution(FUNCTIONS) as execution,
        supervise(MemoryStore(), execution) as sup,
    ):
        quitting = await opened(sup)
        crashing = await opened(sup, key=Key(identity="p", instance="crash"))
        await sup.load(quitting, Load(specifier="quits"))
        await sup.load(crashing, Load(specifier="crashes"))
        with caplog.at_level(logging.ERROR, logger="trio_supervisor"):
            await trio.sleep(2.0)
        for handle, code in ((quitting, 5), (crashing, 1)):
            record = await sup.status(handle)
            assert isinstance(record, StoppedRecord)
            assert record.reason == Exited()
            assert record.termination == Termination(kind="exited", exit=ExitStatus(code=code))
        assert "plugin bug" in caplog.text


@pytest.mark.parametrize(
    ("specifier", "words"),
    [
        ("nothing", "cannot load 'nothing': no plugin is registered under that name"),
        (
            "tests.no_such_module:main",
            "cannot load 'tests.no_such_module:main': there is no module 'tests.no_such_module'",
        ),
        (
            "tests.adapters.test_inprocess:missing",
            "tests.adapters.test_inprocess defines no 'missing'",
        ),
        ("tests.adapters.test_inprocess:not_a_function", "names a int, not a function"),
        ("tests.adapters.test_inprocess:__class__", "'__class__' is not a public name"),
        (
            "tests.adapters.test_inprocess:Load",
            "trio_supervisor.model.Load, imported by the plugin",
        ),
        (":main", "a specifier is package.module:function"),
    ],
)
async def test_unresolvable_specifiers_are_package_errors(specifier: str, words: str) -> None:
    async with (
        InProcessExecution(importable=True) as execution,
        supervise(MemoryStore(), execution) as sup,
    ):
        handle = await opened(sup)
        with pytest.raises(PackageError, match=words):
            await sup.load(handle, Load(specifier=specifier))


async def test_importable_specifiers_resolve_only_when_allowed() -> None:
    async with (
        InProcessExecution(importable=True) as execution,
        supervise(MemoryStore(), execution) as sup,
    ):
        handle = await opened(sup)
        code = await sup.load(handle, Load(specifier="tests.adapters.test_inprocess:idle"))
        assert code.origin == "tests.adapters.test_inprocess:idle"
    async with InProcessExecution() as execution, supervise(MemoryStore(), execution) as sup:
        handle = await opened(sup)
        with pytest.raises(PackageError, match="no plugin"):
            await sup.load(handle, Load(specifier="tests.adapters.test_inprocess:idle"))


async def test_spawn_needs_the_execution_running() -> None:
    execution = InProcessExecution(FUNCTIONS)
    async with supervise(MemoryStore(), execution) as sup:
        handle = await opened(sup)
        with pytest.raises(ExecutionError, match="async with"):
            await sup.load(handle, Load(specifier="idle"))


def test_bad_plugin_tables_are_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        InProcessExecution({"": idle})
    with pytest.raises(TypeError, match="not callable"):
        InProcessExecution({"x": 3})  # type: ignore[dict-item]


async def test_recovery_kills_a_task_a_crashed_supervisor_left_running() -> None:
    store = MemoryStore()
    async with InProcessExecution(FUNCTIONS) as execution, supervise(store, execution) as first:
        handle = await opened(first)
        await first.load(handle, Load(specifier="idle"))
        async with supervise(store.copy(), execution) as second:
            record = await second.status(handle)
            assert isinstance(record, StoppedRecord)
            assert record.reason == Recovery()
            assert record.termination == Termination(kind="killed", exit=ExitStatus(cancelled=True))
            assert execution.running == 0


async def test_recover_of_a_gone_or_foreign_child() -> None:
    async with InProcessExecution(FUNCTIONS) as execution:
        gone = await execution.recover(ChildIdentity(adapter="inprocess", ref="nope"))
        assert gone == Termination(kind="exited", exit=ExitStatus(code=None, signal=None))
        assert gone.describe() == "exited (already gone; exit status unknown)"
        with pytest.raises(ExecutionError, match="not made by the in-process execution"):
            await execution.recover(ChildIdentity(adapter="subprocess", ref="1", pid=1))


async def test_leaving_the_execution_cancels_what_still_runs() -> None:
    handle = Handle(key=Key(identity="p", instance="a"), token="t" * 32, generation=1)
    async with InProcessExecution(FUNCTIONS) as execution:
        unit = await execution.spawn(handle, Load(specifier="idle"), Limits())
        await unit.start()
        assert execution.running == 1
    assert execution.running == 0
    assert await unit.wait() == ExitStatus(cancelled=True)
