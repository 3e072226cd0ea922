"""The PostgreSQL store's worker thread at its edges (``_postgres_worker``, and the link
it stands on), on a real server: what a commit window holds back and what ends it, a
batch the server rolls back to end a conflict, opening and closing (in reach or not),
what a call that fails says and what it costs the connection, and a batch whose answer
was lost."""

from __future__ import annotations

import logging
import queue
from typing import Any

import pytest
import trio
import trio.testing
from psycopg import sql

from trio_supervisor import (
    Handle,
    Key,
    Limits,
    OpenRecord,
    PostgresStore,
    RecordFormatError,
    Retention,
    StateStorageError,
    StoreUnavailableError,
)
from trio_supervisor import _defaults as defaults
from trio_supervisor.stores._jobs import Job
from trio_supervisor.stores._postgres_connection import Settings
from trio_supervisor.stores._postgres_worker import Worker

from ..support.postgres import query_in as run
from ..support.tcp_proxy import TcpProxy
from ..support.waits import until


def opened(instance: str) -> OpenRecord:
    return OpenRecord(
        handle=Handle(
            key=Key(identity="p", instance=instance),
            token=f"p-{instance}-1".rjust(32, "0"),
            generation=1,
        ),
        request_id="r1",
        lease=7.5,
        limits=Limits(),
    )


def said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "trio_supervisor.stores.postgres" and text in r.getMessage()
    ]


# -- the commit window -----------------------------------------------------------------


def windowed_worker(jobs: queue.SimpleQueue[Job]) -> Worker:
    """A worker of a store with the longest commit window, as PostgresStore makes its
    settings; its thread is not started (``_gather`` touches no connection)."""
    settings = Settings(
        "postgresql://postgres@127.0.0.1:5432/unused",
        schema=defaults.FLEET_SCHEMA,
        runner_id="a",
        advertise="",
        runner_lease=defaults.RUNNER_LEASE,
        retention=Retention(),
        connect_timeout=defaults.STORE_CONNECT_TIMEOUT,
        statement_timeout=defaults.STORE_STATEMENT_TIMEOUT,
        store_wait=defaults.STORE_WAIT,
        commit_window=defaults.MOST_COMMIT_WINDOW,
    )
    return Worker(settings, jobs)


def queued(*jobs: Job) -> queue.SimpleQueue[Job]:
    waiting: queue.SimpleQueue[Job] = queue.SimpleQueue()
    for job in jobs:
        waiting.put(job)
    return waiting


def left_in(jobs: queue.SimpleQueue[Job]) -> list[Job]:
    left = []
    while not jobs.empty():
        left.append(jobs.get_nowait())
    return left


async def test_a_batch_with_a_read_in_it_is_not_held_for_the_window() -> None:
    """A read is never held back: a batch of a save and a read is served as it is, and
    the jobs queued since wait for the next batch."""
    save, read = Job("save"), Job("list")
    later = [Job("save"), Job("list")]
    jobs = queued(*later)
    worker = windowed_worker(jobs)
    taken = [save, read]
    for job in taken:
        assert job.take()
    assert worker._gather(taken) is None
    assert taken == [save, read]
    assert left_in(jobs) == later


async def test_a_close_that_comes_within_the_window_ends_it_and_is_handed_back() -> None:
    """The store closes while a batch of saves waits for more: the close job (taken by
    the closer as it queued it) ends the wait and is handed back to the thread's loop,
    which serves the batch and then closes; what came after it stays queued."""
    save = Job("save")
    closing = Job("close")
    assert closing.take()  # as Desk.close queues it
    after = Job("list")
    jobs = queued(closing, after)
    worker = windowed_worker(jobs)
    taken = [save]
    assert save.take()
    assert worker._gather(taken) is closing
    assert taken == [save]
    assert left_in(jobs) == [after]


# -- a batch the server rolls back to end a conflict -----------------------------------


def refuse_inserts(database: str, schema: str, *, first: int, state: str, message: str) -> None:
    """A trigger of the test's on the store's records: every row a batch inserts is
    counted (a sequence, ``attempts``: no rollback takes a count back), and the first
    ``first`` of them raise SQLSTATE ``state`` with ``message``, as the server does to a
    transaction it ends."""
    names = {
        "schema": sql.Identifier(schema),
        "attempts": sql.Literal(f"{schema}.attempts"),
        "first": sql.Literal(first),
        "state": sql.Literal(state),
        "message": sql.Literal(message),
    }
    for statement in (
        "CREATE SEQUENCE {schema}.attempts",
        "CREATE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS $$ "
        "BEGIN IF nextval({attempts}) <= {first} THEN "
        "RAISE EXCEPTION USING ERRCODE = {state}, MESSAGE = {message}; "
        "END IF; RETURN NEW; END $$",
        "CREATE TRIGGER refuse BEFORE INSERT ON {schema}.records "
        "FOR EACH ROW EXECUTE FUNCTION {schema}.refuse()",
    ):
        run(database, schema, sql.SQL(statement).format(**names))


def attempts(database: str, schema: str) -> int:
    """How many times a batch tried to insert its row, since :func:`refuse_inserts`."""
    [(count,)] = run(database, schema, "SELECT last_value FROM attempts")
    return int(count)


DEADLOCK = "40P01"  # deadlock_detected


async def test_a_batch_rolled_back_for_a_deadlock_is_written_again_unseen(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server ends the batch's transaction to end a deadlock (here a trigger of the
    test's, once): nothing of it landed, the worker writes it again at once, and its
    caller never sees the conflict; the log says so."""
    caplog.set_level(logging.INFO, logger="trio_supervisor.stores.postgres")
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        await store.save(opened("first"))
        commits = store.commits
        refuse_inserts(database, schema, first=1, state=DEADLOCK, message="a deadlock")
        await store.save(opened("second"))
        assert [r.handle.key.instance for r in await store.list()] == ["first", "second"]
        assert store.commits == commits + 1
        assert attempts(database, schema) == 2
        [again] = said(caplog, "written again")
        assert again.startswith(f"{store.dsn}: cannot save: a deadlock\n"), again
        assert again.endswith("; written again"), again


async def test_a_batch_that_conflicts_each_time_is_written_three_times_more(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch the server rolls back every time is written again three times
    (CONFLICT_TRIES), then its caller gets the conflict: a failed call, not a store
    out of reach; nothing landed."""
    caplog.set_level(logging.INFO, logger="trio_supervisor.stores.postgres")
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        refuse_inserts(database, schema, first=100, state=DEADLOCK, message="a deadlock")
        with pytest.raises(StateStorageError) as caught:
            await store.save(opened("k"))
        assert type(caught.value) is StateStorageError
        assert str(caught.value).startswith(f"{store.dsn}: cannot save: a deadlock\n")
        assert attempts(database, schema) == 1 + defaults.CONFLICT_TRIES == 4
        assert len(said(caplog, "written again")) == 3
        assert await store.list() == []


async def test_a_batch_the_server_refuses_otherwise_is_not_written_again(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch that fails for any other reason than a conflict is tried once: its
    caller gets the server's error."""
    caplog.set_level(logging.INFO, logger="trio_supervisor.stores.postgres")
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        refuse_inserts(database, schema, first=100, state="23514", message="not this row")
        with pytest.raises(StateStorageError) as caught:
            await store.save(opened("k"))
        assert type(caught.value) is StateStorageError
        assert str(caught.value).startswith(f"{store.dsn}: cannot save: not this row\n")
        assert attempts(database, schema) == 1
        assert said(caplog, "written again") == []
        assert await store.list() == []


# -- opening, closing, and calls that fail ---------------------------------------------


OURS = (
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s"
)


def sessions_of(database: str, schema: str, runner: str) -> list[tuple[int]]:
    """The server's sessions of ``runner``'s store (its connections name the runner)."""
    return run(database, schema, OURS, f"trio_supervisor {runner}")


async def test_calls_made_while_the_store_opens_are_served_once_it_is_open(
    database: str, schema: str
) -> None:
    """The thread opens the store as it starts; calls queued meanwhile come in one batch
    with the open job, and each is served after it."""
    store = PostgresStore(database, runner_id="a", schema=schema)
    found: dict[str, object] = {}

    async def ask(name: str, call: Any) -> None:
        found[name] = await call()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.open)
            await trio.testing.wait_all_tasks_blocked()  # the open job queued first
            nursery.start_soon(ask, "list", store.list)
            nursery.start_soon(ask, "high_water", store.high_water)
    finally:
        await store.aclose()
    assert found == {"list": [], "high_water": {}}


async def test_a_store_out_of_reach_as_it_opens_is_tried_again_within_store_wait(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The network is cut as the store opens: the open is tried again, and succeeds
    once the network is back, within store_wait."""
    caplog.set_level(logging.INFO, logger="trio_supervisor.stores.postgres")
    with TcpProxy.to(database) as proxy:
        proxy.cut()
        store = PostgresStore(proxy.url(database), runner_id="a", schema=schema, store_wait=10)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.open)
                await until(lambda: said(caplog, "trying again"), "a first attempt refused")
                proxy.restore()
            assert await store.list() == []
        finally:
            await store.aclose()


async def test_a_store_that_never_opened_gives_each_call_the_reason(
    database: str, schema: str
) -> None:
    """A store out of reach past store_wait as it opens: the open fails, saying so, and
    each later call gets the same error."""
    with TcpProxy.to(database) as proxy:
        proxy.cut()
        store = PostgresStore(proxy.url(database), runner_id="a", schema=schema, store_wait=0.2)
        try:
            with pytest.raises(StoreUnavailableError) as caught:
                await store.open()
            told = str(caught.value)
            assert told.startswith(f"{store.dsn}: cannot open the store: "), told
            assert told.endswith("; gave up after 0.2 s of trying (store_wait)"), told
            with pytest.raises(StoreUnavailableError) as again:
                await store.list()
            assert again.value is caught.value
        finally:
            await store.aclose()


async def test_a_read_out_of_reach_names_what_it_could_not_do(database: str, schema: str) -> None:
    """A read on a cut network is tried again within store_wait, then fails naming
    what it could not do."""
    with TcpProxy.to(database) as proxy:
        async with PostgresStore(
            proxy.url(database), runner_id="a", schema=schema, store_wait=0.2
        ) as store:
            proxy.cut()
            with pytest.raises(StoreUnavailableError) as caught:
                await store.list()
            told = str(caught.value)
            assert told.startswith(f"{store.dsn}: cannot list records: "), told
            assert told.endswith("; gave up after 0.2 s of trying (store_wait)"), told
            proxy.restore()


async def test_a_call_the_network_never_answers_is_dropped_by_the_watchdog(
    database: str, schema: str
) -> None:
    """A network that takes the bytes and delivers nothing (a paused proxy): the call
    gets no answer, and no TCP timeout ends it; the watchdog drops the connection after
    twice the statement timeout plus the connect timeout, and the caller is told so."""
    async with PostgresStore(database, runner_id="a", schema=schema):
        pass  # the schema made (DDL is slower than the short statement timeout below)
    with TcpProxy.to(database) as proxy:
        async with PostgresStore(
            proxy.url(database),
            runner_id="a",
            schema=schema,
            statement_timeout=0.4,
            connect_timeout=0.2,
            store_wait=0.3,
        ) as store:
            proxy.pause()
            with pytest.raises(StoreUnavailableError) as caught:
                await store.list()
            assert str(caught.value) == (
                f"{store.dsn}: cannot list records: no answer within 1 s (the network or "
                "the server is stuck); the connection was dropped; gave up after 0.3 s of "
                "trying (store_wait)"
            )
            proxy.restore()


async def test_closing_expires_the_runner_s_row_and_hangs_up(database: str, schema: str) -> None:
    """Closing marks the runner's row expired (the fleet need not wait out its lease)
    and closes the store's connection: no session of it is left on the server."""
    runner = "closes"
    alive = "SELECT lease_until > clock_timestamp() FROM runners WHERE runner_id = %s"
    async with PostgresStore(database, runner_id=runner, schema=schema) as store:
        await store.save(opened("k"))
        assert run(database, schema, alive, runner) == [(True,)]
        assert len(sessions_of(database, schema, runner)) == 1
    assert run(database, schema, alive, runner) == [(False,)]
    await until(
        lambda: not sessions_of(database, schema, runner), "the store's session ended", bound=10
    )


async def test_a_close_that_cannot_reach_the_store_says_so_and_closes(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Closing on a cut network cannot mark the runner's row expired: a courtesy, so it
    is logged, not raised, and the store closes all the same."""
    caplog.set_level(logging.INFO, logger="trio_supervisor.stores.postgres")
    with TcpProxy.to(database) as proxy:
        async with PostgresStore(proxy.url(database), runner_id="a", schema=schema) as store:
            await store.save(opened("k"))
            proxy.cut()
        prefix = f"{store.dsn}: cannot mark this runner's row expired: "
        told = [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith(prefix)
        ]
        # Said as the store went out of reach, then as what closing failed with.
        assert len(told) == 2, told
        assert told[0].endswith("; trying again")
        assert told[0] == f"{told[1]}; trying again"
        with pytest.raises(StateStorageError, match="is closed"):
            await store.list()


async def test_a_server_that_takes_no_writes_now_costs_the_connection(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server refuses the batch as read-only (25006, as a primary demoted to a
    standby does; here a trigger of the test's, once): the store is out of reach for
    writes, so the connection is dropped and the batch written again on a new one (where
    a multi-host DSN finds the new primary); said once, and that it answers again."""
    caplog.set_level(logging.INFO, logger="trio_supervisor.stores.postgres")
    runner = "reconnects"
    async with PostgresStore(database, runner_id=runner, schema=schema) as store:
        await store.save(opened("first"))
        before = sessions_of(database, schema, runner)
        refuse_inserts(database, schema, first=1, state="25006", message="read-only now")
        await store.save(opened("second"))
        assert attempts(database, schema) == 2
        assert [pid for pid in sessions_of(database, schema, runner) if pid not in before]
        [warned] = said(caplog, "trying again")
        assert warned.startswith(f"{store.dsn}: cannot save: read-only now\n"), warned
        assert said(caplog, "answers again") == [f"{store.dsn}: the store answers again"]
        # The same server: nothing to check for writes a failover lost (B6).
        assert said(caplog, "was lost") == []


async def test_the_server_a_store_meets_is_remembered_by_identity_and_timeline(
    database: str, schema: str
) -> None:
    """What a new connection remembers of its server (B6): the cluster's system
    identifier, and the timeline, the first 8 digits of the current WAL file's name (a
    promoted standby starts a new one)."""
    async with PostgresStore(database, runner_id="a", schema=schema) as store:
        [(identity, walfile)] = run(
            database,
            schema,
            "SELECT (SELECT system_identifier FROM pg_control_system()), "
            "pg_walfile_name(pg_current_wal_lsn())",
        )
        assert store.memory.server == f"{identity}/{walfile[:8]}"


async def test_a_call_that_fails_for_its_data_keeps_the_connection(
    database: str, schema: str
) -> None:
    """A read that meets a corrupt row fails, and says so; the connection is sound, and
    the next call runs on it: only a store out of reach costs a new connection."""
    runner = "keeps-its-connection"
    async with PostgresStore(database, runner_id=runner, schema=schema) as store:
        await store.save(opened("k"))
        before = sessions_of(database, schema, runner)
        assert len(before) == 1
        run(database, schema, "UPDATE records SET body = '{no'")
        with pytest.raises(RecordFormatError):
            await store.list()
        assert (await store.high_water())[Key(identity="p", instance="k")] == 1
        assert sessions_of(database, schema, runner) == before


# -- a save out of reach, and a batch whose answer was lost ----------------------------


async def test_a_save_the_store_never_got_gives_up_after_store_wait_and_says_so(
    database: str, schema: str
) -> None:
    """A cut network, and no batch sent: the save is tried again within store_wait, then
    its caller learns that the store is out of reach and that nothing was written."""
    with TcpProxy.to(database) as proxy:
        async with PostgresStore(
            proxy.url(database), runner_id="a", schema=schema, store_wait=0.3
        ) as store:
            proxy.cut()
            with pytest.raises(StoreUnavailableError) as caught:
                await store.save(opened("k"))
            told = str(caught.value)
            assert told.startswith(f"{store.dsn}: cannot save: "), told
            assert told.endswith(
                "; gave up after 0.3 s of trying (store_wait): nothing of this save was written"
            ), told
            proxy.restore()
    assert run(database, schema, "SELECT count(*) FROM records") == [(0,)]


async def save_with_its_answer_lost(
    database: str, schema: str, store: PostgresStore, proxy: TcpProxy, *, restore: bool
) -> BaseException | None:
    """Save through ``proxy``: the batch commits, its answer is held, then the network is
    cut (and restored at once if ``restore``); what the save's caller got."""
    proxy.hold_answers(after=b"write_batch")
    outcome: list[BaseException | None] = []

    async def save() -> None:
        try:
            await store.save(opened("k"))
        except StateStorageError as error:
            outcome.append(error)
        else:
            outcome.append(None)

    committed = "SELECT 1 FROM records WHERE token = %s"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(save)
        await until(
            lambda: run(database, schema, committed, opened("k").handle.token),
            "the batch committed, its answer held",
        )
        proxy.cut()
        if restore:
            proxy.restore()
    [got] = outcome
    return got


async def test_a_lost_answer_the_look_finds_landed_is_a_save_done_and_logged(
    database: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The batch commits and its answer is lost with the connection; the network is
    back at once: the look finds the rows, the save returns, and the log says what
    happened."""
    with TcpProxy.to(database) as proxy:
        async with PostgresStore(proxy.url(database), runner_id="a", schema=schema) as store:
            got = await save_with_its_answer_lost(database, schema, store, proxy, restore=True)
            assert got is None
            assert said(caplog, "it had landed") == [
                f"{store.dsn}: the connection broke as a save committed; it had landed"
            ]
            assert [r.handle.key.instance for r in await store.list()] == ["k"]


async def test_a_lost_answer_the_store_never_tells_is_reported_with_the_last_look(
    database: str, schema: str
) -> None:
    """The batch commits, its answer is lost with the connection, and the network stays
    cut: the worker looks again and again (each look fails at once) for as long as the
    runner's row could last, then reports that it cannot tell whether the save landed,
    caused by the last look's failure; the thread lives on and closes."""
    with TcpProxy.to(database) as proxy:
        # The worker looks for max(store_wait, runner_lease): 0.6 s.
        async with PostgresStore(
            proxy.url(database), runner_id="a", schema=schema, store_wait=0.2, runner_lease=0.6
        ) as store:
            error = await save_with_its_answer_lost(database, schema, store, proxy, restore=False)
            assert type(error) is StateStorageError, error
            assert str(error) == (
                f"{store.dsn}: cannot tell whether a save landed: the connection broke as "
                "it was sent, and the store did not answer for 0.6 s after"
            )
            cause = error.__cause__
            assert isinstance(cause, StoreUnavailableError)
            assert str(cause).startswith(
                f"{store.dsn}: cannot look for a save whose answer was lost: "
            )
            proxy.restore()
