"""PostgresStore's part in the fleet on a real server: an open's wait for the older
generations of its key on other runners (whom it waits for, how long, and what it says
when it gives up), and the takeover of a dead runner (whom it takes, and what it says)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
import trio
from psycopg.conninfo import make_conninfo

from trio_supervisor import (
    Disposed,
    ExitStatus,
    Handle,
    Key,
    Limits,
    OpenRecord,
    PostgresStore,
    RecordFormatError,
    StateStorageError,
    StoppedRecord,
    Termination,
    TerminationUnconfirmedError,
)
from trio_supervisor import _defaults as defaults
from trio_supervisor.stores._jobs import Job
from trio_supervisor.stores._postgres_schema import SCHEMA_VERSION

from ..support.postgres import query_in as run
from ..support.waits import until

DONE = Termination(kind="exited", exit=ExitStatus(code=0))
LOGGER = "trio_supervisor.stores.postgres"


def record(instance: str, generation: int) -> OpenRecord:
    handle = Handle(
        key=Key(identity="p", instance=instance),
        token=f"{instance}-{generation}".rjust(32, "0"),
        generation=generation,
    )
    return OpenRecord(handle=handle, request_id=f"r{generation}", lease=5.0, limits=Limits())


def stopped(opened: OpenRecord) -> StoppedRecord:
    return StoppedRecord.of(opened, Disposed(), DONE)


def expire(database: str, schema: str, runner: str, seconds: float) -> None:
    """``runner``'s row expired ``seconds`` ago."""
    run(
        database,
        schema,
        "UPDATE runners SET lease_until = clock_timestamp() - make_interval(secs => %s) "
        "WHERE runner_id = %s",
        seconds,
        runner,
    )


@contextlib.asynccontextmanager
async def runners(
    database: str, schema: str, *names: str, **options: Any
) -> AsyncIterator[list[PostgresStore]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                PostgresStore(database, runner_id=name, schema=schema, **options)
            )
            for name in names
        ]


async def held(store: PostgresStore, instance: str, generation: int) -> OpenRecord | StoppedRecord:
    """The record of ``instance``'s ``generation``, as the fleet has it."""
    (found,) = [
        f.record
        for f in await store.fleet_records()
        if f.record.handle == record(instance, generation).handle
    ]
    assert isinstance(found, OpenRecord | StoppedRecord)
    return found


def said(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name == LOGGER]


# -- an open's wait for older generations ----------------------------------------------


async def test_an_open_gives_up_on_a_live_holder_after_its_stop_bound_and_two_checks(
    database: str, schema: str
) -> None:
    async with runners(database, schema, "a", "b") as (a, b):
        await a.save(record("live", 1))
        assert await a._ask("renew", 0.25)  # a's stop_bound
        await b.save(record("live", 2))
        began = time.monotonic()
        with trio.fail_after(10), pytest.raises(TerminationUnconfirmedError) as failed:
            await b.wait_older_stopped(record("live", 2).handle)
        waited = time.monotonic() - began
        assert str(failed.value) == (
            "runner a did not stop generation 1 of p/live within 2.25 s of generation 2 "
            "being opened"
        )
        assert 2.25 <= waited < 2.25 + 2
        # Nothing was taken over: a is alive.
        owner = await held(b, "live", 1)
        assert not isinstance(owner, StoppedRecord)


async def test_an_open_s_wait_starts_from_what_its_save_found_when_nothing_stopped_since(
    database: str, schema: str
) -> None:
    """The save of an Open looked for older generations already: while no stop was
    heard since, the wait does not look again at once, but after its poll."""
    looks: list[float] = []
    async with runners(database, schema, "a", "b") as (a, b):
        ask = b._ask

        async def noted(kind: str, *args: Any) -> Any:
            if kind == "older":
                looks.append(time.monotonic())
            return await ask(kind, *args)

        b._ask = noted  # type: ignore[method-assign]
        await a.save(record("k", 1))
        await b.save(record("k", 2))
        began = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.wait_older_stopped, record("k", 2).handle)
            await until(lambda: looks, "a look after the poll", bound=10)
            await a.save(stopped(record("k", 1)))
        assert looks[0] - began >= defaults.OLDER_POLL


async def test_an_open_returns_at_once_when_no_older_generation_is_unstopped_elsewhere(
    database: str, schema: str
) -> None:
    async with runners(database, schema, "a", "b") as (a, b):
        await a.save(stopped(record("k", 1)))
        await b.save(record("k", 2))  # its own older generation is its own to stop
        await b.save(record("k", 3))
        with trio.fail_after(1):
            await b.wait_older_stopped(record("k", 3).handle)
        await a.save(record("other", 1))
        with trio.fail_after(1):
            await b.wait_older_stopped(record("k", 3).handle)


async def test_a_new_incarnation_waits_for_an_older_generation_its_last_one_opened_over(
    database: str, schema: str
) -> None:
    async with runners(database, schema, "a") as (a,):
        await a.save(record("k", 1))
        async with runners(database, schema, "b") as (b,):
            await b.save(record("k", 2))
        # b again, a new incarnation that saved nothing yet: its wait is as good.
        async with runners(database, schema, "b") as (b,):
            done = trio.Event()

            async def wait() -> None:
                await b.wait_older_stopped(record("k", 2).handle)
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait)
                await trio.sleep(0.3)
                assert not done.is_set()
                await a.save(stopped(record("k", 1)))
                with trio.fail_after(5):
                    await done.wait()


async def test_a_holder_whose_row_expires_while_an_open_waits_gets_a_new_bound_once_back(
    database: str, schema: str
) -> None:
    async with runners(database, schema, "a", "b") as (a, b):
        await a.save(record("k", 1))
        assert await a._ask("renew", 0.0)  # alive: a bound of 2 s, from the first look
        await b.save(record("k", 2))
        failure: list[BaseException] = []
        done = trio.Event()

        async def wait() -> None:
            try:
                await b.wait_older_stopped(record("k", 2).handle)
            except TerminationUnconfirmedError as error:
                failure.append(error)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.sleep(1.5)
            # a's row expires half a second before its bound would end: from now on
            # its takeover margin bounds the wait, not the bound it had alive ...
            expire(database, schema, "a", 0.0)
            with trio.move_on_after(1.5):
                await done.wait()
            assert not failure
            assert not done.is_set()
            # ... and once it renews its row again, its bound starts again from then.
            assert await a._ask("renew", 0.0)
            with trio.move_on_after(0.5):
                await done.wait()
            assert not failure
            await a.save(stopped(record("k", 1)))
            with trio.fail_after(5):
                await done.wait()
        assert not failure


async def test_a_live_holder_of_a_later_generation_than_an_expired_one_is_waited_for_past_its_bound(
    database: str, schema: str
) -> None:
    # a's row expired, within its takeover margin: c's generation 2 may be an open that
    # waits for a's generation 1 to be taken over, so c is not failed at its own bound.
    async with runners(database, schema, "a", "b", "c") as (a, b, c):
        await a.save(record("k", 1))
        assert await a._ask("renew", 60.0)  # a long margin: not taken over in this test
        await c.save(record("k", 2))
        assert await c._ask("renew", 0.0)  # c's bound: 2 s
        await b.save(record("k", 3))
        expire(database, schema, "a", 1.0)
        done = trio.Event()
        failure: list[BaseException] = []

        async def wait() -> None:
            try:
                await b.wait_older_stopped(record("k", 3).handle)
            except TerminationUnconfirmedError as error:
                failure.append(error)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            with trio.move_on_after(3):
                await done.wait()
            assert not failure
            assert not done.is_set()
            await c.save(stopped(record("k", 2)))
            with trio.move_on_after(1):
                await done.wait()
            assert not done.is_set(), "a's generation 1 is still unstopped"
            await a.save(stopped(record("k", 1)))
            with trio.fail_after(5):
                await done.wait()
        assert not failure


async def test_an_open_takes_over_a_holder_dead_past_its_margin_and_only_then(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with runners(database, schema, "a", "b") as (a, b):
        await a.save(record("k", 1))  # lease 5 s
        assert await a._ask("renew", 30.0)  # margin: 35 s
        await b.save(record("k", 2))
        expire(database, schema, "a", 33.0)
        with trio.move_on_after(1):
            await b.wait_older_stopped(record("k", 2).handle)
            pytest.fail("returned before a's margin passed")
        expire(database, schema, "a", 35.5)
        with trio.fail_after(5):
            await b.wait_older_stopped(record("k", 2).handle)
        owner = await held(b, "k", 1)
        assert isinstance(owner, StoppedRecord)
        assert owner.reason.kind == "Recovery"
        assert said(caplog, logging.WARNING) == [
            f"{b.dsn}: runner a (epoch {a.epoch}) is dead past its takeover margin; took "
            "over 1 of its sessions: p/k#1"
        ]


async def test_an_open_that_took_a_dead_holder_over_still_waits_for_a_live_one(
    database: str, schema: str
) -> None:
    async with runners(database, schema, "a", "b", "c") as (a, b, c):
        await a.save(record("k", 1))
        await c.save(record("k", 2))
        assert await c._ask("renew", 30.0)  # alive, with a long bound
        await b.save(record("k", 3))
        expire(database, schema, "a", 60.0)  # dead past its margin
        done = trio.Event()

        async def wait() -> None:
            await b.wait_older_stopped(record("k", 3).handle)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            with trio.move_on_after(0.5):
                await done.wait()
            assert not done.is_set(), "c's generation 2 is still unstopped"
            assert isinstance(await held(b, "k", 1), StoppedRecord)  # a was taken over
            await c.save(stopped(record("k", 2)))
            with trio.fail_after(5):
                await done.wait()


async def test_a_takeover_that_cannot_lock_the_dead_row_is_tried_again_then_fails(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with runners(database, schema, "a", "b", statement_timeout=0.2) as (a, b):
        await a.save(record("k", 1))
        await a.save(record("j", 1))
        await b.save(record("k", 2))
        await b.save(record("j", 2))
        expire(database, schema, "a", 60.0)
        locker = psycopg.connect(make_conninfo(database, options=f"-c search_path={schema}"))
        try:
            # As a frozen incarnation of a would: its row locked, the lock never let go.
            locker.execute("SELECT 1 FROM runners WHERE runner_id = 'a' FOR UPDATE")
            with trio.fail_after(10), pytest.raises(StateStorageError, match="take a dead"):
                await b.wait_older_stopped(record("k", 2).handle)
            warned = said(caplog, logging.WARNING)
            assert len(warned) == 3
            assert all(w.endswith("; trying again") for w in warned)
            assert all("cannot take a dead runner's records over" in w for w in warned)
            caplog.clear()
            # Let go after a failure: the next look takes a over.
            async with trio.open_nursery() as nursery:

                async def free() -> None:
                    await until(lambda: said(caplog, logging.WARNING), "a failed takeover", bound=5)
                    locker.rollback()

                nursery.start_soon(free)
                with trio.fail_after(10):
                    await b.wait_older_stopped(record("j", 2).handle)
        finally:
            locker.close()
        owner = await held(b, "j", 1)
        assert isinstance(owner, StoppedRecord)


# -- takeovers ---------------------------------------------------------------------------


async def test_a_takeover_of_a_runner_whose_row_lives_or_moved_on_takes_nothing(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with runners(database, schema, "a", "b") as (a, b):
        await a.save(record("x", 1))
        await a.save(record("y", 1))
        # Alive: its row did not expire.
        assert await b._submit(Job("takeover", args=("a", a.epoch))) == []
        expire(database, schema, "a", 60.0)
        # Expired, but not at the epoch seen.
        assert await b._submit(Job("takeover", args=("a", a.epoch + 1))) == []
        assert await b._submit(Job("takeover", args=("nobody", 1))) == []
        caplog.clear()
        taken = await b._submit(Job("takeover", args=("a", a.epoch)))
        assert [t.handle for t in taken] == [record("x", 1).handle, record("y", 1).handle]
        assert {t.termination for t in taken} == {
            Termination(kind="exited", exit=ExitStatus(runner_lost=True))
        }
        # Again, at the epoch it had: it moved on.
        assert await b._submit(Job("takeover", args=("a", a.epoch))) == []
        assert said(caplog, logging.WARNING) == [
            f"{b.dsn}: runner a (epoch {a.epoch}) is dead past its takeover margin; took "
            "over 2 of its sessions: p/x#1, p/y#1"
        ]


async def test_a_takeover_that_meets_a_corrupt_record_names_the_database_and_takes_nothing(
    database: str, schema: str
) -> None:
    async with runners(database, schema, "a", "b") as (a, b):
        await a.save(record("x", 1))
        run(database, schema, "UPDATE records SET body = '{' WHERE instance = 'x'")
        expire(database, schema, "a", 60.0)
        with pytest.raises(RecordFormatError) as failed:
            await b._submit(Job("takeover", args=("a", a.epoch)))
        assert str(failed.value).startswith(f"{b.dsn}: ")
        # Nothing of it landed: a still holds its epoch.
        assert run(database, schema, "SELECT epoch FROM runners WHERE runner_id = 'a'") == [
            (a.epoch,)
        ]


async def test_a_takeover_with_nothing_due_says_none_and_fences_the_runner(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with runners(database, schema, "a", "b") as (a, b):
        await a.save(stopped(record("x", 1)))
        expire(database, schema, "a", 60.0)
        caplog.clear()
        assert await b._submit(Job("takeover", args=("a", a.epoch))) == []
        assert said(caplog, logging.WARNING) == [
            f"{b.dsn}: runner a (epoch {a.epoch}) is dead past its takeover margin; took "
            "over 0 of its sessions: none"
        ]
        with pytest.raises(StateStorageError, match="taken over"):
            await a.save(record("y", 1))


# -- registration ------------------------------------------------------------------------


async def test_registration_says_who_else_is_alive_and_who_shares_its_url(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with contextlib.AsyncExitStack() as stack:
        for runner, advertise in (("a", "http://h:1"), ("b", "http://h:1"), ("c", "")):
            await stack.enter_async_context(
                PostgresStore(database, runner_id=runner, schema=schema, advertise=advertise)
            )
        caplog.clear()
        d = await stack.enter_async_context(
            PostgresStore(database, runner_id="d", schema=schema, advertise="http://h:1")
        )
        assert said(caplog, logging.WARNING) == [
            f"{d.dsn}: runner d advertises http://h:1, as a, b already does each: hosts "
            "sent there reach only one of them; give each runner its own --advertise URL"
        ]
        assert said(caplog, logging.INFO) == [
            f"{d.dsn}: runner d registered as epoch 1; 3 other runners alive (a, b, c)"
        ]
        caplog.clear()
        # No URL is no URL shared; a second incarnation while the first's row lives.
        await stack.enter_async_context(PostgresStore(database, runner_id="c", schema=schema))
        assert said(caplog, logging.WARNING) == [
            f"{d.dsn}: runner c registered as epoch 2 while the row of its epoch 1 was "
            "still within its lease: another process may be running under this id"
        ]
        assert said(caplog, logging.INFO) == []


async def test_a_new_schema_is_migrated_and_said_once(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with PostgresStore(database, runner_id="a", schema=schema) as a:
        pass
    async with PostgresStore(database, runner_id="b", schema=schema):
        pass
    assert [m for m in said(caplog, logging.INFO) if "migrated" in m] == [
        f"{a.dsn}: schema {schema} migrated from version 0 to {SCHEMA_VERSION}"
    ]
    assert run(database, schema, "SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]


async def test_an_open_waiting_for_a_live_holder_looks_again_only_now_and_then(
    database: str, schema: str
) -> None:
    def commits() -> int:
        query = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        return int(run(database, schema, query)[0][0])

    before = commits()
    async with runners(database, schema, "a", "b") as (a, b):
        await a.save(record("k", 1))
        assert await a._ask("renew", 30.0)
        await b.save(record("k", 2))
        with trio.move_on_after(1):
            await b.wait_older_stopped(record("k", 2).handle)
            pytest.fail("a never stopped generation 1")
    # The stores' sessions ended, and with them their counts came in: a look every
    # OLDER_POLL (0.2 s), not one after the other.
    assert commits() - before < 150
