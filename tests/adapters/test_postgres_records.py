"""The PostgreSQL store's records on a real server (``_postgres_records``): the arrays a
batch of saves sends, the claims and refusals it carries, and the reads back (a
runner's records, the fleet's, one key's, one token's, the runners'), checked against
what the rows in the database hold."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import pytest
import trio
import trio.testing

from trio_supervisor import (
    ChildIdentity,
    CodeIdentity,
    Disposed,
    ExitStatus,
    Handle,
    Key,
    Limits,
    Load,
    LoadedRecord,
    LoadingRecord,
    OpenRecord,
    PostgresStore,
    QuotaClaim,
    QuotaExceededError,
    RecordFormatError,
    Retention,
    RunnerFencedError,
    StaleSessionError,
    StoppedRecord,
    StoppingRecord,
    Superseded,
    Termination,
)
from trio_supervisor.codec import encode
from trio_supervisor.model import FleetRecord, RunnerInfo, carried
from trio_supervisor.stores._postgres_patterns import identity_regex
from trio_supervisor.stores._postgres_records import claimed, columns, refusal_error
from trio_supervisor.stores._postgres_schema import Kind

from ..support.postgres import query_in as run
from ..support.postgres import runner_row_locked
from ..support.tcp_proxy import TcpProxy
from ..support.waits import until

DONE = Termination(kind="exited", exit=ExitStatus(code=0))


def opened(
    instance: str,
    generation: int = 1,
    *,
    identity: str = "p",
    limits: Limits | None = None,
    request: str | None = None,
    token: str | None = None,
) -> OpenRecord:
    return OpenRecord(
        handle=Handle(
            key=Key(identity=identity, instance=instance),
            token=token or f"{identity}-{instance}-{generation}".rjust(32, "0"),
            generation=generation,
        ),
        request_id=request or f"r{generation}",
        lease=7.5,
        limits=limits or Limits(),
    )


def loading(record: OpenRecord) -> LoadingRecord:
    return LoadingRecord(**carried(record), load=Load(specifier="x"), child=None)


def loaded(record: OpenRecord) -> LoadedRecord:
    return LoadedRecord(
        **carried(record),
        load=Load(specifier="x"),
        code=CodeIdentity(specifier="x"),
        child=ChildIdentity(adapter="fake", ref="1"),
    )


def stopped(record: OpenRecord, reason: Any = None) -> StoppedRecord:
    return StoppedRecord.of(record, reason or Disposed(), DONE)


def rows_of(*records: Any) -> list[tuple[Any, str]]:
    return [(each, encode(each)) for each in records]


# -- what a batch sends ----------------------------------------------------------------


def test_columns_are_write_batch_s_arrays_job_by_job() -> None:
    first = opened("a", 3, limits=Limits(memory_bytes=64, cpu_percent=150))
    second = opened("b", 1, identity="q")
    jobs = [
        rows_of(first, loading(first)),
        rows_of(
            StoppingRecord.of(second, Disposed()),
            stopped(second, Superseded()),
            stopped(first),
        ),
    ]
    (
        numbers,
        tokens,
        identities,
        instances,
        generations,
        requests,
        leases,
        kinds,
        bodies,
        phases,
        memory,
        cpu,
    ) = columns(jobs)
    assert numbers == [0, 0, 1, 1, 1]
    assert tokens == [first.handle.token] * 2 + [second.handle.token] * 2 + [first.handle.token]
    assert identities == ["p", "p", "q", "q", "p"]
    assert instances == ["a", "a", "b", "b", "a"]
    assert generations == [3, 3, 1, 1, 3]
    assert requests == ["r3", "r3", "r1", "r1", "r3"]
    assert leases == [7.5] * 5
    assert kinds == [Kind.OPEN, Kind.OTHER, Kind.OTHER, Kind.SUPERSEDED, Kind.STOPPED]
    assert kinds == [1, 0, 0, 3, 2]
    assert bodies == [body for job in jobs for _, body in job]
    assert phases == ["Open", "Loading", "Stopping", "Stopped", "Stopped"]
    assert memory == [64, 64, None, None, 64]
    assert cpu == [150, 150, None, None, 150]


def test_columns_written_back_send_no_open() -> None:
    """Restored rows (a failover lost them) are no Opens: no compare-and-set."""
    first = opened("a")
    jobs = [rows_of(first, loaded(first), stopped(first, Superseded()))]
    assert columns(jobs, restore=True)[7] == [Kind.OTHER, Kind.OTHER, Kind.SUPERSEDED]
    assert columns(jobs)[7] == [Kind.OPEN, Kind.OTHER, Kind.SUPERSEDED]
    assert columns([]) == ([],) * 12


def test_claims_are_sent_by_job_number_as_quota_refusal_reads_them() -> None:
    full = QuotaClaim(
        tenant="acme",
        identities=["acme-*", "x?"],
        sessions=1,
        children=2,
        memory_bytes=3,
        cpu_percent=4,
        unlimited_memory_bytes=5,
        unlimited_cpu_percent=6,
    )
    bare = QuotaClaim(tenant="globex", identities=[])
    assert claimed({0: full, 7: bare}) == {
        "0": {
            "tenant": "acme",
            "pattern": identity_regex(["acme-*", "x?"]),
            "sessions": 1,
            "children": 2,
            "memory_bytes": 3,
            "cpu_percent": 4,
            "unlimited_memory_bytes": 5,
            "unlimited_cpu_percent": 6,
        },
        "7": {
            "tenant": "globex",
            "pattern": None,
            "sessions": None,
            "children": None,
            "memory_bytes": None,
            "cpu_percent": None,
            "unlimited_memory_bytes": 0,
            "unlimited_cpu_percent": 0,
        },
    }
    assert claimed({}) == {}


def test_a_refused_open_says_which_generation_opens_next() -> None:
    error = refusal_error(("p", "k", 3, 1, None, None, None, None), None)
    assert isinstance(error, StaleSessionError)
    assert str(error) == (
        "generation 3 of p/k was not opened: the key's high-water in the fleet is 1, so "
        "the next open is generation 2 (another open claimed it first); nothing of this "
        "save was written"
    )


def test_a_refused_claim_names_its_tenant_and_counts() -> None:
    claim = QuotaClaim(tenant="acme", identities=["p"], memory_bytes=100)
    refusal = ("p", "k", 1, None, "memory_bytes", Decimal(60), Decimal(50), Decimal(100))
    error = refusal_error(refusal, claim)
    assert isinstance(error, QuotaExceededError)
    assert (error.quota, error.requested, error.used, error.hard) == ("memory_bytes", 60, 50, 100)
    assert all(type(n) is int for n in (error.requested, error.used, error.hard))
    assert str(error) == (
        "tenant 'acme' exceeded quota: memory_bytes, requested 60, used 50, limited 100"
    )
    # Without the claim (no caller's job has it), the tenant is unknown.
    unknown = refusal_error(refusal, None)
    assert str(unknown).startswith("tenant '?' exceeded quota: memory_bytes")


# -- on the server ---------------------------------------------------------------------


@pytest.fixture
async def store(database: str, schema: str) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(
        database, runner_id="a", schema=schema, advertise="http://a:1"
    ) as opened_store:
        yield opened_store


async def test_a_save_writes_each_record_s_columns(
    database: str, schema: str, store: PostgresStore
) -> None:
    limited = opened("l", 2, limits=Limits(memory_bytes=64, cpu_percent=150))
    plain = opened("m")
    await store.save(opened("l", 1))
    await store.save(limited)
    await store.save_many([plain, loading(limited)])
    await store.save(stopped(plain))
    rows = run(
        database,
        schema,
        "SELECT token, identity, instance, generation, request_id, runner_id, epoch, "
        "stopped IS NOT NULL, stopped_at IS NOT NULL, lease, body, phase, memory_bytes, "
        "cpu_percent FROM records ORDER BY saved",
    )
    epoch = store.epoch
    assert rows == [
        (opened("l", 1).handle.token, "p", "l", 1, "r1", "a", epoch, False, False, 7.5,
         encode(opened("l", 1)), "Open", None, None),
        (limited.handle.token, "p", "l", 2, "r2", "a", epoch, False, False, 7.5,
         encode(loading(limited)), "Loading", 64, 150),
        (plain.handle.token, "p", "m", 1, "r1", "a", epoch, True, True, 7.5,
         encode(stopped(plain)), "Stopped", None, None),
    ]  # fmt: skip
    assert run(database, schema, "SELECT * FROM high_water ORDER BY instance") == [
        ("p", "l", 2),
        ("p", "m", 1),
    ]
    assert [record.handle.token for record in await store.list()] == [row[0] for row in rows]


async def test_a_fenced_save_says_whose_epoch_and_writes_nothing(
    database: str, schema: str, store: PostgresStore
) -> None:
    await store.save(opened("k"))
    run(database, schema, "UPDATE runners SET epoch = epoch + 1 WHERE runner_id = 'a'")
    with pytest.raises(RunnerFencedError) as caught:
        await store.save(loading(opened("k")))
    assert str(caught.value) == (
        f"{store.dsn}: cannot save: the epoch {store.epoch} of runner a was taken over by "
        "another runner of the fleet; nothing of this write landed"
    )
    assert run(database, schema, "SELECT phase FROM records") == [("Open",)]


async def test_a_lost_open_names_its_key_and_the_fleet_s_mark(store: PostgresStore) -> None:
    await store.save(opened("k", 1))
    await store.save(opened("other", 1))
    with pytest.raises(StaleSessionError) as caught:
        await store.save(opened("k", 3))
    assert str(caught.value) == (
        "generation 3 of p/k was not opened: the key's high-water in the fleet is 1, so "
        "the next open is generation 2 (another open claimed it first); nothing of this "
        "save was written"
    )
    # The batch's other jobs land; the refused one does not.
    await store.save_many([opened("k", 2)])
    assert [r.handle.generation for r in await store.list()] == [1, 1, 2]


async def test_a_claim_refused_in_a_batch_names_its_own_tenant(store: PostgresStore) -> None:
    """Each job of a batch gets its own claim's refusal; the others land."""
    first = QuotaClaim(tenant="first", identities=["p"], sessions=0)
    second = QuotaClaim(tenant="second", identities=["q"], sessions=5)
    outcomes: dict[str, BaseException | None] = {}

    async def save(name: str, record: OpenRecord, claim: QuotaClaim) -> None:
        try:
            await store.save_within(record, claim)
        except QuotaExceededError as error:
            outcomes[name] = error
        else:
            outcomes[name] = None

    async with trio.open_nursery() as nursery:
        nursery.start_soon(save, "q", opened("k", identity="q"), second)
        nursery.start_soon(save, "p", opened("k"), first)
    assert outcomes["q"] is None
    assert str(outcomes["p"]) == (
        "tenant 'first' exceeded quota: sessions, requested 1, used 0, limited 0"
    )
    assert [r.handle.key.identity for r in await store.list()] == ["q"]


async def test_the_runners_are_listed_as_their_rows_say(
    database: str, schema: str, store: PostgresStore
) -> None:
    before = time.time()
    async with PostgresStore(database, runner_id="b", schema=schema, runner_lease=30) as b:
        await store.save(opened("1"))
        await store.save(opened("2"))
        await store.save(stopped(opened("2")))
        await b.drain()
        run(database, schema, "UPDATE runners SET stop_bound = 2.5 WHERE runner_id = 'a'")
        a_row, b_row = await store.runners()
        assert (a_row.runner_id, a_row.epoch, a_row.advertise) == ("a", store.epoch, "http://a:1")
        assert (a_row.alive, a_row.sessions, a_row.stop_bound, a_row.draining) == (
            True,
            1,
            2.5,
            False,
        )
        assert (a_row.taken_over_at, a_row.taken_over_by) == (None, None)
        assert before - 5 < a_row.started_at < time.time() + 5
        assert type(a_row.started_at) is float
        assert type(a_row.lease_until) is float
        assert a_row.started_at < a_row.lease_until <= a_row.started_at + 10 + 5
        assert (b_row.runner_id, b_row.advertise, b_row.sessions, b_row.draining) == (
            "b",
            "",
            0,
            True,
        )
        assert b_row.lease_until > a_row.lease_until
        # Taken over, and its row expired: the listing says when, by whom, and not alive.
        run(
            database,
            schema,
            "UPDATE runners SET taken_over_at = to_timestamp(1000.5), taken_over_by = 'a', "
            "lease_until = clock_timestamp() - interval '1 minute' WHERE runner_id = 'b'",
        )
        (_, taken) = await b.runners()
        assert (taken.alive, taken.taken_over_at, taken.taken_over_by) == (False, 1000.5, "a")
        assert type(taken.taken_over_at) is float
        assert await store.runners() == [
            RunnerInfo(
                runner_id="a",
                epoch=store.epoch,
                advertise="http://a:1",
                started_at=a_row.started_at,
                lease_until=a_row.lease_until,
                alive=True,
                sessions=1,
                stop_bound=2.5,
            ),
            taken,
        ]


async def test_a_token_s_owner_and_record_are_found_whichever_runner_holds_it(
    database: str, schema: str, store: PostgresStore
) -> None:
    mine, theirs = opened("mine"), opened("theirs")
    async with PostgresStore(database, runner_id="b", schema=schema) as b:
        await store.save(mine)
        await b.save(theirs)
        owner = await store.owner(theirs.handle.token)
        assert owner is not None
        assert (owner.runner_id, owner.epoch, owner.sessions) == ("b", b.epoch, 1)
        assert owner == (await store.runners())[1]
        mine_owner = await b.owner(mine.handle.token)
        assert mine_owner is not None
        assert mine_owner.runner_id == "a"
        assert await store.held(theirs.handle.token) == FleetRecord(
            record=theirs, runner_id="b", epoch=b.epoch
        )
        assert await store.owner("no such token") is None
        assert await store.held("no such token") is None
    # A record whose runner's row is gone is held by no runner the fleet lists.
    run(database, schema, "DELETE FROM runners WHERE runner_id = 'b'")
    assert await store.owner(theirs.handle.token) is None
    held = await store.held(theirs.handle.token)
    assert held is not None
    assert held.runner_id == "b"


async def test_the_fleet_s_records_carry_the_times_their_runners_published(
    database: str, schema: str, store: PostgresStore
) -> None:
    young, late, done = opened("young"), opened("late"), opened("done")
    for record in (young, late, done):
        await store.save(record)
    await store.save(stopped(done))
    # As runner a published its sessions' times (never due again: published far ahead).
    run(
        database,
        schema,
        "INSERT INTO runner_times SELECT 'a', 1e12, jsonb_build_object("
        "%s::text, jsonb_build_array(n.e - 10, n.e + 100), "
        "%s::text, jsonb_build_array(n.e - 20, n.e - 5), "
        "%s::text, jsonb_build_array(n.e - 30, n.e + 5)) "
        "FROM (SELECT extract(epoch FROM clock_timestamp())::double precision AS e) AS n",
        young.handle.token,
        late.handle.token,
        done.handle.token,
    )
    with trio.fail_after(10):
        listed = await store.fleet_records()
    assert listed == [
        FleetRecord(record=young, runner_id="a", epoch=store.epoch),
        FleetRecord(record=late, runner_id="a", epoch=store.epoch),
        FleetRecord(record=stopped(done), runner_id="a", epoch=store.epoch),
    ]
    (y, lt, d) = listed
    assert y.age is not None
    assert y.lease_left is not None
    assert 10 <= y.age < 15
    assert 95 < y.lease_left <= 100
    assert lt.age is not None
    assert 20 <= lt.age < 25
    assert lt.lease_left == 0.0  # its lease ended 5 s ago: none left, not a negative
    assert (d.age, d.lease_left) == (None, None)  # Stopped: no session's times


async def test_lookup_gives_the_mark_and_the_request_s_latest_record(
    database: str, schema: str, store: PostgresStore
) -> None:
    assert await store.lookup(Key(identity="p", instance="k"), "r1") == (0, None)
    first = opened("k", 1, request="same")
    await store.save(first)
    await store.save(opened("k", 2, request="other"))
    await store.save(opened("j", 1, request="same"))
    key = Key(identity="p", instance="k")
    assert await store.lookup(key, "same") == (2, first)
    assert await store.lookup(key, "other") == (2, opened("k", 2, request="other"))
    assert await store.lookup(key, "none") == (2, None)
    assert await store.lookup(key, None) == (2, None)
    # A mark of 0 (a key locked by an Open that then lost) is no mark.
    run(database, schema, "INSERT INTO high_water VALUES ('p', 'zero', 0)")
    assert await store.lookup(Key(identity="p", instance="zero"), None) == (0, None)
    assert await store.high_water() == {key: 2, Key(identity="p", instance="j"): 1}


async def test_a_high_water_row_no_key_can_hold_is_refused_naming_the_store(
    database: str, schema: str, store: PostgresStore
) -> None:
    await store.save(opened("k"))
    run(database, schema, "INSERT INTO high_water VALUES ('', 'k', 3)")
    with pytest.raises(RecordFormatError) as caught:
        await store.high_water()
    assert str(caught.value).startswith(f"{store.dsn}: a high-water row is malformed: ")
    assert run(database, schema, "SELECT count(*) FROM high_water") == [(2,)]


async def test_a_runner_lists_only_its_own_records_in_save_order(
    database: str, schema: str, store: PostgresStore
) -> None:
    async with PostgresStore(database, runner_id="b", schema=schema) as b:
        await store.save(opened("2"))
        await b.save(opened("theirs"))
        await store.save(opened("1"))
        await store.save(loading(opened("2")))
        assert await store.list() == [opened("1"), loading(opened("2"))]
        assert await b.list() == [opened("theirs")]


# -- writes a failover lost (B6) -------------------------------------------------------


def sessions_of(runner: str) -> str:
    """The statement that lists (or, with a function around ``pid``, acts on) the
    server sessions of ``runner``'s store in the test's database."""
    return (
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        f"AND application_name = 'trio_supervisor {runner}'"
    )


async def test_marks_alone_a_failover_lost_are_raised_and_the_inbox_refilled(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The records are all there, but a key's mark and the supersede of another runner's
    older generation are not: the marks are raised back, the inbox written again, and
    the check is not made again on the same server."""
    async with PostgresStore(database, runner_id="b", schema=schema) as b:
        await b.save(opened("k", 1))
        async with PostgresStore(database, runner_id="a", schema=schema) as a:
            await a.save(opened("k", 2))
            await a.save(opened("j", 1))
        assert run(database, schema, "SELECT * FROM inbox") == [("b", "p", "k", 2)]
        memory = a.memory
        run(database, schema, "UPDATE high_water SET generation = 1 WHERE instance = 'k'")
        run(database, schema, "DELETE FROM inbox")
        memory.server = "another server/00000001"
        async with PostgresStore(database, runner_id="a", schema=schema, memory=memory) as again:
            assert again.lost_writes == 1  # k's mark; no record
            (told,) = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
            assert told.startswith(
                f"{again.dsn}: the database lost writes of this runner (a failover to a "
                "standby that had not received them): 0 records (none) and 1 high-water "
                "mark below generations it handed out; written back"
            )
            assert (await again.high_water())[Key(identity="p", instance="k")] == 2
            assert run(database, schema, "SELECT * FROM inbox") == [("b", "p", "k", 2)]
            assert not memory.check_lost
            # Checked once: a new connection to the same server checks nothing again.
            run(database, schema, "DELETE FROM records WHERE instance = 'j'")
            ours = sessions_of("a")
            run(database, schema, ours.replace("pid", "pg_terminate_backend(pid)", 1))
            await until(lambda: not run(database, schema, ours), "a's session ended", bound=10)
            assert [r.handle.key.instance for r in await again.list()] == ["k"]
            assert again.lost_writes == 1


async def test_every_read_of_a_corrupt_row_names_the_store_and_the_row(
    database: str, schema: str, store: PostgresStore
) -> None:
    record = opened("k", request="req")
    await store.save(record)
    run(database, schema, "UPDATE records SET body = '{no'")
    row = f"{store.dsn}: the record of p/k (token {record.handle.token[:8]}...) is unreadable"
    reads = {
        "list": store.list,
        "lookup": lambda: store.lookup(record.handle.key, "req"),
        "held": lambda: store.held(record.handle.token),
        "fleet_records": store.fleet_records,
    }
    for read in reads.values():
        with pytest.raises(RecordFormatError) as caught:
            await read()
        assert str(caught.value).startswith(row)


# -- a batch whose answer was lost -----------------------------------------------------


WAITS_FOR_LOCK = (
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
    "AND application_name = 'trio_supervisor a' AND wait_event_type = 'Lock'"
)


async def test_a_batch_whose_answer_was_lost_is_looked_for_job_by_job(
    database: str, schema: str
) -> None:
    """The batch commits and its answer never comes back: the store looks on a new
    connection. The jobs that landed are done (a Stopped row the batch itself evicted
    too); an Open that lost its generation and a refused claim did not land, are
    written again, and are refused again, each saying why (an Open with a claim that
    landed is not: its Open would lose to itself)."""
    retention = Retention(stopped_per_key=1)
    with TcpProxy.to(database) as proxy:
        dsn = proxy.url(database)
        async with (
            PostgresStore(dsn, runner_id="a", schema=schema, retention=retention) as store,
            PostgresStore(database, runner_id="b", schema=schema) as b,
        ):
            await b.save(opened("x"))  # the generation the bystander supersedes
            session = opened("s")
            await store.save(opened("k"))
            await store.save(session)
            commits = store.commits
            outcomes: dict[str, BaseException | None] = {}

            async def save(name: str, record: Any, claim: QuotaClaim | None = None) -> None:
                try:
                    if claim is None:
                        await store.save(record)
                    else:
                        await store.save_within(record, claim)
                except (StaleSessionError, QuotaExceededError) as error:
                    outcomes[name] = error
                else:
                    outcomes[name] = None

            roomy = QuotaClaim(tenant="t", identities=["*"], children=9)
            full = QuotaClaim(tenant="t", identities=["*"], children=0)
            bystander, claimed_open = opened("x", 2), opened("c")
            evicted, evicts = stopped(opened("m", 1)), stopped(opened("m", 2))
            with runner_row_locked(database, schema) as blocker:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(save, "first", opened("first"))
                    await until(lambda: run(database, schema, WAITS_FOR_LOCK), "the batch waits")
                    proxy.hold_answers(after=b"write_batch")
                    for name, record, claim in (
                        ("bystander", bystander, None),
                        ("claimed", claimed_open, roomy),
                        ("lost", opened("k", token="a lost open"), None),
                        ("refused", loading(session), full),
                        ("evicted", evicted, roomy),
                        ("evicts", evicts, None),
                    ):
                        nursery.start_soon(save, name, record, claim)
                        await trio.testing.wait_all_tasks_blocked()  # queued, in this order
                    blocker.execute("COMMIT")
                    committed = "SELECT 1 FROM records WHERE token = %s"
                    await until(
                        lambda: run(database, schema, committed, evicts.handle.token),
                        "the batch committed, its answer held",
                    )
                    proxy.cut()
                    proxy.restore()
            assert {name: type(error) for name, error in outcomes.items()} == {
                "first": type(None),
                "bystander": type(None),
                "claimed": type(None),
                "lost": StaleSessionError,
                "refused": QuotaExceededError,
                "evicted": type(None),
                "evicts": type(None),
            }
            # The first batch, the one whose answer was lost (found by the look), and the
            # two jobs written again.
            assert store.commits == commits + 3
            assert run(database, schema, "SELECT instance, phase FROM records ORDER BY saved") == [
                ("x", "Open"),  # b's
                ("k", "Open"),
                ("s", "Open"),
                ("first", "Open"),
                ("x", "Open"),
                ("c", "Open"),
                ("m", "Stopped"),
            ]
            assert run(database, schema, "SELECT generation FROM records WHERE instance = 'm'") == [
                (2,)
            ]
            remembered = set(store.memory.written)
            for landed in (bystander, claimed_open, evicted, evicts):
                assert landed.handle.token in remembered
            assert "a lost open" not in remembered
            # What the bystander's Open superseded was looked up again, with the rest:
            # its opener waits for b's generation 1 to stop.
            waited = trio.Event()

            async def wait() -> None:
                await store.wait_older_stopped(bystander.handle)
                waited.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                assert not waited.is_set()
                await b.save(stopped(opened("x")))
                with trio.fail_after(10):
                    await waited.wait()


async def test_a_batch_ended_before_it_committed_is_written_again(
    database: str, schema: str
) -> None:
    """The server ends the batch's session while it waits: nothing committed, the look
    finds none of its rows as it wrote them, and it is written again."""
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        record = opened("k")
        await store.save(record)
        commits = store.commits
        with runner_row_locked(database, schema) as blocker:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.save, loading(record))
                await until(lambda: run(database, schema, WAITS_FOR_LOCK), "the batch waits")
                ended = WAITS_FOR_LOCK.replace("pid", "pg_terminate_backend(pid)", 1)
                assert run(database, schema, ended) == [(True,)]
                blocker.execute("COMMIT")
        assert run(database, schema, "SELECT phase FROM records") == [("Loading",)]
        assert store.commits == commits + 1  # only the batch written again


async def test_a_refusal_after_a_supersede_in_one_batch_is_still_a_refusal(
    database: str, schema: str
) -> None:
    """write_batch's rows of older generations and of refusals come mixed: a job refused
    after another job's Open found an older generation is refused all the same."""
    async with (
        PostgresStore(database, runner_id="a", schema=schema) as a,
        PostgresStore(database, runner_id="b", schema=schema) as b,
    ):
        await b.save(opened("x"))
        await a.save(opened("k"))
        outcomes: dict[str, BaseException | None] = {}

        async def save(name: str, record: OpenRecord) -> None:
            try:
                await a.save(record)
            except StaleSessionError as error:
                outcomes[name] = error
            else:
                outcomes[name] = None

        with runner_row_locked(database, schema) as blocker:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(save, "first", opened("first"))
                await until(lambda: run(database, schema, WAITS_FOR_LOCK), "the batch waits")
                for name, record in (("supersedes", opened("x", 2)), ("lost", opened("k", 3))):
                    nursery.start_soon(save, name, record)
                    await trio.testing.wait_all_tasks_blocked()  # queued, in this order
                blocker.execute("COMMIT")
        assert (outcomes["first"], outcomes["supersedes"]) == (None, None)
        assert "generation 3 of p/k was not opened" in str(outcomes["lost"])
        assert [r.handle.key.instance for r in await a.list()] == ["k", "first", "x"]
