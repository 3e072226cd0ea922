"""The PostgreSQL store's schema, its write function, and the statements it runs.

Everything lives in one schema (``trio_supervisor`` unless the store is told another),
which each connection puts first on its ``search_path``: the statements here name
tables unqualified. The schema is versioned in ``schema_version``; :data:`MIGRATIONS`
takes an empty schema to :data:`SCHEMA_VERSION`, inside the one transaction that holds
:data:`MIGRATION_LOCK`.

A batch of saves is one call of ``write_batch`` (so one round trip, as SQLite's trigger
makes it one statement, and in autocommit one transaction): the function fences the
writer, claims the generations of its Open records, writes the rows, raises the marks,
applies retention, writes the supersedes into their holders' inboxes and notifies, and
returns its refusals and the older generations its Opens found on other runners. A
save that carries a tenant's quota claim is counted there too, by ``quota_refusal``,
once the batch holds its tenants' advisory locks.

Every other statement the store runs is here too, after the migrations, grouped by what
runs it: migrating, this runner's row, saving, the reads, and membership (renewal, the
checks, takeover). A statement that names an identifier (the schema, as a channel too)
is built by a function, which quotes it; the others are constants, each with the
parameters of its ``%s`` or ``%(name)s`` placeholders in order. The worker
(:mod:`._postgres_worker`) and the connections (:mod:`._postgres_connection`) hold no
SQL of their own.
"""

from __future__ import annotations

from typing import Final

from .._extras import needs_extra

with needs_extra("postgres", "trio_supervisor.stores.postgres", "psycopg"):
    from psycopg import sql

__all__ = [
    "ASK_TIMES",
    "CLEAR_SCHEMA_VERSION",
    "CREATE_SCHEMA_VERSION",
    "DEAD",
    "DEAD_ROW",
    "DRAINING",
    "DUE",
    "EXPIRE",
    "FENCED",
    "FLEET_RECORDS",
    "HELD",
    "HIGH_WATER",
    "INBOX",
    "LANDED",
    "LIST",
    "LOOKUP",
    "MIGRATIONS",
    "MIGRATION_LOCK",
    "NEXT_EPOCH",
    "OLDER",
    "OTHERS_ALIVE",
    "OWNER",
    "OWN_ROW",
    "PUBLISH_TIMES",
    "REFILL_INBOX",
    "REGISTER",
    "RENEW",
    "RUNNERS",
    "SAVE_BATCH",
    "SCHEMA_VERSION",
    "SCHEMA_VERSIONS",
    "TAKEOVER_DUE",
    "TAKE_MIGRATION_LOCK",
    "TIMES_DUE",
    "WRITE_SCHEMA_VERSION",
    "Kind",
    "create_schema",
    "listen",
    "session_settings",
]

SCHEMA_VERSION: Final = 6

# pg_advisory_xact_lock's key for creating or migrating the schema: "trio_sup" in ASCII.
MIGRATION_LOCK: Final = 0x7472696F5F737570

# The call of write_batch, as the store's worker (and the benchmark's baseline) sends it.
SAVE_BATCH: Final = (
    "SELECT * FROM write_batch(%s, %s, %s, %s, %s::integer[], %s::text[], "
    "%s::text[], %s::text[], %s::bigint[], %s::text[], %s::double precision[], "
    "%s::smallint[], %s::text[], %s::text[], %s::bigint[], %s::bigint[], %s::jsonb)"
)

# The SQLSTATE write_batch raises when the writer's epoch was taken over ("TS" is no
# class of PostgreSQL's own).
FENCED: Final = "TS001"


class Kind:
    """What write_batch is told of each row (a smallint; Python builds them, SQL reads)."""

    OTHER: Final = 0  # Loading, Loaded, Stopping
    OPEN: Final = 1  # claims its generation: compare-and-set on the key's high-water
    STOPPED: Final = 2  # gets a stop order; retention applies
    SUPERSEDED: Final = 3  # Stopped with reason Superseded: an opener may wait for it


def _named(sql: str) -> str:
    """``sql`` with the Python names it uses put in: ``KIND_OPEN`` (and the other kinds)
    and ``SQLSTATE_FENCED``, so that the numbers and the code are written once, here."""
    for name in ("OTHER", "OPEN", "STOPPED", "SUPERSEDED"):
        sql = sql.replace(f"KIND_{name}", str(getattr(Kind, name)))
    return sql.replace("SQLSTATE_FENCED", FENCED)


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

# The write path. The rows of a batch come as parallel arrays (psycopg sends them in
# binary: no JSON to build or parse), grouped by job: a job is one caller's save or
# save_many, and is written whole or, when one of its Opens loses, not at all. Other
# jobs of the batch land either way: they are other callers' saves. A job may carry a
# tenant's quota claim (p_claims, by job number: quota_refusal says what it holds), and
# is refused whole, the same way, when the claim would pass its quota.
_PARAMETERS = """
    p_runner text, p_epoch bigint, p_per_key integer, p_total integer,
    p_jobs integer[], p_tokens text[], p_identities text[], p_instances text[],
    p_generations bigint[], p_requests text[], p_leases double precision[],
    p_kinds smallint[], p_bodies text[], p_phases text[], p_memory bigint[],
    p_cpu bigint[], p_claims jsonb
"""
_REFUSALS = """
    refused_job integer, refused_identity text, refused_instance text,
    refused_generation bigint, refused_mark bigint, refused_quota text,
    refused_requested numeric, refused_used numeric, refused_hard numeric
"""
_WRITE_BATCH = _named(
    "CREATE FUNCTION write_batch(" + _PARAMETERS + ") RETURNS TABLE (" + _REFUSALS + ","
    """
    older_runner text, older_epoch bigint, older_generation bigint,
    older_lease double precision, older_stop_bound double precision,
    older_expired double precision
)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    n_rows integer := coalesce(array_length(p_tokens, 1), 0);
    held bigint;
    job_first integer;
    job_last integer := 0;
    mark bigint;
    marks jsonb;
    named text;
    refused boolean;
    fresh bigint;
    kept bigint;
    stopped_count bigint;  -- Stopped rows in all before this batch; NULL until a stop reads it
    stopped_delta bigint := 0;  -- how many this batch added (stops) and took (evictions)
    gone integer;
    claim jsonb;
    tenant_lock bigint;
    over record;
    older record;
BEGIN
    -- (a) Fencing: the writer's row must still hold its epoch. FOR SHARE, so a takeover
    -- (FOR UPDATE) waits for this transaction, and this one for a takeover.
    SELECT r.epoch INTO held FROM runners r WHERE r.runner_id = p_runner FOR SHARE;
    IF held IS DISTINCT FROM p_epoch THEN
        RAISE EXCEPTION USING ERRCODE = 'SQLSTATE_FENCED', MESSAGE = format(
            'runner %s: its epoch %s was taken over (the row holds %s)',
            p_runner, p_epoch, coalesce(held::text, 'no epoch'));
    END IF;
    -- The high-water rows of every key an Open claims exist and are locked, in one
    -- order for every writer (no deadlock between two runners' batches). A stop of
    -- reason Superseded locks its key's row too: an Open of the key that another
    -- runner writes meanwhile either committed first (then this batch's look below, a
    -- statement after the lock, sees it, and tells its opener of the stop) or waits
    -- for this one (then its look finds the session stopped): no opener waits for a
    -- stop it is not told of.
    IF KIND_OPEN = ANY (p_kinds) OR KIND_SUPERSEDED = ANY (p_kinds) THEN
        INSERT INTO high_water (identity, instance, generation)
            SELECT DISTINCT u.i, u.n, 0
            FROM unnest(p_identities, p_instances, p_kinds) AS u (i, n, k)
            WHERE u.k IN (KIND_OPEN, KIND_SUPERSEDED) ORDER BY 1, 2
            ON CONFLICT DO NOTHING;
        PERFORM 1 FROM high_water h
            WHERE (h.identity, h.instance) IN (
                SELECT u.i, u.n FROM unnest(p_identities, p_instances, p_kinds) AS u (i, n, k)
                WHERE u.k IN (KIND_OPEN, KIND_SUPERSEDED))
            ORDER BY h.identity, h.instance FOR UPDATE;
    END IF;
    -- The tenants whose quota a job claims: one advisory lock each, held to the commit,
    -- so that two runners' claims of one tenant are counted one after the other (the
    -- second, under READ COMMITTED, counts what the first wrote). All are taken here,
    -- after the high-water rows and in one order (the locks' own), before any row is
    -- written: no two batches can wait for each other.
    IF p_claims IS NOT NULL THEN
        FOR tenant_lock IN
            SELECT DISTINCT hashtextextended(
                    'trio_supervisor quota' || chr(31) || current_schema() || chr(31)
                    || (c.value ->> 'tenant'), 0)
                FROM jsonb_each(p_claims) AS c ORDER BY 1
        LOOP
            PERFORM pg_advisory_xact_lock(tenant_lock);
        END LOOP;
    END IF;
    WHILE job_last < n_rows LOOP
        job_first := job_last + 1;
        job_last := job_first;
        WHILE job_last < n_rows AND p_jobs[job_last + 1] = p_jobs[job_first] LOOP
            job_last := job_last + 1;
        END LOOP;
        -- (b) Global fencing of generations: each Open must be its key's mark + 1, the
        -- job's own earlier rows counted. A job that loses is refused whole.
        refused := false;
        IF KIND_OPEN = ANY (p_kinds[job_first:job_last]) THEN
            marks := '{}';
            FOR j IN job_first .. job_last LOOP
                named := p_identities[j] || chr(31) || p_instances[j];
                IF marks ? named THEN
                    mark := (marks ->> named)::bigint;
                ELSE
                    SELECT h.generation INTO mark FROM high_water h
                        WHERE h.identity = p_identities[j] AND h.instance = p_instances[j];
                    mark := coalesce(mark, 0);
                END IF;
                IF p_kinds[j] = KIND_OPEN AND p_generations[j] <> mark + 1 THEN
                    refused_job := p_jobs[j];
                    refused_identity := p_identities[j];
                    refused_instance := p_instances[j];
                    refused_generation := p_generations[j];
                    refused_mark := mark;
                    refused_quota := NULL;
                    RETURN NEXT;
                    refused := true;
                    EXIT;
                END IF;
                marks := marks || jsonb_build_object(named, greatest(mark, p_generations[j]));
            END LOOP;
        END IF;
        CONTINUE WHEN refused;
        -- (f) A job that claims its tenant's quota is counted against it, and refused
        -- whole when a count would pass its quota: nothing written, no mark raised.
        claim := p_claims -> p_jobs[job_first]::text;
        IF claim IS NOT NULL THEN
            FOR j IN job_first .. job_last LOOP
                SELECT * INTO over FROM quota_refusal(
                    claim, p_tokens[j], p_identities[j], p_instances[j], p_generations[j],
                    p_kinds[j], p_phases[j], p_memory[j], p_cpu[j]);
                IF FOUND THEN
                    refused_job := p_jobs[j];
                    refused_identity := p_identities[j];
                    refused_instance := p_instances[j];
                    refused_generation := p_generations[j];
                    refused_mark := NULL;
                    refused_quota := over.quota;
                    refused_requested := over.requested;
                    refused_used := over.used;
                    refused_hard := over.hard;
                    RETURN NEXT;
                    refused := true;
                    EXIT;
                END IF;
            END LOOP;
            CONTINUE WHEN refused;
        END IF;
        FOR j IN job_first .. job_last LOOP
            IF p_kinds[j] = KIND_OPEN THEN
                -- (e) Another runner's live older generation: a row in its runner's
                -- inbox, a notification to it (only here, not on the common path:
                -- NOTIFY serializes commits), and a row to the opener, which waits for
                -- its stop (F6) without a look of its own.
                FOR older IN
                    SELECT r.runner_id, u.epoch, r.generation, r.lease, u.stop_bound,
                        extract(epoch FROM clock_timestamp() - u.lease_until)::double precision
                            AS expired
                    FROM records r JOIN runners u ON u.runner_id = r.runner_id
                    WHERE r.identity = p_identities[j] AND r.instance = p_instances[j]
                      AND r.generation < p_generations[j] AND r.stopped IS NULL
                      AND r.runner_id <> p_runner
                LOOP
                    INSERT INTO inbox AS b (runner_id, identity, instance, generation)
                        VALUES (older.runner_id, p_identities[j], p_instances[j],
                                p_generations[j])
                        ON CONFLICT (runner_id, identity, instance) DO UPDATE
                        SET generation = greatest(b.generation, excluded.generation);
                    PERFORM pg_notify(current_schema(), json_build_object(
                        'kind', 'superseded', 'runner', older.runner_id,
                        'identity', p_identities[j], 'instance', p_instances[j],
                        'generation', p_generations[j])::text);
                    refused_job := p_jobs[j];
                    refused_identity := NULL;
                    refused_instance := NULL;
                    refused_generation := NULL;
                    refused_mark := NULL;
                    refused_quota := NULL;
                    refused_requested := NULL;
                    refused_used := NULL;
                    refused_hard := NULL;
                    older_runner := older.runner_id;
                    older_epoch := older.epoch;
                    older_generation := older.generation;
                    older_lease := older.lease;
                    older_stop_bound := older.stop_bound;
                    older_expired := older.expired;
                    RETURN NEXT;
                END LOOP;
                older_runner := NULL;
                UPDATE high_water h SET generation = p_generations[j]
                    WHERE h.identity = p_identities[j] AND h.instance = p_instances[j];
            ELSIF NOT EXISTS (
                SELECT 1 FROM high_water h
                WHERE h.identity = p_identities[j] AND h.instance = p_instances[j]
                  AND h.generation >= p_generations[j]
            ) THEN
                -- (c) A record above its key's mark that is no Open (recovery writes
                -- them): the mark rises too. Rare, so this read spares the common path
                -- a write.
                INSERT INTO high_water AS h (identity, instance, generation)
                    VALUES (p_identities[j], p_instances[j], p_generations[j])
                    ON CONFLICT (identity, instance) DO UPDATE
                    SET generation = greatest(h.generation, excluded.generation);
            END IF;
            IF p_kinds[j] < KIND_STOPPED THEN
                -- A Stopped record saved as not Stopped (only a caller that un-stops
                -- one): one Stopped record fewer.
                PERFORM 1 FROM records r WHERE r.token = p_tokens[j] AND r.stopped IS NOT NULL;
                IF FOUND THEN
                    stopped_delta := stopped_delta - 1;
                END IF;
            END IF;
            fresh := CASE WHEN p_kinds[j] >= KIND_STOPPED THEN nextval('stop_order') END;
            INSERT INTO records AS r (
                token, identity, instance, generation, request_id, runner_id, epoch,
                saved, stopped, lease, body, phase, memory_bytes, cpu_percent
            ) VALUES (
                p_tokens[j], p_identities[j], p_instances[j], p_generations[j],
                p_requests[j], p_runner, p_epoch, nextval('save_order'), fresh,
                p_leases[j], p_bodies[j], p_phases[j], p_memory[j], p_cpu[j]
            ) ON CONFLICT (token) DO UPDATE SET
                identity = excluded.identity, instance = excluded.instance,
                generation = excluded.generation, request_id = excluded.request_id,
                runner_id = excluded.runner_id, epoch = excluded.epoch,
                saved = excluded.saved, lease = excluded.lease, body = excluded.body,
                phase = excluded.phase, memory_bytes = excluded.memory_bytes,
                cpu_percent = excluded.cpu_percent,
                -- A record Stopped already keeps its place in the stop order.
                stopped = CASE WHEN excluded.stopped IS NULL THEN NULL
                               ELSE coalesce(r.stopped, excluded.stopped) END
            RETURNING r.stopped INTO kept;
            -- Only a new stop evicts, as retention.StopOrder has it (a record saved
            -- Stopped again keeps its place, and evicts nothing).
            IF kept = fresh THEN
                IF p_kinds[j] = KIND_SUPERSEDED THEN
                    -- An opener on another runner may wait for this stop (O5 across
                    -- the fleet): tell it, and only it (NOTIFY serializes commits).
                    PERFORM pg_notify(current_schema(), json_build_object(
                        'kind', 'stopped', 'runner', p_runner,
                        'identity', p_identities[j], 'instance', p_instances[j],
                        'generation', p_generations[j])::text)
                    WHERE EXISTS (
                        SELECT 1 FROM records r
                        WHERE r.identity = p_identities[j] AND r.instance = p_instances[j]
                          AND r.generation > p_generations[j] AND r.runner_id <> p_runner);
                END IF;
                -- (d) Retention, fleet-wide: the oldest Stopped of the key beyond the
                -- number kept per key go ...
                -- Rows another batch is evicting meanwhile are skipped, never waited
                -- for: two runners' evictions must not wait for each other (a deadlock
                -- fails both batches), and what one skips, the other deletes.
                DELETE FROM records r WHERE r.token IN (
                    SELECT s.token FROM records s
                    WHERE s.identity = p_identities[j] AND s.instance = p_instances[j]
                      AND s.stopped IS NOT NULL
                    ORDER BY s.stopped DESC OFFSET p_per_key FOR UPDATE SKIP LOCKED);
                GET DIAGNOSTICS gone = ROW_COUNT;
                stopped_delta := stopped_delta + 1 - gone;
                -- ... then the oldest of all beyond the cap. The count is the sum of
                -- the runners' counters (stop_counts: each batch adds what it changed
                -- to its own runner's, so no two runners write one row), read once a
                -- batch; a concurrent batch of another runner may overshoot the cap
                -- until the next. (Counting the Stopped rows took 6 ms a batch at a
                -- million records: most of a session's cost to the server.)
                IF stopped_count IS NULL THEN
                    SELECT coalesce(sum(c.stopped), 0) INTO stopped_count FROM stop_counts c;
                END IF;
                IF stopped_count + stopped_delta > p_total THEN
                    DELETE FROM records r WHERE r.token IN (
                        SELECT s.token FROM records s WHERE s.stopped IS NOT NULL
                        ORDER BY s.stopped LIMIT stopped_count + stopped_delta - p_total
                        FOR UPDATE SKIP LOCKED);
                    GET DIAGNOSTICS gone = ROW_COUNT;
                    stopped_delta := stopped_delta - gone;
                END IF;
            END IF;
        END LOOP;
    END LOOP;
    IF stopped_delta <> 0 THEN
        INSERT INTO stop_counts AS c (runner_id, stopped) VALUES (p_runner, stopped_delta)
            ON CONFLICT (runner_id) DO UPDATE SET stopped = c.stopped + excluded.stopped;
    END IF;
END
$$
"""
)


# What a job's claim (a QuotaClaim, as the worker sends it: tenant, pattern (the
# identities as one regular expression, or null: none), the four quotas (null: none),
# and what a child without a memory or CPU limit counts) says of one of its rows: no
# row when the row is within the quota, else the first quota it would pass. An Open
# row takes a session, unless an older generation of its key is live (it supersedes
# it); a Loading or Loaded row takes a child, unless its session counted one already.
# Live rows (not Stopped) are counted: the partial index records_live finds them.
_QUOTA_REFUSAL = _named("""
CREATE FUNCTION quota_refusal(
    p_claim jsonb, p_token text, p_identity text, p_instance text, p_generation bigint,
    p_kind smallint, p_phase text, p_memory bigint, p_cpu bigint
) RETURNS TABLE (quota text, requested numeric, used numeric, hard numeric)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    pattern text := p_claim ->> 'pattern';
    unlimited_memory bigint := (p_claim ->> 'unlimited_memory_bytes')::bigint;
    unlimited_cpu bigint := (p_claim ->> 'unlimited_cpu_percent')::bigint;
    children numeric;
    memory numeric;
    cpu numeric;
BEGIN
    IF p_kind = KIND_OPEN THEN
        hard := (p_claim ->> 'sessions')::numeric;
        IF hard IS NULL OR EXISTS (
            SELECT 1 FROM records r
            WHERE r.identity = p_identity AND r.instance = p_instance
              AND r.stopped IS NULL AND r.generation < p_generation
        ) THEN
            RETURN;
        END IF;
        SELECT count(*) INTO used FROM records r
            WHERE r.stopped IS NULL AND r.identity ~ pattern;
        IF used + 1 > hard THEN
            quota := 'sessions';
            requested := 1;
            RETURN NEXT;
        END IF;
        RETURN;
    END IF;
    IF p_phase NOT IN ('Loading', 'Loaded') OR EXISTS (
        SELECT 1 FROM records r
        WHERE r.token = p_token AND r.phase IN ('Loading', 'Loaded') AND r.stopped IS NULL
    ) THEN
        RETURN;
    END IF;
    SELECT count(*), coalesce(sum(coalesce(r.memory_bytes, unlimited_memory)), 0),
           coalesce(sum(coalesce(r.cpu_percent, unlimited_cpu)), 0)
        INTO children, memory, cpu
        FROM records r
        WHERE r.stopped IS NULL AND r.phase IN ('Loading', 'Loaded') AND r.identity ~ pattern;
    hard := (p_claim ->> 'children')::numeric;
    IF hard IS NOT NULL AND children + 1 > hard THEN
        quota := 'children';
        requested := 1;
        used := children;
        RETURN NEXT;
        RETURN;
    END IF;
    hard := (p_claim ->> 'memory_bytes')::numeric;
    requested := coalesce(p_memory, unlimited_memory);
    IF hard IS NOT NULL AND memory + requested > hard THEN
        quota := 'memory_bytes';
        used := memory;
        RETURN NEXT;
        RETURN;
    END IF;
    hard := (p_claim ->> 'cpu_percent')::numeric;
    requested := coalesce(p_cpu, unlimited_cpu);
    IF hard IS NOT NULL AND cpu + requested > hard THEN
        quota := 'cpu_percent';
        used := cpu;
        RETURN NEXT;
    END IF;
END
$$
""")

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
    _QUOTA_REFUSAL,
    # Versions 2 to 5 created save_batch here, as write_batch is now; version 6 makes
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
#   runners of version 5 until they restart, as its refusals.
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
_SAVE_BATCH = f"""
CREATE OR REPLACE FUNCTION save_batch({_PARAMETERS}) RETURNS TABLE ({_REFUSALS})
LANGUAGE sql SET search_path FROM CURRENT AS $$
    SELECT w.refused_job, w.refused_identity, w.refused_instance, w.refused_generation,
        w.refused_mark, w.refused_quota, w.refused_requested, w.refused_used,
        w.refused_hard
    FROM write_batch(p_runner, p_epoch, p_per_key, p_total, p_jobs, p_tokens,
        p_identities, p_instances, p_generations, p_requests, p_leases, p_kinds,
        p_bodies, p_phases, p_memory, p_cpu, p_claims) AS w
    WHERE w.older_runner IS NULL
$$
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
    _WRITE_BATCH,
    _SAVE_BATCH,
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
}

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


# -- migrating: under MIGRATION_LOCK, in one transaction (_postgres_worker.migrate) -----

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
    "    lease_until = excluded.lease_until, draining = false "
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
    "    u.draining "
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
NEXT_EPOCH: Final = "UPDATE runners SET epoch = epoch + 1 WHERE runner_id = %s"
