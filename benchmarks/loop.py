"""loop.lag: how long the runner's Trio loop stalls while many sessions start at once.

A ticker task sleeps 5 ms at a time in the same Trio loop as the supervisor and records
how late each wake-up is. Meanwhile 150 clients each call open and then load (the
minimal plugin, ``benchmarks/plugins/minimal.py``) at once, on ``SubprocessExecution``
with ``standby=True, fork_server=True`` (as the runner service runs) and a
``SqliteStore``. The window measured runs from the first call to the last load
returning; the sessions are disposed after it, unmeasured.

The targets are absolute (the loop must keep answering), so the baseline is the budget:
25 ms for the worst lateness (``loop.lag``) and 10 ms for its 99th percentile
(``loop.lag.p99``); the ratio is the lateness over the budget, target <= 1.0. ``extra``
says in which phase the worst stall started (``open``: some open is still pending;
``load``: every open returned, some load is pending) and the same ticker's lateness
measured on an idle loop in the same run (``idle_max_ms``).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from trio_supervisor import Handle, Key, Load, SqliteStore, SubprocessExecution, open_supervisor

from .measure import Result

PLUGINS = Path(__file__).parent / "plugins"
TICK = 0.005
MAX_BUDGET_MS = 25.0
P99_BUDGET_MS = 10.0


class Ticker:
    """Sleeps ``TICK`` at a time; records each wake-up's lateness and the phase then."""

    def __init__(self) -> None:
        self.phase = "open"  # the window's first phase (see run)
        self.lateness: list[tuple[float, str]] = []  # (ms, phase when it went to sleep)
        self.active = False

    async def run(self) -> None:
        while True:
            # A tick asleep as the window began counts for its first phase: the burst
            # of opens started while it slept.
            phase = self.phase if self.active else "open"
            asked = time.perf_counter()
            await trio.sleep(TICK)
            late = (time.perf_counter() - asked - TICK) * 1000
            if self.active:
                self.lateness.append((max(late, 0.0), phase))


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def measure(sessions: int, fork_server: bool = True) -> dict[str, Any]:
    """One round: the ticker's lateness while ``sessions`` open+load calls run at once."""

    async def main(directory: Path) -> dict[str, Any]:
        ticker = Ticker()
        pending = {"open": sessions, "load": sessions}
        handles: list[Handle] = []

        async def start(number: int) -> None:
            key = Key(identity="lag", instance=str(number))
            record = await supervisor.open(key, f"lag-{number}")
            pending["open"] -= 1
            if not pending["open"]:
                ticker.phase = "load"
            await supervisor.load(record.handle, Load(specifier="minimal:main"))
            pending["load"] -= 1
            handles.append(record.handle)

        async with (
            SqliteStore(directory / "runner.db") as store,
            SubprocessExecution(
                directory, entry_paths=[PLUGINS], standby=True, fork_server=fork_server
            ) as execution,
            open_supervisor(store, execution, lease=60.0, grace=5.0) as supervisor,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(ticker.run)
            with trio.fail_after(30):  # the standby has been started (forked, or cold)
                while execution._standby.ready is None:  # noqa: ASYNC110  # no event
                    await trio.sleep(0.01)
            await trio.sleep(0.2)  # the ticker is running, the start-up is over
            ticker.phase = "open"
            ticker.active = True
            started = time.perf_counter()
            async with trio.open_nursery() as starting:
                for number in range(sessions):
                    starting.start_soon(start, number)
            elapsed = time.perf_counter() - started
            ticker.active = False
            async with trio.open_nursery() as stopping:
                for handle in handles:
                    stopping.start_soon(supervisor.dispose, handle)
            nursery.cancel_scope.cancel()
        values = [late for late, _ in ticker.lateness]
        worst, phase = max(ticker.lateness)
        by_phase = {
            name: max((late for late, where in ticker.lateness if where == name), default=0.0)
            for name in ("open", "load")
        }
        return {
            "max": worst,
            "p99": _p99(values),
            "worst_phase": phase,
            "open_max": by_phase["open"],
            "load_max": by_phase["load"],
            "ticks": len(values),
            "window_s": elapsed,
        }

    with tempfile.TemporaryDirectory() as directory:
        return trio.run(main, Path(directory))


def idle_max(duration: float) -> float:
    """The same ticker's worst lateness on an otherwise idle Trio loop, in ms."""

    async def main() -> float:
        ticker = Ticker()
        ticker.active = True
        with trio.move_on_after(duration):
            await ticker.run()
        return max(late for late, _ in ticker.lateness)

    return trio.run(main)


def run(quick: bool, rounds: int) -> list[Result]:
    sessions = 10 if quick else 150
    measured = [measure(sessions) for _ in range(rounds)]
    idle = [idle_max(0.2 if quick else 1.0) for _ in range(rounds)]
    phases = [round_["worst_phase"] for round_ in measured]
    extra: dict[str, Any] = {
        "worst_phase": max(set(phases), key=phases.count),
        "worst_phase_per_round": ",".join(phases),
        "open_phase_max_ms": statistics.median(round_["open_max"] for round_ in measured),
        "load_phase_max_ms": statistics.median(round_["load_max"] for round_ in measured),
        "window_s": statistics.median(round_["window_s"] for round_ in measured),
        "idle_max_ms": statistics.median(idle),
    }
    note = (
        f"{TICK * 1000:g} ms ticker while {sessions} open+load calls start at once "
        "(SubprocessExecution standby=True, fork_server=True, SqliteStore, minimal plugin)"
    )
    return [
        Result(
            name="loop.lag",
            unit="ms",
            better="lower",
            target=1.0,
            ours=[round_["max"] for round_ in measured],
            baseline=[MAX_BUDGET_MS] * rounds,
            baseline_name=f"budget: max lateness {MAX_BUDGET_MS:g} ms",
            note=note,
            extra=extra,
        ),
        Result(
            name="loop.lag.p99",
            unit="ms",
            better="lower",
            target=1.0,
            ours=[round_["p99"] for round_ in measured],
            baseline=[P99_BUDGET_MS] * rounds,
            baseline_name=f"budget: p99 lateness {P99_BUDGET_MS:g} ms",
            note=note,
        ),
    ]
