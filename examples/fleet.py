"""Two runners on one PostgreSQL database act as one fleet; then one of them dies.

It starts two ``trio-supervisor serve`` processes, ``r1`` and ``r2``, on a database of
its own (made on the server you name, dropped at the end), with the same token files.
A host opens a session on r1, loads a plugin, renews through r2 (which sends it on to
r1: a 421 the client follows), and reads the fleet's runners. Then r1 is killed with
SIGKILL: an open of the same key on r2 waits until r1's session can safely be taken
over, and the example prints how long that took and how r1's session ended.

    python examples/fleet.py                          # PostgreSQL at 127.0.0.1:5432
    python examples/fleet.py postgresql://postgres@db.example/postgres

The URL is a connection the example may create and drop a database with (the database
it names is only used for that).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psycopg
import trio
from psycopg import sql

from trio_supervisor import Key, Load, LoadedRecord, StoppedRecord
from trio_supervisor.client import connect

PLUGINS = Path(__file__).parent / "plugins"
KEY = Key(identity="fleet-example", instance="eu-1")
TIMINGS = ["--runner-lease", "2", "--lease", "3", "--grace", "1", "--confirmation-timeout", "1"]


@contextmanager
def database(server: str) -> Iterator[str]:
    """A database of the example's own on ``server``; its URL. Dropped afterwards."""
    name = f"trio_supervisor_fleet_example_{os.getpid()}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield urllib.parse.urlunsplit(urllib.parse.urlsplit(server)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@contextmanager
def runner(name: str, store: str, state: Path, tokens: Path) -> Iterator[tuple[str, int]]:
    """``serve`` as runner ``name`` of the fleet; its URL and pid, once it listens."""
    command = [sys.executable, "-m", "trio_supervisor", "serve", "--state", str(state / name)]
    command += ["--listen", "127.0.0.1:0", "--plugins", str(PLUGINS), *TIMINGS]
    command += ["--store", store, "--runner-id", name]
    command += ["--token-file", str(tokens / "token")]
    command += ["--operator-token-file", str(tokens / "operator-token")]
    with open(state / f"{name}.log", "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # the readiness handshake: "listening on URL"
        if not line.startswith("listening on "):
            raise SystemExit(f"{name} did not start; its log is {state / name}.log")
        yield line.split()[-1], process.pid
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


async def host(r1: str, r2: str, token: str, r1_pid: int) -> None:
    async with connect(r1, token=token) as on_r1, connect(r2, token=token) as on_r2:
        record = await on_r1.open(KEY, "fleet-example-1")
        await on_r1.load(record.handle, Load(specifier="heartbeat:main"))
        print(f"opened {KEY.identity}/{KEY.instance} generation 1 on r1, heartbeat loaded")
        lease = await on_r2.renew(record.handle)
        print(f"renewed through r2 (sent on to r1, the holder): lease {lease:g} s")
        status = await on_r2.status(record.handle)
        assert isinstance(status, LoadedRecord)
        print(f"its child runs as pid {status.child.pid}")

        os.kill(r1_pid, signal.SIGKILL)
        print("r1 killed with SIGKILL")
        started = time.monotonic()
        newer = await on_r2.open(KEY, "fleet-example-2", expected_generation=1)
        waited = time.monotonic() - started
        print(f"opened generation {newer.handle.generation} on r2 after {waited:.1f} s")
        older = await on_r2.status(record.handle)
        assert isinstance(older, StoppedRecord)
        print(f"generation 1, on r1: {older.reason.kind}, {older.termination.describe()}")
        await on_r2.dispose(newer.handle)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "server",
        nargs="?",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="a PostgreSQL URL the example may create and drop a database with",
    )
    arguments = parser.parse_args()
    with ExitStack() as stack:
        state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-")))
        for name in ("token", "operator-token"):
            (state / name).write_text(secrets.token_urlsafe(32) + "\n")
            (state / name).chmod(0o600)
        store = stack.enter_context(database(arguments.server))
        r1, r1_pid = stack.enter_context(runner("r1", store, state, state))
        r2, _ = stack.enter_context(runner("r2", store, state, state))
        print(f"r1 listens on {r1}, r2 on {r2}, one database")
        token = (state / "token").read_text().strip()
        trio.run(host, r1, r2, token, r1_pid)
    print("r2 stopped, every child reaped; the example's database is dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
