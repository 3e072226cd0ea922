"""The fleet machine: supervisors sharing one PostgreSQL database, driven at random.

Hypothesis picks, step after step: opens on random runners (one at a time, or the same
key from every runner at once), renews, loads and disposes through the runner that holds
the session, crashes and restarts of a runner, and a runner cut off from the database
past its takeover (every byte it sends held by a proxy, :mod:`tests.tcp_proxy`) and then
let through again. After each step the machine holds the database and what the calls
returned against the fleet's promises (docs/design.md, "The fleet"):

* F3: a key's generations strictly increase and none is handed out twice, and the
  database's high-water is the highest generation any open returned;
* F6: once an open of generation g returned, no record of its key below g is unstopped;
* F4: nothing a runner sent after it was taken over lands (its rows stay as the
  takeover left them);
* nothing acknowledged is lost: the record of every open that returned, and of every
  dispose that returned, is in the database (or a later record of its session).

Each supervisor runs in one Trio run on a thread of the machine's, with real time:
takeover is judged by the database's clock, so the timings below are short.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import attrs
import psycopg
import pytest
import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.tcp_proxy import TcpProxy
from trio_supervisor import (
    Handle,
    Key,
    Load,
    Retention,
    StoppedRecord,
    Supervisor,
    SupervisorError,
    open_supervisor,
)
from trio_supervisor.codec import decode
from trio_supervisor.stores.postgres import PostgresStore
from trio_supervisor.testing import FakeExecution

from ..postgres import database_for

T = TypeVar("T")

RUNNERS = ("r1", "r2", "r3")
KEYS = tuple(Key(identity="fleet", instance=name) for name in "ab")
RUNNER_LEASE = 1.5  # renewed every 0.5 s
LEASE = 1.0  # a session's
GRACE = 0.1
CONFIRMATION = 0.3
# A dead runner's sessions are taken over once its row expired by a lease plus grace
# plus confirmation: at most this long after it stopped renewing, with the checks' periods.
TAKEOVER = RUNNER_LEASE + LEASE + GRACE + CONFIRMATION + 3.0
CALL_BOUND = 30.0  # seconds any one call may take before the machine calls it stuck

DSN: list[str] = []  # the module's database, set by the fixture below


@pytest.fixture(scope="module", autouse=True)
def _database() -> Iterator[None]:
    with database_for(__name__) as dsn:
        DSN.append(dsn)
        yield
        DSN.clear()


# -- the Trio run the supervisors live in ----------------------------------------------


class World:
    """One Trio run on a thread; the machine's rules call into it and wait."""

    def __init__(self) -> None:
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._nursery: trio.Nursery | None = None
        self._done: trio.Event | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the machine's Trio run did not start"

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._ready.set()
            await self._done.wait()
            nursery.cancel_scope.cancel()

    def call(self, function: Callable[[], Awaitable[T]], bound: float = CALL_BOUND) -> T:
        """Run ``function()`` in the run; fail the example if it takes over ``bound`` s."""

        async def bounded() -> T:
            with trio.fail_after(bound):
                return await function()

        return trio.from_thread.run(bounded, trio_token=self._token)

    def start(self, function: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Start a task in the run; return what it passes to ``task_status.started``."""

        async def starting() -> Any:
            assert self._nursery is not None
            return await self._nursery.start(function, *args)

        return trio.from_thread.run(starting, trio_token=self._token)

    def close(self) -> None:
        if self._done is not None:
            trio.from_thread.run_sync(self._done.set, trio_token=self._token)
        self._thread.join(CALL_BOUND)


@attrs.define
class RunnerSlot:
    """One runner of the fleet: its proxy to the database, and its supervisor while up."""

    name: str
    proxy: TcpProxy
    execution: FakeExecution
    supervisor: Supervisor | None = None
    stop: trio.Event | None = None
    stopped: threading.Event | None = None
    cut_off: bool = False  # its bytes are held by the proxy
    poisoned: bool = False


async def run_runner(
    slot: RunnerSlot, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED
) -> None:
    """A supervisor on its own PostgresStore, until the slot's stop event is set.

    A failure to start is raised (the machine fails with it); once it serves, how its
    supervisor ends (poisoned, with problems) is the machine's business, not an error.
    """
    stop = trio.Event()
    slot.stop = stop
    slot.stopped = threading.Event()
    started = False
    try:
        store = PostgresStore(
            slot.proxy.url(DSN[0]),
            runner_id=slot.name,
            runner_lease=RUNNER_LEASE,
            retention=Retention(stopped_per_key=1000, stopped_total=100_000),
        )
        async with (
            store,
            open_supervisor(
                store,
                slot.execution,
                lease=LEASE,
                grace=GRACE,
                confirmation_timeout=CONFIRMATION,
            ) as supervisor,
        ):
            task_status.started(supervisor)
            started = True
            await stop.wait()
    except (Exception, BaseExceptionGroup):
        if not started:
            raise
    finally:
        slot.stopped.set()


# -- what the database says ---------------------------------------------------------------


@attrs.frozen
class Row:
    token: str
    runner: str
    epoch: int
    saved: int
    body: str


def rows() -> dict[str, Row]:
    with psycopg.connect(DSN[0], autocommit=True) as connection:
        return {
            token: Row(token, runner, epoch, saved, body)
            for token, runner, epoch, saved, body in connection.execute(
                "SELECT token, runner_id, epoch, saved, body FROM trio_supervisor.records"
            ).fetchall()
        }


def epochs() -> dict[str, int]:
    with psycopg.connect(DSN[0], autocommit=True) as connection:
        return dict(
            connection.execute("SELECT runner_id, epoch FROM trio_supervisor.runners").fetchall()
        )


def marks() -> dict[Key, int]:
    with psycopg.connect(DSN[0], autocommit=True) as connection:
        return {
            Key(identity=identity, instance=instance): generation
            for identity, instance, generation in connection.execute(
                "SELECT identity, instance, generation FROM trio_supervisor.high_water"
            ).fetchall()
        }


def reset_database() -> None:
    with psycopg.connect(DSN[0], autocommit=True) as connection:
        connection.execute("DROP SCHEMA IF EXISTS trio_supervisor CASCADE")


# -- the machine ----------------------------------------------------------------------


class FleetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        reset_database()
        self.world = World()
        self.slots = {
            name: RunnerSlot(name, TcpProxy(("127.0.0.1", 5432)), FakeExecution())
            for name in RUNNERS
        }
        self.requests = itertools.count(1)
        # What the calls returned: every generation handed out, by key, with its token.
        self.handed: dict[tuple[Key, int], str] = {}
        # Sessions by token, with the runner that holds them.
        self.sessions: dict[str, tuple[Handle, str]] = {}
        # The last record each session's calls acknowledged: its phase's rank.
        self.acknowledged: dict[str, int] = {}
        # Runners taken over while cut off: their rows as the takeover left them.
        self.fenced: dict[str, dict[str, Row]] = {}

    @initialize(count=st.sampled_from((2, 3)))
    def start(self, count: int) -> None:
        for name in RUNNERS[count:]:
            self.slots.pop(name).proxy.close()
        for slot in self.slots.values():
            self._up(slot)

    def teardown(self) -> None:
        for slot in self.slots.values():
            slot.proxy.resume()
            self._down(slot)
            slot.proxy.close()
        self.world.close()

    # -- runners up and down ----------------------------------------------------------

    def _up(self, slot: RunnerSlot) -> None:
        slot.poisoned = False
        slot.supervisor = self.world.start(run_runner, slot)

    def _down(self, slot: RunnerSlot) -> None:
        if slot.supervisor is None:
            return
        stop = slot.stop
        assert stop is not None
        assert slot.stopped is not None
        trio.from_thread.run_sync(stop.set, trio_token=self.world._token)
        assert slot.stopped.wait(CALL_BOUND), f"runner {slot.name} did not stop"
        slot.supervisor = None

    def _usable(self) -> list[RunnerSlot]:
        """The runners that are up and reach the database: what the machine did, never
        what it observes (Hypothesis needs the same choices on a replay)."""
        return [
            slot for slot in self.slots.values() if slot.supervisor is not None and not slot.cut_off
        ]

    # -- host calls -------------------------------------------------------------------

    def _open(self, slot: RunnerSlot, key: Key) -> None:
        supervisor = slot.supervisor
        assert supervisor is not None
        request = f"request-{next(self.requests)}"

        async def call() -> Any:
            expected = await supervisor.high_water(key)
            try:
                return await supervisor.open(key, request, expected_generation=expected)
            except SupervisorError as error:
                return error

        outcome = self.world.call(call)
        if isinstance(outcome, SupervisorError):
            return
        self._opened(outcome, slot.name)

    def _opened(self, record: Any, runner: str) -> None:
        handle: Handle = record.handle
        claim = (handle.key, handle.generation)
        earlier = self.handed.setdefault(claim, handle.token)
        assert earlier == handle.token, (
            f"F3: generation {handle.generation} of {handle.key} was handed out twice "
            f"(tokens {earlier[:8]} and {handle.token[:8]})"
        )
        self.sessions[handle.token] = (handle, runner)
        self.acknowledged.setdefault(handle.token, 0)
        # F6: the open returned, so every older generation of its key is stopped.
        for row in rows().values():
            record_ = decode(row.body)
            older = record_.handle
            if older.key == handle.key and older.generation < handle.generation:
                assert isinstance(record_, StoppedRecord), (
                    f"F6: the open of generation {handle.generation} of {handle.key} "
                    f"returned while generation {older.generation} on {row.runner} is "
                    f"{record_.phase.value}"
                )

    @precondition(lambda self: self._usable())
    @rule(pick=st.integers(0, 2), key=st.sampled_from(KEYS))
    def open(self, pick: int, key: Key) -> None:
        usable = self._usable()
        self._open(usable[pick % len(usable)], key)

    @precondition(lambda self: len(self._usable()) > 1)
    @rule(key=st.sampled_from(KEYS))
    def racing_opens(self, key: Key) -> None:
        """Every usable runner opens the same key at once, with the same expectation."""
        usable = self._usable()
        results: list[Any] = []

        async def race() -> None:
            expected = await usable[0].supervisor.high_water(key)  # type: ignore[union-attr]

            async def one(slot: RunnerSlot) -> None:
                assert slot.supervisor is not None
                try:
                    record = await slot.supervisor.open(
                        key, f"request-{next(self.requests)}", expected_generation=expected
                    )
                except SupervisorError as error:
                    results.append(error)
                else:
                    results.append((record, slot.name))

            async with trio.open_nursery() as nursery:
                for slot in usable:
                    nursery.start_soon(one, slot)

        self.world.call(race)
        won = [result for result in results if isinstance(result, tuple)]
        assert len(won) <= 1, f"F3: {len(won)} runners won the same generation of {key}"
        for record, runner in won:
            self._opened(record, runner)

    def _live_session(self, pick: int) -> tuple[Handle, RunnerSlot] | None:
        candidates = [
            (handle, self.slots[runner])
            for handle, runner in self.sessions.values()
            if runner in self.slots and self.slots[runner] in self._usable()
        ]
        return candidates[pick % len(candidates)] if candidates else None

    @rule(pick=st.integers(0, 20))
    def renew(self, pick: int) -> None:
        chosen = self._live_session(pick)
        if chosen is None:
            return
        handle, slot = chosen
        supervisor = slot.supervisor
        assert supervisor is not None

        async def call() -> Any:
            with contextlib.suppress(SupervisorError):
                await supervisor.renew(handle)

        self.world.call(call)

    @rule(pick=st.integers(0, 20))
    def load(self, pick: int) -> None:
        chosen = self._live_session(pick)
        if chosen is None:
            return
        handle, slot = chosen
        supervisor = slot.supervisor
        assert supervisor is not None

        async def call() -> Any:
            try:
                await supervisor.load(handle, Load(specifier="fleet:child"))
            except SupervisorError:
                return
            self.acknowledged[handle.token] = max(self.acknowledged[handle.token], 2)

        self.world.call(call)

    @rule(pick=st.integers(0, 20))
    def dispose(self, pick: int) -> None:
        chosen = self._live_session(pick)
        if chosen is None:
            return
        handle, slot = chosen
        supervisor = slot.supervisor
        assert supervisor is not None

        async def call() -> Any:
            try:
                await supervisor.dispose(handle)
            except SupervisorError:
                return
            self.acknowledged[handle.token] = 4

        self.world.call(call)

    # -- faults -----------------------------------------------------------------------

    @precondition(lambda self: len(self._usable()) > 1)
    @rule(pick=st.integers(0, 2))
    def crash_and_restart(self, pick: int) -> None:
        """A runner dies (its connections reset first, so its shutdown writes nothing),
        then starts again under the same id: a new epoch, which recovers its records."""
        usable = self._usable()
        slot = usable[pick % len(usable)]
        slot.proxy.cut()
        self._down(slot)
        slot.proxy.restore()
        self._up(slot)

    @precondition(lambda self: len(self._usable()) > 1)
    @rule(pick=st.integers(0, 2))
    def cut_off_past_takeover(self, pick: int) -> None:
        """A runner's bytes are held (to the database it is frozen) until the others have
        taken its records over; then what it sent arrives, and must all be refused."""
        usable = self._usable()
        slot = usable[pick % len(usable)]
        before = epochs()[slot.name]
        slot.proxy.pause()
        slot.cut_off = True

        def unstopped() -> bool:
            return any(
                row.runner == slot.name and not isinstance(decode(row.body), StoppedRecord)
                for row in rows().values()
            )

        # A runner that held sessions is taken over (its epoch moves on); one that held
        # none has nothing to take: the machine waits as long, then lets it through.
        held = unstopped()
        started = time.monotonic()

        def taken() -> bool:
            if not held:
                return time.monotonic() - started > TAKEOVER - 3.0
            return epochs()[slot.name] > before and not unstopped()

        # Real time: the takeover is judged by the database's clock.
        limit = time.monotonic() + TAKEOVER + 10
        while not taken():
            assert time.monotonic() < limit, f"F7: {slot.name} was not taken over in time"
            time.sleep(0.1)
        self.fenced[slot.name] = {
            token: row for token, row in rows().items() if row.runner == slot.name
        }
        slot.proxy.resume()
        # It finds itself fenced: poisoned by its next write or renewal of its row.
        limit = time.monotonic() + CALL_BOUND
        while slot.supervisor is not None and slot.supervisor.poisoned is None:
            assert time.monotonic() < limit, f"H1: {slot.name} was not poisoned once fenced"
            time.sleep(0.05)
        self._down(slot)
        slot.cut_off = False
        self._up(slot)

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def the_database_keeps_the_fleets_promises(self) -> None:
        stored = rows()
        # F3: the high-water is the highest generation handed out.
        highest: dict[Key, int] = {}
        for key, generation in self.handed:
            highest[key] = max(highest.get(key, 0), generation)
        for key, generation in highest.items():
            assert marks().get(key) == generation, (
                f"F3: the high-water of {key} is {marks().get(key)}, but generation "
                f"{generation} was handed out"
            )
        # Nothing acknowledged is lost.
        ranks = {"Open": 0, "Loading": 1, "Loaded": 2, "Stopping": 3, "Stopped": 4}
        for token, rank in self.acknowledged.items():
            row = stored.get(token)
            assert row is not None, f"an acknowledged record ({token[:8]}) is gone"
            assert ranks[decode(row.body).phase.value] >= rank, (
                f"the record of {token[:8]} went back to {decode(row.body).phase.value}"
            )
        # F4: a runner taken over wrote nothing after.
        for runner, then in self.fenced.items():
            for token, row in then.items():
                now = stored.get(token)
                if now is not None and now.runner == runner and now.epoch <= row.epoch:
                    assert now == row, (
                        f"F4: {runner}, taken over, still wrote the record of {token[:8]}"
                    )


FleetMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("TRIO_SUPERVISOR_FLEET_EXAMPLES", "8")),
    stateful_step_count=12,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestFleet = FleetMachine.TestCase
