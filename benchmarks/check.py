"""``python -m benchmarks.check [--record RUNS]``: the regression guard (``nox -s
bench-check``), in two minutes at most.

It runs a fast subset of the benchmarks (``GROUPS`` at their ``--quick`` sizes, ``ROUNDS``
rounds each) and compares each counted row's ratio with its reference in
docs/benchmarks.md: the JSON block under the line ``MARK``, the one place the figures
live. A row whose ratio is worse than its reference by more than its noise band (in the
direction that is bad for its unit) is flagged; the groups of the rows flagged then run
once more, and a row whose better ratio of the two is still beyond its band is a drop:
the command exits 1. It prints a table either way. The quick sizes give ratios of their
own, not the full suite's: the references are this check's, measured by it.

``--record RUNS`` measures the references instead: the subset ``RUNS`` times on the same
commit, each row's median ratio as its reference and ``MARGIN`` times the largest
relative distance of a run from that median, either way, as its band (at least
``LEAST_BAND``), and writes them into the block with the runs' ratios, the date and
the machine's load average as it began (other work shares the cores: a band measured
under load is wider).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple

from .groups import GROUPS as ALL_GROUPS
from .measure import Result, Skipped, Table, grid

GROUPS: Final = ("control", "memory", "durable", "fleet", "service", "child")
ROUNDS: Final = 11
LEAST_BAND: Final = 0.05
# A band is this many times the spread the recording saw: a sound run lands beyond the
# largest distance of n runs from their median about once in (n + 1) / 2 per row, so with
# a dozen rows nearly every run would flag one (a band of the spread itself, from eight
# runs, flagged a sound run's control.concurrent at -11% against 10%).
MARGIN: Final = 1.5
# The load average under which the machine counts as quiet: the bands are measured there.
QUIET: Final = 1.0
DOC: Final = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
MARK: Final = "<!-- bench-check: the references of python -m benchmarks.check -->"


def measure(rounds: int = ROUNDS, groups: Sequence[str] = GROUPS) -> dict[str, Measured]:
    """The counted rows of ``groups``, by name, each with its group (a group whose
    server is absent is left out)."""
    found: dict[str, Measured] = {}
    for group in groups:
        print(f"running {group} ...", file=sys.stderr, flush=True)
        try:
            rows = ALL_GROUPS[group](True, rounds)
        except Skipped as skip:
            print(f"skipped {group}: {skip}", file=sys.stderr, flush=True)
            continue
        for row in rows:
            if not isinstance(row, Table) and not row.informational:
                found[row.name] = Measured(group, row)
    return found


class Measured(NamedTuple):
    """A row of the subset, and the group that measured it."""

    group: str
    result: Result


def read_block(text: str) -> dict[str, Any]:
    """The JSON block under ``MARK`` in ``text``."""
    _, found, after = text.partition(MARK)
    if not found:
        raise SystemExit(f"{DOC}: no line {MARK!r}; run with --record first")
    opening, _, rest = after.lstrip("\n").partition("\n")
    body, closed, _ = rest.partition("\n```")
    if opening.strip() != "```json" or not closed:
        raise SystemExit(f"{DOC}: the line {MARK!r} is not followed by a ```json block")
    block: dict[str, Any] = json.loads(body)
    return block


def write_block(text: str, block: dict[str, Any]) -> str:
    """``text`` with the JSON block under ``MARK`` replaced by ``block``."""
    before, found, after = text.partition(MARK)
    if not found:
        raise SystemExit(f"{DOC}: no line {MARK!r} to write the references under")
    rest = after.lstrip("\n").partition("\n")[2].partition("\n```")[2]
    return f"{before}{MARK}\n```json\n{dumped(block)}\n```{rest}"


def dumped(block: dict[str, Any]) -> str:
    """``block`` as JSON, a line per field and per row."""
    rows = ",\n".join(
        f"  {json.dumps(name)}: {json.dumps(figures)}" for name, figures in block["rows"].items()
    )
    fields = [f" {json.dumps(name)}: {json.dumps(value)}" for name, value in block.items()]
    fields[list(block).index("rows")] = f' "rows": {{\n{rows}\n }}'
    return "{\n" + ",\n".join(fields) + "\n}"


def worse_by(result: Result, reference: float) -> float:
    """How much worse ``result``'s ratio is than ``reference``, relatively (<= 0: not)."""
    if result.better == "higher":
        return 1 - result.ratio / reference
    return result.ratio / reference - 1


def judge(results: dict[str, Result], block: dict[str, Any]) -> tuple[list[list[str]], list[str]]:
    """The table's rows, and the rows flagged."""
    rows = [["scenario", "ratio", "reference", "band", "worse by", "verdict"]]
    flagged: list[str] = []
    for name, figures in block["rows"].items():
        result = results.get(name)
        if result is None:
            rows.append([name, "-", f"{figures['ratio']:.3f}", "", "", "not measured"])
            continue
        worse = worse_by(result, figures["ratio"])
        drop = worse > figures["band"]
        if drop:
            flagged.append(name)
        rows.append(
            [
                name,
                f"{result.ratio:.3f}",
                f"{figures['ratio']:.3f}",
                f"{figures['band']:.0%}",
                f"{worse:+.0%}",
                "DROP" if drop else "ok",
            ]
        )
    # Rows of the subset that have no reference yet (added since the last --record):
    # shown, not judged, until the references are measured again.
    for name, result in results.items():
        if name not in block["rows"]:
            rows.append([name, f"{result.ratio:.3f}", "-", "", "", "no reference"])
    return rows, flagged


def record(runs: int, rounds: int) -> dict[str, Any]:
    """The references and bands of ``runs`` runs of the subset (see the module docs)."""
    load = os.getloadavg()
    ratios: dict[str, list[float]] = {}
    better: dict[str, str] = {}
    seconds: list[float] = []
    for run in range(runs):
        print(f"run {run + 1} of {runs}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        for name, (_, result) in measure(rounds).items():
            ratios.setdefault(name, []).append(result.ratio)
            better[name] = result.better
        seconds.append(time.perf_counter() - started)
    rows = {
        name: reference(better[name], [round(ratio, 4) for ratio in found])
        for name, found in ratios.items()
    }
    return {
        "measured": datetime.date.today().isoformat(),
        "command": f"python -m benchmarks.check --record {runs} --rounds {rounds}",
        "load_average_at_start": [round(figure, 2) for figure in load],
        "seconds_per_run": [round(second) for second in seconds],
        "rounds": rounds,
        "rows": rows,
    }


def reference(better: str, runs: list[float]) -> dict[str, Any]:
    """A row's reference from its ratios over the recording's runs: their median, their
    spread (the largest relative distance of one from the median, either way: with a
    few runs, how far one lands above it is evidence of how far a sound commit may land
    below), and its band, ``MARGIN`` times the spread."""
    middle = statistics.median(runs)
    spread = max(abs(ratio / middle - 1) for ratio in runs)
    return {
        "ratio": round(middle, 4),
        "band": max(LEAST_BAND, math.ceil(MARGIN * spread * 100) / 100),
        "spread": math.ceil(spread * 100) / 100,
        "better": better,
        "runs": runs,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.check", description=__doc__)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds per scenario")
    parser.add_argument(
        "--record", type=int, metavar="RUNS", help="measure the references and bands instead"
    )
    options = parser.parse_args(argv)
    text = DOC.read_text()
    if options.record:
        DOC.write_text(write_block(text, record(options.record, options.rounds)))
        print(f"wrote the references of {options.record} runs into {DOC}")
        return 0
    block = read_block(text)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    measured = measure(options.rounds)
    results = {name: result for name, (_, result) in measured.items()}
    rows, flagged = judge(results, block)
    if flagged:
        # A drop must show twice: the groups of the rows flagged run once more, and each
        # such row keeps the better of its two ratios.
        again = sorted({measured[name].group for name in flagged})
        print(
            f"flagged {', '.join(flagged)}: running {', '.join(again)} once more", file=sys.stderr
        )
        for name, (_, result) in measure(options.rounds, again).items():
            if name in flagged:
                mark = block["rows"][name]["ratio"]
                if worse_by(result, mark) < worse_by(results[name], mark):
                    results[name] = result
        rows, flagged = judge(results, block)
    print("\n".join(grid(rows)))
    print(
        f"\n{len(flagged)} of {len(block['rows'])} rows dropped beyond their band in "
        f"{time.perf_counter() - started:.0f} s (references of {block['measured']}, "
        "docs/benchmarks.md)"
    )
    if flagged and load > QUIET:
        print(
            f"the load average was {load:.2f} as the check began (the references were "
            f"measured at {block['load_average_at_start'][0]:.2f}): other work on the cores "
            "may be the drop; run it again when the machine is quiet"
        )
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
