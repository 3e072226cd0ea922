"""availability.*: a fleet of two real runners through what its database goes through
(issue 50, item 9; docs/design.md, "Availability").

Every row runs ``trio-supervisor serve`` processes (two runners, ``r1`` and ``r2``, a
fleet on one database) on a PostgreSQL cluster of the group's own, made, restarted,
stopped, killed and promoted with the tests' own tool for it,
``tests/support/clusters.py`` (imported, not copied: the benchmarks import nothing else
from ``tests``; it needs pytest, which ``nox -s bench`` does not install, so there the
group is skipped and says so). The runners are started by ``tests/support/runners.py``'s
``serving`` (the readiness handshake: the first line on stdout, ``listening on URL``),
each with the flags of ``RUNNER_FLAGS``: a runner lease of 2 s (a row trusted for 1.6 s
after the last renewal sent, renewed every 0.67 s) and a store wait of 1 s, as the
availability tests run them. On each runner a host holds a session whose child (the
minimal plugin, ``benchmarks/plugins/minimal.py``) runs, and renews it every 0.5 s.

What the first three rows time, each in seconds:

* the **mark**: the moment the cluster's call returns in the benchmark's thread:
  ``Cluster.start()`` (within ``restart()``) returns once ``pg_ctl start -w`` returned
  and one connection of ours ran ``SELECT 1``; ``Cluster.promote()`` once ``pg_ctl
  promote -w`` returned and ``pg_is_in_recovery()`` said false on a connection of ours;
* **ready**: every 20 ms (POLL) the benchmark asks each runner's ``GET /readyz`` (from
  before the event until the end of the round); a runner is ready at the answer of the
  first poll sent at or after the mark from which on every poll of that runner answered
  200 for STEADY seconds (so a runner fenced a moment after the mark is not counted
  ready before it). The row's figure is the later runner's, minus the mark. A runner
  that never stopped being ready is ready at its first poll's answer: a few ms, the
  resolution of the measure. ``extra`` counts the polls that did not answer 200.

* ``availability.restart``: a fast restart of the server (``Cluster.restart()``:
  ``pg_ctl stop -m fast``, then start). Goal: ready within 1 s. ``extra``:
  ``first_write_s``, the later of two opens (a write to the store), one per runner,
  sent at the mark; ``restart_s``, how long the restart took.
* ``availability.outage``: an outage past the runners' trust, on a new pair of runners
  (and a new database of the cluster) per round: the server is stopped (``fast``), the
  benchmark waits until both runners' ``/readyz`` answer 503 ``RunnerRestarting`` (each
  fenced, its children stopped), keeps the server down DOWN_AFTER seconds more, and
  starts it. Goal: ready within the runner lease + 5 s. ``extra``: ``fenced_s``, from
  the stop's return to both answering ``RunnerRestarting``.
* ``availability.failover``: a primary and its synchronous standby of their own per
  round, the runners' ``--store`` the libpq multi-host URL of both with
  ``target_session_attrs=read-write``: ``primary.kill()`` (SIGKILL to every process of
  the cluster), then ``standby.promote()``; from the promotion's return. Goal: the
  runner lease + 5 s. ``extra``: ``first_write_s`` as above; ``kill_promote_s``.
* ``availability.renew_p99``: a host renews its session on ``r1`` every RENEW_EVERY
  seconds (then the next renewal), from BEFORE seconds before a fast restart begins to
  AFTER seconds after it returned, against the same host renewing the same session on
  the same runner for as long with no restart (the raw baseline, measured in the same
  run, alternately). Ratio of the 99th percentiles; goal <= 5.

The budgets are the baselines of the first three rows (as ``loop.lag``'s): the ratio
is the time over its goal, target <= 1. With ``--quick`` each row runs one round,
whatever ``--rounds`` says, with shorter windows (QUICK): about 40 s.
"""

from __future__ import annotations

import compileall
import contextlib
import ctypes
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs
import httpx
import psycopg
import trio

from trio_supervisor import Handle, Key, Load, LoadedRecord, SupervisorError
from trio_supervisor.client import RemoteSupervisor, connect

from .measure import Result, Skipped, interleaved_async

if TYPE_CHECKING:
    from tests.support.clusters import Cluster, Clusters
    from tests.support.runners import Runner

PLUGINS: Final = Path(__file__).parent / "plugins"
HOSTS_TOKEN: Final = "bench-availability-hosts-token"
OPERATOR_TOKEN: Final = "bench-availability-operator-token"
RUNNER_LEASE: Final = 2.0
STORE_WAIT: Final = 1.0
SESSION_LEASE: Final = 5.0
HOLD_EVERY: Final = 0.5  # seconds between a holding host's renewals
POLL: Final = 0.02  # seconds between two /readyz of a runner
POLL_TIMEOUT: Final = 5.0
BOUND: Final = 60.0  # seconds a runner may take to be ready again before the round fails
RESTART_GOAL: Final = 1.0
LATER_GOAL: Final = RUNNER_LEASE + 5.0  # the outage's and the failover's
RENEW_EVERY: Final = 0.02
RENEW_TARGET: Final = 5.0
PR_SET_CHILD_SUBREAPER: Final = 36
RUNNER_FLAGS: Final = (
    "--runner-lease",
    str(RUNNER_LEASE),
    "--store-wait",
    str(STORE_WAIT),
    "--lease",
    str(SESSION_LEASE),
    "--grace",
    "1",
    "--confirmation-timeout",
    "1",
    # Five outages in ten minutes would reach the default limit (5/600) of a runner
    # that outlived them; each outage's runners are new anyway.
    "--restart-limit",
    "100/600",
)


@attrs.frozen
class Sizes:
    steady: float  # seconds every poll must answer 200 for a runner to count as ready
    down_after: float  # seconds the outage lasts after both runners said RunnerRestarting
    before: float  # seconds of renewals before the restart (renew_p99)
    after: float  # ... and after it returned


FULL: Final = Sizes(steady=2.0, down_after=2.0, before=1.0, after=2.0)
QUICK: Final = Sizes(steady=0.5, down_after=0.5, before=0.3, after=0.5)


def run(quick: bool, rounds: int) -> list[Result]:
    try:
        # The tests' support: it needs pytest (the group ``test``'s packages).
        import pytest

        from tests.support import clusters
    except ImportError as error:
        raise Skipped(
            "the availability group makes its clusters with tests/support/clusters.py, "
            f"which needs the test packages (pip install -e .[test]): {error}"
        ) from None
    try:
        clusters.binaries()
    except (pytest.skip.Exception, pytest.fail.Exception) as error:
        raise Skipped(str(error.msg)) from None
    sizes = QUICK if quick else FULL
    rounds = 1 if quick else rounds
    # As child.py: an isolated child's uid cannot write the plugin's bytecode cache.
    compileall.compile_dir(PLUGINS, quiet=1)
    with (
        _subreaper(),
        tempfile.TemporaryDirectory(prefix="trio-supervisor-bench-") as directory,
        clusters.own_clusters() as made,
    ):
        scratch = Path(directory)
        tokens = _tokens(scratch)
        cluster = made.primary("avail")
        with _pair(scratch / "restart", tokens, _database(cluster, "restart")) as runners:
            restart = [trio.run(_restart_round, runners, cluster, sizes) for _ in range(rounds)]
            quiet, through, renewals = trio.run(_renew_rows, runners[0], cluster, sizes, rounds)
        outage = [
            _outage(scratch / f"outage{number}", tokens, cluster, sizes, number)
            for number in range(rounds)
        ]
        failover = [
            _failover(scratch / f"failover{number}", tokens, made, sizes, number)
            for number in range(rounds)
        ]
    return [
        _budget_row(
            "availability.restart",
            restart,
            RESTART_GOAL,
            "a fast restart of the server (pg_ctl stop -m fast, start -w)",
        ),
        _budget_row(
            "availability.outage",
            outage,
            LATER_GOAL,
            "the server stopped until both runners answer RunnerRestarting (fenced), then "
            f"{sizes.down_after:g} s more; from its start",
        ),
        _budget_row(
            "availability.failover",
            failover,
            LATER_GOAL,
            "the primary killed (SIGKILL, every process), its synchronous standby promoted; "
            "the runners' store the multi-host URL of both; from the promotion",
        ),
        Result(
            name="availability.renew_p99",
            unit="ms (renew p99)",
            better="lower",
            target=RENEW_TARGET,
            ours=through,
            baseline=quiet,
            baseline_name="the same host, session and runner renewing as long, no restart",
            note=f"a host renews its session every {RENEW_EVERY * 1000:g} ms from "
            f"{sizes.before:g} s before a fast restart of the server to {sizes.after:g} s "
            "after it returned",
            extra=renewals,
        ),
    ]


# -- the rows -------------------------------------------------------------------------


def _budget_row(name: str, rounds: list[dict[str, float]], goal: float, what: str) -> Result:
    """A row whose figure is ``ready_s`` of each round, against its goal as the budget;
    the medians of the rounds' other figures (the counts summed) in ``extra``."""
    extra: dict[str, Any] = {}
    for figure in rounds[0]:
        if figure == "ready_s":
            continue
        values = [round_[figure] for round_ in rounds]
        counted = figure.endswith(("polls", "kept", "held"))
        extra[figure] = sum(values) if counted else statistics.median(values)
    extra["ready_s_per_round"] = ",".join(f"{round_['ready_s']:.3f}" for round_ in rounds)
    return Result(
        name=name,
        unit="s",
        better="lower",
        target=1.0,
        ours=[round_["ready_s"] for round_ in rounds],
        baseline=[goal] * len(rounds),
        baseline_name=f"budget: {goal:g} s (the goal)",
        note=f"two runners, each holding a session with a live child; {what}; to every "
        "runner's /readyz answering 200 (and for good)",
        extra=extra,
    )


async def _restart_round(
    runners: Sequence[Runner], cluster: Cluster, sizes: Sizes
) -> dict[str, float]:
    async with _hosts(runners) as hosts:
        async with trio.open_nursery() as background:
            watch = Readiness(runners)
            for runner in runners:
                background.start_soon(watch.watch, runner)
            held = Held()
            await held.hold(hosts, background)
            await trio.sleep(0.3)  # polls before the event
            began = time.monotonic()
            mark = await trio.to_thread.run_sync(_timed(cluster.restart))
            wrote = await _first_writes(hosts, mark)
            ready = await watch.steady(mark, sizes.steady)
            kept = await held.kept(hosts)
            background.cancel_scope.cancel()
        await _dispose(hosts, held.handles)
    return {
        "ready_s": ready,
        "first_write_s": wrote,
        "restart_s": mark - began,
        "not_ready_polls": watch.not_ready(),
        "polls": watch.count(),
        "children_kept": kept,
        "children_held": len(held.handles),
    }


def _outage(
    directory: Path, tokens: tuple[Path, Path], cluster: Cluster, sizes: Sizes, number: int
) -> dict[str, float]:
    """A round of the outage, on two runners of its own, on a database of its own."""
    with _pair(directory, tokens, _database(cluster, f"outage{number}")) as runners:
        return trio.run(_outage_round, runners, cluster, sizes)


async def _outage_round(
    runners: Sequence[Runner], cluster: Cluster, sizes: Sizes
) -> dict[str, float]:
    async with _hosts(runners) as hosts, trio.open_nursery() as background:
        watch = Readiness(runners)
        for runner in runners:
            background.start_soon(watch.watch, runner)
        held = Held()
        await held.hold(hosts, background)
        await trio.sleep(0.3)
        stopped = await trio.to_thread.run_sync(_timed(cluster.stop))
        fenced = await watch.until_restarting(stopped) - stopped
        await trio.sleep(sizes.down_after)
        mark = await trio.to_thread.run_sync(_timed(cluster.start))
        ready = await watch.steady(mark, sizes.steady)
        kept = await held.kept(hosts)
        # They serve: a write on each.
        await _first_writes(hosts, time.monotonic())
        background.cancel_scope.cancel()
    return {
        "ready_s": ready,
        "fenced_s": fenced,
        "down_s": mark - stopped,
        "not_ready_polls": watch.not_ready(),
        "polls": watch.count(),
        "children_kept": kept,
        "children_held": len(held.handles),
    }


def _failover(
    directory: Path, tokens: tuple[Path, Path], made: Clusters, sizes: Sizes, number: int
) -> dict[str, float]:
    """A round of the failover: a primary and its synchronous standby of their own, and
    two runners on both; the pair is removed after it."""
    primary = made.primary(f"primary{number}")
    try:
        standby = made.standby(primary, f"standby{number}", synchronous=True)
        try:
            standby.wait_caught_up()
            store = (
                f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}"
                "/postgres?target_session_attrs=read-write"
            )
            with _pair(directory, tokens, store) as runners:
                return trio.run(_failover_round, runners, primary, standby, sizes)
        finally:
            standby.remove()
    finally:
        primary.remove()


async def _failover_round(
    runners: Sequence[Runner], primary: Cluster, standby: Cluster, sizes: Sizes
) -> dict[str, float]:
    async with _hosts(runners) as hosts, trio.open_nursery() as background:
        watch = Readiness(runners)
        for runner in runners:
            background.start_soon(watch.watch, runner)
        held = Held()
        await held.hold(hosts, background)
        await trio.sleep(0.3)
        began = time.monotonic()
        await trio.to_thread.run_sync(primary.kill)
        mark = await trio.to_thread.run_sync(_timed(standby.promote))
        wrote = await _first_writes(hosts, mark)
        ready = await watch.steady(mark, sizes.steady)
        kept = await held.kept(hosts)
        background.cancel_scope.cancel()
    return {
        "ready_s": ready,
        "first_write_s": wrote,
        "kill_promote_s": mark - began,
        "not_ready_polls": watch.not_ready(),
        "polls": watch.count(),
        "children_kept": kept,
        "children_held": len(held.handles),
    }


async def _renew_rows(
    runner: Runner, cluster: Cluster, sizes: Sizes, rounds: int
) -> tuple[list[float], list[float], dict[str, Any]]:
    """The p99 of a host's renewals through a fast restart, and on a quiet runner (ms),
    measured alternately; and their ``extra``."""
    seen: dict[str, list[float]] = {"quiet": [], "through": []}
    failures = {"quiet": 0, "through": 0}
    restarts: list[float] = []
    async with connect(runner.url, token=HOSTS_TOKEN, retry_for=SESSION_LEASE) as host:
        key = Key(identity="avail", instance=f"renewing-{uuid.uuid4().hex[:8]}")
        record = await host.open(key, key.instance, lease=SESSION_LEASE)
        await host.load(record.handle, Load(specifier="minimal:main"))

        async def renewals(which: str, during: Callable[[], Awaitable[None]]) -> float:
            took: list[float] = []

            async def renewing() -> None:
                while True:
                    began = time.perf_counter()
                    try:
                        await host.renew(record.handle)
                    except SupervisorError:
                        failures[which] += 1
                    took.append(1000 * (time.perf_counter() - began))
                    await trio.sleep(RENEW_EVERY)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(renewing)
                await during()
                nursery.cancel_scope.cancel()
            seen[which].extend(took)
            return _p99(took)

        async def through() -> float:
            async def restart() -> None:
                await trio.sleep(sizes.before)
                began = time.monotonic()
                restarts.append(await trio.to_thread.run_sync(_timed(cluster.restart)) - began)
                await trio.sleep(sizes.after)

            return await renewals("through", restart)

        async def quiet() -> float:
            async def wait() -> None:
                await trio.sleep(sizes.before + sizes.after)

            return await renewals("quiet", wait)

        mine, theirs = await interleaved_async(through, quiet, rounds)
        await host.dispose(record.handle)
    extra: dict[str, Any] = {
        "through_max_ms": max(seen["through"]),
        "quiet_max_ms": max(seen["quiet"]),
        "through_samples": len(seen["through"]),
        "quiet_samples": len(seen["quiet"]),
        "through_failures": failures["through"],
        "quiet_failures": failures["quiet"],
        "restart_s": statistics.median(restarts),
    }
    return theirs, mine, extra


# -- what the rounds share -------------------------------------------------------------


@attrs.frozen
class Poll:
    """One ``GET /readyz``: when sent and answered (monotonic), and what it said (0: no
    answer; the problem's code if not 200)."""

    sent: float
    answered: float
    status: int
    code: str


class Readiness:
    """Each runner's ``/readyz``, asked every POLL seconds while :meth:`watch` runs."""

    def __init__(self, runners: Sequence[Runner]) -> None:
        self.polls: dict[str, list[Poll]] = {runner.url: [] for runner in runners}
        self.logs = {runner.url: runner for runner in runners}

    async def watch(self, runner: Runner) -> None:
        polls = self.polls[runner.url]
        async with httpx.AsyncClient(base_url=runner.url, timeout=POLL_TIMEOUT) as client:
            while True:
                sent = time.monotonic()
                try:
                    answer = await client.get("/readyz")
                    status = answer.status_code
                    code = "" if status == 200 else str(answer.json().get("code", ""))
                except (httpx.HTTPError, ValueError) as error:
                    status, code = 0, type(error).__name__
                polls.append(Poll(sent, time.monotonic(), status, code))
                await trio.sleep(max(0.0, sent + POLL - time.monotonic()))

    def not_ready(self) -> int:
        return sum(poll.status != 200 for polls in self.polls.values() for poll in polls)

    def count(self) -> int:
        return sum(len(polls) for polls in self.polls.values())

    @staticmethod
    def _since(polls: list[Poll], mark: float, good: Callable[[Poll], bool]) -> Poll | None:
        """The first poll, sent at or after ``mark``, of the last run of ``good`` ones
        (None: the last poll is not good)."""
        first: Poll | None = None
        for poll in polls:
            if poll.sent < mark:
                continue
            if not good(poll):
                first = None
            elif first is None:
                first = poll
        return first

    async def steady(self, mark: float, steady: float) -> float:
        """Seconds from ``mark`` to the answer of the poll from which on every runner
        answered 200 (the later runner's), once each has for ``steady`` seconds."""
        deadline = mark + BOUND + steady
        while True:
            firsts = [self._since(polls, mark, _ready) for polls in self.polls.values()]
            answered = [
                first.answered
                for first, polls in zip(firsts, self.polls.values(), strict=True)
                if first is not None and polls[-1].answered - first.answered >= steady
            ]
            if len(answered) == len(firsts):
                return max(answered) - mark
            if time.monotonic() > deadline:
                raise RuntimeError(self._story(f"not ready within {BOUND:g} s of the mark"))
            await trio.sleep(POLL)

    async def until_restarting(self, mark: float) -> float:
        """When every runner answers 503 RunnerRestarting: the answer of the first poll
        of that run, sent at or after ``mark`` (monotonic; the later runner's)."""
        deadline = mark + BOUND
        while True:
            firsts = [self._since(polls, mark, _restarting) for polls in self.polls.values()]
            answered = [first.answered for first in firsts if first is not None]
            if len(answered) == len(firsts):
                return max(answered)
            if time.monotonic() > deadline:
                raise RuntimeError(self._story(f"not restarting within {BOUND:g} s"))
            await trio.sleep(POLL)

    def _story(self, what: str) -> str:
        told = [what]
        for url, polls in self.polls.items():
            told.append(f"{url}: last polls {[(p.status, p.code) for p in polls[-5:]]}")
            told.append(self.logs[url].stderr(last=20))
        return "\n".join(told)


def _ready(poll: Poll) -> bool:
    return poll.status == 200


def _restarting(poll: Poll) -> bool:
    return poll.status == 503 and poll.code == "RunnerRestarting"


class Held:
    """A session with a live child on each runner, each renewed every HOLD_EVERY s."""

    def __init__(self) -> None:
        self.handles: list[Handle] = []
        self.pids: list[int] = []
        self.failures = 0

    async def hold(self, hosts: Sequence[RemoteSupervisor], nursery: trio.Nursery) -> None:
        for host in hosts:
            key = Key(identity="avail", instance=f"held-{uuid.uuid4().hex[:8]}")
            record = await host.open(key, key.instance, lease=SESSION_LEASE)
            await host.load(record.handle, Load(specifier="minimal:main"))
            loaded = await host.status(record.handle)
            assert isinstance(loaded, LoadedRecord), loaded
            assert loaded.child.pid is not None
            self.handles.append(record.handle)
            self.pids.append(loaded.child.pid)
            nursery.start_soon(self._renew, host, record.handle)

    async def _renew(self, host: RemoteSupervisor, handle: Handle) -> None:
        while True:
            try:
                await host.renew(handle)
            except SupervisorError:
                self.failures += 1  # a fenced runner's session ends with it
                return
            await trio.sleep(HOLD_EVERY)

    async def kept(self, hosts: Sequence[RemoteSupervisor]) -> int:
        """How many of the sessions still have their first child, alive."""
        from tests.support.processes import running

        kept = 0
        for host, handle, pid in zip(hosts, self.handles, self.pids, strict=True):
            with contextlib.suppress(SupervisorError):
                record = await host.status(handle)
                if isinstance(record, LoadedRecord) and record.child.pid == pid and running(pid):
                    kept += 1
        return kept


async def _first_writes(hosts: Sequence[RemoteSupervisor], mark: float) -> float:
    """Seconds from ``mark`` until an open sent to each runner now returned (the later)."""
    returned: list[float] = []

    async def write(host: RemoteSupervisor) -> None:
        key = Key(identity="avail", instance=f"write-{uuid.uuid4().hex[:8]}")
        record = await host.open(key, key.instance, lease=SESSION_LEASE)
        returned.append(time.monotonic())
        await host.dispose(record.handle)

    async with trio.open_nursery() as nursery:
        for host in hosts:
            nursery.start_soon(write, host)
    return max(returned) - mark


async def _dispose(hosts: Sequence[RemoteSupervisor], handles: Sequence[Handle]) -> None:
    for host, handle in zip(hosts, handles, strict=True):
        with contextlib.suppress(SupervisorError):
            await host.dispose(handle)


@contextlib.asynccontextmanager
async def _hosts(runners: Sequence[Runner]) -> AsyncIterator[list[RemoteSupervisor]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                connect(runner.url, token=HOSTS_TOKEN, retry_for=SESSION_LEASE)
            )
            for runner in runners
        ]


@contextlib.contextmanager
def _pair(directory: Path, tokens: tuple[Path, Path], store: str) -> Iterator[list[Runner]]:
    """Runners ``r1`` and ``r2`` of a fleet on ``store``, stopped on the way out."""
    from tests.support.runners import serving

    directory.mkdir()
    hosts, operators = tokens
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                serving(
                    directory / name,
                    "--store",
                    store,
                    "--runner-id",
                    name,
                    "--token-file",
                    hosts,
                    "--operator-token-file",
                    operators,
                    *RUNNER_FLAGS,
                    plugins=(PLUGINS,),
                )
            )
            for name in ("r1", "r2")
        ]


def _tokens(directory: Path) -> tuple[Path, Path]:
    paths = directory / "hosts-token", directory / "operator-token"
    for path, token in zip(paths, (HOSTS_TOKEN, OPERATOR_TOKEN), strict=True):
        path.write_text(token + "\n")
        path.chmod(0o600)
    return paths


def _database(cluster: Cluster, name: str) -> str:
    """A new database on ``cluster``: its URL."""
    with psycopg.connect(cluster.dsn(), autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name}")
    return cluster.dsn(name)


def _timed(call: Callable[[], None]) -> Callable[[], float]:
    """``call``, returning the monotonic time as it returned (in its own thread)."""

    def timed() -> float:
        call()
        return time.monotonic()

    return timed


def _p99(samples: list[float]) -> float:
    """The 99th percentile, within the samples (a few hundred: "exclusive" would reach
    past the largest)."""
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


@contextlib.contextmanager
def _subreaper() -> Iterator[None]:
    """Make this process a child subreaper while the group runs (as the tests' run is,
    tests/conftest.py): a postmaster daemonized by ``pg_ctl`` becomes our child, which
    ``Cluster.stop`` and ``kill`` reap."""
    from tests.support.processes import reap_orphans

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        reap_orphans()


__all__ = ["run"]
