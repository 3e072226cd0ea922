"""The runners of a fleet as the tests run them: ``trio-supervisor serve`` processes on
one database (``member``), with short timings, the token files they share (the
``tokens`` fixture of tests/service/conftest.py), their hosts, and a look at what the
database holds."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import psycopg

from trio_supervisor import Handle, LoadedRecord, StoppedRecord
from trio_supervisor.client import RemoteSupervisor, connect

from .runners import Runner, serving
from .waits import until

__all__ = [
    "CONFIRMATION",
    "FLEET_HOSTS_TOKEN",
    "FLEET_OPERATOR_TOKEN",
    "GRACE",
    "MARGIN",
    "RUNNER_LEASE",
    "SESSION_LEASE",
    "child_of",
    "hosts",
    "member",
    "stopped_on",
    "stored",
    "write_tokens",
]

# Each runner's row: renewed every third of it, and trusted for four fifths of it from
# when its last renewal was sent, so a renewal may come 1.4 s late before its runner
# fences itself. The tests that wait for a row to expire (a runner killed, frozen or cut
# off) wait a runner lease longer for each: a short one, but not so short that a busy
# machine fences a runner no test stopped (at 1 s, trusted for 0.8 s, one of the rolling
# restart's runners fenced itself on a machine at a load of 6 on 2 cores).
RUNNER_LEASE: Final = 3.0
SESSION_LEASE: Final = 2.0  # each session's
GRACE: Final = 0.5
CONFIRMATION: Final = 1.0
# F7: a dead runner's session is taken over once its row expired by the session's lease,
# its grace, its confirmation and the children's switch slack (2 s).
MARGIN: Final = SESSION_LEASE + GRACE + CONFIRMATION + 2.0
FLEET_HOSTS_TOKEN: Final = "fleet-hosts-token-for-tests"
FLEET_OPERATOR_TOKEN: Final = "fleet-operator-token-for-tests"


def write_tokens(directory: Path) -> tuple[Path, Path]:
    """The token files every runner of the fleet is given (copies, on real machines)."""
    hosts, operators = directory / "hosts-token", directory / "operator-token"
    for path, token in ((hosts, FLEET_HOSTS_TOKEN), (operators, FLEET_OPERATOR_TOKEN)):
        path.write_text(token + "\n")
        path.chmod(0o600)
    return hosts, operators


def member(
    tmp_path: Path, tokens: tuple[Path, Path], store: str, name: str, *flags: str
) -> contextlib.AbstractContextManager[Runner]:
    """``serve`` as runner ``name`` of the fleet on ``store``; ``flags`` come last, so
    that they win over these timings."""
    hosts, operators = tokens
    return serving(
        tmp_path / name,
        "--store",
        store,
        "--runner-id",
        name,
        "--runner-lease",
        str(RUNNER_LEASE),
        "--lease",
        str(SESSION_LEASE),
        "--grace",
        str(GRACE),
        "--confirmation-timeout",
        str(CONFIRMATION),
        "--token-file",
        str(hosts),
        "--operator-token-file",
        str(operators),
        *flags,
    )


@contextlib.asynccontextmanager
async def hosts(runners: list[Runner]) -> AsyncIterator[list[RemoteSupervisor]]:
    """A client of each runner, with the hosts' token."""
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(connect(runner.url, token=FLEET_HOSTS_TOKEN))
            for runner in runners
        ]


def stored(url: str) -> dict[str, tuple[str, int, str]]:
    """Every record row: token -> (runner, epoch, body)."""
    with psycopg.connect(url, autocommit=True) as connection:
        return {
            token: (runner, epoch, body)
            for token, runner, epoch, body in connection.execute(
                "SELECT token, runner_id, epoch, body FROM trio_supervisor.records"
            ).fetchall()
        }


async def child_of(host: RemoteSupervisor, handle: Handle) -> int:
    """The pid of the child of a loaded session."""
    record = await host.status(handle)
    assert isinstance(record, LoadedRecord), record
    assert record.child.pid is not None
    return record.child.pid


async def stopped_on(holder: RemoteSupervisor, handle: Handle) -> StoppedRecord:
    """The session's Stopped record as its holder reads it. Another runner's open returns
    once the holder's Stopped row committed (F6); the holder's own index takes the record
    in as its save returns, a moment later on a busy machine (found by CI)."""

    async def stopped() -> StoppedRecord | None:
        record = await holder.status(handle)
        return record if isinstance(record, StoppedRecord) else None

    return await until(stopped, "the holder's index holds the Stopped record", bound=10)
