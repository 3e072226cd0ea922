"""The statements the PostgreSQL store runs, once its schema is in place.

The schema, its ``write_batch`` function and the migrations are in
:mod:`._postgres_schema`; the statements here name its tables unqualified (each
connection puts the store's schema first on its ``search_path``). They are grouped by
what runs them: every connection, this runner's row, the server, saving, the reads,
and membership (renewal, the checks, takeover). A statement that names an identifier
(the schema, as a channel too) is built by a function, which quotes it; the others are
constants, each with the parameters of its ``%s`` or ``%(name)s`` placeholders in order.
The worker (:mod:`._postgres_worker` and the rooms it is built from) and the
connections (:mod:`._postgres_connection`) hold no SQL of their own.
"""

from __future__ import annotations

from typing import Final

from .._extras import needs_extra

with needs_extra("postgres", "trio_supervisor.stores.postgres", "psycopg"):
    from psycopg import sql

__all__ = [
    "ASK_TIMES",
    "CHECKED",
    "DEAD",
    "DEAD_ROW",
    "DRAINING",
    "DUE",
    "EXPIRE",
    "FLEET_RECORDS",
    "HELD",
    "HIGH_WATER",
    "INBOX",
    "LANDED",
    "LIST",
    "LOOKUP",
    "LOW_MARKS",
    "NEXT_EPOCH",
    "OLDER",
    "OTHERS_ALIVE",
    "OWNER",
    "OWN_ROW",
    "POOL_MARK",
    "POOL_SEEN",
    "PUBLISH_TIMES",
    "RAISE_MARKS",
    "REFILL_INBOX",
    "REGISTER",
    "RENEW",
    "RUNNERS",
    "SAVE_BATCH",
    "SERVER",
    "SERVER_IDENTITY",
    "TAKEOVER_DUE",
    "TIMES_DUE",
    "UNCHECKED",
    "WRITTEN_PHASES",
    "listen",
    "session_settings",
]

# The call of write_batch, as the store's worker (and the benchmark's baseline) sends it.
SAVE_BATCH: Final = (
    "SELECT * FROM write_batch(%s, %s, %s, %s, %s::double precision, %s::integer[], %s::text[], "
    "%s::text[], %s::text[], %s::bigint[], %s::text[], %s::double precision[], "
    "%s::smallint[], %s::text[], %s::text[], %s::bigint[], %s::bigint[], %s::jsonb)"
)

# -- every connection: its settings, and the listener's channel ------------------------


def session_settings(timeout: str, schema: str) -> sql.Composed:
    """A new connection's settings: ``timeout`` (a PostgreSQL interval, ``"10000ms"``) for
    every statement, every wait for a lock, and a transaction left idle (a runner frozen
    between a statement and its commit holds its locks: on its own row, which a takeover
    must lock, until the server ends its session), and the store's schema as the search
    path."""
    return sql.SQL(
        "SET statement_timeout = {timeout}; SET lock_timeout = {timeout}; "
        "SET idle_in_transaction_session_timeout = {timeout}; SET search_path = {schema}"
    ).format(timeout=sql.Literal(timeout), schema=sql.Identifier(schema))


def listen(schema: str) -> sql.Composed:
    """LISTEN on the fleet's channel: its name is the schema's (write_batch notifies it)."""
    return sql.SQL("LISTEN {}").format(sql.Identifier(schema))


# -- this runner's row: registered as the store opens, expired as it closes ------------

# Its row as it was (locked until the registration commits): its epoch, and whether it
# was still within its lease (another process may be running under this id).
OWN_ROW: Final = (
    "SELECT epoch, lease_until > clock_timestamp() FROM runners WHERE runner_id = %s FOR UPDATE"
)
# A new row at epoch 1, or the next epoch of the one there: the new incarnation.
REGISTER: Final = (
    "INSERT INTO runners AS u "
    "(runner_id, epoch, advertise, started_at, lease_until, stop_bound) "
    "VALUES (%(runner)s, 1, %(advertise)s, clock_timestamp(), "
    "        clock_timestamp() + make_interval(secs => %(lease)s), 0) "
    "ON CONFLICT (runner_id) DO UPDATE SET epoch = u.epoch + 1, "
    "    advertise = excluded.advertise, started_at = excluded.started_at, "
    "    lease_until = excluded.lease_until, draining = false, "
    "    taken_over_at = NULL, taken_over_by = NULL "
    "RETURNING epoch"
)
# The other runners alive, and where each advertises itself (for the log).
OTHERS_ALIVE: Final = (
    "SELECT runner_id, advertise FROM runners "
    "WHERE runner_id <> %s AND lease_until > clock_timestamp() ORDER BY runner_id"
)
# The row stops counting as alive, if it still holds this epoch.
EXPIRE: Final = (
    "UPDATE runners SET lease_until = least(lease_until, clock_timestamp()) "
    "WHERE runner_id = %s AND epoch = %s"
)

# -- the server: who it is, and whether it takes writes (docs/design.md, B4-B7) ---------

# Whether it is a standby, and the current WAL file's name (its first 8 digits are the
# timeline: a promoted standby starts a new one).
SERVER: Final = (
    "SELECT pg_is_in_recovery(), "
    "CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_walfile_name(pg_current_wal_lsn()) END"
)
# The cluster's identity (a standby made by pg_basebackup shares its primary's).
SERVER_IDENTITY: Final = "SELECT system_identifier FROM pg_control_system()"
# A mark in this session, and the look for it from another: a pooler that hands one
# server session to several clients shows it.
POOL_MARK: Final = "SELECT set_config('trio_supervisor.pool_mark', %s, false)"
POOL_SEEN: Final = "SELECT current_setting('trio_supervisor.pool_mark', true)"
# After a failover: how far on the tokens' rows are, the keys whose mark is below what
# this runner handed out, and those marks raised back.
WRITTEN_PHASES: Final = "SELECT token, phase FROM records WHERE token = ANY(%s)"
# A runner checked its writes on a server (or registered on it); the live runners that
# have not checked on the one a runner sees.
CHECKED: Final = "UPDATE runners SET checked = %s WHERE runner_id = %s AND epoch = %s"
UNCHECKED: Final = (
    "SELECT runner_id FROM runners WHERE runner_id <> %s AND checked <> %s "
    "AND lease_until > clock_timestamp() ORDER BY runner_id"
)
LOW_MARKS: Final = (
    "SELECT k.identity, k.instance FROM unnest(%s::text[], %s::text[], %s::bigint[]) "
    "AS k (identity, instance, generation) LEFT JOIN high_water h "
    "ON h.identity = k.identity AND h.instance = k.instance "
    "WHERE coalesce(h.generation, 0) < k.generation"
)
RAISE_MARKS: Final = (
    "INSERT INTO high_water AS h (identity, instance, generation) "
    "SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[]) "
    "ON CONFLICT (identity, instance) DO UPDATE "
    "SET generation = greatest(h.generation, excluded.generation)"
)

# -- saving: SAVE_BATCH, and the look at a batch whose answer was lost ------------------

# The epoch and body each of the tokens holds.
LANDED: Final = "SELECT token, epoch, body FROM records WHERE token = ANY(%s)"

# -- reads: a record's row is token, identity, instance, body (and what else it says) ---

# This runner's records, in save order.
LIST: Final = (
    "SELECT token, identity, instance, body FROM records WHERE runner_id = %s ORDER BY saved"
)
# Every key's mark; generation 0 is a key locked by an Open that then lost (no mark).
HIGH_WATER: Final = "SELECT identity, instance, generation FROM high_water WHERE generation > 0"
# A key's mark, and its latest record opened with a request id: one round trip.
LOOKUP: Final = (
    "SELECT (SELECT generation FROM high_water "
    "        WHERE identity = %(i)s AND instance = %(n)s), r.token, r.body "
    "FROM (SELECT 1) AS one LEFT JOIN LATERAL ("
    "    SELECT token, body FROM records WHERE identity = %(i)s "
    "    AND instance = %(n)s AND request_id = %(r)s ORDER BY saved DESC LIMIT 1"
    ") AS r ON true"
)
# Every runner (or only the one named), as a RunnerInfo's fields in order.
RUNNERS: Final = (
    "SELECT u.runner_id, u.epoch, u.advertise, extract(epoch FROM u.started_at), "
    "    extract(epoch FROM u.lease_until), u.lease_until > clock_timestamp(), "
    "    (SELECT count(*) FROM records r "
    "     WHERE r.runner_id = u.runner_id AND r.stopped IS NULL), u.stop_bound, "
    "    u.draining, extract(epoch FROM u.taken_over_at), u.taken_over_by "
    "FROM runners u WHERE %(only)s::text IS NULL OR u.runner_id = %(only)s "
    "ORDER BY u.runner_id"
)
# The runner that holds a token's record.
OWNER: Final = "SELECT runner_id FROM records WHERE token = %s"
# A token's record, with its runner and the epoch that wrote it.
HELD: Final = (
    "SELECT token, identity, instance, body, runner_id, epoch FROM records WHERE token = %s"
)
# Every record, in save order, with its runner and epoch; an unstopped session's age and
# lease left, from the moments its runner last published (its opening, its lease's end),
# by the database's clock now.
FLEET_RECORDS: Final = (
    "SELECT r.token, r.identity, r.instance, r.body, r.runner_id, r.epoch, "
    "    n.e - (t.times -> r.token ->> 0)::double precision, "
    "    (t.times -> r.token ->> 1)::double precision - n.e "
    "FROM records r LEFT JOIN runner_times t "
    "    ON t.runner_id = r.runner_id AND r.stopped IS NULL, "
    "    (SELECT extract(epoch FROM clock_timestamp())::double precision AS e) AS n "
    "ORDER BY r.saved"
)
# A listing asks every runner for its sessions' times (each answers with PUBLISH_TIMES
# as it hears it); the moment it asked, by the database's clock.
ASK_TIMES: Final = (
    "SELECT extract(epoch FROM clock_timestamp())::double precision, "
    '    pg_notify(current_schema(), \'{"kind": "times"}\')'
)
# The live runners that publish their times (they listen) and did not since a moment.
TIMES_DUE: Final = (
    "SELECT u.runner_id FROM runners u JOIN runner_times t ON t.runner_id = u.runner_id "
    "WHERE u.lease_until > clock_timestamp() AND t.published < %s ORDER BY u.runner_id"
)
# This runner's sessions' times, by token (arrays of tokens, ages and leases left, in
# seconds), published as moments of the database's clock; a runner that starts to
# listen publishes none, which says it will answer.
PUBLISH_TIMES: Final = (
    "INSERT INTO runner_times AS t (runner_id, published, times) "
    "SELECT %s, n.e, coalesce(("
    "    SELECT jsonb_object_agg(w.t, jsonb_build_array(n.e - w.a, n.e + w.l)) "
    "    FROM unnest(%s::text[], %s::double precision[], %s::double precision[]) "
    "        AS w (t, a, l)), '{}') "
    "FROM (SELECT extract(epoch FROM clock_timestamp())::double precision AS e) AS n "
    "ON CONFLICT (runner_id) DO UPDATE SET published = excluded.published, "
    "    times = excluded.times"
)

# -- membership: renewal, the checks, and the takeover of dead runners ------------------

# When a dead runner's record may be taken over (F7): _defaults.takeover_margin, in SQL,
# by the database's clock (u: the runner's row, r: the record).
TAKEOVER_DUE: Final = "u.lease_until + make_interval(secs => r.lease + u.stop_bound)"

# This runner's row renewed, if it still holds this epoch: one short row, whatever the
# number of its sessions (their times are published on demand: PUBLISH_TIMES).
RENEW: Final = (
    "UPDATE runners SET lease_until = clock_timestamp() + make_interval(secs => %s), "
    "    stop_bound = %s WHERE runner_id = %s AND epoch = %s"
)
DRAINING: Final = "UPDATE runners SET draining = true WHERE runner_id = %s AND epoch = %s"
# This runner's inbox, read and cleared: the keys of its sessions that a later
# generation opened on another runner supersedes, with that generation.
INBOX: Final = "DELETE FROM inbox WHERE runner_id = %s RETURNING identity, instance, generation"
# After a failover (B6): the inbox rows of the keys whose marks this runner raised back,
# for the other runners still holding a live older generation of one.
REFILL_INBOX: Final = (
    "INSERT INTO inbox AS b (runner_id, identity, instance, generation) "
    "SELECT DISTINCT ON (r.runner_id, k.identity, k.instance) r.runner_id, k.identity, "
    "    k.instance, k.generation "
    "FROM unnest(%s::text[], %s::text[], %s::bigint[]) AS k (identity, instance, generation) "
    "JOIN records r ON r.identity = k.identity AND r.instance = k.instance "
    "    AND r.generation < k.generation AND r.stopped IS NULL AND r.runner_id <> %s "
    "ORDER BY r.runner_id, k.identity, k.instance, k.generation DESC "
    "ON CONFLICT (runner_id, identity, instance) DO UPDATE "
    "SET generation = greatest(b.generation, excluded.generation)"
)
# A key's unstopped records below a generation on runners other than the one named.
OLDER: Final = (
    "SELECT r.runner_id, u.epoch, r.generation, r.lease, u.stop_bound, "
    "    extract(epoch FROM clock_timestamp() - u.lease_until)::double precision "
    "FROM records r JOIN runners u ON u.runner_id = r.runner_id "
    "WHERE r.identity = %s AND r.instance = %s AND r.generation < %s "
    "AND r.stopped IS NULL AND r.runner_id <> %s"
)
# The other runners whose row expired with an unstopped record whose margin passed.
DEAD: Final = (
    "SELECT u.runner_id, u.epoch FROM runners u "
    "WHERE u.runner_id <> %s AND u.lease_until < clock_timestamp() AND EXISTS ("
    "    SELECT 1 FROM records r WHERE r.runner_id = u.runner_id "
    f"    AND r.stopped IS NULL AND {TAKEOVER_DUE} < clock_timestamp())"
)
# A takeover, in one transaction: the dead runner's row locked (its epoch, and whether
# it is still expired: the takeover re-checks what it saw), its records due, then its
# epoch moved on; write_batch writes them Stopped under that epoch.
DEAD_ROW: Final = (
    "SELECT epoch, lease_until < clock_timestamp() FROM runners WHERE runner_id = %s FOR UPDATE"
)
DUE: Final = (
    "SELECT r.token, r.identity, r.instance, r.body "
    "FROM records r JOIN runners u ON u.runner_id = r.runner_id "
    f"WHERE r.runner_id = %s AND r.stopped IS NULL AND {TAKEOVER_DUE} < clock_timestamp() "
    "ORDER BY r.saved"
)
# The dead runner's epoch moves on, to fence it; its row says it was taken over (when,
# and by which runner), so that the listing does not show a new incarnation.
NEXT_EPOCH: Final = (
    "UPDATE runners SET epoch = epoch + 1, taken_over_at = clock_timestamp(), "
    "    taken_over_by = %(by)s "
    "WHERE runner_id = %(runner)s"
)
