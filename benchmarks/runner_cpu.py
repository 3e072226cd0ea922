"""The runner's own Python: the event loop's time in task steps (issue 51, item 6).

A :class:`LoopTime` is a ``trio.abc.Instrument`` that times each task step (from
``before_task_step`` to ``after_task_step``) and sums them: the time the event loop
spends running the runner's Python (the supervisor's tasks, the execution's, and the
few microseconds of the benchmark's own loop), as opposed to waiting for the child, the
kernel or the scheduler. Read before and after a step of a cycle, it says what that
step cost the loop, whatever ran in it (the next standby's refill, say, runs during a
warm cycle's dispose).

``child.cycle.runner_cpu`` and ``terminate.runner_cpu`` (``benchmarks/child.py``) are
this time per warm cycle and per dispose against the issue's budgets. Run as a module
it prints where the time goes, by task and by the cycle's steps, and can profile them::

    python -m benchmarks.runner_cpu [--cycles N] [--cold] [--profile FILE]

``--profile`` writes ``cProfile``'s statistics of the measured cycles (the whole run's
thread: the loop's own Python; the profiler slows every call, so read it for counts and
shares, not for times).
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import sys
from collections.abc import Sequence

from .measure import LoopTime

__all__ = ["LoopTime"]  # measure.py's, named here as well


def _report(cycles: int, *, cold: bool, profile: str | None) -> None:
    """Run ``cycles`` cycles as ``child.cycle`` (or ``terminate.cooperative``, cold) does,
    instrumented, and print the loop's time by step and by task."""
    from .child import measured_cycles

    loop = LoopTime(by_task=True)
    profiler = cProfile.Profile() if profile else None
    found = measured_cycles(cycles, cold=cold, loop=loop, profiler=profiler)
    if profiler is not None and profile is not None:
        profiler.dump_stats(profile)
    ms = 1000.0

    def median(values: Sequence[float]) -> str:
        return f"{statistics.median(values) * ms:.3f} ms"

    print(f"{cycles} {'cold' if cold else 'warm'} cycles, medians:")
    print(f"  whole cycle (wall)      {median([cycle.whole for cycle in found])}")
    print(f"  dispose (wall)          {median([cycle.stop for cycle in found])}")
    print(f"  loop, open              {median([cycle.loop_open for cycle in found])}")
    print(f"  loop, load              {median([cycle.loop_load for cycle in found])}")
    print(f"  loop, dispose           {median([cycle.loop_stop for cycle in found])}")
    print(f"  loop, cycle             {median([cycle.loop for cycle in found])}")
    print(f"  task steps a cycle      {statistics.median(cycle.steps for cycle in found):.0f}")
    assert loop.tasks is not None
    total = sum(spent for spent, _, _ in loop.tasks.values())
    print(f"  the steps' CPU time, all cycles   {loop.cpu / loop.busy:.0%} of their time")
    print("loop time by task (all cycles, warm-up included, per measured cycle):")
    for name, (spent, cpu, steps) in sorted(loop.tasks.items(), key=lambda item: -item[1][0]):
        print(
            f"  {spent / cycles * ms:7.3f} ms (CPU {cpu / cycles * ms:6.3f}) "
            f"{steps / cycles:5.1f} steps {spent / total:6.1%}  {name}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.runner_cpu", description=__doc__)
    parser.add_argument("--cycles", type=int, default=100, help="cycles measured")
    parser.add_argument("--cold", action="store_true", help="no standby, no fork server")
    parser.add_argument("--profile", metavar="FILE", help="write cProfile's statistics here")
    options = parser.parse_args(argv)
    _report(options.cycles, cold=options.cold, profile=options.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
