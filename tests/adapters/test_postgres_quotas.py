"""The PostgreSQL store's side of quotas across a fleet (docs/design.md, F9): a tenant's
fnmatch patterns as one regular expression in the database, the claim carried by a
save, and the migration that added what the quotas count. The engine's side (two
runners racing for a tenant's last slots) is tests/rules/test_fleet_quotas.py."""

from __future__ import annotations

import fnmatch
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from trio_supervisor import (
    Handle,
    Key,
    Limits,
    Load,
    LoadingRecord,
    OpenRecord,
    PostgresStore,
    QuotaClaim,
    QuotaExceededError,
    StaleSessionError,
)
from trio_supervisor.codec import encode
from trio_supervisor.model import carried
from trio_supervisor.stores._postgres_patterns import identity_regex
from trio_supervisor.stores._postgres_schema import MIGRATIONS, SCHEMA_VERSION


@pytest.fixture(scope="module")
def connection(database: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database, autocommit=True) as connection:
        yield connection


# -- the patterns ----------------------------------------------------------------------

# Characters a PostgreSQL text can hold, biased towards those special to fnmatch, to
# regular expressions, or to either's sets.
SPECIAL = list("*?[]!-^\\&~|.()$+{}:aAb0\n")
CHARACTERS = st.one_of(
    st.sampled_from(SPECIAL),
    st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
)
IDENTITIES = st.text(CHARACTERS, min_size=1, max_size=10)
PATTERNS = st.text(CHARACTERS, max_size=10)


def matches(connection: psycopg.Connection[Any], identity: str, regex: str | None) -> bool:
    row = connection.execute("SELECT coalesce(%s::text ~ %s::text, false)", (identity, regex))
    found = row.fetchone()
    assert found is not None
    return bool(found[0])


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(identity=IDENTITIES, patterns=st.lists(PATTERNS, max_size=3))
def test_the_patterns_match_in_the_database_exactly_as_fnmatchcase(
    connection: psycopg.Connection[Any], identity: str, patterns: list[str]
) -> None:
    expected = any(fnmatch.fnmatchcase(identity, pattern) for pattern in patterns)
    assert matches(connection, identity, identity_regex(patterns)) is expected


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pattern=PATTERNS, data=st.data())
def test_a_pattern_matches_what_it_was_made_from(
    connection: psycopg.Connection[Any], pattern: str, data: st.DataObject
) -> None:
    """Identities drawn from the pattern itself (its characters, with ``*`` and ``?``
    filled in) are the ones most likely to match: random ones almost never do."""
    pieces = [
        data.draw(st.text(CHARACTERS, max_size=3))
        if c == "*"
        else data.draw(CHARACTERS)
        if c == "?"
        else c
        for c in pattern
    ]
    identity = "".join(pieces).replace("\x00", "") or "x"
    expected = fnmatch.fnmatchcase(identity, pattern)
    assert matches(connection, identity, identity_regex([pattern])) is expected


@pytest.mark.parametrize(
    ("patterns", "identity", "expected"),
    [
        (["acme-*"], "acme-1", True),
        (["acme-*"], "ACME-1", False),  # case matters, as fnmatchcase has it
        (["a[!b-d]?"], "a\n1", True),  # ? and sets match a newline
        (["[]x]"], "]", True),
        (["[!]"], "[!]", True),  # no closing bracket: a plain "["
        (["a["], "a[", True),  # a "[" that ends the pattern is a plain "[" too
        (["a[!"], "a[!", True),  # and so is one with only its "!" after it
        (["[z-a]x"], "x", False),  # an empty set matches nothing
        (["*"], "anything at all", True),
        ([], "x", False),
    ],
)
def test_the_patterns_examples(
    connection: psycopg.Connection[Any], patterns: list[str], identity: str, expected: bool
) -> None:
    assert any(fnmatch.fnmatchcase(identity, pattern) for pattern in patterns) is expected
    assert matches(connection, identity, identity_regex(patterns)) is expected


# -- the claim a save carries ----------------------------------------------------------


def opened(
    instance: str, generation: int = 1, *, memory: int | None = None, identity: str = "acme"
) -> OpenRecord:
    return OpenRecord(
        handle=Handle(
            key=Key(identity=identity, instance=instance),
            token=str(uuid.uuid4()),
            generation=generation,
        ),
        request_id="r",
        lease=30.0,
        limits=Limits(memory_bytes=memory),
    )


def loading(record: OpenRecord) -> LoadingRecord:
    return LoadingRecord(**carried(record), load=Load(specifier="x"), child=None)


async def test_a_refused_claim_writes_nothing_while_its_batch_mates_land(
    database: str, schema: str
) -> None:
    quota = QuotaClaim(tenant="acme", identities=["acme"], sessions=2, children=1)
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        first, second = opened("1"), opened("2")
        await store.save_within(first, quota)
        await store.save_within(second, quota)
        third, unclaimed = opened("3"), opened("4", identity="other")
        refused: list[QuotaExceededError] = []

        async def claimed() -> None:
            try:
                await store.save_within(third, quota)
            except QuotaExceededError as error:
                refused.append(error)

        commits = store.commits
        async with trio.open_nursery() as nursery:  # one batch, one transaction
            nursery.start_soon(claimed)
            nursery.start_soon(store.save, unclaimed)
        assert store.commits == commits + 1
        assert [(e.quota, e.requested, e.used, e.hard) for e in refused] == [("sessions", 1, 2, 2)]
        records = {record.handle.token: record for record in await store.list()}
        assert third.handle.token not in records
        assert unclaimed.handle.token in records
        # No generation claimed: the key opens as generation 1 still, claim-free.
        assert (await store.lookup(third.handle.key, None))[0] == 0
        await store.save(third)
        # A first Loading record takes a child; the session's own later ones do not.
        await store.save_within(loading(first), quota)
        await store.save_within(loading(first), quota)
        with pytest.raises(QuotaExceededError, match="children, requested 1, used 1"):
            await store.save_within(loading(second), quota)
        assert records[second.handle.token] == (await store.held(second.handle.token)).record  # type: ignore[union-attr]
        # A lost compare-and-set still says so, claim or not.
        with pytest.raises(StaleSessionError):
            await store.save_within(opened("1", generation=5), quota)


# -- the migration ---------------------------------------------------------------------


async def test_a_version_1_schema_is_migrated_with_its_records_counted(
    database: str, schema: str
) -> None:
    """A schema version 1 wrote (its tables, a live Loading record) is migrated: the
    columns quotas count are read from the records already there."""
    record = opened("old", memory=64)
    with psycopg.connect(database, autocommit=True) as connection:
        connection.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        connection.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        connection.execute("CREATE TABLE schema_version (version integer NOT NULL)")
        connection.execute("INSERT INTO schema_version VALUES (1)")
        for statement in MIGRATIONS[1]:
            connection.execute(statement)
        connection.execute("INSERT INTO runners VALUES ('old', 1, '', now(), now(), 0)")
        connection.execute(
            "INSERT INTO records (token, identity, instance, generation, request_id, "
            "runner_id, epoch, saved, lease, body) VALUES (%s, 'acme', 'old', 1, 'r', "
            "'old', 1, 1, 30, %s)",
            (record.handle.token, encode(loading(record))),
        )
        connection.execute("INSERT INTO high_water VALUES ('acme', 'old', 1)")
    quota = QuotaClaim(tenant="acme", identities=["acme"], memory_bytes=100)
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        with pytest.raises(QuotaExceededError, match="memory_bytes, requested 50, used 64"):
            await store.save_within(loading(opened("new", memory=50)), quota)
    with psycopg.connect(database, autocommit=True) as connection:
        connection.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        assert connection.execute("SELECT version FROM schema_version").fetchall() == [
            (SCHEMA_VERSION,)
        ]
        assert connection.execute(
            "SELECT phase, memory_bytes, cpu_percent FROM records"
        ).fetchall() == [("Loading", 64, None)]


# The expressions' shape, written out: the fewest ranges of a set (adjacent ones joined),
# "." for a set of every character a text can hold, an escape of four hex digits up to
# U+FFFF and of eight past it, a run of stars as one. What each matches is checked in
# the database above; these pin the text itself (kills mutmut's mutants of the module).
@pytest.mark.parametrize(
    ("patterns", "expected"),
    [
        (["a**b"], r"^(?:a.*b)$"),
        (["*a*"], r"^(?:.*a.*)$"),
        (["a[!]]b"], r"^(?:a[\u0001-\u005c\u005e-\ud7ff\ue000-\U0010ffff]b)$"),
        (["[]a]"], r"^(?:[\u005da])$"),
        (["[!a]"], r"^(?:[\u0001-\u0060b-\ud7ff\ue000-\U0010ffff])$"),
        (["[!\x00]"], r"^(?:.)$"),
        (["[!\ud7ff]"], r"^(?:[\u0001-\ud7fe\ue000-\U0010ffff])$"),
        (["[\ud7ff\ue000]"], r"^(?:[\ud7ff\ue000])$"),
        (["[abc]", "[a-cx]"], r"^(?:[a-c]|[a-cx])$"),
        (["[\U0010ffff]"], r"^(?:[\U0010ffff])$"),
        (["[\uffff]", "[\U00010000]"], r"^(?:[\uffff]|[\U00010000])$"),
        (["[\x01]", "[\x7f]", "[\x80]"], r"^(?:[\u0001]|[\u007f]|[\u0080])$"),
        (["x[ab", "a?\u00e9"], r"^(?:x\u005bab|a.\u00e9)$"),
        (["[z-a]", "k"], r"^(?:k)$"),
        (["[z-a]"], None),
        (["[\ud800]", "[\udfff]"], None),  # a PostgreSQL text holds no surrogate
        ([], None),
    ],
)
def test_the_expressions_are_written_in_the_fewest_ranges(
    patterns: list[str], expected: str | None
) -> None:
    assert identity_regex(patterns) == expected


async def test_a_child_without_ceilings_counts_as_the_claim_says_and_names_its_tenant(
    database: str, schema: str
) -> None:
    """A child without a memory or CPU ceiling counts as the claim's unlimited figures
    (the allocatable memory, every core), quota by quota, and the refusal names the
    claim's tenant."""
    memory = QuotaClaim(
        tenant="acme", identities=["acme"], memory_bytes=100, unlimited_memory_bytes=1000
    )
    cpu = QuotaClaim(
        tenant="globex", identities=["acme"], cpu_percent=150, unlimited_cpu_percent=200
    )
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        first, second = opened("1"), opened("2")
        await store.save_within(first, memory)
        await store.save_within(second, cpu)
        with pytest.raises(QuotaExceededError) as refused:
            await store.save_within(loading(first), memory)
        assert str(refused.value) == (
            "tenant 'acme' exceeded quota: memory_bytes, requested 1000, used 0, limited 100"
        )
        with pytest.raises(QuotaExceededError) as refused:
            await store.save_within(loading(second), cpu)
        assert str(refused.value) == (
            "tenant 'globex' exceeded quota: cpu_percent, requested 200, used 0, limited 150"
        )
        # Within the quotas, with ceilings: admitted.
        third = opened("3", memory=60)
        await store.save_within(third, memory)
        await store.save_within(loading(third), memory)


async def test_a_claim_waits_for_its_tenant_s_lock_which_another_batch_holds(
    database: str, schema: str
) -> None:
    """Two runners' claims of one tenant are counted one after the other: a batch that
    carries one takes the tenant's advisory lock first, and waits while another
    transaction holds it (one of a batch of another runner's, here the test's own)."""
    from ..support.waits import until

    quota = QuotaClaim(tenant="acme", identities=["acme"], sessions=5)
    lock = (
        "SELECT pg_advisory_xact_lock(hashtextextended('trio_supervisor quota' || chr(31) "
        "|| %s || chr(31) || 'acme', 0))"
    )
    waiters = (
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity s USING (pid) "
        "WHERE NOT l.granted AND l.locktype = 'advisory' AND s.datname = current_database() "
        "AND s.application_name = 'trio_supervisor a'"
    )
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        with psycopg.connect(database, autocommit=False) as holder:
            holder.execute(lock, (schema,))
            saved = trio.Event()

            async def save() -> None:
                await store.save_within(opened("1"), quota)
                saved.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(save)
                with psycopg.connect(database, autocommit=True) as looker:

                    def waits_or_saved() -> bool:
                        row = looker.execute(waiters).fetchone()
                        return saved.is_set() or bool(row and row[0])

                    await until(waits_or_saved, "the batch waits, or saved", bound=10)
                assert not saved.is_set(), "the claim did not wait for its tenant's lock"
                holder.rollback()
        assert [record.handle.key.instance for record in await store.list()] == ["1"]
