"""Where the tests' plugins are, and what the example plugins report."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Final

from . import ROOT

# The example plugins (entry path): heartbeat, inspector, ...
PLUGINS: Final = ROOT / "examples" / "plugins"
# The isolation tests' plugins (entry path): attacks on the runner and on other children.
ISOLATION: Final = ROOT / "tests" / "adapters" / "plugins_isolation"
# The tree limits tests' plugins (entry path): hogs of memory, processes and CPU.
LIMITS: Final = ROOT / "tests" / "adapters" / "plugins_limits"


def report_in(log: str) -> dict[str, Any]:
    """The JSON report the ``inspector`` example plugin printed into its log."""
    report: dict[str, Any] = json.loads(log.split("REPORT ", 1)[1].splitlines()[0])
    return report


# Where each isolated child gets a fresh tmpfs of its own (executions/limits/_view.py).
PRIVATE_TMP: Final = ("/tmp", "/var/tmp")


def without_the_way_down(outcomes: dict[str, str], state: Path, uid: int | None) -> dict[str, str]:
    """The isolation attacks' ``outcomes`` less the listings a state directory below /tmp
    shows: there it lies in the fresh tmpfs each child gets, and the child's own directory
    is mounted back in it, so the path down to that directory is all a child can list (the
    state directory shows ``children``, which shows the child's own uid), which is no
    leak. Elsewhere the outcomes are as they are."""
    real = os.path.realpath(state)
    if not any(real.startswith(os.path.realpath(tmp) + "/") for tmp in PRIVATE_TMP):
        return outcomes
    way_down = {"SUCCEEDED ['children']", f"SUCCEEDED ['{uid}']"}
    return {
        name: said
        for name, said in outcomes.items()
        if not (name.startswith("list ") and said.strip() in way_down)
    }
