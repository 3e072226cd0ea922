"""fleet.*: opens on a fleet of three runners against one runner on the same database;
and the group ``fleet``, which also runs durable.postgres (``benchmarks/postgres.py``).

Every runner here is a supervisor over a ``PostgresStore`` of its own, all in this
process and one Trio run, with ``FakeExecution`` (no child) and a short lease. A fleet
of three (runners r1, r2, r3) shares one schema; the baseline, a fleet of one (r0),
has a schema of its own in the same database. An open is what a host does: read the
key's high-water (``Supervisor.high_water``, which asks the fleet), then open with it
as the expected generation; a ``StaleSessionError`` is a conflict, another open having
claimed that generation first. Sessions are not disposed: each open supersedes the one
before, so a key has one live session at a time.

* ``fleet.open_race.one_key``: three clients racing on one key, one per runner, against
  three clients on the one runner; opens/s counts the wins, ``extra`` the conflict rate
  of both sides. Across runners a win supersedes a session of another runner most of the
  time: that runner hears of it (NOTIFY), stops it, and the open returns once it has.
* ``fleet.open_race.distinct``: 100 clients on 100 keys, spread over the three runners,
  against the same on the one runner: no supersede crosses runners.
* ``fleet.open_race.remote`` (informational): on two runners of the fleet, keys whose
  every open supersedes a session of the *other* runner (so each open notifies it, and
  waits for its stop), against the same opens each on the runner that holds the previous
  generation.
* ``fleet.open_race.notify`` (informational): NOTIFY's own cost, on the one runner:
  opens that supersede the key's previous session (its Stopped record, of reason
  Superseded, notifies that it stopped, which takes PostgreSQL's global lock at commit)
  against the same writes without it: the client disposes the previous session and then
  opens (reason Disposed, no NOTIFY).
* ``fleet.renew``: renews per second through ``Supervisor.renew``, 100 clients each
  renewing a session of its own, on a runner of a fleet (whose membership checks its
  live keys every second meanwhile, F5) against the same runner with its store in no
  fleet (``durable.postgres.solo``'s face): a renew reads nothing from the store in
  either. ``fleet.renew.sqlite`` (informational): the same fleet runner against one
  on ``SqliteStore``. The three are measured in turn in each round, in one Trio run.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Final

import attrs
import trio

from trio_supervisor import (
    Handle,
    Key,
    PostgresStore,
    SqliteStore,
    StaleSessionError,
    Supervisor,
    open_supervisor,
)
from trio_supervisor import _defaults as defaults
from trio_supervisor.testing import FakeExecution

from . import postgres
from .measure import Result, interleaved_async, rotated_async

LEASE: Final = 2.0  # seconds: a session that stays behind ends soon by itself
KEYS: Final = 100
SLOW: Final = 0.15  # seconds: see Tally.slow


def run(quick: bool, rounds: int) -> list[Result]:
    with postgres.database() as dsn:
        return trio.run(_rows, dsn, quick, rounds)


async def _rows(dsn: str, quick: bool, rounds: int) -> list[Result]:
    results = await postgres.durable_rows(dsn, quick, rounds)
    async with (
        _fleet(dsn, "fleet", ["r1", "r2", "r3"]) as three,
        _fleet(dsn, "alone", ["r0"]) as (one,),
    ):
        results.append(await _one_key(three, one, quick, rounds))
        results.append(await _distinct(three, one, quick, rounds))
        results.append(await _remote(three, quick, rounds))
        results.append(await _notify(one, quick, rounds))
    results.extend(await _renew(dsn, quick, rounds))
    return results


@attrs.frozen
class Member:
    """A runner of a fleet: its store and its supervisor."""

    store: PostgresStore
    supervisor: Supervisor


@asynccontextmanager
async def members(
    dsn: str,
    schema: str,
    runners: Sequence[str],
    *,
    lease: float = LEASE,
    runner_lease: float = defaults.RUNNER_LEASE,
) -> AsyncIterator[list[Member]]:
    """Supervisors on one schema, one per runner id, started and closed together."""
    leave = trio.Event()

    async def member(runner: str, *, task_status: trio.TaskStatus[Member]) -> None:
        async with (
            PostgresStore(dsn, schema=schema, runner_id=runner, runner_lease=runner_lease) as store,
            open_supervisor(store, FakeExecution(), lease=lease) as supervisor,
        ):
            task_status.started(Member(store, supervisor))
            await leave.wait()

    async with trio.open_nursery() as nursery:
        started = [await nursery.start(member, runner) for runner in runners]
        # Each runner's listener connects on a thread of its own: a notification sent
        # before it listens would only be found by the periodic check, a second later.
        await trio.sleep(0.3)
        try:
            yield started
        finally:
            leave.set()


@asynccontextmanager
async def _fleet(dsn: str, schema: str, runners: Sequence[str]) -> AsyncIterator[list[Supervisor]]:
    """:func:`members`' supervisors."""
    async with members(dsn, schema, runners) as started:
        yield [member.supervisor for member in started]


class Tally:
    """The wins and conflicts of some racing opens, and the wins' times."""

    def __init__(self) -> None:
        self.wins = 0
        self.conflicts = 0
        self.times: list[float] = []

    @property
    def conflict_rate(self) -> float:
        return self.conflicts / max(1, self.wins + self.conflicts)

    @property
    def slow(self) -> int:
        """Wins that took ``SLOW`` or more: near the store's poll for older generations
        (0.2 s), so most likely a wait that missed the notification of their stop."""
        return sum(1 for seconds in self.times if seconds >= SLOW)


async def _attempt(supervisor: Supervisor, key: Key, tally: Tally) -> Handle | None:
    """One host's open: the key's high-water, then an open expecting it."""
    started = time.perf_counter()
    mark = await supervisor.high_water(key)
    try:
        record = await supervisor.open(key, uuid.uuid4().hex, expected_generation=mark)
    except StaleSessionError:
        tally.conflicts += 1
        return None
    tally.wins += 1
    tally.times.append(time.perf_counter() - started)
    return record.handle


async def _race(supervisors: Sequence[Supervisor], key: Key, wins: int, tally: Tally) -> float:
    """Wins per second of clients racing on ``key``, one per supervisor given."""
    first = tally.wins

    async def client(supervisor: Supervisor) -> None:
        while tally.wins - first < wins:
            await _attempt(supervisor, key, tally)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for supervisor in supervisors:
            nursery.start_soon(client, supervisor)
    return (tally.wins - first) / (time.perf_counter() - started)


async def _opens(
    where: Callable[[int, int], Supervisor],
    prefix: str,
    keys: int,
    opens: int,
    *,
    held: dict[Key, tuple[Supervisor, Handle]] | None = None,
    dispose: bool = False,
    tally: Tally | None = None,
) -> float:
    """Opens per second of ``keys`` clients, each opening its own key ``opens`` times on
    the supervisor ``where(client, cycle)``. ``held`` keeps each key's live session
    from one call to the next; with ``dispose``, a client disposes it before it opens."""
    counted = Tally() if tally is None else tally
    live = {} if held is None else held

    async def client(number: int) -> None:
        key = Key(identity="race", instance=f"{prefix}{number}")
        for cycle in range(opens):
            supervisor = where(number, cycle)
            if dispose and key in live:
                holder, previous = live.pop(key)
                await holder.dispose(previous)
            handle = await _attempt(supervisor, key, counted)
            assert handle is not None, "only one client opens this key"
            live[key] = supervisor, handle

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for number in range(keys):
            nursery.start_soon(client, number)
    return keys * opens / (time.perf_counter() - started)


async def _one_key(three: list[Supervisor], one: Supervisor, quick: bool, rounds: int) -> Result:
    wins = 4 if quick else 60
    key = Key(identity="race", instance="one")
    ours, theirs = Tally(), Tally()

    async def fleet() -> float:
        return await _race(three, key, wins, ours)

    async def alone() -> float:
        return await _race([one] * len(three), key, wins, theirs)

    mine, baseline = await interleaved_async(fleet, alone, rounds)
    return Result(
        name="fleet.open_race.one_key",
        unit="opens/s",
        better="higher",
        target=0.5,
        ours=mine,
        baseline=baseline,
        baseline_name="one runner: the same 3 clients racing on one key",
        note="3 clients, one per runner, each reading the high-water and opening; opens/s "
        "counts the wins; a win on one runner supersedes another's session most of the time",
        extra={
            "ours_conflict_rate": ours.conflict_rate,
            "baseline_conflict_rate": theirs.conflict_rate,
            "ours_open_ms_p50": 1000 * statistics.median(ours.times),
            "ours_open_ms_max": 1000 * max(ours.times),
            "ours_slow_opens": ours.slow,
            "baseline_open_ms_p50": 1000 * statistics.median(theirs.times),
        },
    )


async def _distinct(three: list[Supervisor], one: Supervisor, quick: bool, rounds: int) -> Result:
    keys, opens = (20, 1) if quick else (KEYS, 5)

    async def fleet() -> float:
        return await _opens(lambda client, _: three[client % 3], "d", keys, opens)

    async def alone() -> float:
        return await _opens(lambda *_: one, "d", keys, opens)

    mine, baseline = await interleaved_async(fleet, alone, rounds)
    return Result(
        name="fleet.open_race.distinct",
        unit="opens/s",
        better="higher",
        target=0.8,
        ours=mine,
        baseline=baseline,
        baseline_name="one runner: the same 100 clients and keys",
        note=f"{keys} clients, each opening its own key on its runner (key k on runner "
        "k mod 3): no supersede crosses runners",
    )


async def _remote(three: list[Supervisor], quick: bool, rounds: int) -> Result:
    # Few clients: each open's wait is seen alone, not cut short by another key's stop.
    keys, opens = (1, 3) if quick else (2, 30)
    pair = three[:2]
    ours, theirs = Tally(), Tally()

    async def other() -> float:
        return await _opens(
            lambda client, cycle: pair[(client + cycle) % 2], "x", keys, opens, tally=ours
        )

    async def same() -> float:
        return await _opens(lambda client, _: pair[client % 2], "x", keys, opens, tally=theirs)

    mine, baseline = await interleaved_async(other, same, rounds)
    return Result(
        name="fleet.open_race.remote",
        unit="opens/s",
        better="higher",
        target=0.5,
        ours=mine,
        baseline=baseline,
        baseline_name="the same opens, each on the runner holding the previous generation",
        note=f"{keys} clients on their own keys, each open on the runner that does not hold "
        "the previous generation: it notifies that runner, and returns once that one stopped",
        informational=True,
        extra={
            "ours_open_ms_p50": 1000 * statistics.median(ours.times),
            "ours_open_ms_max": 1000 * max(ours.times),
            "ours_slow_opens": ours.slow,
            "baseline_open_ms_p50": 1000 * statistics.median(theirs.times),
            "baseline_open_ms_max": 1000 * max(theirs.times),
        },
    )


async def _notify(one: Supervisor, quick: bool, rounds: int) -> Result:
    keys, opens = (20, 1) if quick else (KEYS, 5)
    held: dict[Key, tuple[Supervisor, Handle]] = {}

    async def supersede() -> float:
        return await _opens(lambda *_: one, "n", keys, opens, held=held)

    async def dispose() -> float:
        return await _opens(lambda *_: one, "n", keys, opens, held=held, dispose=True)

    mine, baseline = await interleaved_async(supersede, dispose, rounds)
    return Result(
        name="fleet.open_race.notify",
        unit="opens/s",
        better="higher",
        target=0.9,
        ours=mine,
        baseline=baseline,
        baseline_name="ours: dispose, then open (the same writes, no NOTIFY)",
        note=f"{keys} clients on one runner; each open supersedes the key's previous "
        "session, whose Stopped record (reason Superseded) notifies at commit",
        informational=True,
    )


async def _renew(dsn: str, quick: bool, rounds: int) -> list[Result]:
    renews = 20 if quick else 3000  # per client and round: a second or more of renewals
    lease = defaults.LEASE  # the fleet's check runs every second, as with a host's leases
    with tempfile.TemporaryDirectory(prefix="trio-supervisor-bench-") as directory:
        async with AsyncExitStack() as stack:
            (member,) = await stack.enter_async_context(
                members(dsn, "renew", ["renewing"], lease=lease)
            )
            alone = await stack.enter_async_context(
                PostgresStore(dsn, schema="renew_solo", runner_id="solo")
            )
            solo = await stack.enter_async_context(
                open_supervisor(postgres.Solo(alone), FakeExecution(), lease=lease)
            )
            sqlite = await stack.enter_async_context(
                open_supervisor(
                    SqliteStore(Path(directory) / "renew.db"), FakeExecution(), lease=lease
                )
            )
            rates = [
                await _renewing(supervisor, renews)
                for supervisor in (member.supervisor, solo, sqlite)
            ]
            fleet, alone_rates, sqlite_rates = await rotated_async(rates, rounds)
    note = f"{postgres.CLIENTS} clients, each renewing a session of its own {renews} times"
    return [
        Result(
            name="fleet.renew",
            unit="renews/s",
            better="higher",
            target=0.9,
            ours=fleet,
            baseline=alone_rates,
            baseline_name="the same runner with its PostgresStore in no fleet (solo)",
            note=note + "; the fleet's runner checks its live keys meanwhile",
        ),
        Result(
            name="fleet.renew.sqlite",
            unit="renews/s",
            better="higher",
            target=0.9,
            ours=fleet,
            baseline=sqlite_rates,
            baseline_name="the same runner on SqliteStore",
            note=note,
            informational=True,
        ),
    ]


async def _renewing(supervisor: Supervisor, renews: int) -> Callable[[], Awaitable[float]]:
    """Open a session per client on ``supervisor``; a round of their renewals, in
    renews per second."""
    tag = uuid.uuid4().hex[:8]
    handles = [
        (await supervisor.open(Key(identity="renew", instance=f"{tag}-{n}"), tag)).handle
        for n in range(postgres.CLIENTS)
    ]

    async def client(handle: Handle) -> None:
        for _ in range(renews):
            await supervisor.renew(handle)

    async def rate() -> float:
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for handle in handles:
                nursery.start_soon(client, handle)
        return len(handles) * renews / (time.perf_counter() - started)

    return rate
