"""PostgresStore's upkeep of its own runner row in a fleet (run_member): a renewal that
comes too late fences the store (what it says, and that it stays fenced), a renewal that
fails is tried again within the row's trust, and a row another runner took over is
noticed at the next renewal."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import psycopg
import pytest
import trio
from psycopg.conninfo import make_conninfo

from trio_supervisor import (
    Key,
    Limits,
    OpenRecord,
    PostgresStore,
    RunnerFencedError,
    StateStorageError,
)
from trio_supervisor.model import Handle

from ..support.postgres import runner_row_locked
from ..support.waits import until

LOGGER = "trio_supervisor.stores.postgres"


class Member:
    """A supervisor as run_member sees it: its live keys (and how often asked), its
    sessions' times, and the supersedes it was told."""

    stop_bound = 0.5

    def __init__(self, live: Mapping[Key, int] | None = None) -> None:
        self.alive = dict(live or {})
        self.checks = 0
        self.calls: list[tuple[Key, int]] = []

    def live(self) -> Mapping[Key, int]:
        self.checks += 1
        return dict(self.alive)

    def times(self) -> Mapping[str, tuple[float, float]]:
        return {}

    def shortest_lease(self) -> float | None:
        return None

    def superseded(self, key: Key, high_water: int) -> None:
        self.calls.append((key, high_water))


def connect(database: str, schema: str) -> psycopg.Connection[Any]:
    return psycopg.connect(
        make_conninfo(database, options=f"-c search_path={schema}"),
        autocommit=True,
        connect_timeout=5,
    )


def record(instance: str) -> OpenRecord:
    handle = Handle(
        key=Key(identity="p", instance=instance),
        token=f"{instance}-1".rjust(32, "0"),
        generation=1,
    )
    return OpenRecord(handle=handle, request_id="r1", lease=5.0, limits=Limits())


def said(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name == LOGGER]


async def test_a_renewal_blocked_past_its_trust_fences_the_runner(
    database: str, schema: str
) -> None:
    """The row is trusted for its lease less a fifth (0.8 s of 1 s): a renewal not
    answered by then fences the store, which remembers it."""
    async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.0) as a:
        with runner_row_locked(database, schema) as blocker:
            began = time.monotonic()
            with trio.fail_after(10), pytest.raises(RunnerFencedError) as fenced:
                await a.run_member(Member())
            waited = time.monotonic() - began
            blocker.execute("ROLLBACK")
        assert str(fenced.value) == (
            f"{a.dsn}: runner a could not renew its row within 0.8 s of the last renewal "
            "sent; it may be taken over, so it stops serving"
        )
        assert fenced.value.__cause__ is None  # no try failed: the one try never ended
        assert 0.8 <= waited < 0.8 + 1.5
        assert a._fenced is fenced.value


async def test_a_renewal_that_keeps_failing_fences_with_its_last_failure(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each try ends at the server's statement timeout; they are tried again until the
    trust ends, said once, and the fence names the last failure."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with PostgresStore(
        database, runner_id="a", schema=schema, runner_lease=1.5, statement_timeout=0.2
    ) as a:
        with runner_row_locked(database, schema) as blocker:
            with trio.fail_after(10), pytest.raises(RunnerFencedError) as fenced:
                await a.run_member(Member())
            blocker.execute("ROLLBACK")
        failure = fenced.value.__cause__
        assert isinstance(failure, StateStorageError)
        assert str(fenced.value) == (
            f"{a.dsn}: runner a could not renew its row within 1.2 s of the last renewal "
            f"sent; it may be taken over, so it stops serving (last failure: {failure.detail})"
        )
        (warned,) = [m for m in said(caplog, logging.WARNING) if "trying again for" in m]
        assert warned.endswith(" s, until this runner's row is no longer trusted")
        assert warned.startswith(f"{failure}; trying again for ")
        assert a._fenced is fenced.value


async def test_a_renewal_that_failed_and_then_succeeds_keeps_the_runner(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with PostgresStore(
        database, runner_id="a", schema=schema, runner_lease=3.0, statement_timeout=0.2
    ) as a:
        with runner_row_locked(database, schema) as blocker:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.run_member, Member())
                await until(
                    lambda: [m for m in said(caplog, logging.WARNING) if "trying again" in m],
                    "a renewal failed",
                    bound=5,
                )
                blocker.execute("ROLLBACK")
                again = f"{a.dsn}: runner a renewed its row again"
                await until(lambda: again in said(caplog, logging.INFO), "renewed", bound=5)
                nursery.cancel_scope.cancel()
        tries = [m for m in said(caplog, logging.WARNING) if "trying again" in m]
        assert len(tries) == 1  # said once, however often tried
        assert said(caplog, logging.INFO).count(again) == 1
        assert a._fenced is None
        (info,) = await a.runners()
        assert info.alive


async def test_a_row_taken_over_fences_the_runner_at_its_next_renewal(
    database: str, schema: str
) -> None:
    async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.5) as a:
        epoch = a.epoch
        with connect(database, schema) as other:
            other.execute("UPDATE runners SET epoch = epoch + 1 WHERE runner_id = 'a'")
        with trio.fail_after(10), pytest.raises(RunnerFencedError) as fenced:
            await a.run_member(Member())
        assert str(fenced.value) == (
            f"{a.dsn}: runner a lost its row: its epoch {epoch} was taken over by another "
            "runner of the fleet"
        )
        assert a._fenced is fenced.value


async def test_a_runner_fences_itself_before_its_row_expires(database: str, schema: str) -> None:
    """B2: once renewals stop landing, the runner stops serving a fifth of its lease
    before the row it last renewed expires, counted from when that renewal was sent,
    not from the renewal that hangs."""
    async with PostgresStore(database, runner_id="a", schema=schema, runner_lease=1.5) as a:
        with connect(database, schema) as blocker:
            async with trio.open_nursery() as nursery:

                async def member() -> None:
                    with pytest.raises(RunnerFencedError, match="could not renew"):
                        await a.run_member(Member())

                nursery.start_soon(member)
                # The first renewal writes the member's stop bound.
                await until(
                    lambda: blocker.execute(
                        "SELECT 1 FROM runners WHERE runner_id = 'a' AND stop_bound = 0.5"
                    ).fetchall(),
                    "the first renewal",
                    bound=5,
                )
                blocker.execute("BEGIN")
                blocker.execute("SELECT 1 FROM runners WHERE runner_id = 'a' FOR UPDATE")
                with trio.fail_after(10):
                    await until(lambda: a._fenced, "fenced", bound=5)
            # Read in the blocking transaction: the row as last renewed.
            ((left,),) = blocker.execute(
                "SELECT extract(epoch FROM lease_until - clock_timestamp()) FROM runners "
                "WHERE runner_id = 'a'"
            ).fetchall()
            blocker.execute("ROLLBACK")
        assert 0 < left <= 0.5, left


async def test_a_runner_renews_its_row_every_third_of_its_lease(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A lease of 3 s: renewed every second, and nothing said of renewals that went well."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    seen: set[tuple[Any, ...]] = set()
    with connect(database, schema) as reader:
        async with (
            PostgresStore(database, runner_id="a", schema=schema, runner_lease=3.0) as a,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(a.run_member, Member())

            def look() -> bool:
                seen.update(reader.execute("SELECT lease_until FROM runners WHERE runner_id = 'a'"))
                return len(seen) >= 2

            # Never more often than a third of the lease: in 1.5 s, as registered, then
            # renewals at 0 and 1 s (and at most one more on a slow look).
            with trio.move_on_after(1.5):
                while True:
                    look()
                    await trio.sleep(0.02)
            assert len(seen) <= 4, seen
            # And renewed at all, however busy the machine (a renewal may come late).
            await until(look, "a renewal", bound=10)
            nursery.cancel_scope.cancel()
    renewals = [
        m for m in said(caplog, logging.INFO) + said(caplog, logging.WARNING) if "renew" in m
    ]
    assert renewals == []


async def test_a_check_that_fails_is_said_once_until_one_succeeds(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The inbox check, locked out at the server's statement timeout, fails at each
    check: said once while it fails, and again after a check that succeeded."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    member = Member({Key(identity="p", instance="k"): 1})

    def failures() -> list[str]:
        return [m for m in said(caplog, logging.WARNING) if m.startswith(a.dsn)]

    with connect(database, schema) as blocker:
        async with (
            PostgresStore(
                database, runner_id="a", schema=schema, runner_lease=1.5, statement_timeout=0.1
            ) as a,
            trio.open_nursery() as nursery,
        ):
            a._check_period = 0.1
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE inbox IN ACCESS EXCLUSIVE MODE")
            nursery.start_soon(a.run_member, member)
            await until(lambda: member.checks >= 4, "four checks", bound=10)
            blocker.execute("ROLLBACK")
            (first,) = failures()
            # Back: the next check reads the inbox.
            blocker.execute("INSERT INTO inbox VALUES ('a', 'p', 'k', 2)")
            await until(lambda: member.calls, "the inbox read", bound=5)
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE inbox IN ACCESS EXCLUSIVE MODE")
            await until(lambda: len(failures()) == 2, "the next failure said", bound=5)
            blocker.execute("ROLLBACK")
            nursery.cancel_scope.cancel()
    assert member.calls == [(Key(identity="p", instance="k"), 2)]
    assert "statement timeout" in first, first


async def test_a_publish_of_times_that_fails_is_said(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with connect(database, schema) as blocker:
        async with (
            PostgresStore(
                database, runner_id="a", schema=schema, runner_lease=3.0, statement_timeout=0.1
            ) as a,
            trio.open_nursery() as nursery,
        ):
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE runner_times IN ACCESS EXCLUSIVE MODE")
            nursery.start_soon(a.run_member, Member())
            warned = await until(
                lambda: [m for m in said(caplog, logging.WARNING) if m.startswith(a.dsn)],
                "the publish failed",
                bound=5,
            )
            blocker.execute("ROLLBACK")
            nursery.cancel_scope.cancel()
    assert "statement timeout" in warned[0], warned


async def test_take_over_dead_counts_the_records_of_every_dead_runner(
    database: str, schema: str
) -> None:
    async with (
        PostgresStore(database, runner_id="a", schema=schema) as a,
        PostgresStore(database, runner_id="c", schema=schema) as c,
        PostgresStore(database, runner_id="b", schema=schema) as b,
    ):
        await a.save(record("x"))
        await c.save(record("y"))
        with connect(database, schema) as other:
            other.execute(
                "UPDATE runners SET lease_until = clock_timestamp() - interval '60 s' "
                "WHERE runner_id IN ('a', 'c')"
            )
        assert await b.take_over_dead() == 2
        assert await b.take_over_dead() == 0
