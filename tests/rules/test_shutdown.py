"""shutdown, leaving open_supervisor: Z1-Z3 of docs/design.md, "Semantics"."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_supervisor import (
    Handle,
    Key,
    Load,
    MemoryStore,
    RunnerClosingError,
    Shutdown,
    StateStorageError,
    StoppedRecord,
    StoppingRecord,
    SupervisorAPI,
    TerminationUnconfirmedError,
)
from trio_supervisor.testing import FakeExecution, FaultyStore

from ..support.sessions import during_shutdown, opened, supervise


async def test_z1_closing_is_set_first_so_new_work_is_refused(
    store: MemoryStore, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    refused: list[str] = []

    async def new_work(sup: SupervisorAPI, handle: Handle) -> None:
        for name, call in (
            ("open", sup.open(Key(identity="p", instance="new"), "r")),
            ("renew", sup.renew(handle)),
            ("load", sup.load(handle, Load(specifier="slow"))),
        ):
            with pytest.raises(RunnerClosingError, match=r"^the supervisor is shutting down$"):
                await call
            refused.append(name)
        # S1 still answers while closing: the session is stopping with the others.
        assert isinstance(await sup.status(handle), StoppingRecord)

    await during_shutdown(store, fake, new_work)
    assert refused == ["open", "renew", "load"]


async def test_z2_every_session_stops_with_shutdown_concurrently(
    store: MemoryStore, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("slow", exit_delay=0.5)
    async with supervise(store, fake) as sup:
        handles = [await opened(sup, key=Key(identity="p", instance=str(n))) for n in range(5)]
        for handle in handles:
            await sup.load(handle, Load(specifier="slow"))
        leaving = trio.current_time()
    # Five children taking 0.5 s each were stopped together, not one after another.
    assert trio.current_time() - leaving == pytest.approx(0.5)
    records = await store.list()
    assert len(records) == 5
    for record in records:
        assert isinstance(record, StoppedRecord)
        assert record.reason == Shutdown()
    assert all(unit.exited for unit in fake.units)


async def test_z2_a_session_opened_while_shutdown_began_is_stopped_too(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    class SlowStore(MemoryStore):
        async def save(self, record: object) -> None:
            with trio.CancelScope(shield=True):
                await trio.sleep(1.0)
            await super().save(record)  # type: ignore[arg-type]

    store = SlowStore()
    async with trio.open_nursery() as callers, supervise(store, fake) as sup:
        callers.start_soon(sup.open, Key(identity="p", instance="late"), "r")
        await trio.sleep(0.5)  # the open is saving its record as the block ends
    [record] = await store.list()
    assert isinstance(record, StoppedRecord)
    assert record.reason == Shutdown()


async def test_z3_a_poisoned_supervisor_raises_after_reaping_everything(
    fake: FakeExecution,
) -> None:
    store = FaultyStore(MemoryStore())
    with pytest.RaisesGroup(StateStorageError, match="Z3"):
        async with supervise(store, fake) as sup:
            handle = await opened(sup)
            await sup.load(handle, Load(specifier="x"))
            store.fail_next()
            with pytest.raises(StateStorageError):
                await opened(sup, request_id="r2")
    assert all(unit.exited for unit in fake.units)


async def test_z3_termination_problems_of_the_shutdown_are_raised(fake: FakeExecution) -> None:
    fake.behave("leaky", aclose_error=OSError("fd already closed"))
    store = MemoryStore()
    with pytest.RaisesGroup(OSError):
        async with supervise(store, fake) as sup:
            handle = await opened(sup)
            await sup.load(handle, Load(specifier="leaky"))
    [record] = await store.list()
    assert isinstance(record, StoppedRecord)
    assert record.termination.cause[0].message == "fd already closed"


async def test_z3_the_block_s_own_exception_comes_with_the_problems(
    fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("immortal", ignore_interrupt=True, ignore_kill=True)
    with pytest.RaisesGroup(KeyError, TerminationUnconfirmedError):
        async with supervise(MemoryStore(), fake) as sup:
            handle = await opened(sup)
            await sup.load(handle, Load(specifier="immortal"))
            raise KeyError("mine")
    fake.units[0].exit()


async def test_z3_a_clean_shutdown_hands_back_the_block_s_exception_unwrapped(
    fake: FakeExecution,
) -> None:
    async def block() -> None:
        async with supervise(MemoryStore(), fake) as sup:
            await opened(sup)
            raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        await block()


async def test_z3_a_cancelled_block_still_reaps_every_child(
    store: MemoryStore, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    fake.behave("slow", exit_delay=0.5)
    with trio.move_on_after(1.0) as scope:
        async with supervise(store, fake) as sup:
            handle = await opened(sup)
            await sup.load(handle, Load(specifier="slow"))
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert trio.current_time() == pytest.approx(1.5)
    [record] = await store.list()
    assert isinstance(record, StoppedRecord)
    assert record.reason == Shutdown()
    assert fake.units[0].exited


async def test_z3_a_cancelled_block_still_reports_the_problems_of_its_terminations(
    store: MemoryStore, fake: FakeExecution, autojump_clock: trio.testing.MockClock
) -> None:
    # The shutdown is shielded: the cancellation that ended the block neither cuts the
    # terminations short nor swallows what went wrong in them.
    fake.behave("leaky", exit_delay=0.5, aclose_error=OSError("fd already closed"))
    with pytest.RaisesGroup(OSError, flatten_subgroups=True) as caught:
        with trio.move_on_after(1.0):
            async with supervise(store, fake) as sup:
                handle = await opened(sup)
                await sup.load(handle, Load(specifier="leaky"))
                await trio.sleep_forever()
    # Past the cancel scope, the cancellation is gone and the problem is what is left.
    assert [str(problem) for problem in _leaves(caught.value)] == ["fd already closed"]
    assert trio.current_time() == pytest.approx(1.5)
    [record] = await store.list()
    assert isinstance(record, StoppedRecord)
    assert record.termination.kind == "exited"


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]
