"""What the tests share, by concern: a test module imports it from here (the tests that
run real children also from tests/adapters/children.py), never from another test module.

* :mod:`.waits`: bounded waits (:func:`~.waits.until`, :func:`~.waits.settled`) and BOUND;
* :mod:`.processes`: processes through /proc, the one way a test starts a process and
  waits for its readiness handshake (:func:`~.processes.launched`), what tells this run's
  leftovers from other runs' (the leak guards', conftest.py), another pytest run;
* :mod:`.plugins`: where the plugins are (PLUGINS, ISOLATION, LIMITS) and what they report;
* :mod:`.sessions`: the rules' supervisor (KEY, OTHER, :func:`~.sessions.supervise`,
  embedded or over the wire) and what opens and ends its sessions;
* :mod:`.service`: a supervisor served in the test's own Trio run, its clients and tokens;
* :mod:`.runners`: ``trio-supervisor serve`` processes (:func:`~.runners.serving`);
* :mod:`.members`: such processes as the runners of a fleet (:func:`~.members.member`),
  their timings, tokens and hosts;
* :mod:`.clusters`: PostgreSQL clusters and PgBouncers of a test's own, to restart, stop
  and fail over;
* :mod:`.postgres`: the PostgreSQL server, the ``database`` fixture, schemas of a test's own;
* :mod:`.tcp_proxy`: a proxy that pauses and cuts a runner's connections.

Here only ROOT, the project's directory, which they all start from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).parents[2]
