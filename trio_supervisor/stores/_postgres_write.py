"""The PostgreSQL store's write path in the database: ``write_batch``, the function every
batch of saves is one call of, and ``quota_refusal``, which counts a tenant's claim.

A call of ``write_batch`` is one round trip (as SQLite's trigger makes a batch one
statement) and in autocommit one transaction: the function fences the writer, claims
the generations of its Open records, writes the rows, raises the marks, applies
retention (its stopped_for by the database's clock), writes the supersedes into their
holders' inboxes and notifies, and returns its refusals and the older generations its
Opens found on other runners. A save that carries a tenant's quota claim is counted
there too, by ``quota_refusal``, once the batch holds its tenants' advisory locks.
Earlier versions' functions stay, as wrappers, for their runners until they restart.
The migrations (:mod:`._postgres_schema`) create them all.
"""

from __future__ import annotations

from typing import Final

__all__ = ["FENCED", "QUOTA_REFUSAL", "SAVE_BATCH", "WRITE_BATCH", "WRITE_BATCH_6", "Kind"]

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


# The write path. The rows of a batch come as parallel arrays (psycopg sends them in
# binary: no JSON to build or parse), grouped by job: a job is one caller's save or
# save_many, and is written whole or, when one of its Opens loses, not at all. Other
# jobs of the batch land either way: they are other callers' saves. A job may carry a
# tenant's quota claim (p_claims, by job number: quota_refusal says what it holds), and
# is refused whole, the same way, when the claim would pass its quota.
# p_for (version 7) is retention's stopped_for, in seconds: 0 keeps no Stopped record
# past the number per key.
_PARAMETERS = """
    p_runner text, p_epoch bigint, p_per_key integer, p_total integer, p_for double precision,
    p_jobs integer[], p_tokens text[], p_identities text[], p_instances text[],
    p_generations bigint[], p_requests text[], p_leases double precision[],
    p_kinds smallint[], p_bodies text[], p_phases text[], p_memory bigint[],
    p_cpu bigint[], p_claims jsonb
"""
# The parameters of version 6's write_batch (and of save_batch): no p_for.
_PARAMETERS_6 = _PARAMETERS.replace(" p_for double precision,", "")
_REFUSALS = """
    refused_job integer, refused_identity text, refused_instance text,
    refused_generation bigint, refused_mark bigint, refused_quota text,
    refused_requested numeric, refused_used numeric, refused_hard numeric
"""
_OLDER = """
    older_runner text, older_epoch bigint, older_generation bigint,
    older_lease double precision, older_stop_bound double precision,
    older_expired double precision
"""
WRITE_BATCH: Final = _named(
    "CREATE FUNCTION write_batch("
    + _PARAMETERS
    + ") RETURNS TABLE ("
    + _REFUSALS
    + ","
    + _OLDER
    + """)
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
                saved, stopped, lease, body, phase, memory_bytes, cpu_percent, stopped_at
            ) VALUES (
                p_tokens[j], p_identities[j], p_instances[j], p_generations[j],
                p_requests[j], p_runner, p_epoch, nextval('save_order'), fresh,
                p_leases[j], p_bodies[j], p_phases[j], p_memory[j], p_cpu[j],
                CASE WHEN fresh IS NOT NULL THEN clock_timestamp() END
            ) ON CONFLICT (token) DO UPDATE SET
                identity = excluded.identity, instance = excluded.instance,
                generation = excluded.generation, request_id = excluded.request_id,
                runner_id = excluded.runner_id, epoch = excluded.epoch,
                saved = excluded.saved, lease = excluded.lease, body = excluded.body,
                phase = excluded.phase, memory_bytes = excluded.memory_bytes,
                cpu_percent = excluded.cpu_percent,
                -- A record Stopped already keeps its place in the stop order, and
                -- its time (none if it stopped before version 7: long ago).
                stopped = CASE WHEN excluded.stopped IS NULL THEN NULL
                               ELSE coalesce(r.stopped, excluded.stopped) END,
                stopped_at = CASE WHEN excluded.stopped IS NULL THEN NULL
                                  WHEN r.stopped IS NOT NULL THEN r.stopped_at
                                  ELSE excluded.stopped_at END
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
                IF p_for = 0 THEN
                    DELETE FROM records r WHERE r.token IN (
                        SELECT s.token FROM records s
                        WHERE s.identity = p_identities[j] AND s.instance = p_instances[j]
                          AND s.stopped IS NOT NULL
                        ORDER BY s.stopped DESC OFFSET p_per_key FOR UPDATE SKIP LOCKED);
                ELSE
                    -- ... those of them that stopped p_for seconds ago or earlier, by
                    -- the database's clock (retention's stopped_for; a row stopped
                    -- before version 7 has no time: long ago). Only those are locked.
                    DELETE FROM records r WHERE r.token IN (
                        SELECT s.token FROM records s
                        WHERE s.token IN (
                            SELECT x.token FROM records x
                            WHERE x.identity = p_identities[j]
                              AND x.instance = p_instances[j] AND x.stopped IS NOT NULL
                            ORDER BY x.stopped DESC OFFSET p_per_key)
                          AND (s.stopped_at IS NULL OR s.stopped_at
                               <= clock_timestamp() - make_interval(secs => p_for))
                        FOR UPDATE SKIP LOCKED);
                END IF;
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


# The write_batch of version 6, for its runners until they restart: the same function,
# keeping no Stopped record past the number per key (as they did). Replacing it (not
# dropping it) keeps save_batch, which calls it, valid.
WRITE_BATCH_6: Final = (
    "CREATE OR REPLACE FUNCTION write_batch("
    + _PARAMETERS_6
    + ") RETURNS TABLE ("
    + _REFUSALS
    + ","
    + _OLDER
    + """)
LANGUAGE sql SET search_path FROM CURRENT AS $$
    SELECT * FROM write_batch(p_runner, p_epoch, p_per_key, p_total, 0::double precision,
        p_jobs, p_tokens, p_identities, p_instances, p_generations, p_requests, p_leases,
        p_kinds, p_bodies, p_phases, p_memory, p_cpu, p_claims)
$$
"""
)

# save_batch, the function of versions 2 to 5, for their runners until they restart:
# write_batch's refusals alone, in their old shape.
SAVE_BATCH: Final = f"""
CREATE OR REPLACE FUNCTION save_batch({_PARAMETERS_6}) RETURNS TABLE ({_REFUSALS})
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


# What a job's claim (a QuotaClaim, as the worker sends it: tenant, pattern (the
# identities as one regular expression, or null: none), the four quotas (null: none),
# and what a child without a memory or CPU limit counts) says of one of its rows: no
# row when the row is within the quota, else the first quota it would pass. An Open
# row takes a session, unless an older generation of its key is live (it supersedes
# it); a Loading or Loaded row takes a child, unless its session counted one already.
# Live rows (not Stopped) are counted: the partial index records_live finds them.
QUOTA_REFUSAL: Final = _named("""
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
