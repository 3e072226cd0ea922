"""The fleet's rules (docs/design.md, F1-F8) as the engine keeps them: supervisors on one
PostgreSQL database, in one Trio run. The store's own side (fencing, takeover, the
member's row) is tested in tests/adapters/test_postgres_store.py; runner processes in
tests/service/test_fleet_processes.py."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
import trio

from trio_supervisor import (
    Disposed,
    Handle,
    Limits,
    Load,
    MemoryStore,
    OpenRecord,
    PostgresStore,
    RunnerClosingError,
    SessionStoppedError,
    StaleSessionError,
    StateStorageError,
    StoppedRecord,
    Superseded,
    Supervisor,
    TerminationUnconfirmedError,
    open_supervisor,
)
from trio_supervisor.abc import FleetMember
from trio_supervisor.testing import FakeExecution

from ..support.postgres import own_schema
from ..support.sessions import KEY, OTHER, supervise_embedded
from ..support.tcp_proxy import TcpProxy
from ..support.waits import until


@contextlib.asynccontextmanager
async def two_members(database: str) -> AsyncIterator[tuple[Supervisor, Supervisor]]:
    """Supervisors ``a`` and ``b`` of one fleet, in a schema of the test's own."""
    with own_schema(database) as schema:
        async with (
            PostgresStore(database, runner_id="a", schema=schema, runner_lease=3) as on_a,
            PostgresStore(database, runner_id="b", schema=schema, runner_lease=3) as on_b,
            supervise_embedded(on_a, FakeExecution()) as a,
            supervise_embedded(on_b, FakeExecution()) as b,
        ):
            yield a, b


async def test_f3_a_retried_request_is_answered_by_any_member(database: str) -> None:
    """F3 (with O3 and O4 across the fleet): the store's high-water and request ids."""
    async with two_members(database) as (a, b):
        first = await a.open(KEY, "once")
        # The host's retry reaches b: the same record, no second generation (O3).
        assert await b.open(KEY, "once") == first
        assert await b.high_water(KEY) == 1
        # And b's expectation of the key is the fleet's, not its own (O4).
        with pytest.raises(StaleSessionError, match="high-water generation is 1"):
            await b.open(KEY, "fresh")


async def test_f5_a_renew_of_a_session_superseded_elsewhere_stops_it(database: str) -> None:
    """F5: a session superseded on another member stops, and its renew says why."""
    async with two_members(database) as (a, b):
        first = await a.open(KEY, "first")
        await a.load(first.handle, Load(specifier="x"))
        with trio.fail_after(15):
            await b.open(KEY, "second", expected_generation=1)
        # Stopped already (notified, or the open's wait); a renew says why either way.
        with pytest.raises(SessionStoppedError, match=r"[Ss]uperseded"):
            await a.renew(first.handle)

        # b's open returned once a's Stopped row committed (F6); a's own index takes it
        # in as its save returns, a moment later on a busy machine (found by CI).
        async def stopped() -> StoppedRecord | None:
            record = await a.status(first.handle)
            return record if isinstance(record, StoppedRecord) else None

        record = await until(stopped, "a's index holds the Stopped record", bound=10)
        assert isinstance(record.reason, Superseded)


async def test_f5_a_renew_asks_the_fleet_s_store_nothing(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F5, deviation (n): renew is a memory operation in a fleet too; a supersede is told
    by notification, or found by the store's periodic check of every live key."""
    with own_schema(database) as schema:
        async with (
            PostgresStore(database, runner_id="a", schema=schema, runner_lease=3) as on_a,
            supervise_embedded(on_a, FakeExecution()) as a,
        ):
            opened = await a.open(KEY, "r")
            asked: list[str] = []
            ask = on_a._ask

            async def counted(kind: str, *args: object) -> object:
                asked.append(kind)
                return await ask(kind, *args)

            monkeypatch.setattr(on_a, "_ask", counted)
            for _ in range(20):
                await a.renew(opened.handle)
            # The member's own loop may ask meanwhile (its row, its check); renew never.
            assert "lookup" not in asked, asked
            assert len(asked) < 20, asked


async def test_f8_a_session_stopped_elsewhere_is_answered_by_any_member(database: str) -> None:
    """F8: a Stopped record is answered by any member; a live one only by its holder."""
    async with two_members(database) as (a, b):
        opened = await a.open(OTHER, "held")
        termination = await a.dispose(opened.handle)
        # b never held it: its Stopped record never changes, so b answers from it.
        record = await b.status(opened.handle)
        assert isinstance(record, StoppedRecord)
        assert isinstance(record.reason, Disposed)
        assert await b.dispose(opened.handle) == termination
        with pytest.raises(SessionStoppedError):
            await b.renew(opened.handle)
        with pytest.raises(SessionStoppedError):
            await b.load(opened.handle, Load(specifier="x"))
        # A live session held elsewhere stays unknown to b (the service routes it: F8).
        live = await a.open(KEY, "live")
        with pytest.raises(StaleSessionError):
            await b.status(live.handle)


class HalfAFleetStore(MemoryStore):
    """A store that looks like a fleet's (it has run_member) but is not one."""

    async def run_member(self, member: FleetMember) -> None:
        await trio.sleep_forever()


async def test_half_a_fleet_store_is_refused_naming_what_it_lacks() -> None:
    with pytest.raises(TypeError, match=r"missing: .*lookup.*wait_older_stopped"):
        async with open_supervisor(HalfAFleetStore(), FakeExecution()):
            pass


async def test_f6_o9_an_open_that_waited_for_a_takeover_starts_its_lease_as_it_returns(
    database: str,
) -> None:
    """The holder of generation 1 is cut off from the database (a proxy holds its bytes):
    b's open waits for the takeover, far longer than b's own lease, and the session it
    returns is live, its lease counted from the return."""
    with TcpProxy(("127.0.0.1", 5432)) as proxy, own_schema(database) as schema:
        cut_off = proxy.url(database)
        async with (
            PostgresStore(cut_off, runner_id="a", schema=schema, runner_lease=1) as on_a,
            # b's row has time to spare: only a's is to run out.
            PostgresStore(database, runner_id="b", schema=schema, runner_lease=3) as on_b,
            supervise_embedded(on_b, FakeExecution()) as b,
        ):

            async def held_by_a_then_taken_over() -> None:
                async with supervise_embedded(on_a, FakeExecution()) as a:
                    held = await a.open(KEY, "held", lease=1.0)
                    await a.load(held.handle, Load(specifier="x"))
                    proxy.pause()
                    started = trio.current_time()
                    with trio.fail_after(60):
                        newer = await b.open(KEY, "newer", expected_generation=1, lease=0.5)
                    assert trio.current_time() - started > 1.0 + 0.5  # a's lease, and more
                    assert await b.renew(newer.handle) == 0.5  # live: its lease began now
                    taken = await b.status(held.handle)
                    assert isinstance(taken, StoppedRecord)
                    lost = "exited (runner lost; exit status unknown)"
                    assert taken.termination.describe() == lost
                    proxy.resume()
                    await until(lambda: a.poisoned, "a, fenced, poisoned itself")

            # a shuts down poisoned: its writes were refused once it was taken over.
            with pytest.raises(ExceptionGroup) as raised:
                await held_by_a_then_taken_over()
            assert raised.group_contains(StateStorageError, match="taken over")


async def test_f6_an_open_whose_live_holder_never_stops_fails_and_leaves_no_generation_running(
    database: str,
) -> None:
    """a's store holds generation 1 with no supervisor to stop it: its row is live and
    nothing hears the supersede. b's open fails after the stop bound with
    TerminationUnconfirmedError, and its generation 2, whose handle nobody got, is
    stopped (reason Disposed), not left to run until its lease runs out."""
    with own_schema(database) as schema:
        async with (
            PostgresStore(database, runner_id="a", schema=schema, runner_lease=30) as on_a,
            PostgresStore(database, runner_id="b", schema=schema, runner_lease=30) as on_b,
            supervise_embedded(on_b, FakeExecution()) as b,
        ):
            held = OpenRecord(
                handle=Handle(key=KEY, token=uuid.uuid4().hex, generation=1),
                request_id="held",
                lease=60.0,
                limits=Limits(),
            )
            await on_a.save(held)
            with trio.fail_after(30), pytest.raises(TerminationUnconfirmedError, match="runner a"):
                await b.open(KEY, "newer", expected_generation=1, lease=60.0)
            assert b.find(KEY, 2) is not None

            def stopped_record() -> StoppedRecord | None:
                found = b.find(KEY, 2)
                return found if isinstance(found, StoppedRecord) else None

            stopped = await until(stopped_record, "generation 2 stopped")
            assert isinstance(stopped.reason, Disposed)


async def test_z1_a_shutdown_ends_an_open_waiting_for_an_older_generation_elsewhere(
    database: str,
) -> None:
    """b's open waits for a's generation 1 (a is cut off from the database); b shuts down
    meanwhile: the open ends with RunnerClosingError, and the shutdown does not wait for
    a's takeover (a's runner lease is 30 s: none happens during the test)."""
    with TcpProxy(("127.0.0.1", 5432)) as proxy, own_schema(database) as schema:
        cut_off = proxy.url(database)
        async with (
            PostgresStore(database, runner_id="b", schema=schema, runner_lease=30) as on_b,
            PostgresStore(cut_off, runner_id="a", schema=schema, runner_lease=30) as on_a,
            supervise_embedded(on_a, FakeExecution()) as a,
        ):
            held = await a.open(KEY, "held", lease=60.0)
            proxy.pause()
            outcome: list[BaseException] = []

            async def open_on(b: Supervisor) -> None:
                try:
                    await b.open(KEY, "newer", expected_generation=1)
                except RunnerClosingError as error:
                    outcome.append(error)

            # Leaving b's block shuts b down, the waiting open included; the nursery then
            # waits for that open's end.
            async with (
                trio.open_nursery() as nursery,
                supervise_embedded(on_b, FakeExecution()) as b,
            ):
                nursery.start_soon(open_on, b)
                # Its Open record landed: the open now waits for a's generation 1.
                await until(lambda: any(r.handle.generation == 2 for r in b.records()), "b waits")
            assert len(outcome) == 1, outcome
            still = await on_b.held(held.handle.token)
            assert still is not None
            assert not isinstance(still.record, StoppedRecord)  # no takeover was waited for
            proxy.resume()
