"""The defaults, once: every layer that has a default reads it here (as httpx's
``_config.py`` holds its timeouts and limits).

``open_supervisor`` (the engine), ``serve`` (the runner's flags) and ``PostgresStore``
(the fleet) all take these when nothing else is given; docs/service.md lists them.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CONFIRMATION",
    "GRACE",
    "LEASE",
    "RESTART_LIMIT",
    "RUNNER_LEASE",
    "STORE_WAIT",
    "takeover_margin",
]

LEASE: Final = 15.0  # seconds a session lives unrenewed
GRACE: Final = 5.0  # seconds a child has between its interrupt and its kill
CONFIRMATION: Final = 5.0  # seconds to see a killed child's exit
RUNNER_LEASE: Final = 10.0  # seconds a fleet's runner row stays valid unrenewed
STORE_WAIT: Final = 5.0  # seconds a store call reconnects and tries again before giving up
RESTART_LIMIT: Final = (5, 600.0)  # a runner heals itself this often in this many seconds


def takeover_margin(lease: float, stop_bound: float) -> float:
    """How long after a dead runner's row expired its session of ``lease`` may be taken
    over (docs/design.md, F7): the session's lease, then its runner's ``stop_bound``
    (grace, confirmation, and its children's switch slack). The database applies the
    same sum in ``stores/_postgres_sql`` (``TAKEOVER_DUE``)."""
    return lease + stop_bound
