"""The PostgreSQL store's hold on its server, piece by piece on a real server: how a DSN
is shown, the listener thread that LISTENs for the fleet (and listens again when its
connection ends), the watchdog, and how the worker's link tells a store out of reach
from a call that failed."""

from __future__ import annotations

import logging
import queue
import select
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from trio_supervisor import (
    Handle,
    Key,
    Limits,
    OpenRecord,
    Retention,
    StateStorageError,
    StoreUnavailableError,
)
from trio_supervisor import _defaults as defaults
from trio_supervisor.stores._postgres_connection import Listener, Settings, Watchdog, describe
from trio_supervisor.stores._postgres_link import Link, Memory, unavailable

from ..support.postgres import fresh_schema
from ..support.tcp_proxy import TcpProxy

BOUND = 10.0  # seconds a test waits for the listener's thread to do something


def settings_for(dsn: str, **changes: Any) -> Settings:
    """Settings of a runner of this test's own (its sessions are found by its name)."""
    options: dict[str, Any] = {
        "schema": fresh_schema(),
        "runner_id": f"link-{uuid.uuid4().hex[:12]}",
        "advertise": "",
        "runner_lease": 5.0,
        "retention": Retention(),
        "connect_timeout": 5.0,
        "statement_timeout": 5.0,
        "store_wait": 5.0,
    }
    options.update(changes)
    return Settings(dsn, **options)


def sessions_of(database: str, settings: Settings) -> list[int]:
    """The backends of ``settings``' runner in this test's database."""
    with psycopg.connect(database, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = %s",
            (f"trio_supervisor {settings.runner_id}",),
        ).fetchall()
    return [pid for (pid,) in rows]


def end_sessions_of(database: str, settings: Settings) -> None:
    """End the backends of ``settings``' runner (its own only), as an outage would."""
    with psycopg.connect(database, autocommit=True) as connection:
        connection.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            (f"trio_supervisor {settings.runner_id}",),
        )


def notify(database: str, channel: str, payload: str) -> None:
    with psycopg.connect(database, autocommit=True) as connection:
        connection.execute("SELECT pg_notify(%s, %s)", (channel, payload))


class Heard:
    """A listener's ``hand`` and ``listening``: what it heard, and each time it listened."""

    def __init__(self) -> None:
        self.payloads: queue.Queue[str] = queue.Queue()
        self.times = 0
        self._changed = threading.Condition()

    def hand(self, payload: str) -> None:
        self.payloads.put(payload)

    def listening(self) -> None:
        with self._changed:
            self.times += 1
            self._changed.notify_all()

    def wait_listening(self, times: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.times >= times, BOUND), (
                f"listening {times} times: only {self.times} within {BOUND:g} s"
            )

    def next(self) -> str:
        return self.payloads.get(timeout=BOUND)


@pytest.fixture
def listened(database: str) -> Iterator[tuple[Settings, Heard, Listener]]:
    """A listener of this test's own, started; stopped (and its thread ended) after."""
    settings = settings_for(database)
    heard = Heard()
    listener = Listener(settings, heard.hand, heard.listening)
    listener.thread.start()
    try:
        yield settings, heard, listener
    finally:
        listener.stopping.set()
        listener.thread.join(BOUND)
    assert not listener.thread.is_alive()


def said(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == level
        and r.name == "trio_supervisor.stores.postgres"
        and text in r.getMessage()
    ]


# -- describe ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dsn", "shown", "password"),
    [
        ("postgresql://u:pw@h:5433/db", "postgresql://u@h:5433/db", "pw"),
        ("postgresql://h/db", "postgresql://h/db", None),
        ("dbname=db", "postgresql://localhost/db", None),
        ("hostaddr=10.0.0.1 port=6000", "postgresql://10.0.0.1:6000/", None),
        ("host=a,b port=1,2 dbname=d user=u", "postgresql://u@a:1,b:2/d", None),
        ("host=a,b port=7 dbname=d", "postgresql://a:7,b:7/d", None),
        ("host=a,b,c port=1,2", "postgresql://a:1,b:2,c/", None),
        ("postgresql://a:1,b:2/db?password=x", "postgresql://a:1,b:2/db", "x"),
        ("host='unterminated", "PostgreSQL (a DSN that does not parse)", None),
    ],
)
def test_a_dsn_is_shown_with_each_host_and_never_its_password(
    dsn: str, shown: str, password: str | None
) -> None:
    assert describe(dsn) == (shown, password)


def test_an_error_is_worded_with_the_dsn_shown_and_its_password_hidden() -> None:
    settings = settings_for("postgresql://u:s3cret@h:5433/db")
    error = psycopg.OperationalError("password s3cret refused  \n")
    assert (
        settings.explain("save", error)
        == "postgresql://u@h:5433/db: cannot save: password *** refused"
    )
    assert settings.explain("list records", psycopg.OperationalError("")) == (
        "postgresql://u@h:5433/db: cannot list records: OperationalError"
    )
    assert settings.explain("save", ValueError("s3cret")) == (
        "postgresql://u@h:5433/db: cannot save: ValueError('***')"
    )
    # Without a password nothing is hidden.
    plain = settings_for("postgresql://h/db")
    assert plain.explain("save", ValueError("")) == "postgresql://h/db: cannot save: ValueError('')"


# -- the listener --------------------------------------------------------------------


def test_the_listener_is_a_named_daemon_thread(database: str) -> None:
    settings = settings_for(database)
    listener = Listener(settings, lambda payload: None, lambda: None)
    assert listener.thread.daemon
    assert listener.thread.name == f"trio_supervisor listen {settings.shown}"


def test_the_listener_hears_the_fleet_s_channel_and_again_after_each_outage(
    database: str, listened: tuple[Settings, Heard, Listener], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_supervisor.stores.postgres")
    settings, heard, _ = listened
    heard.wait_listening(1)
    notify(database, settings.schema, "one")
    notify(database, "another channel", "not for it")
    notify(database, settings.schema, "two")
    assert [heard.next(), heard.next()] == ["one", "two"]
    assert not said(caplog, logging.WARNING, "")
    for outage in (1, 2):
        end_sessions_of(database, settings)
        heard.wait_listening(1 + outage)
        notify(database, settings.schema, f"after outage {outage}")
        assert heard.next() == f"after outage {outage}"
        # Each outage is said once as it begins, and once as it ends.
        assert len(said(caplog, logging.WARNING, "cannot listen")) == outage
        assert said(caplog, logging.WARNING, "; listening again")[-1].startswith(
            f"{settings.shown}: cannot listen: "
        )
        assert (
            said(caplog, logging.INFO, "listening again")
            == [f"{settings.shown}: listening again"] * outage
        )
    assert heard.payloads.empty()


def test_a_listener_stopped_as_its_connection_ends_says_nothing_and_ends(
    database: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_supervisor.stores.postgres")
    settings = settings_for(database)
    heard = Heard()
    listener: Listener

    def hand(payload: str) -> None:
        # Stopped, then its connection ends under it: an ending, not an outage.
        heard.hand(payload)
        listener.stopping.set()
        end_sessions_of(database, settings)

    listener = Listener(settings, hand, heard.listening)
    listener.thread.start()
    try:
        heard.wait_listening(1)
        notify(database, settings.schema, "stop")
        assert heard.next() == "stop"
        listener.thread.join(BOUND)
        assert not listener.thread.is_alive()
    finally:
        listener.stopping.set()
        listener.thread.join(BOUND)
    assert heard.times == 1
    assert not said(caplog, logging.WARNING, "")
    assert not sessions_of(database, settings)


def test_a_listener_that_cannot_connect_says_so_once_and_keeps_trying_until_stopped(
    database: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_supervisor.stores.postgres")
    settings = settings_for(
        make_conninfo(database, port="1", password="hunter2x"), connect_timeout=2
    )
    tries = threading.Semaphore(0)
    connect = settings.connect

    def counted(*, autocommit: bool = False) -> psycopg.Connection[Any]:
        tries.release()
        return connect(autocommit=autocommit)

    settings.connect = counted  # type: ignore[method-assign]
    heard = Heard()
    listener = Listener(settings, heard.hand, heard.listening)
    listener.thread.start()
    try:
        for _ in range(3):
            assert tries.acquire(timeout=BOUND)
    finally:
        listener.stopping.set()
        listener.thread.join(BOUND)
    assert not listener.thread.is_alive()
    assert heard.times == 0
    warned = said(caplog, logging.WARNING, "")
    assert len(warned) == 1
    assert warned[0].startswith(f"{settings.shown}: cannot listen: ")
    assert warned[0].endswith("; listening again")
    assert "port 1 failed" in warned[0]  # the error itself, in its words
    assert "hunter2x" not in warned[0]


# -- the link: out of reach, or failed -----------------------------------------------


@pytest.mark.parametrize(
    ("error", "out_of_reach"),
    [
        (psycopg.errors.lookup("08006")("connection failure"), True),
        (psycopg.errors.lookup("08P01")("protocol violation"), True),
        (psycopg.errors.AdminShutdown("terminating connection"), True),
        (psycopg.errors.CrashShutdown("crashed"), True),
        (psycopg.errors.CannotConnectNow("starting up"), True),
        (psycopg.errors.ReadOnlySqlTransaction("read-only"), True),
        (psycopg.OperationalError("server closed the connection"), True),
        (psycopg.errors.QueryCanceled("statement timeout"), False),
        (psycopg.errors.UniqueViolation("duplicate"), False),
        (psycopg.errors.lookup("58P01")("undefined file"), False),
        (psycopg.errors.lookup("25P02")("in failed transaction"), False),
        (psycopg.InterfaceError("not an operational error"), False),
        (OSError("not psycopg's"), False),
    ],
)
def test_only_errors_that_say_the_server_cannot_serve_now_are_out_of_reach(
    error: BaseException, out_of_reach: bool
) -> None:
    assert unavailable(error, None) is out_of_reach


def test_a_failure_on_a_connection_that_broke_is_out_of_reach(database: str) -> None:
    settings = settings_for(database)
    with settings.connect(autocommit=True) as connection:
        assert not unavailable(psycopg.InterfaceError("no"), connection)
        assert not unavailable(OSError("no"), connection)
        end_sessions_of(database, settings)
        with pytest.raises(psycopg.OperationalError):
            connection.execute("SELECT 1")
        assert connection.broken
        assert unavailable(psycopg.InterfaceError("after"), connection)
        assert not unavailable(OSError("not psycopg's"), connection)
    closed = settings.connect(autocommit=True)
    closed.close()
    assert unavailable(psycopg.InterfaceError("closed"), closed)


def test_a_link_tries_a_store_out_of_reach_again_and_says_so_once(
    database: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_supervisor.stores.postgres")
    link = Link(settings_for(database))
    calls: list[int] = []

    def work() -> None:
        calls.append(len(calls))
        if len(calls) <= 2:
            raise psycopg.OperationalError(f"down {len(calls)}")
        link._connected().execute("SELECT 1")

    try:
        assert link._retrying("save", work, time.monotonic() + BOUND) is None
        assert calls == [0, 1, 2]
        shown = link.settings.shown
        assert said(caplog, logging.WARNING, "") == [f"{shown}: cannot save: down 1; trying again"]
        assert said(caplog, logging.INFO, "answers") == [f"{shown}: the store answers again"]
        # Out of reach again: said again.
        calls.clear()
        assert link._retrying("list records", work, time.monotonic() + BOUND) is None
        assert said(caplog, logging.WARNING, "")[1:] == [
            f"{shown}: cannot list records: down 1; trying again"
        ]
    finally:
        link._end_transaction(drop=True)


def test_a_link_gives_up_on_a_store_out_of_reach_at_its_deadline(database: str) -> None:
    unreachable = make_conninfo(database, port="1")
    link = Link(settings_for(unreachable, store_wait=0.3, connect_timeout=2))
    shown = link.settings.shown
    calls = []

    def work() -> None:
        calls.append(1)
        link._connected()

    began = time.monotonic()
    failure = link._retrying("save", work, began + 0.3)
    assert 0.3 <= time.monotonic() - began < 0.3 + 2
    assert isinstance(failure, StoreUnavailableError)
    assert isinstance(failure.__cause__, psycopg.OperationalError)
    assert len(calls) >= 2
    assert str(failure).startswith(f"{shown}: cannot save: ")
    assert str(failure).endswith(
        "; gave up after 0.3 s of trying (store_wait): nothing of this save was written"
    )
    # Still out of reach, past its deadline: not tried once more.
    calls.clear()
    again = link._retrying("list records", work, time.monotonic())
    assert calls == []
    assert isinstance(again, StoreUnavailableError)
    assert str(again).startswith(f"{shown}: cannot save: ")
    assert str(again).endswith("; gave up after 0.3 s of trying (store_wait)")
    assert "nothing of this" not in str(again)
    assert isinstance(again.__cause__, psycopg.OperationalError)


def test_a_call_that_fails_is_not_tried_again(database: str) -> None:
    link = Link(settings_for(database))
    calls = []

    def work() -> None:
        calls.append(1)
        raise psycopg.errors.UniqueViolation("duplicate key")

    def refused() -> None:
        calls.append(1)
        raise StateStorageError("refused as it is")

    failure = link._retrying("save", work, time.monotonic() + BOUND)
    assert type(failure) is StateStorageError
    assert str(failure) == f"{link.settings.shown}: cannot save: duplicate key"
    assert isinstance(failure.__cause__, psycopg.errors.UniqueViolation)
    failure = link._retrying("save", refused, time.monotonic() + BOUND)
    assert type(failure) is StateStorageError
    assert str(failure) == "refused as it is"
    assert len(calls) == 2


def test_memory_keeps_the_latest_records_and_the_highest_generations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(defaults, "REMEMBERED", 2)
    memory = Memory()

    def opened(instance: str, generation: int) -> OpenRecord:
        handle = Handle(
            key=Key(identity="p", instance=instance),
            token=f"{instance}{generation}".rjust(32, "0"),
            generation=generation,
        )
        return OpenRecord(handle=handle, request_id="r", lease=5.0, limits=Limits())

    a1, b1, c1, a2 = opened("a", 1), opened("b", 1), opened("c", 1), opened("a", 2)
    memory.wrote([(a1, "a1"), (b1, "b1")])
    memory.wrote([(a1, "a1 again")])  # the latest of a token: remembered longest
    assert list(memory.written.values()) == [(b1, "b1"), (a1, "a1 again")]
    assert memory.handed == {a1.handle.key: 1, b1.handle.key: 1}
    memory.wrote([(c1, "c1")])
    assert list(memory.written.values()) == [(a1, "a1 again"), (c1, "c1")]
    # a's generation did not rise: it is the oldest of the generations, and forgotten.
    assert list(memory.handed.items()) == [(b1.handle.key, 1), (c1.handle.key, 1)]
    memory.wrote([(a2, "a2"), (b1, "b1 late")])
    assert list(memory.written.values()) == [(a2, "a2"), (b1, "b1 late")]
    assert list(memory.handed.items()) == [(a2.handle.key, 2), (b1.handle.key, 1)]
    memory.wrote([(a1, "a1 late")])  # an older generation does not lower the highest
    assert list(memory.handed.items()) == [(a2.handle.key, 2), (b1.handle.key, 1)]
    # A key whose generation rises is the latest: the one forgotten last.
    memory.wrote([(opened("a", 3), "a3")])
    assert list(memory.handed.items()) == [(b1.handle.key, 1), (a1.handle.key, 3)]


@pytest.mark.parametrize(
    ("connect_timeout", "statement_timeout", "given", "user_timeout", "statements"),
    [(0.5, 0.0004, "2", "1000", "1ms"), (3.2, 2.5, "4", "2500", "2500ms")],
)
def test_a_connection_is_made_with_the_store_s_timeouts_and_name(
    database: str,
    connect_timeout: float,
    statement_timeout: float,
    given: str,
    user_timeout: str,
    statements: str,
) -> None:
    settings = settings_for(
        database,
        runner_id="r" * 70,
        connect_timeout=connect_timeout,
        statement_timeout=statement_timeout,
    )
    with settings.connect() as connection:
        assert not connection.autocommit
        parameters = connection.info.get_parameters()
        assert parameters["connect_timeout"] == given
        assert parameters["tcp_user_timeout"] == user_timeout
        assert (
            parameters["keepalives"],
            parameters["keepalives_idle"],
            parameters["keepalives_interval"],
            parameters["keepalives_count"],
        ) == ("1", "5", "2", "3")
        assert parameters["application_name"] == f"trio_supervisor {'r' * 70}"[:63]
        # The session's settings were committed: a rollback keeps them.
        connection.rollback()
        # Read in one statement of its own: with a timeout of 1 ms, a transaction left
        # open between statements would be ended on a busy machine.
        connection.autocommit = True
        assert connection.execute(
            "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'), "
            "current_setting('idle_in_transaction_session_timeout'), "
            "current_setting('search_path')"
        ).fetchone() == (statements, statements, statements, settings.schema)
    with settings.connect(autocommit=True) as connection:
        assert connection.autocommit


def fired(watchdog: Watchdog) -> bool:
    """Whether ``watchdog`` fired for the call under it (its thread sets it)."""
    return watchdog.fired


def test_the_watchdog_drops_a_connection_whose_call_outlives_its_bound(database: str) -> None:
    settings = settings_for(database)
    connection = settings.connect(autocommit=True)
    watchdog = Watchdog(0.3, lambda: connection)
    assert watchdog._thread.daemon
    assert watchdog._thread.name == "trio_supervisor watchdog"
    watchdog.start()
    try:
        with watchdog:
            assert connection.execute("SELECT 1").fetchone() == (1,)
        assert not fired(watchdog)
        # Past the bound, outside of a call: nothing is dropped.
        assert connection.execute("SELECT pg_sleep(0.5), 2").fetchone() == ("", 2)
        began = time.monotonic()
        with pytest.raises(psycopg.OperationalError), watchdog:
            connection.execute("SELECT pg_sleep(5)")
        assert 0.3 <= time.monotonic() - began < 3
        assert fired(watchdog)
        assert connection.broken
        # The next call under it starts afresh.
        connection = settings.connect(autocommit=True)
        with watchdog:
            assert not fired(watchdog)
            connection.execute("SELECT 1")
        assert connection.execute("SELECT pg_sleep(0.5), 3").fetchone() == ("", 3)
    finally:
        watchdog.stop()
        watchdog._thread.join(BOUND)
        connection.close()
    assert not watchdog._thread.is_alive()


def test_a_watchdog_without_a_connection_only_says_it_fired() -> None:
    asked = threading.Event()

    def no_connection() -> None:
        asked.set()

    watchdog = Watchdog(0.05, no_connection)
    watchdog.start()
    try:
        with watchdog:
            assert asked.wait(BOUND)
            assert watchdog.fired
        assert watchdog._thread.is_alive()
    finally:
        watchdog.stop()
        watchdog._thread.join(BOUND)
    assert not watchdog._thread.is_alive()


def test_a_watchdog_outlives_a_connection_whose_network_reset_it(database: str) -> None:
    with TcpProxy.to(database) as proxy:
        through = proxy.through(database)
        connection = settings_for(through).connect(autocommit=True)
        asked = threading.Event()

        def dropped() -> psycopg.Connection[Any]:
            asked.set()
            return connection

        watchdog = Watchdog(0.05, dropped)
        watchdog.start()
        try:
            proxy.cut()  # a reset: the socket is no longer connected
            readable, _, _ = select.select([connection.pgconn.socket], [], [], BOUND)
            assert readable
            for _ in range(2):  # it fires, and is there for the next call
                asked.clear()
                with watchdog:
                    assert asked.wait(BOUND)
                    assert fired(watchdog)
                assert watchdog._thread.is_alive()
        finally:
            watchdog.stop()
            watchdog._thread.join(BOUND)
            connection.close()


def test_a_watchdog_outlives_a_connection_closed_under_it(database: str) -> None:
    connection = settings_for(database).connect(autocommit=True)
    connection.close()
    asked = threading.Event()

    def closed() -> psycopg.Connection[Any]:
        asked.set()
        return connection

    watchdog = Watchdog(0.05, closed)
    watchdog.start()
    try:
        for _ in range(2):  # it fires, and is there for the next call
            asked.clear()
            with watchdog:
                assert asked.wait(BOUND)
                assert fired(watchdog)
            assert watchdog._thread.is_alive()
    finally:
        watchdog.stop()
        watchdog._thread.join(BOUND)
