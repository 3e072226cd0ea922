"""The service's side of a fleet on the real thing: ``serve`` processes on one PostgreSQL.

Each runner is a ``trio-supervisor serve --store postgresql://...`` process with a state
directory of its own, holding copies of the same token files (docs/service.md section
C); the database is this module's own (``tests/support/postgres.py``), dropped
afterwards. A host opens a session on one runner and reaches it through another: the raw
answer is a 421 naming the holder, and the client follows it.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import psycopg
import pytest
import trio
from click.testing import CliRunner

from trio_supervisor import Key, Load, cli
from trio_supervisor.cli._common import moment
from trio_supervisor.client import connect
from trio_supervisor.model import RunnerInfo

from ..support import ROOT
from ..support.postgres import with_parts
from ..support.runners import Runner, serving
from ..support.waits import until

KEY: Final = Key(identity="acme", instance="eu-1")
TIMEOUT: Final = 60.0  # seconds a command may take
RUNNER_LEASE: Final = 3.0  # each runner's row's, renewed every third of it


@pytest.fixture
def fleet(tmp_path: Path, database: str) -> Iterator[tuple[Runner, Runner]]:
    """Two runners of one fleet, named uniquely (the module's database outlives a test)."""
    hosts, operators = f"hosts-{uuid.uuid4()}", f"operators-{uuid.uuid4()}"
    suffix = uuid.uuid4().hex[:6]
    with contextlib.ExitStack() as stack:
        runners = []
        for name in ("r1", "r2"):
            state = tmp_path / name
            state.mkdir(mode=0o700)
            (state / "token").write_text(hosts + "\n")
            (state / "operator-token").write_text(operators + "\n")
            # Renewed every second: what a runner publishes with its row is that fresh.
            lease = ("--runner-lease", str(RUNNER_LEASE))
            flags = ("--store", database, "--runner-id", f"{name}-{suffix}", "--no-standby", *lease)
            runners.append(stack.enter_context(serving(state, *flags, "--no-fork-server")))
        yield runners[0], runners[1]


async def test_a_call_to_the_wrong_runner_is_a_421_and_the_client_follows_it(
    fleet: tuple[Runner, Runner],
) -> None:
    first, second = fleet
    async with first.host() as on_first:
        record = await on_first.open(KEY, f"req-{uuid.uuid4()}", expected_generation=None)
    handle = {
        "key": {"identity": KEY.identity, "instance": KEY.instance},
        "token": record.handle.token,
        "generation": record.handle.generation,
    }
    async with second.http(second.hosts_token) as bare:
        answer = await bare.post("/v1/status", json={"handle": handle})
    assert answer.status_code == 421, answer.text
    problem = answer.json()
    assert problem["location"] == first.url
    assert problem["owner"].startswith("r1-")

    async with second.host() as through_second:
        assert await through_second.renew(record.handle) > 0
        await through_second.load(record.handle, Load(specifier="heartbeat:main"))
        assert (await through_second.status(record.handle)).phase.value == "Loaded"
        # An operator's dispose by key, through the second runner, is followed too.
        async with connect(second.url, token=second.operator_token) as operator:
            generation = record.handle.generation
            termination = await operator.admin_dispose(KEY, generation)
            assert "stopping after" in await operator.logs(KEY, generation)
        assert termination.kind == "exited"
        assert await through_second.dispose(record.handle) == termination  # D3
        # Any runner answers open and high-water.
        assert await through_second.high_water(KEY) == record.handle.generation


async def test_runners_and_sessions_list_the_fleet_on_any_runner(
    fleet: tuple[Runner, Runner],
) -> None:
    first, second = fleet
    async with first.host() as on_first:
        record = await on_first.open(
            Key(identity="acme", instance=f"eu-{uuid.uuid4().hex[:6]}"), "req-1"
        )
    async with connect(second.url, token=second.operator_token) as operator:
        runners = {info.runner_id: info for info in await operator.runners()}
        listed = await operator.sessions()
    ours = {
        name: info for name, info in runners.items() if info.advertise in (first.url, second.url)
    }
    assert len(ours) == 2, runners
    assert all(info.alive for info in ours.values())
    (holder,) = (name for name, info in ours.items() if info.advertise == first.url)
    assert ours[holder].sessions >= 1
    (session,) = (
        one for one in listed if one["handle"]["key"]["instance"] == record.handle.key.instance
    )
    assert session["runner"] == holder

    # The commands run trio.run of their own: in a thread, beside this test's run.
    async def command(*arguments: str) -> str:
        flags = ["--url", second.url, "--state", str(second.state)]
        result = await trio.to_thread.run_sync(CliRunner().invoke, cli.main, [*arguments, *flags])
        assert result.exit_code == 0, result.output
        return str(result.output)

    assert holder in await command("runners")
    # The second runner shows the session's age and lease left, as its holder published
    # them with its row (a session opened since its last renewal has none yet).
    instance = record.handle.key.instance

    async def timed() -> list[str] | None:
        (line,) = (line for line in (await command("sessions")).splitlines() if instance in line)
        row = [cell.strip() for cell in line.strip("│ ").split("│")]
        return row if row[3] != "-" else None

    row = await until(timed, "the second runner shows the session's age", bound=RUNNER_LEASE + 5)
    key, generation, phase, age, lease_left, *_, runner = row
    assert (key, generation, phase, runner) == (f"acme/{instance}", "1", "Open", holder)
    assert re.fullmatch(r"\d+\.\ds", age), age
    assert re.fullmatch(r"\d+\.\ds", lease_left), lease_left
    assert 0 < float(lease_left[:-1]) <= 15.0  # serve's --lease


def test_a_fleet_store_out_of_reach_exits_1_saying_so(tmp_path: Path, database: str) -> None:
    unreachable = with_parts(database, port=1)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "trio_supervisor", "serve", "--state", tmp_path / "s"),
            *("--listen", "127.0.0.1:0", "--store", unreachable, "--no-standby"),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert "Traceback" not in done.stderr, done.stderr
    assert "cannot open the fleet's store at" in done.stderr, done.stderr


async def test_runners_says_a_runner_was_taken_over_not_restarted(
    fleet: tuple[Runner, Runner], database: str
) -> None:
    """A takeover moves a dead runner's epoch on to fence it: the listing says when and
    by whom, on the wire and in ``trio-supervisor runners``, instead of a new epoch that
    looks like a restart. (The row is as a takeover leaves it: test_postgres_store.py
    takes a runner over.)"""
    first, second = fleet
    taker = next(info.runner_id for info in await _runners(first) if info.advertise == first.url)
    ghost = f"ghost-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(database, autocommit=True) as connection:
        connection.execute(
            "INSERT INTO trio_supervisor.runners (runner_id, epoch, advertise, started_at, "
            "lease_until, stop_bound, taken_over_at, taken_over_by) VALUES (%s, 2, '', "
            "now() - interval '1 hour', now() - interval '50 minutes', 0, "
            "now() - interval '40 minutes', %s)",
            (ghost, taker),
        )
    try:
        (info,) = [info for info in await _runners(second) if info.runner_id == ghost]
        assert (info.epoch, info.alive, info.taken_over_by) == (2, False, taker)
        assert info.taken_over_at is not None
        assert info.lease_until < info.taken_over_at < info.lease_until + 601

        def listed(*flags: str) -> str:
            result = CliRunner().invoke(
                cli.main, ["runners", "--url", second.url, "--state", str(second.state), *flags]
            )
            assert result.exit_code == 0, result.output
            return str(result.output)

        table = await trio.to_thread.run_sync(listed)
        (header,) = [line for line in table.splitlines() if "taken over" in line]
        (row,) = [line for line in table.splitlines() if ghost in line]
        cells = [cell.strip() for cell in row.strip("│ ").split("│")]
        assert cells[-1] == f"{moment(info.taken_over_at)} by {taker}", table
        assert header.split("┃")[-2].strip() == "taken over", table
        as_json = await trio.to_thread.run_sync(listed, "--json")
        assert f'"taken_over_by": "{taker}"' in as_json
    finally:
        with psycopg.connect(database, autocommit=True) as connection:
            connection.execute("DELETE FROM trio_supervisor.runners WHERE runner_id = %s", (ghost,))


async def _runners(runner: Runner) -> list[RunnerInfo]:
    async with connect(runner.url, token=runner.operator_token) as operator:
        return await operator.runners()
