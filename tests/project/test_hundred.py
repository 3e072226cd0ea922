"""The hundred-runner benchmark (benchmarks/hundred.py, issue 51) runs end to end at its
quick size: the short pass of ``nox -s bench-hundred`` that the suite makes.

A smoke test, as test_benchmarks.py's: it checks what the benchmark reports and that
the fleet it drove made no error, never a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..support import ROOT


def test_the_quick_hundred_drives_a_fleet_without_an_error(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "hundred", "--quick", "--json", str(out)],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    document = json.loads(out.read_text())
    if "hundred" in document["skipped"]:
        # No server binaries here: skipped, and said so, unless this is CI.
        assert not os.environ.get("CI"), document["skipped"]["hundred"]
        return
    tables = {table["name"]: table for table in document["tables"]}
    assert set(tables) >= {"hundred", "hundred.latency", "hundred.session", "hundred.goals"}
    (upkeep, churn, *baselines) = tables["hundred"]["rows"]
    assert upkeep["window"].startswith("upkeep")
    assert churn["window"].startswith("churn")
    # The runners renewed their rows while idle, and sessions came and went meanwhile.
    assert float(upkeep["statements/s"].replace(",", "")) > 0
    opened = float(churn["sessions/s opened+loaded (disposed)"].split()[0].replace(",", ""))
    assert opened > 0
    assert [row["window"].split(":")[0] for row in baselines] == [
        "pgbench TPC-B-like -c 8 -j 2",
        "pgbench TPC-B-like -c 100 -j 2",
    ]
    # Every operation a runner makes was timed, and nothing failed.
    operations = {row["operation"] for row in tables["hundred.latency"]["rows"]}
    assert {"open", "load", "dispose"} <= operations
    assert "ERRORS" not in tables["hundred"].get("note", "")
    assert "ERRORS" not in completed.stdout
    goals = {row["goal"].split(" ")[0] for row in tables["hundred.goals"]["rows"]}
    assert goals >= {"write", "server"}
