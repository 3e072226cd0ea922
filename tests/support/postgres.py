"""The PostgreSQL server the fleet's tests use: a database of their own per test module,
and schemas of a test's own in it.

The server is ``$TRIO_SUPERVISOR_TEST_DSN``, by default the one every machine of this
project runs (``postgresql://postgres@127.0.0.1:5432/test``, trust authentication).
When it cannot be reached, the tests fail where they must run (``CI`` is set, or the
variable names a server on purpose) and are skipped elsewhere, with a message naming
the variable.

A mutation run (``nox -s mutants-adapters``) runs a mutant's tests in a process of its
own, thousands of times: there a fresh database per module would cost its ``DROP
DATABASE`` each time (a checkpoint of the whole server: 0.2-5 s here, most of a
mutant's run). With ``$TRIO_SUPERVISOR_TEST_DATABASES`` naming a directory, a module
takes one of a few databases kept for the purpose (``ts_kept_slotN``) instead: a slot is
held by a lock on a file of that directory while the module runs (released by the
kernel if its process is killed), and the database is emptied as it is taken (its
connections ended, every schema of its own dropped).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

__all__ = [
    "DEFAULT_DSN",
    "database_for",
    "drop_kept",
    "fresh_schema",
    "own_schema",
    "query_in",
    "runner_row_locked",
    "schema",
    "server_dsn",
    "with_parts",
]

DEFAULT_DSN: Final = "postgresql://postgres@127.0.0.1:5432/test"
VARIABLE: Final = "TRIO_SUPERVISOR_TEST_DSN"
# The directory of the kept databases' locks (see the module's docs), and how many.
KEPT: Final = "TRIO_SUPERVISOR_TEST_DATABASES"
SLOTS: Final = 8


def server_dsn() -> str:
    """The server's DSN, once it answered; fails or skips as the module docs say."""
    dsn = os.environ.get(VARIABLE, DEFAULT_DSN)
    try:
        with psycopg.connect(dsn, connect_timeout=5, autocommit=True) as connection:
            connection.execute("SELECT 1")
    except psycopg.Error as error:
        message = (
            f"the fleet's tests need PostgreSQL at {dsn} ({VARIABLE}), which did not "
            f"answer: {error}".strip()
        )
        if os.environ.get("CI") or VARIABLE in os.environ:
            pytest.fail(message, pytrace=False)
        pytest.skip(message + f"; set {VARIABLE} to a server to run them")
    return dsn


@contextlib.contextmanager
def database_for(module: str) -> Iterator[str]:
    """A fresh database named after ``module`` (and this process), dropped afterwards;
    its DSN."""
    dsn = server_dsn()
    kept = os.environ.get(KEPT)
    if kept:
        with _kept_database(dsn, Path(kept)) as url:
            yield url
        return
    name = "ts_" + re.sub(r"[^a-z0-9]+", "_", module.lower().rsplit(".", 1)[-1]) + f"_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        for left in _left_behind(admin, dsn) | {name}:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(left))
            )
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield with_parts(dsn, path=f"/{name}")
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@contextlib.contextmanager
def _kept_database(dsn: str, locks: Path) -> Iterator[str]:
    """A kept database no other process uses meanwhile, emptied; its DSN."""
    locks.mkdir(parents=True, exist_ok=True)
    for slot in range(SLOTS):
        lock = (locks / f"slot{slot}.lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        try:
            name = f"ts_kept_slot{slot}"
            with psycopg.connect(dsn, autocommit=True) as admin:
                if (
                    admin.execute(
                        "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
                    ).fetchone()
                    is None
                ):
                    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    (name,),
                )
            url = with_parts(dsn, path=f"/{name}")
            with psycopg.connect(url, autocommit=True) as connection:
                schemas = connection.execute(
                    "SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%' "
                    "AND nspname <> 'information_schema'"
                ).fetchall()
                for (schema,) in schemas:
                    connection.execute(
                        sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(str(schema)))
                    )
                connection.execute("CREATE SCHEMA public")
            yield url
            return
        finally:
            lock.close()
    raise RuntimeError(f"all {SLOTS} kept databases are in use (locks in {locks})")


def drop_kept() -> list[str]:
    """Drop the kept databases (see the module's docs) that no process holds now; their
    names. The mutation run calls it as it ends."""
    dsn = os.environ.get(VARIABLE, DEFAULT_DSN)
    locks = Path(os.environ[KEPT]) if os.environ.get(KEPT) else None
    dropped = []
    with psycopg.connect(dsn, autocommit=True) as admin:
        for slot in range(SLOTS):
            name = f"ts_kept_slot{slot}"
            lock = None
            if locks is not None and (locks / f"slot{slot}.lock").exists():
                lock = (locks / f"slot{slot}.lock").open("w")
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    lock.close()
                    continue  # in use
            try:
                exists = admin.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
                ).fetchone()
                if exists is not None:
                    admin.execute(
                        sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name))
                    )
                    dropped.append(name)
            finally:
                if lock is not None:
                    lock.close()
    return dropped


_OURS: Final = re.compile(r"ts_[a-z0-9_]+_([0-9]+)")


def _left_behind(admin: psycopg.Connection[tuple[object, ...]], dsn: str) -> set[str]:
    """The databases this naming gave a process of this machine that is gone without
    dropping them (a test process killed mid-module: a mutant's run ended by mutmut's
    timeout, say). Only on a server of this machine, whose pids they are; a live pid's
    database is another run's, and stays."""
    host = urllib.parse.urlsplit(dsn).hostname or "localhost"
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("/"):
        return set()
    gone = set()
    for (name,) in admin.execute("SELECT datname FROM pg_database").fetchall():
        match = _OURS.fullmatch(str(name))
        if match is None:
            continue
        try:
            os.kill(int(match[1]), 0)
        except ProcessLookupError:
            gone.add(str(name))
        except PermissionError:
            pass  # alive, another user's
    return gone


def fresh_schema() -> str:
    """A schema name no store used yet (a store given it creates it)."""
    return f"t_{uuid.uuid4().hex[:16]}"


@contextlib.contextmanager
def own_schema(database: str) -> Iterator[str]:
    """A schema name no store used yet (:func:`fresh_schema`), in ``database`` (a DSN);
    the schema is dropped afterwards."""
    schema = fresh_schema()
    try:
        yield schema
    finally:
        with psycopg.connect(database, autocommit=True) as connection:
            connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def with_parts(url: str, *, path: str | None = None, port: int | None = None) -> str:
    """``url`` (a ``postgresql://`` URL, as ``serve --store`` takes) with another
    database (``path="/name"``) or, on the same host, another port (a proxy's)."""
    parts = urllib.parse.urlsplit(url)
    if port is not None:
        host = parts.hostname or "127.0.0.1"
        user = f"{parts.username}@" if parts.username else ""
        parts = parts._replace(netloc=f"{user}{host}:{port}")
    if path is not None:
        parts = parts._replace(path=path)
    return urllib.parse.urlunsplit(parts)


@pytest.fixture(scope="module")
def database(request: pytest.FixtureRequest) -> Iterator[str]:
    """A PostgreSQL database of the requesting test module's own (``database_for``),
    dropped once the module's tests are done: the one fixture every module that needs
    PostgreSQL uses (registered in conftest.py)."""
    with database_for(request.module.__name__) as url:
        yield url


@pytest.fixture
def schema(database: str) -> Iterator[str]:
    """A schema of the test's own in its module's database (``own_schema``), dropped once
    the test is done (registered in conftest.py; a module may define its own)."""
    with own_schema(database) as name:
        yield name


def connect_in(database: str, schema: str) -> psycopg.Connection[Any]:
    """A connection of the test's own (autocommit) to ``database`` (a DSN), whose
    statements find ``schema``'s tables unqualified; the caller closes it."""
    return psycopg.connect(
        make_conninfo(database, options=f"-c search_path={schema}"),
        autocommit=True,
        connect_timeout=5,
    )


def query_in(database: str, schema: str, statement: Any, *args: object) -> list[tuple[Any, ...]]:
    """``statement`` with ``args`` on a connection of the test's own, in ``schema`` of
    ``database`` (a DSN); its rows (none for a statement that returns none)."""
    with psycopg.connect(database, autocommit=True, connect_timeout=5) as connection:
        connection.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        cursor = connection.execute(statement, args)
        return cursor.fetchall() if cursor.description else []


@contextlib.contextmanager
def runner_row_locked(
    database: str, schema: str, runner: str = "a"
) -> Iterator[psycopg.Connection[Any]]:
    """``runner``'s row in ``schema`` locked by a transaction of the test's own (COMMIT or
    ROLLBACK it to let go): the runner's next write of its row, a renewal or a batch,
    waits at the server meanwhile."""
    with psycopg.connect(database, autocommit=True, connect_timeout=5) as blocker:
        blocker.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        blocker.execute("BEGIN")
        blocker.execute("SELECT 1 FROM runners WHERE runner_id = %s FOR UPDATE", (runner,))
        yield blocker
