"""The order a mutmut run takes a mutant's tests in, and how long each may take
(pyproject.toml's ``[tool.mutmut-adapters]`` loads this plugin with ``-p``).

mutmut hands pytest a mutant's tests as a set, in no order: modules interleave, and a
module's PostgreSQL database (``support/postgres.py``, one per module: a kept one in
this run) is taken and emptied again each time its tests resume. Here they run module
by module, each module's fastest tests first: the run stops at the first failure
(``-x``), which the fastest tests reach soonest. And each test may take ``PER_TEST`` seconds plus
``SLOWER`` times its duration (pytest-timeout's marker): a mutant that deadlocks a
test of a tenth of a second is ended after 10 s, while the 9 s tests of a network that
stops answering keep the time they need (one bound for all, PYTEST_TIMEOUT, would
either hold a worker that long for every deadlock or fail those tests as if a mutant
had). The durations are those mutmut's stats run measured, in ``mutmut-stats.json``
of the directory the tests run in; without it (the stats run itself, or a run that is
not mutmut's) nothing changes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Final

import pytest

__all__ = ["pytest_collection_modifyitems"]

STATS: Final = Path("mutmut-stats.json")
PER_TEST: Final = 10.0  # seconds: a database made, a schema migrated, on a busy machine
SLOWER: Final = 5.0  # times a test's duration in the stats run


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Sort ``items`` (modules by their fastest test, then each module's by duration),
    and give each measured test its timeout."""
    try:
        durations: dict[str, float] = json.loads(STATS.read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return

    def duration(item: pytest.Item) -> float:
        return durations.get(item.nodeid, math.inf)

    def module(item: pytest.Item) -> str:
        return item.nodeid.partition("::")[0]

    fastest: dict[str, float] = {}
    for item in items:
        fastest[module(item)] = min(fastest.get(module(item), math.inf), duration(item))
        if item.nodeid in durations:
            item.add_marker(pytest.mark.timeout(PER_TEST + SLOWER * duration(item)))
    items.sort(key=lambda item: (fastest[module(item)], module(item), duration(item)))
