"""``python -m benchmarks [--quick] [--json PATH] [--only NAME ...] [--rounds N]``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .groups import GROUPS, ON_REQUEST
from .measure import Result, Skipped, Table, machine, render


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per scenario (>= 1)")
    parser.add_argument(
        "--only", nargs="+", choices=sorted(GROUPS), metavar="GROUP", help="run only these"
    )
    options = parser.parse_args(argv)
    if options.rounds < 1:
        parser.error("--rounds must be at least 1")
    results: list[Result] = []
    tables: list[Table] = []
    skipped: dict[str, str] = {}
    started = time.perf_counter()
    for name, run in GROUPS.items():
        # Without --only, every group but those run only when asked for (ON_REQUEST).
        asked = name in options.only if options.only else name not in ON_REQUEST
        if not asked:
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            for row in run(options.quick, options.rounds):
                if isinstance(row, Table):
                    tables.append(row)
                else:
                    results.append(row)
        except Skipped as skip:
            skipped[name] = str(skip)
            print(f"skipped {name}: {skip}", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started
    if results:
        print(render(results))
    for table in tables:
        print(f"\n{table.render()}")
    for name, reason in skipped.items():
        print(f"\nskipped {name}: {reason}")
    counted = [result for result in results if not result.informational]
    missed = [result.name for result in counted if not result.met]
    print(f"\n{len(counted) - len(missed)} of {len(counted)} targets met in {elapsed:.0f} s")
    if options.json is not None:
        document = {
            "machine": machine(),
            "quick": options.quick,
            "results": [result.as_json() for result in results],
            "tables": [table.as_json() for table in tables],
            "skipped": skipped,
        }
        options.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
