"""An application's tests on a virtual clock: work outside the run takes no virtual time.

pytest-trio's ``autojump_clock`` jumps to the next deadline whenever every task waits,
and a task waiting for a store's thread or a child process waits. The supervisor's
bounds on such work are measured in real time, and the clock does not jump while it is
under way, so an application can test its own code on a virtual clock with a real store.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import trio

from trio_supervisor import (
    Expired,
    InProcessExecution,
    Key,
    LeaseExpiredError,
    Load,
    MemoryStore,
    Phase,
    PluginContext,
    SessionRecord,
    SqliteStore,
    StateStorageError,
    StoppedRecord,
    SubprocessExecution,
    open_supervisor,
)
from trio_supervisor._core import session
from trio_supervisor.realtime import outside_the_run

from ..support.plugins import PLUGINS
from ..support.waits import until_logged

KEY = Key(identity="app", instance="virtual")
OTHER = Key(identity="app", instance="other")


async def worker(context: PluginContext) -> None:
    await trio.sleep_forever()


async def test_a_supervisor_on_sqlite_loads_expires_and_disposes_under_autojump(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with (
        SqliteStore(tmp_path / "state.db") as store,
        InProcessExecution({"worker": worker}) as execution,
        open_supervisor(store, execution, lease=15.0, grace=5.0) as supervisor,
    ):
        started = trio.current_time()
        record = await supervisor.open(KEY, "open-1")
        await supervisor.load(record.handle, Load(specifier="worker"))
        for _ in range(3):  # each save is real work in the store's thread
            await supervisor.renew(record.handle)
        assert trio.current_time() == started  # not one virtual second went by
        status = await supervisor.status(record.handle)
        assert status.phase.value == "Loaded"

        await trio.sleep(16.0)  # past the lease: the session expires
        status = await supervisor.status(record.handle)
        assert status.phase.value == "Stopped"
        assert isinstance(status, StoppedRecord)
        assert isinstance(status.reason, Expired)
        with pytest.raises(LeaseExpiredError):
            await supervisor.renew(record.handle)

        second = await supervisor.open(KEY, "open-2", expected_generation=1)
        await supervisor.load(second.handle, Load(specifier="worker"))
        termination = await supervisor.dispose(second.handle)
        assert termination.describe() == "exited (cancelled)"
    assert trio.current_time() - started == pytest.approx(16.0)


class StoreWhoseThreadHangs(MemoryStore):
    """Answers every save from a thread; the Stopping save's thread never finishes in time."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    async def save(self, record: SessionRecord) -> None:
        with outside_the_run():
            if record.phase is Phase.STOPPING:
                await trio.to_thread.run_sync(self.release.wait, abandon_on_cancel=True)
            await trio.to_thread.run_sync(lambda: None)
        await super().save(record)


async def test_a_bound_on_a_store_s_thread_is_real_time_under_autojump(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SAVE_BOUND is 30 s; a test cannot wait that long in real time.
    monkeypatch.setattr(session, "SAVE_BOUND", 0.3)
    store = StoreWhoseThreadHangs()

    async def dispose_on_a_hanging_thread() -> None:
        async with (
            InProcessExecution({"worker": worker}) as execution,
            open_supervisor(store, execution, lease=15.0, grace=5.0) as supervisor,
        ):
            record = await supervisor.open(KEY, "open-1")
            await supervisor.load(record.handle, Load(specifier="worker"))
            virtual, real = trio.current_time(), time.monotonic()
            with pytest.raises(StateStorageError, match=r"did not save the Stopping .* 0\.3 s"):
                await supervisor.dispose(record.handle)
            # The thread held the virtual clock still; real time ended the wait.
            assert trio.current_time() == virtual
            assert time.monotonic() - real >= 0.3
            assert supervisor.poisoned is not None

    try:
        with pytest.raises(ExceptionGroup):  # Z3: the poisoning is reported on leaving
            await dispose_on_a_hanging_thread()
    finally:
        store.release.set()


@pytest.mark.parametrize("fork_server", [False, True], ids=["started", "forked"])
async def test_real_children_load_expire_and_stop_under_autojump(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, fork_server: bool
) -> None:
    async with (
        SqliteStore(tmp_path / "state.db") as store,
        SubprocessExecution(
            tmp_path / "state", entry_paths=[PLUGINS], fork_server=fork_server
        ) as execution,
        open_supervisor(store, execution, lease=15.0, grace=1.0) as supervisor,
    ):
        started = trio.current_time()
        # A polite child: the interrupt ends it within the grace, measured in real time.
        polite = await supervisor.open(KEY, "polite")
        await supervisor.load(polite.handle, Load(specifier="heartbeat:main"))
        assert trio.current_time() - started < 1.0  # its start took no virtual time
        termination = await supervisor.dispose(polite.handle)
        assert termination.kind == "exited", termination.describe()
        # A stubborn one: killed after the grace, and its exit confirmed.
        stubborn = await supervisor.open(OTHER, "stubborn")
        await supervisor.load(stubborn.handle, Load(specifier="stubborn:main"))
        await until_logged(execution, stubborn.handle, "ignoring SIGTERM")
        termination = await supervisor.dispose(stubborn.handle)
        assert termination.kind == "killed", termination.describe()
        # A child whose lease runs out on the virtual clock.
        third = await supervisor.open(KEY, "third", expected_generation=1)
        await supervisor.load(third.handle, Load(specifier="heartbeat:main"))
        await trio.sleep(16.0)
        record = await supervisor.status(third.handle)
        assert isinstance(record, StoppedRecord)
        assert isinstance(record.reason, Expired)
        assert supervisor.poisoned is None
