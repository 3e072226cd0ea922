"""child.cycle and terminate.cooperative: real processes, with the runner service's
defaults on (each child isolated where the runner is root, and in a cgroup of its own
with the default ceilings: SERVICE.md section D; issue 43).

Baseline: raw Trio spawning ``sys.executable -I`` with the same minimal code, waiting
for its ready line, sending SIGTERM, and reaping it.

``child.cycle`` runs the execution as the runner service does, with ``fork_server=True``
(each child forked from a prepared interpreter) and ``standby=True``;
``child.cycle.cold`` is the default, which starts each child's interpreter during its
load.

``terminate.cooperative`` is judged against the floor that the shape of
docs/design.md, "Shape in Trio" with P2-P6, sets for a dispose in Trio, with its child
shaped as containment needs it: a process that runs the plugin as its own child, passes
the SIGTERM on and ends as the plugin did, so the exit takes two processes, as ours does
(the tracked process and the plugin). A task in a session nursery watches for the exit,
and the stop request cancels that nursery; the session task then, shielded, saves
Stopping (one checkpoint, as any async save is), signals the child and reaps it within a
grace period, closes its pipe, saves Stopped (another checkpoint), and wakes the
disposer. There is no store, no record, no namespace, no cgroup and no control message,
so nothing an implementation could trim is left. ``terminate.cooperative.watched``
(informational) is the older floor, whose child is one process with a thread blocked on
a read (as a child-side watchdog would wait on a control pipe);
``terminate.cooperative.raw`` keeps the raw SIGTERM + wait baseline.

``child.cycle.multiprocessing`` is ``child.cycle`` against its peer, the tool a Python
user would otherwise pick: the standard library's ``multiprocessing`` with the forkserver
start method, its fork server warmed as ours is, starting and joining a process with a
no-op target (:data:`PEER`), the same number of cycles in the same rounds.

``child.cycle.runner_cpu`` and ``terminate.runner_cpu`` are the runner's own Python: the
event loop's time in task steps (``measure.LoopTime``) in a warm cycle, and in a
dispose started cold as ``terminate.cooperative``'s is, against the budgets of issue 51
(:data:`CYCLE_BUDGET`, :data:`DISPOSE_BUDGET`).
"""

from __future__ import annotations

import compileall
import contextlib
import cProfile
import functools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

import attrs
import trio
import trio.testing

from trio_supervisor import Key, Limits, Load, MemoryStore, SubprocessExecution, open_supervisor

from .measure import LoopTime, Result, compare

PLUGINS = Path(__file__).parent / "plugins"
PLUGIN = (PLUGINS / "minimal.py").read_text()
MINIMAL = PLUGIN + "\nmain(None)\n"
# The floor's child: the same, plus a thread blocked on a pipe the way the bootstrap's
# watchdog is blocked on the control pipe.
WATCHED = (
    PLUGIN
    + "\nimport _thread, os\n_thread.start_new_thread(os.read, (os.pipe()[0], 1))\nmain(None)\n"
)
# The floor's child as containment shapes it (terminate.cooperative.contained): the
# watched process runs the plugin as its own child, passes SIGTERM on, and once the
# plugin has ended, ends the same way. Two processes, as ours are (the tracked process
# and the plugin), without the namespace, the lease, the report or any sweep.
CONTAINED = (
    PLUGIN
    + """
import _thread, os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # held until passed on
plugin = os.fork()
if plugin == 0:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    main(None)
_thread.start_new_thread(os.read, (os.pipe()[0], 1))
signal.signal(signal.SIGTERM, lambda *_: os.kill(plugin, signal.SIGTERM))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
_, status = os.waitpid(plugin, 0)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
os.kill(os.getpid(), os.WTERMSIG(status))
"""
)
GRACE = 5.0


async def _ready_child(code: str = MINIMAL) -> trio.Process:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-I", "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    assert process.stdout is not None
    buffer = b""
    while b"ready\n" not in buffer:
        chunk = await process.stdout.receive_some(1024)
        assert chunk, "the child exited before it was ready"
        buffer += chunk
    return process


# A raw cycle's times in seconds: the whole cycle, SIGTERM to reaped, and the event
# loop's own time in the stop (0 unless the run is instrumented: measure.LoopTime).
Timed = tuple[float, float, float]


async def _raw_cycle(loop: LoopTime | None = None) -> Timed:
    """One raw cycle (see :data:`Timed`)."""
    started = time.perf_counter()
    process = await _ready_child()
    assert process.stdout is not None
    began = loop.busy if loop is not None else 0.0
    stopping = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    await process.wait()
    await process.stdout.aclose()
    ended = time.perf_counter()
    spent = loop.busy - began if loop is not None else 0.0
    return ended - started, ended - stopping, spent


async def _floor_cycle(code: str = WATCHED, loop: LoopTime | None = None) -> Timed:
    """One cycle stopped the way section 5 shapes a dispose (see the module docs and
    :data:`Timed`)."""
    started = time.perf_counter()
    process = await _ready_child(code)
    assert process.stdout is not None
    stdout = process.stdout
    session_scope = trio.CancelScope()
    stopped = trio.Event()

    async def watch_exit() -> None:
        await process.wait()
        session_scope.cancel()  # X1: an exit by itself stops the session too

    async def run_session(task_status: trio.TaskStatus[None]) -> None:
        with session_scope:
            async with trio.open_nursery() as session_nursery:
                session_nursery.start_soon(watch_exit)
                task_status.started()
                await trio.sleep_forever()
        with trio.CancelScope(shield=True):
            await trio.lowlevel.checkpoint()  # P2: the Stopping record is saved
            with trio.move_on_after(GRACE):  # P3: interrupt, wait for the exit
                process.send_signal(signal.SIGTERM)
                await process.wait()
            if process.returncode is None:  # P3: then the kill
                # Its whole group (it was started in a session of its own): the watched
                # process's plugin, its child, must not outlive it as an orphan.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
            await stdout.aclose()  # P4
            await trio.lowlevel.checkpoint()  # P5: the Stopped record is saved
        stopped.set()  # P6

    async with trio.open_nursery() as nursery:
        await nursery.start(run_session)
        await trio.testing.wait_all_tasks_blocked()  # the watcher waits for the exit
        began = loop.busy if loop is not None else 0.0
        stopping = time.perf_counter()
        session_scope.cancel()  # the stop request
        await stopped.wait()
        ended = time.perf_counter()
        spent = loop.busy - began if loop is not None else 0.0
    return ended - started, ended - stopping, spent


def raw(
    cycles: int,
    which: int,
    cycle: Callable[[LoopTime | None], Awaitable[Timed]] = _raw_cycle,
    *,
    instrumented: bool = False,
) -> float:
    """The median of ``cycles`` raw cycles' ``which`` time (see :data:`Timed`); the
    loop's own time (2) needs ``instrumented``."""
    loop = LoopTime() if instrumented else None

    async def main() -> float:
        times = [(await cycle(loop))[which] for _ in range(cycles)]
        return sorted(times)[len(times) // 2]

    return trio.run(main, instruments=[] if loop is None else [loop])


def _contained(loop: LoopTime | None) -> Awaitable[Timed]:
    """The floor's cycle, its child shaped as containment needs (terminate.cooperative)."""
    return _floor_cycle(CONTAINED, loop)


def _watched(loop: LoopTime | None) -> Awaitable[Timed]:
    """The older floor's cycle, one child with a watchdog thread."""
    return _floor_cycle(WATCHED, loop)


# The cycles of a fresh execution left out of its median: its first load finds no
# standby yet (its first is still starting), and the first standby that waits in a cgroup
# is the one started as the first load under a tree limit resolved (the execution learns
# then which hierarchies the children need); with ceilings the first load's tracked
# process joins its cgroup on the load's path (an RCU grace period: 20-30 ms here). A
# runner's later loads are the ones measured.
WARM_UP = 2

# The ceilings the runner service gives every child by default (SERVICE.md section D):
# each child gets a cgroup of its own (where one can be written).
CEILINGS = Limits(memory_bytes=1024**3, processes=4096)

# What the fork server of child.cycle imports ahead: the one module the plugin imports
# beside the built-in ``time`` (an owner preloads what the plugins share).
PRELOAD = ("typing",)


@attrs.frozen(kw_only=True)
class Cycle:
    """One measured cycle: wall times, and the event loop's own time in its steps
    (zero unless a :class:`~benchmarks.measure.LoopTime` was given)."""

    whole: float  # open, load and dispose
    stop: float  # the dispose
    loop_open: float = 0.0
    loop_load: float = 0.0
    loop_stop: float = 0.0
    steps: int = 0  # task steps of the whole cycle
    cpu: float = 0.0  # their CPU time, if the LoopTime sums it
    cpu_stop: float = 0.0  # the dispose's steps' CPU time, likewise

    @property
    def loop(self) -> float:
        """The loop's time in the whole cycle."""
        return self.loop_open + self.loop_load + self.loop_stop


def cycles_of(
    cycles: int,
    *,
    standby: bool = False,
    fork_server: bool = False,
    preload: tuple[str, ...] = (),
    isolation: Literal["auto", "none"] = "auto",
    limits: Limits | None = None,
    loop: LoopTime | None = None,
    profiler: cProfile.Profile | None = None,
) -> list[Cycle]:
    """``cycles`` open+load+dispose cycles of a fresh execution, after its ``WARM_UP``
    first; with ``loop``, the run is instrumented, and with ``profiler``, the measured
    cycles are profiled."""

    async def main(directory: str) -> list[Cycle]:
        key = Key(identity="bench", instance="child")
        found = []
        mark = loop.mark if loop is not None else lambda: (0.0, 0, 0.0)
        async with (
            SubprocessExecution(
                directory,
                entry_paths=[PLUGINS],
                standby=standby,
                fork_server=fork_server,
                preload=preload,
                isolation=isolation,
            ) as execution,
            open_supervisor(
                MemoryStore(), execution, lease=60.0, grace=GRACE, limits=limits
            ) as supervisor,
        ):
            for cycle in range(WARM_UP + cycles):
                if cycle == WARM_UP and profiler is not None:
                    profiler.enable()
                began, steps, cpu = mark()
                started = time.perf_counter()
                record = await supervisor.open(
                    key, f"cycle-{cycle}", expected_generation=cycle or None
                )
                opened, _, _ = mark()
                await supervisor.load(record.handle, Load(specifier="minimal:main"))
                loaded, _, cpu_loaded = mark()
                stopping = time.perf_counter()
                await supervisor.dispose(record.handle)
                ended = time.perf_counter()
                disposed, after, cpu_after = mark()
                if cycle >= WARM_UP:
                    found.append(
                        Cycle(
                            whole=ended - started,
                            stop=ended - stopping,
                            loop_open=opened - began,
                            loop_load=loaded - opened,
                            loop_stop=disposed - loaded,
                            steps=after - steps,
                            cpu=cpu_after - cpu,
                            cpu_stop=cpu_after - cpu_loaded,
                        )
                    )
            if profiler is not None:
                profiler.disable()
        return found

    with tempfile.TemporaryDirectory() as directory:
        return trio.run(main, directory, instruments=[] if loop is None else [loop])


def ours(
    cycles: int,
    which: int,
    *,
    standby: bool = False,
    fork_server: bool = False,
    preload: tuple[str, ...] = (),
    isolation: Literal["auto", "none"] = "auto",
    limits: Limits | None = None,
) -> float:
    """The median of ``cycles`` cycles' whole time (``which`` 0) or dispose (1)."""
    found = cycles_of(
        cycles,
        standby=standby,
        fork_server=fork_server,
        preload=preload,
        isolation=isolation,
        limits=limits,
    )
    times = sorted(cycle.stop if which else cycle.whole for cycle in found)
    return times[len(times) // 2]


def measured_cycles(
    cycles: int,
    *,
    cold: bool,
    loop: LoopTime,
    profiler: cProfile.Profile | None = None,
) -> list[Cycle]:
    """Cycles with the runner service's defaults on, as ``child.cycle`` runs them (or,
    ``cold``, as ``terminate.cooperative`` does), the loop's time in each measured."""
    return cycles_of(
        cycles,
        fork_server=not cold,
        standby=not cold,
        preload=() if cold else PRELOAD,
        limits=CEILINGS,
        loop=loop,
        profiler=profiler,
    )


def _loop_times(cycles: int, *, cold: bool) -> list[Cycle]:
    return measured_cycles(cycles, cold=cold, loop=LoopTime(cpu=True))


# child.cycle.multiprocessing's peer, the tool a Python user would otherwise pick: the
# standard library's multiprocessing with the forkserver start method, a process with a
# no-op target started and joined. It runs in an interpreter of its own (``-I -c``: its
# main module is no file, so a child re-runs nothing of it; one that names a module
# would have each child import that module again), its target in a module of its own
# that the fork server imports ahead (as ours preloads typing), its fork server started
# and warmed by WARM_UP cycles left out, as ours are; it prints the median of the rest.
PEER = """
import multiprocessing, sys, time
cycles, directory = int(sys.argv[1]), sys.argv[2]
sys.path.insert(0, directory)
import peer_target
context = multiprocessing.get_context("forkserver")
context.set_forkserver_preload(["peer_target"])
times = []
for cycle in range(int(sys.argv[3]) + cycles):
    started = time.perf_counter()
    process = context.Process(target=peer_target.noop)
    process.start()
    process.join()
    ended = time.perf_counter()
    assert process.exitcode == 0, process.exitcode
    process.close()
    times.append(ended - started)
print(sorted(times[-cycles:])[cycles // 2])
"""
PEER_TARGET = 'def noop() -> None:\n    """Nothing: the cycle is the process."""\n'


def multiprocessing_cycle(cycles: int) -> float:
    """The median of ``cycles`` start+join cycles of ``multiprocessing`` (:data:`PEER`)."""
    # Its temporary directory (and multiprocessing's, through TMPDIR) in /tmp: the fork
    # server listens on a unix socket there, whose path must be short (108 bytes).
    with tempfile.TemporaryDirectory(dir="/tmp") as directory:
        (Path(directory) / "peer_target.py").write_text(PEER_TARGET)
        done = subprocess.run(
            [sys.executable, "-I", "-c", PEER, str(cycles), directory, str(WARM_UP)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
            env={**os.environ, "TMPDIR": directory},
        )
    return float(done.stdout)


# The budgets for the runner's own Python (issue 51, item 6): half of the 2.5 ms
# of a warm cycle and about half of the 0.88 ms of a dispose measured before (see
# docs/benchmarks.md, "Background work in idle time").
CYCLE_BUDGET = 1.25e-3
DISPOSE_BUDGET = 0.45e-3


def runner_cpu(cycles: int, rounds: int) -> list[Result]:
    """``child.cycle.runner_cpu`` and ``terminate.runner_cpu``: the loop's own time in a
    warm cycle and in a dispose (started cold, as ``terminate.cooperative``), each
    round's median over its cycles, against the budgets; the floor's loop time in its
    dispose, measured in the same rounds, is in ``extra``."""
    warm: list[list[Cycle]] = []
    cold: list[list[Cycle]] = []
    floor: list[float] = []
    for round_ in range(rounds):
        # Neither always first: the three alternate as compare's rounds do.
        measures = [
            lambda: warm.append(_loop_times(cycles, cold=False)),
            lambda: cold.append(_loop_times(cycles, cold=True)),
            lambda: floor.append(raw(cycles, 2, _contained, instrumented=True)),
        ]
        for offset in range(len(measures)):
            measures[(round_ + offset) % len(measures)]()

    def medians(found: list[list[Cycle]], part: Callable[[Cycle], float]) -> list[float]:
        return [statistics.median(part(cycle) for cycle in round_) for round_ in found]

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1000, 4)

    return [
        Result(
            name="child.cycle.runner_cpu",
            unit="s/cycle",
            better="lower",
            target=1.0,
            ours=medians(warm, lambda cycle: cycle.loop),
            baseline=[CYCLE_BUDGET] * rounds,
            baseline_name=f"budget: {CYCLE_BUDGET * 1000:g} ms of the loop's own time a cycle",
            note="the event loop's time in task steps (a trio Instrument) during a warm "
            "child.cycle (defaults on), the standby's refill included: the runner's own "
            "Python, against half of the 2.5 ms it was (issue 51); cpu_ms is the steps' CPU "
            "time (not the time a process they woke held the core)",
            extra={
                "open_ms": ms(medians(warm, lambda cycle: cycle.loop_open)),
                "load_ms": ms(medians(warm, lambda cycle: cycle.loop_load)),
                "dispose_ms": ms(medians(warm, lambda cycle: cycle.loop_stop)),
                "cpu_ms": ms(medians(warm, lambda cycle: cycle.cpu)),
                "steps": statistics.median(
                    statistics.median(cycle.steps for cycle in round_) for round_ in warm
                ),
            },
        ),
        Result(
            name="terminate.runner_cpu",
            unit="s",
            better="lower",
            target=1.0,
            ours=medians(cold, lambda cycle: cycle.loop_stop),
            baseline=[DISPOSE_BUDGET] * rounds,
            baseline_name=f"budget: {DISPOSE_BUDGET * 1000:g} ms of the loop's own time a dispose",
            note="the event loop's time in task steps during terminate.cooperative's dispose "
            "(defaults on, started cold): the runner's own Python in a stop, against its "
            "budget (issue 51); floor_ms is the contained floor's, measured alike",
            extra={
                "floor_ms": ms(floor),
                "cpu_ms": ms(medians(cold, lambda cycle: cycle.cpu_stop)),
                "warm_dispose_ms": ms(medians(warm, lambda cycle: cycle.loop_stop)),
            },
        ),
    ]


def run(quick: bool, rounds: int) -> list[Result]:
    cycles = 3 if quick else 10
    # Deployed as a package is (pip compiles what it installs): an isolated child runs as
    # a uid that cannot write the plugins' bytecode cache, and would compile the plugin
    # from source on every load (1.3 ms a load here) until a row run as root wrote it.
    compileall.compile_dir(PLUGINS, quiet=1)
    # The runner service's defaults (issue 43): every child isolated (a uid of its own,
    # where the runner is root) and in a cgroup of its own with the default ceilings.
    warm = functools.partial(ours, fork_server=True, standby=True, preload=PRELOAD)
    # Every row's time is lower-is-better; a cycle's is a cycle's, a stop's a stop's.
    cycle = functools.partial(compare, unit="s/cycle", better="lower", rounds=rounds)
    stop = functools.partial(compare, unit="s", better="lower", rounds=rounds)
    against_spawn = functools.partial(
        cycle,
        baseline=lambda: raw(cycles, 0),
        baseline_name="raw Trio: spawn, ready line, SIGTERM, reap",
    )
    return [
        against_spawn(
            "child.cycle",
            ours=lambda: warm(cycles, 0, limits=CEILINGS),
            target=0.25,
            note="open+load+dispose of a minimal plugin as the runner service runs it, its "
            "defaults on (fork_server=True, standby=True: the next child is forked ahead; "
            "isolated; the default ceilings, a cgroup per child) with the plugin's one "
            "import preloaded (typing) vs a cold spawn of the same code, ready line, "
            "SIGTERM, reaped",
        ),
        cycle(
            "child.cycle.multiprocessing",
            ours=lambda: warm(cycles, 0, limits=CEILINGS),
            baseline=lambda: multiprocessing_cycle(cycles),
            baseline_name="multiprocessing, forkserver: start and join of a no-op target",
            target=0.2,
            note="child.cycle (defaults on: isolated, ceilings, every transition saved) vs "
            "Python's own multiprocessing with the forkserver start method, warmed, its "
            "target preloaded, starting and joining a process with a no-op target (no "
            "isolation, no cgroup, nothing recorded, no signal: the target returns)",
        ),
        cycle(
            "child.cycle.ceilings",
            ours=lambda: warm(cycles, 0, limits=CEILINGS),
            baseline=lambda: warm(cycles, 0),
            baseline_name="ours: child.cycle without ceilings",
            target=1.05,
            note="child.cycle (the runner service's default ceilings: memory_bytes 1 GiB, "
            "processes 4096, a cgroup per child) vs the same without them",
        ),
        against_spawn(
            "child.cycle.no_ceilings",
            ours=lambda: warm(cycles, 0),
            target=0.25,
            informational=True,
            note="as child.cycle without ceilings: no cgroup (isolated all the same)",
        ),
        against_spawn(
            "child.cycle.no_isolation",
            ours=lambda: warm(cycles, 0, isolation="none"),
            target=0.25,
            informational=True,
            note="as child.cycle.no_ceilings with isolation='none': the child runs as the "
            "runner's user (else a uid of its own, its private directory made and removed, "
            "the children's view entered)",
        ),
        against_spawn(
            "child.cycle.no_preload",
            ours=lambda: ours(cycles, 0, fork_server=True, standby=True, limits=CEILINGS),
            target=0.25,
            informational=True,
            note="as child.cycle with nothing preloaded: the plugin imports typing itself",
        ),
        against_spawn(
            "child.cycle.cold",
            ours=lambda: ours(cycles, 0, limits=CEILINGS),
            target=1.15,
            note="as child.cycle, with the default standby=False and fork_server=False: the "
            "interpreter starts during the load",
        ),
        cycle(
            "child.cycle.cold.ceilings",
            ours=lambda: ours(cycles, 0, limits=CEILINGS),
            baseline=lambda: ours(cycles, 0),
            baseline_name="ours: child.cycle.cold without ceilings",
            target=1.05,
            note="child.cycle.cold vs the same without ceilings",
        ),
        against_spawn(
            "child.cycle.cold.no_isolation",
            ours=lambda: ours(cycles, 0, isolation="none"),
            target=1.15,
            informational=True,
            note="as child.cycle.cold with isolation='none' and no ceilings",
        ),
        stop(
            "terminate.cooperative",
            ours=lambda: ours(cycles, 1, limits=CEILINGS),
            baseline=lambda: raw(cycles, 1, _contained),
            baseline_name="floor: section 5's stop in raw Trio, a contained child",
            target=1.25,
            note="dispose of a running child (defaults on, started cold) that exits on "
            "SIGTERM vs the same stop shaped as docs/design.md section 5 with no store, its "
            "child shaped as containment needs: it runs the plugin as its child, passes "
            "SIGTERM on, ends as it did (see the module docs)",
        ),
        stop(
            "terminate.cooperative.watched",
            ours=lambda: ours(cycles, 1, limits=CEILINGS),
            baseline=lambda: raw(cycles, 1, _watched),
            baseline_name="floor: section 5's stop in raw Trio, one child with a watchdog thread",
            target=1.25,
            informational=True,
            note="as terminate.cooperative, against the floor whose child is one process "
            "with a thread blocked on a read (the older floor)",
        ),
        stop(
            "terminate.cooperative.raw",
            ours=lambda: ours(cycles, 1, limits=CEILINGS),
            baseline=lambda: raw(cycles, 1),
            baseline_name="raw Trio: SIGTERM + wait",
            target=1.2,
            informational=True,
            note="the oldest baseline: no session, no watchdog, nothing saved",
        ),
        *runner_cpu(cycles, rounds),
    ]
