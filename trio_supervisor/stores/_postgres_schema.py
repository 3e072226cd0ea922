"""The PostgreSQL store's schema: its tables, its functions, and the migrations to them.

Everything lives in one schema (``trio_supervisor`` unless the store is told another),
which each connection puts first on its ``search_path``: the statements name tables
unqualified. The schema is versioned in ``schema_version``; :data:`MIGRATIONS` takes an
empty schema to :data:`SCHEMA_VERSION`, inside the one transaction that holds
:data:`MIGRATION_LOCK` (``_postgres_member.migrate``).

The functions of the write path (``write_batch``, ``quota_refusal``) are in
:mod:`._postgres_write`; the statements the store runs against this schema are in
:mod:`._postgres_sql`.
"""

from __future__ import annotations

from typing import Final

from .._extras import needs_extra
from ._postgres_write import FENCED, QUOTA_REFUSAL, SAVE_BATCH, WRITE_BATCH, WRITE_BATCH_6, Kind

with needs_extra("postgres", "trio_supervisor.stores.postgres", "psycopg"):
    from psycopg import sql

__all__ = [
    "CLEAR_SCHEMA_VERSION",
    "CREATE_SCHEMA_VERSION",
    "FENCED",
    "MIGRATIONS",
    "MIGRATION_LOCK",
    "SCHEMA_VERSION",
    "SCHEMA_VERSIONS",
    "TAKE_MIGRATION_LOCK",
    "WRITE_SCHEMA_VERSION",
    "Kind",
    "create_schema",
]

# The version MIGRATIONS end at; a schema of a later one (a newer library's) is refused.
SCHEMA_VERSION: Final = 7

# pg_advisory_xact_lock's key for creating or migrating the schema: "trio_sup" in ASCII.
MIGRATION_LOCK: Final = 0x7472696F5F737570

_TABLES = """
CREATE TABLE runners (
    runner_id   text PRIMARY KEY,
    epoch       bigint NOT NULL,            -- the incarnation whose writes are accepted
    advertise   text NOT NULL,
    started_at  timestamptz NOT NULL,
    lease_until timestamptz NOT NULL,       -- by the database's clock
    stop_bound  double precision NOT NULL   -- grace + confirmation of its supervisor
);
CREATE SEQUENCE save_order;
CREATE SEQUENCE stop_order;
CREATE TABLE records (
    token      text PRIMARY KEY,
    identity   text NOT NULL,
    instance   text NOT NULL,
    generation bigint NOT NULL,
    request_id text NOT NULL,
    runner_id  text NOT NULL,               -- the runner that holds the session
    epoch      bigint NOT NULL,             -- its incarnation that wrote this row
    saved      bigint NOT NULL,             -- save order (list)
    stopped    bigint,                      -- stop order, NULL while not Stopped (retention)
    lease      double precision NOT NULL,   -- the session's lease: the takeover margin
    body       text NOT NULL                -- the versioned JSON record (codec.encode)
);
-- By key: an open's look for older live generations, lookup by request id, per-key
-- retention. By runner: list() and takeover. By stop: retention's cap on all.
CREATE INDEX records_by_key ON records (identity, instance, generation);
CREATE INDEX records_by_runner ON records (runner_id, saved);
CREATE INDEX records_by_stop ON records (stopped) WHERE stopped IS NOT NULL;
-- Never evicted. A row of generation 0 is a key an open locked and then lost: no mark.
CREATE TABLE high_water (
    identity   text NOT NULL,
    instance   text NOT NULL,
    generation bigint NOT NULL,
    PRIMARY KEY (identity, instance)
);
"""


# Version 2: what the quotas count (each record's phase and the limits it holds) in
# columns, read from the records already written; save_batch writes them, and counts
# claims. The version 1 save_batch is dropped first (a new signature would overload it).
_VERSION_2 = (
    "ALTER TABLE records ADD COLUMN phase text NOT NULL DEFAULT '', "
    "ADD COLUMN memory_bytes bigint, ADD COLUMN cpu_percent bigint",
    "UPDATE records SET phase = 'Stopped' WHERE stopped IS NOT NULL",
    "UPDATE records SET phase = b.body ->> 'phase', "
    "    memory_bytes = (b.body -> 'limits' ->> 'memory_bytes')::bigint, "
    "    cpu_percent = (b.body -> 'limits' ->> 'cpu_percent')::bigint "
    "FROM (SELECT token, body::jsonb AS body FROM records WHERE stopped IS NULL) AS b "
    "WHERE records.token = b.token",
    "CREATE INDEX records_live ON records (identity) WHERE stopped IS NULL",
    "DROP FUNCTION IF EXISTS save_batch(text, bigint, integer, integer, integer[], text[], "
    "text[], text[], bigint[], text[], double precision[], smallint[], text[])",
    QUOTA_REFUSAL,
    # Versions 2 to 5 created save_batch here, as write_batch is now; version 7 makes
    # it a wrapper, so a database migrated from any version holds the same functions.
)

# Version 3: whether a runner drains (it takes no new sessions), for the fleet's listing.
_VERSION_3 = ("ALTER TABLE runners ADD COLUMN draining boolean NOT NULL DEFAULT false",)

# Version 4: each runner's row holds the times of the sessions it runs, as of its last
# renewal (token -> [opened, lease ends], seconds since the Unix epoch by the database's
# clock): renewals of a session's lease write nothing (R6), so the fleet's other runners
# read its age and lease left from here (GET /v1/sessions).
_VERSION_4 = ("ALTER TABLE runners ADD COLUMN session_times jsonb NOT NULL DEFAULT '{}'",)
# Which server each runner last checked its writes on (B6): after a failover, no runner
# hands out a generation until every live one has.
_VERSION_5 = ("ALTER TABLE runners ADD COLUMN checked text NOT NULL DEFAULT ''",)

# Version 6 (issue 51): what a fleet of a hundred runners can afford.
# - Each runner's inbox of supersedes: an Open that supersedes another runner's live
#   session writes a row for it in the Open's transaction; the holder reads (and clears)
#   its own rows on the notification and every check period, one index probe, where it
#   looked up the high-water of every live key.
# - The sessions' times published on demand (a listing asks; each runner answers with
#   one row), no longer with every renewal (runners.session_times, 355 kB of WAL at 10k
#   sessions a renewal, is left empty; a runner of version 5 still writes it).
# - A counter of Stopped records per runner (stop_counts), which retention's fleet-wide
#   cap sums, where each batch that stopped a session counted them all.
# - write_batch, which tells the opener the older generations its Open superseded on
#   other runners (the look F6 waits with starts from them); save_batch stays, for the
#   runners of version 5 until they restart, as its refusals. Version 6 created both
#   functions here; version 7 does, as they are now, so that a database migrated from
#   any version holds the same functions.
_INBOX = """
CREATE TABLE inbox (
    runner_id  text NOT NULL,               -- the holder of the superseded session
    identity   text NOT NULL,
    instance   text NOT NULL,
    generation bigint NOT NULL,             -- the generation that supersedes it
    PRIMARY KEY (runner_id, identity, instance)
)
"""
_TIMES = """
CREATE TABLE runner_times (
    runner_id text PRIMARY KEY,
    published double precision NOT NULL,    -- seconds since the Unix epoch, database clock
    times     jsonb NOT NULL                -- token -> [opened, lease ends], the same clock
)
"""
# What each runner's batches changed of the number of Stopped records (retention's
# fleet-wide cap reads their sum); the Stopped records already there, under no runner.
_STOP_COUNTS = (
    "CREATE TABLE stop_counts (runner_id text PRIMARY KEY, stopped bigint NOT NULL)",
    "INSERT INTO stop_counts SELECT '', count(*) FROM records WHERE stopped IS NOT NULL",
)
_VERSION_6 = (
    _INBOX,
    _TIMES,
    *_STOP_COUNTS,
    "UPDATE runners SET session_times = '{}'",
)

# Version 7 (issue 52):
# - Each Stopped record's time (stopped_at, the database's clock), from which
#   retention's stopped_for keeps a key's records past the number per key; a record
#   stopped before it has none, and counts as stopped long ago.
# - A takeover is said as such: the row of a runner taken over says when and by whom
#   (its epoch moved on to fence it, though it never restarted); its next registration
#   clears both.
# - write_batch takes stopped_for; the one of version 6 is its wrapper, for version 6's
#   runners until they restart (they keep no record past the number per key).
_VERSION_7 = (
    "ALTER TABLE records ADD COLUMN stopped_at timestamptz",
    "ALTER TABLE runners ADD COLUMN taken_over_at timestamptz, ADD COLUMN taken_over_by text",
    WRITE_BATCH,
    WRITE_BATCH_6,
    SAVE_BATCH,
)

MIGRATIONS: Final[dict[int, tuple[str, ...]]] = {
    # From version N - 1 to N: the statements, run in order.
    # Version 1 also created the save_batch of its day, which version 2 drops.
    1: tuple(statement for statement in _TABLES.split(";") if statement.strip()),
    2: _VERSION_2,
    3: _VERSION_3,
    4: _VERSION_4,
    5: _VERSION_5,
    6: _VERSION_6,
    7: _VERSION_7,
}

# -- migrating: under MIGRATION_LOCK, in one transaction (_postgres_member.migrate) -----

TAKE_MIGRATION_LOCK: Final = "SELECT pg_advisory_xact_lock(%s)"


def create_schema(schema: str) -> sql.Composed:
    """The store's schema, made if it does not exist (its name is an identifier)."""
    return sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema))


CREATE_SCHEMA_VERSION: Final = (
    "CREATE TABLE IF NOT EXISTS schema_version (version integer NOT NULL)"
)
SCHEMA_VERSIONS: Final = "SELECT version FROM schema_version"
CLEAR_SCHEMA_VERSION: Final = "DELETE FROM schema_version"
WRITE_SCHEMA_VERSION: Final = "INSERT INTO schema_version VALUES (%s)"
