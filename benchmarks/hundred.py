"""hundred: a hundred runners on one PostgreSQL server, measured (issue 51, item 4).

What it runs. A PostgreSQL cluster of its own (``tests/support/clusters.py``, as the
group ``availability`` makes its: PostgreSQL 15's binaries, run as the ``postgres``
user on a free port, removed at the end), with the machine's server's settings where
they matter (``shared_buffers`` 128 MB, ``fsync`` and ``synchronous_commit`` on) and
``max_connections`` 400 (each runner holds two connections: its worker's and its
listener's), ``pg_stat_statements`` preloaded (statements counted by query, and with
``track = all`` those inside ``write_batch`` too) and ``pg_walinspect`` (commits counted
in the WAL itself). On it, in this order:

1. **The baseline**: ``pgbench`` of the same binaries, TPC-B-like, into a database of its
   own (``-i -s 10``, then ``-c 8 -j 2 -T 30`` and ``-c 100 -j 2 -T 30``), as
   docs/benchmarks.md ran it against the machine's server.
2. **The fleet**: ``RUNNERS`` runners in this process and one Trio run, each a
   ``PostgresStore`` of its own (its worker thread and connection, its listener) running
   ``run_member`` for a simulated member (:class:`Runner`) that holds ``SESSIONS`` live
   Loaded sessions. The sessions are preloaded by SQL (not timed): rows as ``write_batch``
   writes them, each body the JSON of a real ``LoadedRecord`` (a subprocess child's
   identity: pid, pgid, start time, boot id, cgroup, uid; the runner's limits; a load
   with its configuration and code identity), plus the 10,000 Stopped records retention
   keeps in a fleet's steady state, then ``VACUUM ANALYZE`` and a checkpoint.
3. **Upkeep** (the first tenth of ``SECONDS``): the runners hold their sessions, and
   nothing opens or stops: what membership costs (each runner's row renewed every
   third of its 10 s lease, its inbox read every second, the scan for dead runners).
4. **Churn** (the rest): sessions opened, loaded and disposed at the sizing's rate, each
   runner at 16.7 a second (10,000 sessions living 10 minutes on average), with
   Poisson arrivals, through the store's API as a runner's supervisor calls it: an
   open is ``save(OpenRecord)`` and ``wait_older_stopped`` (a ``lookup`` first where it
   takes another runner's key: docs/design.md F3); a load saves
   Loading, Loading with its child's identity (after a simulated spawn of 10 ms), then
   Loaded (after 20 ms); a dispose saves Stopping, then Stopped (after a simulated exit
   of 10 ms). 1% of opens take a live session's key from another runner: that one
   hears of it (NOTIFY, or its inbox), stops it with reason Superseded (Stopping, then
   Stopped), and the open returns once it did. The first tenth is a warm-up, not counted.

**Why only some runners churn.** One Python process on two cores (which the server
shares) does not carry 1,670 sessions a second, and a driver that falls behind either
queues the saves of a runner (so its group commit merges more of them than a real
runner's at 16.7 sessions a second would: fewer commits, the wrong way to err) or
slows every runner alike (merging fewer). So every runner stays a member, holding its
sessions, but the churn runs on as many runners as the driver keeps up with, each at
exactly the sizing's rate: the warm-up adds runners in steps (``STEPS``) while the
arrivals stay on time and the store's latencies near the first step's, and backs off
one step when they do not (``TRIO_SUPERVISOR_HUNDRED_CHURNING=K`` sets K instead).
The per-session costs are measured there, at a real runner's rate (how many saves its
group commit merges then depends on the store's latency: about 1.1 a commit when it
answers in milliseconds, several when the server is saturated); the full sizing's
figures are extrapolated from them (upkeep per runner + 16.7 x per-session cost per
runner) and labelled so.

What each window records: the server's CPU (utime + stime of the postmaster and its
children, from /proc, reaped children included: in cores), this process's CPU
(``getrusage``) and the machine's (/proc/stat), transactions committed in the fleet's
database (``pg_stat_database``), **write commits** (``Transaction/COMMIT`` records in the
WAL, ``pg_get_wal_stats``: a read-only transaction writes none), statements and round
trips (``pg_stat_statements``' calls, top-level; the stores run in autocommit, so a
statement is a round trip), WAL bytes (LSN difference, full-page images included),
NOTIFYs (a listener of its own on the fleet's channel), and the stores' own count of
their write transactions; during the churn, the sessions opened, loaded and disposed,
and the latency of each operation as the driver sees it (the store's calls only, the
simulated child's times left out).

Sizes: full (``RUNNERS`` 100, ``SESSIONS`` 10,000, ``SECONDS`` 300); ``--quick`` 5
runners of 100 sessions for 10 s and a shortened pgbench (``-s 1``, 3 s runs);
``TRIO_SUPERVISOR_HUNDRED=RUNNERS,SESSIONS,SECONDS`` sets others, and
``TRIO_SUPERVISOR_HUNDRED_COMMIT_WINDOW=SECONDS`` the stores' ``commit_window``, and
``TRIO_SUPERVISOR_HUNDRED_STOPPED_TOTAL=N`` the stores' ``Retention(stopped_total=N)``
(the library's default, 10,000, unless set: a larger one keeps the fleet-wide cap's
eviction, which concurrent runners' batches deadlock on, out of the run). The group runs only
when asked for (``--only hundred``: benchmarks/groups.py, ``ON_REQUEST``): a full run
takes about ten minutes and makes a million rows.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import json
import math
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs
import psycopg
import trio
from psycopg import sql

from trio_supervisor import PostgresStore
from trio_supervisor import _defaults as defaults
from trio_supervisor.codec import encode
from trio_supervisor.errors import StateStorageError, SupervisorError
from trio_supervisor.model import (
    ChildIdentity,
    CodeIdentity,
    Disposed,
    ExitStatus,
    Handle,
    Key,
    Limits,
    Load,
    LoadedRecord,
    LoadingRecord,
    OpenRecord,
    StoppedRecord,
    StoppingRecord,
    Superseded,
    Termination,
    carried,
)
from trio_supervisor.retention import Retention
from trio_supervisor.stores import _postgres_schema, _postgres_sql

from .measure import Skipped, Table

if TYPE_CHECKING:
    from tests.support.clusters import Cluster

# -- the sizing (docs/benchmarks.md, "What a session costs PostgreSQL") ------------------

LIFETIME: Final = 600.0  # seconds a session lives, on average
SIZING_SESSIONS: Final = 10_000  # live sessions per runner
CHURN: Final = SIZING_SESSIONS / LIFETIME  # sessions a runner opens (and disposes) a second
SUPERSEDING: Final = 0.01  # the share of opens that take a key another runner holds
LEASE: Final = defaults.LEASE  # the sessions' (15 s)
STOP_BOUND: Final = defaults.GRACE + defaults.CONFIRMATION  # a runner's, by default
RENEW_EVERY: Final = 5.0  # seconds between a host's renewals (for the times published)
# The simulated child: seconds from Loading to its spawn, from its spawn to Loaded
# (its code imported and resolved), and from Stopping to its exit.
SPAWN: Final = 0.010
START: Final = 0.020
EXIT: Final = 0.010
# The table "today's" figures are judged against (docs/benchmarks.md, issue 43): 100
# runners of 10,000 sessions, 10,030 write commits a second.
OLD_WRITE_COMMITS: Final = 10_030.0
OLD_SESSIONS: Final = 1_000_000
GOAL_SHARE: Final = 0.7  # of the measured TPC-B rate
GOAL_FEWER: Final = 10.0  # times fewer write commits per session-second than today's

# -- the run -----------------------------------------------------------------------------

VARIABLE: Final = "TRIO_SUPERVISOR_HUNDRED"  # RUNNERS,SESSIONS,SECONDS
CHURNING_VARIABLE: Final = "TRIO_SUPERVISOR_HUNDRED_CHURNING"  # runners that churn, fixed
# The stores' Retention.stopped_total (the library's default, 10,000, unless set).
RETENTION_VARIABLE: Final = "TRIO_SUPERVISOR_HUNDRED_STOPPED_TOTAL"
WINDOW_VARIABLE: Final = "TRIO_SUPERVISOR_HUNDRED_COMMIT_WINDOW"
DATABASE: Final = "hundred"
PGBENCH_DATABASE: Final = "hundred_pgbench"
SCHEMA: Final = "trio_supervisor"  # the store's default: the fleet's channel too
IDENTITY: Final = "plugins.reports:Worker"
UPKEEP_SHARE: Final = 0.1  # of SECONDS, before the churn
WARMUP_SHARE: Final = 0.1  # of the churn, not counted
RAMP_SHARE: Final = 0.7  # of the warm-up: the steps; the rest settles
STEPS: Final = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 80)  # runners churning, then all
LATE: Final = 0.1  # seconds an arrival may start late before the driver is behind
BACKLOG: Final = 0.5  # seconds of arrivals under way at once, past which it is behind
BASELINE_SAMPLES: Final = 10  # operations of the first step(s), whose median judges the next
MOST_IN_FLIGHT: Final = 5_000  # operations at once; beyond, arrivals are shed (counted)
SETTLE: Final = 2.0  # seconds between the last runner's start and the upkeep's window
MIGRATOR: Final = "hundred-schema"  # the store that makes the schema before the preload
DRAIN: Final = 15.0  # seconds the operations under way get to end once arrivals stop
SEED: Final = 51
INSIDE_TEXT: Final = 90  # characters of a statement inside a function that name it
INSIDE_ROWS: Final = 14  # of them in the table, the costliest first

LIMITS: Final = Limits(
    memory_bytes=512 * 2**20,
    open_files=1024,
    output_bytes=10 * 2**20,
    processes=64,
    cpu_percent=100,
)
LOAD: Final = Load(
    specifier=IDENTITY, config={"tenant": "tenant-0042", "region": "eu-west-1", "batch": 500}
)
CODE: Final = CodeIdentity(
    specifier=IDENTITY,
    origin="/srv/plugins/reports/__init__.py",
    digest="sha256:" + hashlib.sha256(b"reports 2.4.1").hexdigest(),
    version="2.4.1",
)
BOOT_ID: Final = str(uuid.UUID(int=0x51_0000_0000_4000_8000_0000_0000_0051))
EXECUTION: Final = hashlib.sha256(b"/var/lib/trio-supervisor").hexdigest()[:12]
DONE: Final = Termination(kind="exited", exit=ExitStatus(code=0))


@attrs.frozen
class Sizes:
    runners: int
    sessions: int  # live sessions each runner holds
    seconds: float  # the fleet's measured run: upkeep, then churn
    pgbench_scale: int
    pgbench_seconds: int

    @property
    def upkeep(self) -> float:
        return max(UPKEEP_SHARE * self.seconds, 3.0)

    @property
    def churn(self) -> float:
        return self.seconds - self.upkeep

    @property
    def warmup(self) -> float:
        return max(WARMUP_SHARE * self.churn, 1.0)


FULL: Final = Sizes(
    runners=100, sessions=10_000, seconds=300.0, pgbench_scale=10, pgbench_seconds=30
)
QUICK: Final = Sizes(runners=5, sessions=100, seconds=10.0, pgbench_scale=1, pgbench_seconds=3)


def sizes(quick: bool) -> Sizes:
    """The run's sizes: full or quick, or ``$TRIO_SUPERVISOR_HUNDRED``'s."""
    chosen = QUICK if quick else FULL
    given = os.environ.get(VARIABLE)
    if given:
        runners, sessions, seconds = given.split(",")
        chosen = attrs.evolve(
            chosen, runners=int(runners), sessions=int(sessions), seconds=float(seconds)
        )
    if chosen.runners < 2 or chosen.sessions < 1 or chosen.seconds < 5:
        raise ValueError(f"{VARIABLE}: at least 2 runners, 1 session, 5 seconds: {given}")
    return chosen


def retention_of() -> Retention:
    """The stores' retention: the library's default, unless ``$..._STOPPED_TOTAL`` says."""
    given = os.environ.get(RETENTION_VARIABLE)
    return Retention() if not given else Retention(stopped_total=int(given))


def commit_window_of() -> float:
    """The stores' ``commit_window``: none (the default), unless ``$..._COMMIT_WINDOW``
    gives seconds."""
    given = os.environ.get(WINDOW_VARIABLE)
    return 0.0 if not given else float(given)


# -- the records a runner writes ----------------------------------------------------------


def instance_of(runner: int, number: int) -> str:
    return f"runner{runner:03d}/session-{number:07d}"


def request_of(runner: int, number: int) -> str:
    """A host's request id: 32 hex digits, as a uuid4's."""
    return f"{runner:08x}{number:024x}"


def child_of(runner: int, number: int) -> ChildIdentity:
    """The identity of a subprocess child, as the subprocess execution records it."""
    pid = 1_000 + (runner * 40_009 + number * 7) % 4_000_000
    started = 90_000_000 + number * 13 + runner
    return ChildIdentity(
        adapter="subprocess",
        ref=f"{pid}:{started}",
        pid=pid,
        pgid=pid,
        start_time=started,
        boot_id=BOOT_ID,
        cgroup=f"trio_supervisor/{EXECUTION}/{pid}-{started}",
        uid=60_000 + number % 4_096,
    )


def loaded_of(handle: Handle, request_id: str, child: ChildIdentity) -> LoadedRecord:
    return LoadedRecord(
        handle=handle,
        request_id=request_id,
        lease=LEASE,
        limits=LIMITS,
        load=LOAD,
        code=CODE,
        child=child,
    )


def preloaded(runner: int, number: int, token: str) -> LoadedRecord:
    """The Loaded record of a preloaded session (generation 1 of a key of its own)."""
    handle = Handle(
        key=Key(identity=IDENTITY, instance=instance_of(runner, number)), token=token, generation=1
    )
    return loaded_of(handle, request_of(runner, number), child_of(runner, number))


class Template:
    """Bodies of preloaded records fast: ``encode`` of one record whose varying fields are
    marks, the marks replaced. :meth:`check` compares with ``encode`` of the real record."""

    PID: Final = 919_191_919
    STARTED: Final = 828_282_828_282
    UID: Final = 737_373_737

    def __init__(self) -> None:
        handle = Handle(
            key=Key(identity=IDENTITY, instance="@instance@"), token="@token@", generation=1
        )
        child = ChildIdentity(
            adapter="subprocess",
            ref=f"{self.PID}:{self.STARTED}",
            pid=self.PID,
            pgid=self.PID,
            start_time=self.STARTED,
            boot_id=BOOT_ID,
            cgroup=f"trio_supervisor/{EXECUTION}/{self.PID}-{self.STARTED}",
            uid=self.UID,
        )
        self._text = encode(loaded_of(handle, "@request@", child))

    def body(self, runner: int, number: int, token: str) -> str:
        child = child_of(runner, number)
        assert child.pid is not None
        assert child.start_time is not None
        assert child.uid is not None
        return (
            self._text.replace("@token@", token)
            .replace("@instance@", instance_of(runner, number))
            .replace("@request@", request_of(runner, number))
            .replace(str(self.STARTED), str(child.start_time))
            .replace(str(self.PID), str(child.pid))
            .replace(str(self.UID), str(child.uid))
        )

    def check(self, runner: int, number: int, token: str) -> None:
        made, real = self.body(runner, number, token), encode(preloaded(runner, number, token))
        if made != real:
            raise AssertionError(f"a preloaded body is not a runner's:\n{made}\n{real}")


# -- one runner: a simulated member of the fleet -------------------------------------------


class Held:
    """A live Loaded session of a runner. A preloaded one keeps no record: it is made
    again from its number when the session stops."""

    __slots__ = ("busy", "generation", "instance", "number", "opened", "record", "slot", "token")

    def __init__(
        self,
        token: str,
        instance: str,
        generation: int,
        number: int,
        opened: float,
        record: LoadedRecord | None = None,
    ) -> None:
        self.token = token
        self.instance = instance
        self.generation = generation
        self.number = number  # its child's
        self.opened = opened  # time.monotonic()
        self.record = record
        self.busy = False  # another runner's open takes its key
        self.slot = -1  # its place in its runner's Pool; -1: in none


class Pool:
    """A runner's idle Loaded sessions: added, removed and picked at random in O(1)."""

    def __init__(self) -> None:
        self._items: list[Held] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, held: Held) -> None:
        held.slot = len(self._items)
        self._items.append(held)

    def remove(self, held: Held) -> None:
        last = self._items.pop()
        if last is not held:
            self._items[held.slot] = last
            last.slot = held.slot
        held.slot = -1

    def pick(self, rng: random.Random) -> Held | None:
        """An idle session no other runner's open is taking, if one is found soon."""
        for _ in range(8):
            if not self._items:
                return None
            held = self._items[rng.randrange(len(self._items))]
            if not held.busy:
                return held
        return None


class _Live(Mapping[Key, int]):
    """A runner's live keys and their generations, read from its sessions as asked."""

    def __init__(self, sessions: dict[str, Held]) -> None:
        self._sessions = sessions

    def __getitem__(self, key: Key) -> int:
        held = self._sessions.get(key.instance) if key.identity == IDENTITY else None
        if held is None:
            raise KeyError(key)
        return held.generation

    def __iter__(self) -> Iterator[Key]:
        return (Key(identity=IDENTITY, instance=instance) for instance in list(self._sessions))

    def __len__(self) -> int:
        return len(self._sessions)


class Runner:
    """One runner of the fleet: its store, and the sessions it holds (a FleetMember)."""

    def __init__(self, number: int, store: PostgresStore, fleet: Fleet) -> None:
        self.number = number
        self.store = store
        self.fleet = fleet
        self.sessions: dict[str, Held] = {}  # every live Loaded session, by its instance
        self.idle = Pool()
        self.children = 0  # the numbers of its children so far
        self._live = _Live(self.sessions)

    @property
    def stop_bound(self) -> float:
        return STOP_BOUND

    def live(self) -> Mapping[Key, int]:
        return self._live

    def times(self) -> Mapping[str, tuple[float, float]]:
        now = time.monotonic()
        return {
            held.token: (now - held.opened, LEASE - (now - held.opened) % RENEW_EVERY)
            for held in self.sessions.values()
        }

    def shortest_lease(self) -> float | None:
        return LEASE if self.sessions else None

    def superseded(self, key: Key, high_water: int) -> None:
        held = self.sessions.get(key.instance) if key.identity == IDENTITY else None
        if held is None or held.generation >= high_water:
            return
        self.forget(held)
        self.fleet.start(self.fleet.stop_superseded, self, held)

    def child(self) -> int:
        self.children += 1
        return self.children - 1

    def hold(self, held: Held) -> None:
        self.sessions[held.instance] = held
        self.idle.add(held)

    def forget(self, held: Held) -> None:
        del self.sessions[held.instance]
        if held.slot >= 0:
            self.idle.remove(held)

    def record_of(self, held: Held) -> LoadedRecord:
        if held.record is not None:
            return held.record
        return preloaded(self.number, held.number, held.token)


# -- the churn -----------------------------------------------------------------------------


@attrs.define
class Done:
    """An operation that ended: when (time.monotonic()), what, and its store calls' time."""

    at: float
    kind: str
    seconds: float


@attrs.frozen
class Step:
    churning: int
    arrived: int
    median_ms: float
    late_ms: float
    in_flight: int
    kept: bool


class Fleet:
    """The runners, and the operations that churn their sessions."""

    def __init__(self) -> None:
        self.runners: list[Runner] = []
        self.rng = random.Random(SEED)
        self.counts: collections.Counter[str] = collections.Counter()
        self.done: list[Done] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.first_errors: list[str] = []
        self.left: list[str] = []  # the runners whose membership failed
        self.in_flight = 0
        self.late = 0.0  # the latest start of an arrival since it was last reset
        self.churning = 0
        self.steps: list[Step] = []
        self._work: trio.Nursery | None = None
        self._scopes: dict[int, list[trio.CancelScope]] = {}  # each churning runner's arrivals
        self._quiet: trio.Event | None = None  # set once no operation is under way

    @property
    def store_commits(self) -> int:
        return sum(runner.store.commits for runner in self.runners)

    def start(self, operation: Any, *args: Any) -> None:
        """Run ``operation(*args)`` in the fleet's nursery, counted while it runs."""
        assert self._work is not None
        self._work.start_soon(self._counted, operation, *args)

    async def _counted(self, operation: Any, *args: Any) -> None:
        self.in_flight += 1
        try:
            await operation(*args)
        except (SupervisorError, AssertionError) as error:
            self.failed(error)
        finally:
            self.in_flight -= 1
            if not self.in_flight and self._quiet is not None:
                self._quiet.set()

    def failed(self, error: BaseException) -> None:
        self.errors[type(error).__name__] += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(f"{type(error).__name__}: {error}")
            print(f"hundred: {type(error).__name__}: {error}", file=sys.stderr, flush=True)

    async def member(self, runner: Runner) -> None:
        """The runner's membership, for as long as the fleet runs: a runner that leaves
        the fleet (its row not renewed in time) is counted, as a failure."""
        try:
            await runner.store.run_member(runner)
        except StateStorageError as error:
            self.left.append(runner.store.member)
            self.failed(error)

    # -- the operations, as a runner's supervisor calls the store ------------------------

    async def _save(self, runner: Runner, record: Any) -> float:
        started = time.monotonic()
        await runner.store.save(record)
        self.counts["saves"] += 1
        return time.monotonic() - started

    async def open_and_load(self, runner: Runner) -> None:
        store = runner.store
        victim: Held | None = None
        if self.rng.random() < SUPERSEDING:
            others = len(self.runners) - 1
            holder = self.runners[self.rng.randrange(others)]
            if holder is runner:
                holder = self.runners[-1]
            victim = holder.idle.pick(self.rng)
            if victim is None:
                self.counts["no_victim"] += 1
            else:
                victim.busy = True
        number = runner.child()
        instance = instance_of(runner.number, number) if victim is None else victim.instance
        key = Key(identity=IDENTITY, instance=instance)
        request_id = uuid.uuid4().hex
        try:
            started = time.monotonic()
            mark = 0  # a new key: its host expects what the runner knows (F3)
            if victim is not None:
                # A key another runner holds: its host expects the generation it read,
                # which this runner's index does not know, so the runner reads it first.
                mark, _ = await store.lookup(key, request_id)
                self.counts["lookups"] += 1
            handle = Handle(key=key, token=str(uuid.uuid4()), generation=mark + 1)
            opened = OpenRecord(handle=handle, request_id=request_id, lease=LEASE, limits=LIMITS)
            await store.save(opened)
            self.counts["saves"] += 1
            await store.wait_older_stopped(handle)
            self.counts["waits"] += 1
        except BaseException:
            if victim is not None:
                victim.busy = False
            raise
        now = time.monotonic()
        self.done.append(
            Done(now, "open" if victim is None else "open, superseding", now - started)
        )
        loading = LoadingRecord(**carried(opened), load=LOAD)
        spent = await self._save(runner, loading)
        await trio.sleep(SPAWN)
        child = child_of(runner.number, number)
        spent += await self._save(runner, attrs.evolve(loading, child=child))
        await trio.sleep(START)
        loaded = loaded_of(handle, request_id, child)
        spent += await self._save(runner, loaded)
        now = time.monotonic()
        self.done.append(Done(now, "load", spent))
        runner.hold(Held(handle.token, instance, handle.generation, number, now, loaded))

    async def dispose(self, runner: Runner) -> None:
        held = runner.idle.pick(self.rng)
        if held is None:
            self.counts["no_idle"] += 1
            return
        runner.forget(held)
        spent = await self._stop(runner, held, Disposed())
        self.done.append(Done(time.monotonic(), "dispose", spent))

    async def stop_superseded(self, runner: Runner, held: Held) -> None:
        spent = await self._stop(runner, held, Superseded())
        self.done.append(Done(time.monotonic(), "stop, superseded", spent))

    async def _stop(self, runner: Runner, held: Held, reason: Disposed | Superseded) -> float:
        previous = runner.record_of(held)
        spent = await self._save(runner, StoppingRecord.of(previous, reason))
        await trio.sleep(EXIT)
        return spent + await self._save(runner, StoppedRecord.of(previous, reason, DONE))

    # -- arrivals --------------------------------------------------------------------------

    async def _arrivals(self, runner: Runner, operation: Any, scope: trio.CancelScope) -> None:
        """Poisson arrivals of ``operation`` on ``runner`` at the sizing's rate."""
        with scope:
            due = trio.current_time()
            while True:
                due += self.rng.expovariate(CHURN)
                await trio.sleep_until(due)
                self.late = max(self.late, trio.current_time() - due)
                self.counts["arrived"] += 1
                if self.in_flight >= MOST_IN_FLIGHT:
                    self.counts["shed"] += 1
                    continue
                self.start(operation, runner)

    def churn_on(self, runners: Sequence[Runner]) -> None:
        assert self._work is not None
        for runner in runners:
            scopes = [trio.CancelScope(), trio.CancelScope()]
            self._scopes[runner.number] = scopes
            self._work.start_soon(self._arrivals, runner, self.open_and_load, scopes[0])
            self._work.start_soon(self._arrivals, runner, self.dispose, scopes[1])

    def churn_off(self, runners: Sequence[Runner]) -> None:
        for runner in runners:
            for scope in self._scopes.pop(runner.number, []):
                scope.cancel()

    async def ramp(self, seconds: float, fixed: int | None) -> None:
        """Churn on as many runners as the driver keeps up with (see the module's docs)."""
        count = len(self.runners)
        if fixed is not None:
            self.churning = max(1, min(fixed, count))
            self.churn_on(self.runners[: self.churning])
            return
        steps = [step for step in STEPS if step < count] + [count]
        every = seconds / len(steps)
        baseline: float | None = None
        for target in steps:
            self.churn_on(self.runners[self.churning : target])
            mark, arrived = len(self.done), self.counts["arrived"]
            failed = sum(self.errors.values())
            self.late = 0.0
            await trio.sleep(every)
            times = [done.seconds for done in self.done[mark:] if done.kind in ("open", "load")]
            median = statistics.median(times) if times else math.inf
            if baseline is None and len(times) >= BASELINE_SAMPLES:
                baseline = median
            arrivals = self.counts["arrived"] - arrived
            # Behind: arrivals start late (this process is short of CPU), or operations
            # pile up (a mean operation of over half a second, by Little's law, where
            # one takes tens of milliseconds), or the store's latency grew (the server).
            behind = (
                sum(self.errors.values()) > failed
                or self.late > LATE
                or self.in_flight > max(20.0, BACKLOG * 2 * CHURN * target)
                or (baseline is not None and median > max(3 * baseline, baseline + 0.02))
            )
            kept = not behind or not self.churning
            self.steps.append(
                Step(target, arrivals, 1000 * median, 1000 * self.late, self.in_flight, kept)
            )
            if not kept:
                self.churn_off(self.runners[self.churning : target])
                return
            self.churning = target

    async def stop_churn(self) -> None:
        """Stop the arrivals; give the operations under way ``DRAIN`` seconds to end."""
        self.churn_off(self.runners)
        self._quiet = trio.Event()
        if self.in_flight:
            with trio.move_on_after(DRAIN):
                await self._quiet.wait()

    def attach(self, work: trio.Nursery) -> None:
        """Where the fleet's operations and arrivals run from now on."""
        self._work = work


# -- what the server and this process did ------------------------------------------------

CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
TRANSACTION_CONTROL: Final = ("BEGIN", "COMMIT", "ROLLBACK")


# A server process's kind, by its title (``postgres: checkpointer`` ...): the first found.
KINDS: Final = (
    ("autovacuum", "autovacuum"),
    ("checkpointer", "checkpointer"),
    ("background writer", "background writer"),
    ("walwriter", "walwriter"),
    ("backends", "postgres: postgres "),
)


def cluster_seconds(postmaster: int) -> dict[str, float]:
    """CPU seconds the cluster spent, by kind of process: its postmaster's and its
    children's (the backends and helpers, and, through the postmaster's own, those that
    exited: "postmaster, exited")."""
    ticks: collections.Counter[str] = collections.Counter()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            title = Path(entry.path, "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        spent = sum(int(field) for field in fields[11:15])  # utime stime cutime cstime
        if int(entry.name) == postmaster:
            ticks["postmaster, exited"] += spent
        elif int(fields[1]) == postmaster:
            kind = next((kind for kind, mark in KINDS if mark in title), "other")
            ticks[kind] += spent
    return {kind: count / CLOCK_TICKS for kind, count in ticks.items()}


def machine_seconds() -> float:
    """CPU seconds the machine's cores were busy (all of /proc/stat's but idle, iowait)."""
    values = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / CLOCK_TICKS


def process_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) + int(low, 16)


@attrs.frozen
class Snapshot:
    at: float  # time.monotonic()
    lsn: str
    server: dict[str, float]  # CPU seconds, by kind of process
    client: float
    machine: float
    commits: int  # xact_commit of the database
    calls: dict[int, tuple[int, float]]  # pg_stat_statements: queryid -> calls, ms
    nested: dict[int, tuple[int, float]]  # ... of the statements inside functions
    heard: collections.Counter[str]  # NOTIFYs by kind
    counts: collections.Counter[str]  # the fleet's
    store_commits: int
    done: int  # len(fleet.done)


class Monitor:
    """The cluster seen from outside the fleet: a connection to its ``postgres`` database
    (so its own statements are not the fleet's), a listener on the fleet's channel, and
    /proc."""

    def __init__(self, cluster: Cluster, postmaster: int, statements: bool) -> None:
        self.postmaster = postmaster
        self.statements = statements
        self.texts: dict[int, str] = {}
        self.heard: collections.Counter[str] = collections.Counter()
        self._connection = psycopg.connect(cluster.dsn(), autocommit=True)
        self._listener = psycopg.connect(cluster.dsn(DATABASE), autocommit=True)
        self._listener.execute(_postgres_sql.listen(SCHEMA))
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="hundred listen", daemon=True)
        self._thread.start()
        self._slot: str | None = None

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(5.0)
        self._listener.close()
        self._connection.close()

    def _listen(self) -> None:
        with contextlib.suppress(psycopg.Error):
            while not self._stopping.is_set():
                for note in self._listener.notifies(timeout=0.25):
                    kind = str(json.loads(note.payload).get("kind", "?"))
                    with self._lock:
                        self.heard[kind] += 1

    def retain(self) -> None:
        """Keep the WAL from now on, for :meth:`wal` (a temporary slot of this connection)."""
        self.release()
        self._slot = f"hundred_{os.getpid()}"
        self._connection.execute(
            "SELECT pg_create_physical_replication_slot(%s, true, true)", (self._slot,)
        )

    def release(self) -> None:
        if self._slot is not None:
            self._connection.execute("SELECT pg_drop_replication_slot(%s)", (self._slot,))
            self._slot = None

    def snapshot(self, database: str, fleet: Fleet | None = None) -> Snapshot:
        row = self._connection.execute(
            "SELECT pg_current_wal_flush_lsn()::text, "
            "(SELECT xact_commit FROM pg_stat_database WHERE datname = %s)",
            (database,),
        ).fetchone()
        assert row is not None
        calls: dict[int, tuple[int, float]] = {}
        nested: dict[int, tuple[int, float]] = {}
        if self.statements:
            for queryid, toplevel, count, spent, text in self._connection.execute(
                "SELECT s.queryid, s.toplevel, s.calls, s.total_exec_time, s.query "
                "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
                "WHERE d.datname = %s",
                (database,),
            ):
                (calls if toplevel else nested)[queryid] = (count, spent)
                self.texts.setdefault(queryid, text)
        with self._lock:
            heard = collections.Counter(self.heard)
        return Snapshot(
            at=time.monotonic(),
            lsn=str(row[0]),
            server=cluster_seconds(self.postmaster),
            client=process_seconds(),
            machine=machine_seconds(),
            commits=int(row[1] or 0),
            calls=calls,
            nested=nested,
            heard=heard,
            counts=collections.Counter() if fleet is None else collections.Counter(fleet.counts),
            store_commits=0 if fleet is None else fleet.store_commits,
            done=0 if fleet is None else len(fleet.done),
        )

    def wal(self, start: str, end: str) -> tuple[int, int]:
        """The COMMIT records between two LSNs (write transactions that committed), and
        the WAL's bytes of full-page images there."""
        if lsn(end) <= lsn(start):
            return 0, 0
        commits = fpi = 0
        for kind, count, fpi_size in self._connection.execute(
            'SELECT "resource_manager/record_type", count, fpi_size '
            "FROM pg_get_wal_stats(%s::pg_lsn, %s::pg_lsn, true)",
            (start, end),
        ):
            fpi += int(fpi_size)
            if kind == "Transaction/COMMIT":
                commits += int(count)
        return commits, fpi


# Each statement of the store by its constant's name (pg_stat_statements shows its text
# with $n for the parameters and the constants).
_PLACEHOLDER: Final = re.compile(r"%\(\w+\)s|%s|\$\d+")
_NAMES: Final = {
    re.sub(r"\s+", " ", _PLACEHOLDER.sub("?", value)).strip(): name
    for name, value in {**vars(_postgres_schema), **vars(_postgres_sql)}.items()
    if name.isupper() and isinstance(value, str) and len(value) > 20
}


def statement_name(text: str) -> str:
    normal = re.sub(r"\s+", " ", _PLACEHOLDER.sub("?", text)).strip()
    if normal.upper() in TRANSACTION_CONTROL:
        return normal.upper()
    best, length = "", 0
    for known, name in _NAMES.items():
        common = next(
            (at for at, (a, b) in enumerate(zip(known, normal, strict=False)) if a != b),
            min(len(known), len(normal)),
        )
        if common > length:
            best, length = name, common
    if length >= min(40, len(normal)):
        return best
    return normal[:40]


@attrs.frozen(kw_only=True)
class Rates:
    """What a window cost, per second."""

    seconds: float
    commits: float
    write_commits: float
    statements: float
    round_trips: float
    wal: float
    fpi: float
    notifies: float
    server: float  # cores
    server_by: dict[str, float]  # cores, by kind of process
    client: float
    machine: float
    store_commits: float
    saves: float
    lookups: float
    by_statement: dict[str, tuple[float, float]]  # calls/s, mean ms
    inside: dict[str, tuple[float, float]]  # statements in functions: calls/s, ms/s


def rates(monitor: Monitor, first: Snapshot, last: Snapshot) -> Rates:
    seconds = last.at - first.at
    write_commits, fpi = monitor.wal(first.lsn, last.lsn)
    by: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for queryid, (count, spent) in last.calls.items():
        before = first.calls.get(queryid, (0, 0.0))
        name = statement_name(monitor.texts.get(queryid, "?"))
        by[name][0] += count - before[0]
        by[name][1] += spent - before[1]
    calls = sum(count for count, _ in by.values())
    control = sum(by[name][0] for name in TRANSACTION_CONTROL if name in by)
    return Rates(
        seconds=seconds,
        commits=(last.commits - first.commits) / seconds,
        write_commits=write_commits / seconds,
        statements=(calls - control) / seconds,
        round_trips=calls / seconds,
        wal=(lsn(last.lsn) - lsn(first.lsn)) / seconds,
        fpi=fpi / seconds,
        notifies=sum((last.heard - first.heard).values()) / seconds,
        server=(sum(last.server.values()) - sum(first.server.values())) / seconds,
        server_by={
            kind: (last.server.get(kind, 0.0) - first.server.get(kind, 0.0)) / seconds
            for kind in sorted(set(last.server) | set(first.server))
        },
        client=(last.client - first.client) / seconds,
        machine=(last.machine - first.machine) / seconds,
        store_commits=(last.store_commits - first.store_commits) / seconds,
        saves=(last.counts["saves"] - first.counts["saves"]) / seconds,
        lookups=(last.counts["lookups"] - first.counts["lookups"]) / seconds,
        by_statement={
            name: (count / seconds, spent / count if count else 0.0)
            for name, (count, spent) in by.items()
            if count
        },
        inside=inside(monitor, first, last),
    )


def inside(monitor: Monitor, first: Snapshot, last: Snapshot) -> dict[str, tuple[float, float]]:
    """The statements run inside functions (write_batch's), by their text's start: calls
    and milliseconds of execution a second (pg_stat_statements.track = all)."""
    seconds = last.at - first.at
    found: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for queryid, (count, spent) in last.nested.items():
        before = first.nested.get(queryid, (0, 0.0))
        text = re.sub(r"\s+", " ", monitor.texts.get(queryid, "?")).strip()[:INSIDE_TEXT]
        found[text][0] += count - before[0]
        found[text][1] += spent - before[1]
    return {
        text: (count / seconds, spent / seconds) for text, (count, spent) in found.items() if count
    }


# -- the cluster, and pgbench ---------------------------------------------------------------


def prepare(cluster: Cluster, binaries: Path) -> tuple[bool, dict[str, str]]:
    """Set the cluster up (restarting it); whether pg_stat_statements counts, and the
    settings that matter here."""
    with psycopg.connect(cluster.dsn(), autocommit=True) as admin:
        available = {
            name
            for (name,) in admin.execute(
                "SELECT name FROM pg_available_extensions "
                "WHERE name IN ('pg_stat_statements', 'pg_walinspect')"
            )
        }
        if "pg_walinspect" not in available:
            raise Skipped("the group counts commits with pg_walinspect (PostgreSQL 15 or later)")
        library = binaries.parent / "lib" / "pg_stat_statements.so"
        statements = "pg_stat_statements" in available and (
            library.exists() or not library.parent.is_dir()
        )
        admin.execute("ALTER SYSTEM SET max_connections = 400")
        admin.execute("ALTER SYSTEM SET shared_buffers = '128MB'")
        if statements:
            admin.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
    cluster.restart()
    with psycopg.connect(cluster.dsn(), autocommit=True) as admin:
        for database in (DATABASE, PGBENCH_DATABASE):
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        admin.execute("CREATE EXTENSION pg_walinspect")
        if statements:
            admin.execute("CREATE EXTENSION pg_stat_statements")
            # The statements inside write_batch too (where a save's server time goes):
            # the setting exists once the library is loaded.
            admin.execute("ALTER SYSTEM SET pg_stat_statements.track = 'all'")
            admin.execute("SELECT pg_reload_conf()")
        shown = {
            name: str(
                (
                    admin.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
                    or ("?",)
                )[0]
            )
            for name in (
                "server_version",
                "max_connections",
                "shared_buffers",
                "fsync",
                "synchronous_commit",
                "wal_level",
                "max_wal_size",
                "pg_stat_statements.track",
                "checkpoint_timeout",
            )
        }
    return statements, shown


@attrs.frozen
class Bench:
    clients: int
    tps: float
    latency_ms: float
    window: Rates


def pgbench(cluster: Cluster, binaries: Path, monitor: Monitor, size: Sizes) -> list[Bench]:
    """pgbench's TPC-B-like runs, as docs/benchmarks.md's; then its database is dropped."""
    base = [str(binaries / "pgbench"), "-h", "127.0.0.1", "-p", str(cluster.port), "-U", "postgres"]
    initialize = [*base, "-i", "-s", str(size.pgbench_scale), "-q", PGBENCH_DATABASE]
    subprocess.run(initialize, check=True, capture_output=True, timeout=900)
    with psycopg.connect(cluster.dsn(), autocommit=True) as admin:
        admin.execute("CHECKPOINT")
    found: list[Bench] = []
    monitor.retain()
    for clients in (8, 100):
        first = monitor.snapshot(PGBENCH_DATABASE)
        done = subprocess.run(
            [
                *base,
                "-c",
                str(clients),
                "-j",
                "2",
                "-T",
                str(size.pgbench_seconds),
                PGBENCH_DATABASE,
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=size.pgbench_seconds + 300,
        )
        last = monitor.snapshot(PGBENCH_DATABASE)
        tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", done.stdout)
        latency = re.search(r"latency average = ([\d.]+) ms", done.stdout)
        if tps is None or latency is None:
            raise RuntimeError(f"pgbench said nothing of its rate:\n{done.stdout}{done.stderr}")
        found.append(Bench(clients, float(tps[1]), float(latency[1]), rates(monitor, first, last)))
    monitor.release()
    with psycopg.connect(cluster.dsn(), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE {}").format(sql.Identifier(PGBENCH_DATABASE)))
        admin.execute("CHECKPOINT")
    return found


# -- the preload ----------------------------------------------------------------------------

_RECORDS: Final = """
INSERT INTO records (token, identity, instance, generation, request_id, runner_id, epoch,
    saved, stopped, lease, body, phase, memory_bytes, cpu_percent)
SELECT u.token, %(identity)s, u.instance, 1, u.request, %(runner)s, %(epoch)s,
    nextval('save_order'), CASE WHEN %(stopped)s THEN nextval('stop_order') END, %(lease)s,
    u.body, %(phase)s, %(memory)s, %(cpu)s
FROM unnest(%(tokens)s::text[], %(instances)s::text[], %(requests)s::text[], %(bodies)s::text[])
    WITH ORDINALITY AS u (token, instance, request, body, n)
ORDER BY u.n
"""
_MARKS: Final = (
    "INSERT INTO high_water (identity, instance, generation) "
    "SELECT %s, u.instance, 1 FROM unnest(%s::text[]) AS u (instance)"
)


class Preload:
    """Rows as write_batch writes them, by the thousand, on a connection of its own."""

    def __init__(self, dsn: str) -> None:
        self._connection = psycopg.connect(dsn, autocommit=True)
        self._connection.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(SCHEMA)))
        self._template = Template()

    def close(self) -> None:
        self._connection.close()

    def _insert(
        self,
        runner: str,
        epoch: int,
        rows: Sequence[tuple[str, str, str, str]],
        *,
        stopped: bool,
    ) -> None:
        with self._connection.transaction():
            self._connection.execute(
                _RECORDS,
                {
                    "identity": IDENTITY,
                    "runner": runner,
                    "epoch": epoch,
                    "stopped": stopped,
                    "lease": LEASE,
                    "phase": "Stopped" if stopped else "Loaded",
                    "memory": LIMITS.memory_bytes,
                    "cpu": LIMITS.cpu_percent,
                    "tokens": [row[0] for row in rows],
                    "instances": [row[1] for row in rows],
                    "requests": [row[2] for row in rows],
                    "bodies": [row[3] for row in rows],
                },
            )
            self._connection.execute(_MARKS, (IDENTITY, [row[1] for row in rows]))

    def live(self, runner: int, name: str, epoch: int, count: int) -> list[str]:
        """``count`` Loaded sessions of a runner; their tokens, by number."""
        tokens = [str(uuid.uuid4()) for _ in range(count)]
        for number in {0, count // 2, count - 1}:
            self._template.check(runner, number, tokens[number])
        rows = [
            (
                token,
                instance_of(runner, number),
                request_of(runner, number),
                self._template.body(runner, number, token),
            )
            for number, token in enumerate(tokens)
        ]
        self._insert(name, epoch, rows, stopped=False)
        return tokens

    def stopped(self, runners: Sequence[tuple[str, int]], count: int) -> None:
        """``count`` Stopped records of keys of their own, spread over the runners: what
        retention keeps in a fleet's steady state (``Retention().stopped_total``)."""
        for index, (name, epoch) in enumerate(runners):
            numbers = range(index, count, len(runners))
            rows = []
            for number in numbers:
                token = str(uuid.uuid4())
                loaded = preloaded(index, 10_000_000 + number, token)
                instance = loaded.handle.key.instance
                body = encode(StoppedRecord.of(loaded, Disposed(), DONE))
                rows.append((token, instance, loaded.request_id, body))
            if rows:
                self._insert(name, epoch, rows, stopped=True)

    def forget(self, runner: str) -> None:
        """The row of a runner that never held a session (the one that made the schema)."""
        self._connection.execute("DELETE FROM runners WHERE runner_id = %s", (runner,))

    def settle(self) -> None:
        self._connection.execute("VACUUM ANALYZE records")
        self._connection.execute("VACUUM ANALYZE high_water")
        self._connection.execute("CHECKPOINT")


# -- the fleet's run ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Measured:
    upkeep: Rates
    churn: Rates
    opened: float  # sessions opened and loaded a second, in the churn's window
    disposed: float
    superseded: float
    latencies: dict[str, list[float]]  # seconds, by operation
    churning: int
    steps: list[Step]
    counts: dict[str, int]  # the fleet's, in the churn's window
    errors: dict[str, int]
    first_errors: list[str]
    left: list[str]  # runners that left the fleet (fenced)
    live: int  # sessions held at the end
    preload_seconds: float
    in_flight_end: int
    stopped_total: int  # the stores' retention


def runner_name(number: int) -> str:
    return f"runner{number:03d}"


async def fleet_run(cluster: Cluster, monitor: Monitor, size: Sizes) -> Measured:
    dsn = cluster.dsn(DATABASE)
    fleet = Fleet()
    fixed = os.environ.get(CHURNING_VARIABLE)
    retention = retention_of()
    began = time.monotonic()
    tokens = await preload(dsn, size)
    preload_seconds = time.monotonic() - began
    print(
        f"hundred: {size.runners * size.sessions:,} live sessions preloaded in "
        f"{preload_seconds:.0f} s; {size.runners} runners start",
        file=sys.stderr,
        flush=True,
    )
    async with AsyncExitStack() as stack, trio.open_nursery() as work:
        fleet.attach(work)
        for number in range(size.runners):
            store = PostgresStore(
                dsn,
                runner_id=runner_name(number),
                retention=retention,
                commit_window=commit_window_of(),
            )
            await stack.enter_async_context(store)
            if store.epoch != 1:
                raise RuntimeError(f"{store.member} registered as epoch {store.epoch}, not 1")
            runner = Runner(number, store, fleet)
            now = time.monotonic()
            for child, token in enumerate(tokens[number]):
                # Their ages spread over a session's life; no record kept (see Held).
                opened = now - LIFETIME * ((child * 0.618034) % 1.0)
                runner.hold(Held(token, instance_of(number, child), 1, child, opened))
            runner.children = size.sessions
            fleet.runners.append(runner)
            work.start_soon(fleet.member, runner)
        # The simulation's million sessions are not a runner's: the collector leaves them
        # be (a full collection over them stalls the run for a good part of a second).
        gc.collect()
        gc.freeze()
        await trio.sleep(SETTLE)  # every runner renewed its row and listens
        print(f"hundred: upkeep for {size.upkeep:g} s", file=sys.stderr, flush=True)
        await trio.to_thread.run_sync(monitor.retain)
        upkeep_first = await trio.to_thread.run_sync(monitor.snapshot, DATABASE, fleet)
        await trio.sleep(size.upkeep)
        upkeep_last = await trio.to_thread.run_sync(monitor.snapshot, DATABASE, fleet)
        print(
            f"hundred: churn for {size.churn:g} s ({size.warmup:g} s of warm-up)",
            file=sys.stderr,
            flush=True,
        )
        churn_began = trio.current_time()
        await fleet.ramp(RAMP_SHARE * size.warmup, None if not fixed else int(fixed))
        print(
            f"hundred: {fleet.churning} runners churn, at {CHURN:.1f} sessions/s each",
            file=sys.stderr,
            flush=True,
        )
        await trio.sleep_until(churn_began + size.warmup)
        churn_first = await trio.to_thread.run_sync(monitor.snapshot, DATABASE, fleet)
        await trio.sleep_until(churn_began + size.churn)
        churn_last = await trio.to_thread.run_sync(monitor.snapshot, DATABASE, fleet)
        in_flight_end = fleet.in_flight
        await fleet.stop_churn()
        live = sum(len(runner.sessions) for runner in fleet.runners)
        # The stores close once their memberships ended (the stack is left after them).
        work.cancel_scope.cancel()
    # The stores are closed: the WAL is read now, not while the fleet ran.
    upkeep = await trio.to_thread.run_sync(rates, monitor, upkeep_first, upkeep_last)
    churn = await trio.to_thread.run_sync(rates, monitor, churn_first, churn_last)
    window = [
        done
        for done in fleet.done[churn_first.done : churn_last.done]
        if churn_first.at <= done.at <= churn_last.at
    ]
    latencies: dict[str, list[float]] = collections.defaultdict(list)
    for done in window:
        latencies[done.kind].append(done.seconds)
    seconds = churn.seconds
    return Measured(
        upkeep=upkeep,
        churn=churn,
        opened=len(latencies["load"]) / seconds,
        disposed=len(latencies["dispose"]) / seconds,
        superseded=len(latencies["stop, superseded"]) / seconds,
        latencies=dict(latencies),
        churning=fleet.churning,
        steps=fleet.steps,
        counts=dict(churn_last.counts - churn_first.counts),
        errors=dict(fleet.errors),
        first_errors=fleet.first_errors,
        left=fleet.left,
        live=live,
        preload_seconds=preload_seconds,
        in_flight_end=in_flight_end,
        stopped_total=retention.stopped_total,
    )


async def preload(dsn: str, size: Sizes) -> list[list[str]]:
    """Every runner's sessions in the database, before any runner registers (so none is
    a member while the bulk writes hold the disk: not timed); their tokens, by runner.

    Each runner registers afterwards as epoch 1, the epoch its rows carry. The schema is
    made first by a store opened and closed, whose row then goes.
    """
    async with PostgresStore(dsn, runner_id=MIGRATOR):
        pass
    loader = await trio.to_thread.run_sync(Preload, dsn)
    try:
        await trio.to_thread.run_sync(loader.forget, MIGRATOR)
        tokens = [
            await trio.to_thread.run_sync(
                loader.live, number, runner_name(number), 1, size.sessions
            )
            for number in range(size.runners)
        ]
        named = [(runner_name(number), 1) for number in range(size.runners)]
        await trio.to_thread.run_sync(loader.stopped, named, Retention().stopped_total)
        await trio.to_thread.run_sync(loader.settle)
    finally:
        await trio.to_thread.run_sync(loader.close)
    return tokens


# -- the tables -------------------------------------------------------------------------------


def _n(value: float) -> str:
    """A figure to three significant digits or so, with thousands separated."""
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= size:
            return f"{_n(value / size)} {unit}"
    return f"{_n(value)} B"


def _ms(values: Sequence[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.1f}"


WINDOW_COLUMNS: Final = (
    "window",
    "seconds",
    "sessions/s opened+loaded (disposed)",
    "commits/s",
    "write commits/s (the stores' save batches)",
    "statements/s",
    "WAL/s (full-page images)",
    "NOTIFY/s",
    "server CPU, cores",
    "server CPU by process, cores",
    "this process, cores",
    "machine busy, cores",
)


def _window(name: str, window: Rates, sessions: str, *, fleet: bool = True) -> tuple[str, ...]:
    return (
        name,
        f"{window.seconds:.1f}",
        sessions,
        _n(window.commits),
        f"{_n(window.write_commits)} ({_n(window.store_commits) if fleet else '-'})",
        _n(window.statements),
        f"{_bytes(window.wal)} ({_bytes(window.fpi)})",
        _n(window.notifies),
        f"{window.server:.2f}",
        ", ".join(
            f"{kind} {cores:.2f}" for kind, cores in window.server_by.items() if abs(cores) >= 0.005
        ),
        f"{window.client:.2f}",
        f"{window.machine:.2f}",
    )


@attrs.frozen(kw_only=True)
class PerSession:
    """A session's life (open, load, dispose; 1% superseding), upkeep left out."""

    write_commits: float
    commits: float
    statements: float
    round_trips: float
    wal: float
    notifies: float
    server: float  # CPU seconds
    client: float
    saves: float


def per_session(measured: Measured) -> PerSession:
    up, churn, rate = measured.upkeep, measured.churn, measured.opened or math.inf

    def of(name: str) -> float:
        return max(0.0, (float(getattr(churn, name)) - float(getattr(up, name))) / rate)

    return PerSession(
        write_commits=of("write_commits"),
        commits=of("commits"),
        statements=of("statements"),
        round_trips=of("round_trips"),
        wal=of("wal"),
        notifies=of("notifies"),
        server=of("server"),
        client=of("client"),
        saves=churn.saves / rate,
    )


def tables(
    size: Sizes, settings: dict[str, str], benches: list[Bench], measured: Measured
) -> list[Table]:
    up, churn = measured.upkeep, measured.churn
    session = per_session(measured)
    runners = size.runners
    offered = measured.churning * CHURN
    label = f"{runners} runners x {size.sessions:,} sessions"
    windows = [
        _window(f"upkeep: {label}, no churn", up, "0"),
        _window(
            f"churn: {measured.churning} of them at {CHURN:.1f} sessions/s each "
            f"(offered {offered:,.0f}/s)",
            churn,
            f"{_n(measured.opened)} ({_n(measured.disposed)})",
        ),
    ]
    for bench in benches:
        window = attrs.evolve(bench.window, commits=bench.tps)
        windows.append(
            _window(
                f"pgbench TPC-B-like -c {bench.clients} -j 2: {bench.tps:,.0f} tps, "
                f"{bench.latency_ms:.1f} ms",
                window,
                "-",
                fleet=False,
            )
        )
    setting_text = ", ".join(f"{name} {value}" for name, value in settings.items())
    notes = [
        f"a cluster of its own ({setting_text}); the fleet: {label} preloaded in "
        f"{measured.preload_seconds:.0f} s, and {Retention().stopped_total:,} Stopped records; "
        f"the stores' Retention(stopped_total={measured.stopped_total:,})"
        + ("" if measured.stopped_total == Retention().stopped_total else " (NOT the default)")
        + f", commit_window={commit_window_of():g}"
        + f"; churn windows after a {size.warmup:g} s warm-up",
    ]
    if measured.errors:
        notes.append(
            "ERRORS " + ", ".join(f"{kind} x{count}" for kind, count in measured.errors.items())
        )
    if measured.left:
        notes.append(
            f"{len(measured.left)} RUNNERS LEFT THE FLEET (fenced): {', '.join(measured.left)}"
        )
    found = [
        Table(
            name="hundred",
            note="; ".join(notes),
            columns=WINDOW_COLUMNS,
            rows=windows,
        )
    ]
    kinds = ("open", "open, superseding", "load", "dispose", "stop, superseded")
    calls = {
        "open": "save Open, wait_older_stopped",
        "open, superseding": "lookup, save Open, the wait until the holder's Stopped",
        "load": "save Loading, Loading with child, Loaded",
        "dispose": "save Stopping, Stopped",
        "stop, superseded": "the holder's saves: Stopping, Stopped",
    }
    found.append(
        Table(
            name="hundred.latency",
            note="the store's calls as the driver awaits them, in the churn's window (the "
            f"simulated child's {1000 * SPAWN:g} + {1000 * START:g} ms of load and "
            f"{1000 * EXIT:g} ms of exit left out); the driver kept "
            f"{measured.in_flight_end} operations under way at the window's end; "
            + ", ".join(f"{name} {count}" for name, count in sorted(measured.counts.items())),
            columns=("operation", "store calls", "count", "median ms", "p99 ms", "max ms"),
            rows=[
                (
                    kind,
                    calls[kind],
                    str(len(measured.latencies.get(kind, []))),
                    _ms(measured.latencies.get(kind, []), 0.5),
                    _ms(measured.latencies.get(kind, []), 0.99),
                    _ms(measured.latencies.get(kind, []), 1.0),
                )
                for kind in kinds
            ],
        )
    )
    found.append(
        Table(
            name="hundred.ramp",
            note=f"the warm-up's steps, {RAMP_SHARE:g} of it: runners added while arrivals "
            f"start within {1000 * LATE:g} ms, fewer than {BACKLOG:g} s of arrivals are under "
            "way (or 20), and the median open and load stay within 3x (or +20 ms) of the "
            "first step's; a step that does not is undone",
            columns=("runners churning", "arrivals", "median ms", "latest ms", "in flight", "kept"),
            rows=[
                (
                    str(step.churning),
                    str(step.arrived),
                    f"{step.median_ms:.1f}",
                    f"{step.late_ms:.1f}",
                    str(step.in_flight),
                    "yes" if step.kept else "no",
                )
                for step in measured.steps
            ]
            or [("fixed: " + str(measured.churning), "-", "-", "-", "-", "-")],
        )
    )
    names = sorted(set(up.by_statement) | set(churn.by_statement))
    found.append(
        Table(
            name="hundred.statements",
            note="pg_stat_statements, top-level calls in the fleet's database (each a round "
            "trip: the stores run in autocommit); per session: the churn's calls less the "
            "upkeep's, over the sessions opened",
            columns=(
                "statement",
                "upkeep calls/s",
                "churn calls/s",
                "per session",
                "mean ms (server)",
            ),
            rows=[
                (
                    name,
                    _n(up.by_statement.get(name, (0.0, 0.0))[0]),
                    _n(churn.by_statement.get(name, (0.0, 0.0))[0]),
                    _n(
                        max(
                            0.0,
                            churn.by_statement.get(name, (0.0, 0.0))[0]
                            - up.by_statement.get(name, (0.0, 0.0))[0],
                        )
                        / (measured.opened or math.inf)
                    ),
                    f"{churn.by_statement.get(name, up.by_statement.get(name, (0.0, 0.0)))[1]:.3f}",
                )
                for name in names
            ]
            or [("(pg_stat_statements is not available)", "-", "-", "-", "-")],
        )
    )
    costliest = sorted(churn.inside.items(), key=lambda item: -item[1][1])[:INSIDE_ROWS]
    found.append(
        Table(
            name="hundred.inside",
            note="the statements inside write_batch (and other functions) in the churn's "
            "window, the costliest first (pg_stat_statements.track = all; execution time, "
            "which includes waits for locks and I/O)",
            columns=("statement (its start)", "calls/s", "per session", "mean ms", "ms/s"),
            rows=[
                (
                    text,
                    _n(count),
                    _n(count / (measured.opened or math.inf)),
                    f"{spent / count:.3f}",
                    _n(spent),
                )
                for text, (count, spent) in costliest
            ]
            or [("(not counted)", "-", "-", "-", "-")],
        )
    )
    found.append(
        Table(
            name="hundred.session",
            note="a session's life on a runner (open, load, dispose; 1% of opens superseding "
            "another runner's session), the upkeep's rates taken off, over "
            f"{_n(measured.opened)} sessions/s; and a runner's upkeep at {size.sessions:,} "
            "sessions",
            columns=("figure", "per session", "per runner per second, upkeep"),
            rows=[
                ("write commits", f"{session.write_commits:.2f}", _n(up.write_commits / runners)),
                (
                    "saves (each a store call); saves per write commit",
                    f"{session.saves:.2f}; "
                    f"{session.saves / session.write_commits if session.write_commits else 0:.2f}",
                    "0",
                ),
                ("commits", f"{session.commits:.2f}", _n(up.commits / runners)),
                ("statements", f"{session.statements:.2f}", _n(up.statements / runners)),
                ("round trips", f"{session.round_trips:.2f}", _n(up.round_trips / runners)),
                ("WAL", _bytes(session.wal), _bytes(up.wal / runners)),
                ("NOTIFY", f"{session.notifies:.3f}", _n(up.notifies / runners)),
                (
                    "server CPU",
                    f"{1000 * session.server:.2f} ms",
                    f"{1000 * up.server / runners:.2f} ms",
                ),
                (
                    "this process's CPU (the runners' store work and the driver)",
                    f"{1000 * session.client:.2f} ms",
                    f"{1000 * up.client / runners:.2f} ms",
                ),
            ],
        )
    )
    found.extend(sizing(size, benches, measured, session))
    return found


def sizing(
    size: Sizes, benches: list[Bench], measured: Measured, session: PerSession
) -> list[Table]:
    """The sizing table redone from the measured figures, and the goals."""
    up, count = measured.upkeep, size.runners

    def at(runners: int, upkeep: float, each: float) -> float:
        return runners * (upkeep / count + CHURN * each)

    rows: list[tuple[str, ...]] = []
    figures: dict[int, dict[str, float]] = {}
    for runners in (10, 100, 1_000):
        figure = {
            "write_commits": at(runners, up.write_commits, session.write_commits),
            "statements": at(runners, up.statements, session.statements),
            "round_trips": at(runners, up.round_trips, session.round_trips),
            "wal": at(runners, up.wal, session.wal),
            "notifies": at(runners, up.notifies, session.notifies),
            "upkeep_cpu": runners * up.server / count,
            "cpu": at(runners, up.server, session.server),
        }
        figures[runners] = figure
        rows.append(
            (
                f"{runners:,}",
                f"{runners * SIZING_SESSIONS:,}",
                _n(figure["write_commits"]),
                _n(figure["statements"]),
                _n(figure["round_trips"]),
                _bytes(figure["wal"]),
                _n(figure["notifies"]),
                f"{figure['upkeep_cpu']:.2f}",
                f"{figure['cpu']:.2f}",
            )
        )
    basis = (
        f"extrapolated: the upkeep of {count} runners of {size.sessions:,} sessions measured, "
        f"per runner, plus {CHURN:.1f} sessions/s per runner x the per-session costs measured "
        f"with {measured.churning} runners churning ({_n(measured.opened)} sessions/s)"
    )
    table = Table(
        name="hundred.sizing",
        note=basis,
        columns=(
            "runners (10k sessions each)",
            "live records",
            "write commits/s",
            "statements/s",
            "round trips/s",
            "WAL/s",
            "NOTIFY/s",
            "server CPU, upkeep (cores)",
            "server CPU, all (cores)",
        ),
        rows=rows,
    )
    hundred = figures[100]
    per_session_second = hundred["write_commits"] / (100 * SIZING_SESSIONS)
    old = OLD_WRITE_COMMITS / OLD_SESSIONS
    goals: list[tuple[str, ...]] = []
    for bench in benches:
        bound = GOAL_SHARE * bench.tps
        goals.append(
            (
                f"write commits/s of 100 runners x 10k sessions at the sizing's churn "
                f"(extrapolated) within {GOAL_SHARE:.0%} of TPC-B -c {bench.clients}",
                _n(hundred["write_commits"]),
                f"<= {_n(bound)} ({bench.tps:,.0f} tps)",
                f"{hundred['write_commits'] / bound:.2f}",
                "yes" if hundred["write_commits"] <= bound else "NO",
            )
        )
    upkeep_cpu = up.server * 100 / count
    goals.append(
        (
            "server CPU of the upkeep of 100 runners x 10k sessions"
            + ("" if count == 100 else f" (from {count} runners)"),
            f"{upkeep_cpu:.2f} cores",
            "<= 1 core",
            f"{upkeep_cpu:.2f}",
            "yes" if upkeep_cpu <= 1.0 else "NO",
        )
    )
    goals.append(
        (
            f"write commits per session-second, {GOAL_FEWER:g}x fewer than the issue-43 "
            f"table's ({OLD_WRITE_COMMITS:,.0f}/s for {OLD_SESSIONS:,} sessions)",
            f"{per_session_second:.5f}",
            f"<= {old / GOAL_FEWER:.5f}",
            f"{per_session_second / (old / GOAL_FEWER):.2f}",
            "yes" if per_session_second <= old / GOAL_FEWER else "NO",
        )
    )
    return [
        table,
        Table(
            name="hundred.goals",
            note="issue 51's goals against the sizing above (ratio: measured / bound, <= 1 is met)",
            columns=("goal", "measured", "bound", "ratio", "met"),
            rows=goals,
        ),
    ]


# -- the group --------------------------------------------------------------------------------


def run(quick: bool, rounds: int) -> list[Table]:
    try:
        # The tests' support: it needs pytest (the group ``test``'s packages).
        import pytest

        from tests.support import clusters
    except ImportError as error:
        raise Skipped(
            "the hundred group makes its cluster with tests/support/clusters.py, which "
            f"needs the test packages (pip install -e .[test]): {error}"
        ) from None
    try:
        binaries = clusters.binaries()
    except (pytest.skip.Exception, pytest.fail.Exception) as error:
        raise Skipped(str(error.msg)) from None
    from .availability import _subreaper

    size = sizes(quick)
    with _subreaper(), clusters.own_clusters() as made:
        cluster = made.primary("hundred")
        statements, settings = prepare(cluster, binaries)
        postmaster = cluster.postmaster()
        assert postmaster is not None
        monitor = Monitor(cluster, postmaster, statements)
        try:
            print("hundred: pgbench, the baseline", file=sys.stderr, flush=True)
            benches = pgbench(cluster, binaries, monitor, size)
            measured = trio.run(fleet_run, cluster, monitor, size)
        finally:
            gc.unfreeze()  # fleet_run froze its sessions out of the collector's way
            monitor.close()
    if measured.first_errors:
        print("hundred: first errors:\n  " + "\n  ".join(measured.first_errors), file=sys.stderr)
    return tables(size, settings, benches, measured)


__all__ = ["run"]
