"""Rounds, medians and ratios: how every scenario is measured and reported.

Each scenario measures ours and its baseline alternately in this one process (ours first
on even rounds, the baseline first on odd ones, so neither always runs on a warm or a
cold machine), at least five rounds, and reports medians with their ranges. ``ratio`` is
always ours / baseline in the scenario's unit; ``better`` says which way is good. Every
row names its baseline (``baseline_name``); an ``informational`` row is shown and kept in
the JSON but not counted among the targets. A group that cannot run here (its server is
unreachable) raises :class:`Skipped`, and the suite reports it and goes on.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import attrs
import trio

Better = Literal["higher", "lower"]


class Skipped(Exception):
    """A group cannot run on this machine; the message says why and what to set."""


@attrs.frozen(kw_only=True)
class Result:
    name: str
    unit: str
    better: Better
    target: float
    ours: list[float]
    baseline: list[float]
    baseline_name: str
    note: str = ""
    informational: bool = False
    extra: dict[str, Any] = attrs.Factory(dict)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ours) / statistics.median(self.baseline)

    @property
    def met(self) -> bool:
        return self.ratio >= self.target if self.better == "higher" else self.ratio <= self.target

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ours": statistics.median(self.ours),
            "baseline": statistics.median(self.baseline),
            "baseline_name": self.baseline_name,
            "ratio": self.ratio,
            "unit": self.unit,
            "better": self.better,
            "target": self.target,
            "met": self.met,
            "informational": self.informational,
            "ours_range": [min(self.ours), max(self.ours)],
            "baseline_range": [min(self.baseline), max(self.baseline)],
            "rounds": len(self.ours),
            "note": self.note,
            **({"extra": self.extra} if self.extra else {}),
        }


@attrs.frozen(kw_only=True)
class Table:
    """Figures that are no ratio (a cost counted, say): shown after the scenarios, and
    kept in the JSON under ``tables``."""

    name: str
    note: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "note": self.note,
            "rows": [dict(zip(self.columns, row, strict=True)) for row in self.rows],
        }

    def render(self) -> str:
        return f"{self.name}: {self.note}\n" + "\n".join(grid([list(self.columns), *self.rows]))


def compare(
    name: str,
    *,
    ours: Callable[[], float],
    baseline: Callable[[], float],
    baseline_name: str,
    unit: str,
    better: Better,
    target: float,
    rounds: int,
    note: str = "",
    informational: bool = False,
) -> Result:
    """Measure ``ours`` and ``baseline`` alternately for ``rounds`` rounds."""
    mine, theirs = interleaved(ours, baseline, rounds)
    return Result(
        name=name,
        unit=unit,
        better=better,
        target=target,
        ours=mine,
        baseline=theirs,
        baseline_name=baseline_name,
        note=note,
        informational=informational,
    )


def interleaved(
    first: Callable[[], float], second: Callable[[], float], rounds: int
) -> tuple[list[float], list[float]]:
    """Measure two things alternately, each going first on every other round."""
    firsts: list[float] = []
    seconds: list[float] = []
    for round_ in range(rounds):
        if round_ % 2 == 0:
            firsts.append(first())
            seconds.append(second())
        else:
            seconds.append(second())
            firsts.append(first())
    return firsts, seconds


async def interleaved_async(
    first: Callable[[], Awaitable[float]], second: Callable[[], Awaitable[float]], rounds: int
) -> tuple[list[float], list[float]]:
    """:func:`interleaved` inside one Trio run, for scenarios whose setup outlives a round."""
    firsts, seconds = await rotated_async([first, second], rounds)
    return firsts, seconds


async def rotated_async(
    measures: Sequence[Callable[[], Awaitable[float]]], rounds: int
) -> list[list[float]]:
    """Measure several things in turn each round, round ``r`` starting with the ``r``-th
    (modulo their number), so that none always runs first or last; their measurements."""
    found: list[list[float]] = [[] for _ in measures]
    for round_ in range(rounds):
        for offset in range(len(measures)):
            index = (round_ + offset) % len(measures)
            found[index].append(await measures[index]())
    return found


def machine() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def render(results: list[Result]) -> str:
    rows = [["scenario", "ours", "baseline", "unit", "ratio", "target", "met", "baseline is"]]
    for result in results:
        sign = ">=" if result.better == "higher" else "<="
        rows.append(
            [
                result.name,
                _spread(result.ours),
                _spread(result.baseline),
                result.unit,
                f"{result.ratio:.3f}",
                f"{sign} {result.target}",
                ("yes" if result.met else "NO") + (" (info)" if result.informational else ""),
                result.baseline_name,
            ]
        )
    lines = grid(rows)
    for result in results:
        if result.extra:
            details = ", ".join(
                f"{name}={value:.4g}" if isinstance(value, float | int) else f"{name}={value}"
                for name, value in result.extra.items()
            )
            lines.append(f"{result.name}: {details}")
    return "\n".join(lines)


def grid(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as aligned lines, the first a heading underlined."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return lines


def _spread(values: list[float]) -> str:
    """The median and the range of some measurements."""
    return f"{statistics.median(values):,.4g} [{min(values):,.4g}-{max(values):,.4g}]"


class LoopTime(trio.abc.Instrument):
    """The sum of the run's task steps, in seconds; and by task, if asked.

    Args:
        by_task: Also keep each task's steps and time, by the qualified name of its
            coroutine (``Session._run``, ``Standby.run``), and the steps' CPU time.
        cpu: Also sum the steps' CPU time (the thread's: without the time the thread
            was preempted in a step, by a process the step woke, say). That costs two
            system calls more a step.
    """

    def __init__(self, *, by_task: bool = False, cpu: bool = False) -> None:
        self.busy = 0.0
        self.steps = 0
        self.cpu = 0.0
        # Each task's time, CPU time and steps, by its coroutine's qualified name.
        self.tasks: dict[str, list[float]] | None = {} if by_task else None
        self._cpu = cpu or by_task
        self._began = 0.0
        self._began_cpu = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._cpu:
            self._began_cpu = time.thread_time()
        self._began = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        spent = time.perf_counter() - self._began
        self.busy += spent
        self.steps += 1
        cpu = time.thread_time() - self._began_cpu if self._cpu else 0.0
        self.cpu += cpu
        if self.tasks is not None:
            code = getattr(task.coro, "cr_code", None)
            name = code.co_qualname if code is not None else task.name
            found = self.tasks.setdefault(name, [0.0, 0.0, 0.0])
            found[0] += spent
            found[1] += cpu
            found[2] += 1

    def mark(self) -> tuple[float, int, float]:
        """The time, the steps and the CPU time so far, to subtract from a later mark."""
        return self.busy, self.steps, self.cpu
