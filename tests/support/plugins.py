"""Where the tests' plugins are, and what the example plugins report."""

from __future__ import annotations

import json
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
