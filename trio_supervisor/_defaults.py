"""The defaults, once: every layer that has a default reads it here (as httpx's
``_config.py`` holds its timeouts and limits).

``open_supervisor`` (the engine), ``serve`` (the runner's flags) and ``PostgresStore``
(the fleet) all take these when nothing else is given; docs/service.md lists them.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CGROUP_POOL",
    "CHILDREN_PER_CORE",
    "CHILD_MEMORY",
    "CHILD_PROCESSES",
    "CLIENT_CONNECT_FOR",
    "CLIENT_CONNECT_TIMEOUT",
    "CLIENT_FIRST_BACKOFF",
    "CLIENT_MAX_BACKOFF",
    "CLIENT_MAX_HOLDERS",
    "CLIENT_REQUEST_TIMEOUT",
    "CLIENT_RETRY_AFTER",
    "CLIENT_RETRY_FOR",
    "CLOSING_RETRY_AFTER",
    "COMMIT_WINDOW",
    "CONFIRMATION",
    "CONFLICT_TRIES",
    "DASHBOARD_CODE_FOR",
    "DASHBOARD_MOST_CODES",
    "DASHBOARD_SESSION_FOR",
    "DRAINING_RETRY_AFTER",
    "DRAIN_DEADLINE",
    "EVENT_BUFFER",
    "FLEET_CHECK",
    "FLEET_SCHEMA",
    "FULL_RETRY_AFTER",
    "GRACE",
    "HEAL_FIRST_BACKOFF",
    "HEAL_LAST_BACKOFF",
    "HEAL_SAY_EVERY",
    "INFLIGHT_RETRY_AFTER",
    "KEEPALIVE_COUNT",
    "KEEPALIVE_IDLE",
    "KEEPALIVE_INTERVAL",
    "LEASE",
    "LISTEN",
    "LISTENER_POLL",
    "LISTENER_RETRY",
    "LOG_BATCH",
    "LOG_LINGER",
    "MOST_BODY",
    "MOST_COMMIT_WINDOW",
    "MOST_PAGE",
    "OLDER_KEPT",
    "OLDER_POLL",
    "OPERATOR_CONNECT_FOR",
    "PAGE",
    "REMEMBERED",
    "REOPEN_PAUSE",
    "RESERVE_MEMORY",
    "RESTART_LIMIT",
    "RUNNER_LEASE",
    "SERVER_GRACEFUL",
    "SQLITE_LOCK_WAIT",
    "STATE",
    "STOPPED_FOR",
    "STOPPED_PER_KEY",
    "STOPPED_TOTAL",
    "STORE_CONNECT_TIMEOUT",
    "STORE_FIRST_PAUSE",
    "STORE_LAST_PAUSE",
    "STORE_STATEMENT_TIMEOUT",
    "STORE_WAIT",
    "TAKEOVER_TRIES",
    "TENANTS_FILE",
    "THROTTLED_HOLD",
    "TIMES_POLL",
    "TIMES_WAIT",
    "WATCH_BUFFER",
    "takeover_margin",
]

LEASE: Final = 15.0  # seconds a session lives unrenewed
GRACE: Final = 5.0  # seconds a child has between its interrupt and its kill
CONFIRMATION: Final = 5.0  # seconds to see a killed child's exit
RUNNER_LEASE: Final = 10.0  # seconds a fleet's runner row stays valid unrenewed
STORE_WAIT: Final = 5.0  # seconds a store call reconnects and tries again before giving up
RESTART_LIMIT: Final = (5, 600.0)  # a runner heals itself this often in this many seconds
WATCH_BUFFER: Final = 1024  # records a watcher may fall behind by before it overflows


def takeover_margin(lease: float, stop_bound: float) -> float:
    """How long after a dead runner's row expired its session of ``lease`` may be taken
    over (docs/design.md, F7): the session's lease, then its runner's ``stop_bound``
    (grace, confirmation, and its children's switch slack). The database applies the
    same sum in ``stores/_postgres_sql`` (``TAKEOVER_DUE``)."""
    return lease + stop_bound


# -- the command line (cli/): where a runner listens and keeps its state ---------------
# ``serve`` listens and keeps its state here unless told otherwise, and the operator
# commands look for it here, so that on the runner's machine neither needs a flag.

LISTEN: Final = "127.0.0.1:8470"  # HOST:PORT a runner listens on (the commands' --url)
STATE: Final = "runner-state"  # the state directory, relative to where serve runs
TENANTS_FILE: Final = "tenants.toml"  # the tenants file the commands edit, in STATE
OPERATOR_CONNECT_FOR: Final = 2.0  # seconds an operator command tries a refusing runner


# -- the service (service/): what a runner gives its children, and how long it drains --
# ``serve``'s capacity and out-of-the-box ceilings (docs/service.md section D), the
# deadline of a drain that names none, and how long a dashboard's sign-in code and the
# sign-in it makes last (section B).

_GIB: Final = 1 << 30
RESERVE_MEMORY: Final = _GIB  # bytes of the machine's memory kept from the children
CHILDREN_PER_CORE: Final = 64  # children at once per core, unless --max-children says
CHILD_MEMORY: Final = _GIB  # every child's memory ceiling when nobody asks for one
CHILD_PROCESSES: Final = 4096  # every child's process ceiling, by default and at most
DRAIN_DEADLINE: Final = 3600.0  # seconds a drain lets its sessions run, unless told
DASHBOARD_CODE_FOR: Final = 300.0  # seconds a dashboard sign-in code may be used (once)
DASHBOARD_SESSION_FOR: Final = 12 * 3600.0  # seconds a sign-in by code lasts, at most
PAGE: Final = 100  # sessions a listing answers per page, unless asked for another number
MOST_PAGE: Final = 1000  # the most sessions one page may ask for
MOST_BODY: Final = 1 << 20  # bytes of a request body; a larger one is answered 413
EVENT_BUFFER: Final = 1024  # records one events reader may fall behind by before overflow
FULL_RETRY_AFTER: Final = 5.0  # seconds a host waits before loading into a full runner again
INFLIGHT_RETRY_AFTER: Final = 1.0  # seconds a host waits when a load is refused for one in flight
CLOSING_RETRY_AFTER: Final = 5.0  # seconds a client waits before retrying a closing runner
DRAINING_RETRY_AFTER: Final = 5.0  # seconds an open or load refused by a drain is told to wait
THROTTLED_HOLD: Final = 1.0  # seconds a refused tenant's call waits for its 429, at most
SERVER_GRACEFUL: Final = 5.0  # seconds the server lets requests in flight finish as it stops
REOPEN_PAUSE: Final = 0.25  # seconds between two tries of a store a new incarnation waits for
HEAL_FIRST_BACKOFF: Final = 1.0  # seconds before a runner's first restart of itself
HEAL_LAST_BACKOFF: Final = 30.0  # the longest back-off; an incarnation this stable resets it
HEAL_SAY_EVERY: Final = 60.0  # seconds between two log lines of an incarnation that cannot start
DASHBOARD_MOST_CODES: Final = 1024  # sign-in codes waiting at once; minting more drops the oldest


# -- the client (client/): how long a host tries a runner, and how often ---------------
# ``connect`` and ``RemoteSupervisor`` take these when not told otherwise; the docstrings
# of their parameters say what each means to a call.

CLIENT_RETRY_FOR: Final = 15.0  # seconds a call safe to repeat is retried, a runner waited out
CLIENT_CONNECT_FOR: Final = 5.0  # seconds a refused connection is tried again, any call
CLIENT_FIRST_BACKOFF: Final = 0.05  # seconds before a call's first retry; doubled each time
CLIENT_MAX_BACKOFF: Final = 2.0  # seconds between two tries at most, whatever Retry-After says
CLIENT_RETRY_AFTER: Final = 1.0  # seconds waited on an answer to wait out without Retry-After
CLIENT_MAX_HOLDERS: Final = 10_000  # sessions whose fleet runner the client remembers
CLIENT_REQUEST_TIMEOUT: Final = 60.0  # seconds one request may take (a load waits for its child)
CLIENT_CONNECT_TIMEOUT: Final = 10.0  # seconds a connection may take, at most the request's


# -- the stores (stores/, retention.py): waits, periods and caps of the three stores -----
# ``Retention()``, ``SqliteStore`` and ``PostgresStore`` take these when not told
# otherwise; the rest are the fleet store's own rhythm (docs/design.md, the fleet).

STOPPED_PER_KEY: Final = 1  # Stopped records retained per key, newest first
STOPPED_TOTAL: Final = 10_000  # Stopped records retained in all, per store (or fleet)
STOPPED_FOR: Final = 0.0  # seconds a Stopped record is kept past the per-key count: none
SQLITE_LOCK_WAIT: Final = 10.0  # seconds SQLite waits for a lock no store owns (a checkpoint)
FLEET_SCHEMA: Final = "trio_supervisor"  # the PostgreSQL schema of a fleet's tables
STORE_CONNECT_TIMEOUT: Final = 5.0  # seconds a connection to PostgreSQL may take
STORE_STATEMENT_TIMEOUT: Final = 10.0  # seconds a statement, or its wait for a lock, may take
COMMIT_WINDOW: Final = 0.0  # seconds a save waits for others to share its commit: none
MOST_COMMIT_WINDOW: Final = 1.0  # the longest commit window: past it a save outwaits the database
STORE_FIRST_PAUSE: Final = 0.05  # seconds before a store out of reach is tried again; doubled
STORE_LAST_PAUSE: Final = 0.25  # ... up to this: a server back from a restart is seen within it
CONFLICT_TRIES: Final = 3  # times a batch the server rolled back (a deadlock) is written again
REMEMBERED: Final = 1 << 16  # records and marks a runner remembers, to write back after a failover
KEEPALIVE_IDLE: Final = 5  # seconds an idle connection waits before its first TCP keepalive
KEEPALIVE_INTERVAL: Final = 2  # seconds between two keepalives
KEEPALIVE_COUNT: Final = 3  # keepalives unanswered before the connection is given up
LISTENER_POLL: Final = 0.25  # seconds between a listener's looks at its stop flag
LISTENER_RETRY: Final = 0.5  # seconds between a listener's attempts to connect again
OLDER_POLL: Final = 0.2  # seconds between two looks at the older generations an open waits for
FLEET_CHECK: Final = 1.0  # seconds between two checks of a runner's inbox of supersedes, at most
OLDER_KEPT: Final = 1024  # Opens whose older generations a store keeps for the waits after
TIMES_WAIT: Final = 1.0  # seconds a fleet listing waits for the runners' sessions' times
TIMES_POLL: Final = 0.02  # seconds between its looks for them
TAKEOVER_TRIES: Final = 3  # failed takeovers an open waiting for a dead runner tries again


# -- the subprocess execution (executions/): what it keeps for later ---------------------
# ``SubprocessExecution`` keeps emptied cgroups for its next children, and removes the
# logs retention evicted in batches.

CGROUP_POOL: Final = 4  # emptied cgroups an execution keeps for its next children
LOG_LINGER: Final = 1.0  # seconds an evicted log waits for others to be removed with it
LOG_BATCH: Final = 64  # evicted logs removed at once, at most
