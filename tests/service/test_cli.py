"""``trio-supervisor``, the operator's command, against a real runner (docs/service.md section B).

One runner serves the whole module, started the way an operator starts it: in a working
directory of its own, with its default ``--state runner-state``. The commands run as
processes in that directory too, so they find the runner's operator token with no flag,
and its URL with none either when the runner could take the default port, 8470 (when
another process holds it, the runner takes a free port and the commands are given
``--url``). Exit statuses are part of the interface: 0 ok, 1 the runner's error (its
detail printed), 2 a usage error.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import attrs
import httpx
import pytest
import trio

from trio_supervisor import Handle, Key, Load
from trio_supervisor._defaults import LISTEN
from trio_supervisor.cli._operate import DEFAULT_URL
from trio_supervisor.client import connect
from trio_supervisor.executions._logs import Logs

from ..support.processes import NotReady
from ..support.runners import LEASE, Runner, heartbeat_heard, open_sessions, serving
from ..support.waits import settled

DEFAULT_LISTEN: Final = LISTEN  # serve's, which the commands' --url defaults to
COMMAND_TIMEOUT: Final = 60.0  # seconds one command may take


def port_free(address: str) -> bool:
    host, _, port = address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, int(port)))
        except OSError:
            return False
    return True


@attrs.frozen
class Result:
    status: int
    out: str
    err: str


@attrs.frozen
class Operator:
    """The runner, its directory, and how a command reaches it from there."""

    runner: Runner
    directory: Path
    url_flags: tuple[str, ...]

    def run(self, *arguments: str, reach: bool = True, cwd: Path | None = None) -> Result:
        """``trio-supervisor ARGUMENTS`` in the runner's directory, or ``cwd`` (``--url``
        added only when the runner is not on the default port and ``reach`` is set)."""
        command = [sys.executable, "-m", "trio_supervisor", *arguments]
        if reach:
            command += self.url_flags
        done = subprocess.run(
            command,
            cwd=self.directory if cwd is None else cwd,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
        return Result(done.returncode, done.stdout, done.stderr)

    def listed(self) -> list[dict[str, Any]]:
        """Every record, as the runner lists it to operators."""

        async def sessions() -> list[dict[str, Any]]:
            async with connect(self.runner.url, token=self.runner.operator_token) as operator:
                return await operator.sessions()

        return trio.run(sessions)


@pytest.fixture(scope="module")
def operator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """A runner with three sessions of ``acme``: eu-1 and eu-2 run the heartbeat, eu-3 is
    Open."""
    directory = tmp_path_factory.mktemp("operator")
    log = directory / "runner.stderr"
    with contextlib.ExitStack() as stack:
        runner: Runner | None = None
        if port_free(DEFAULT_LISTEN):
            with contextlib.suppress(NotReady):  # taken meanwhile: any port will do
                runner = stack.enter_context(
                    serving(None, listen=DEFAULT_LISTEN, cwd=directory, log=log)
                )
        if runner is None:
            runner = stack.enter_context(serving(None, cwd=directory, log=log))
        url_flags: tuple[str, ...] = ()
        if runner.url != DEFAULT_URL:
            url_flags = ("--url", runner.url)
            print(f"port 8470 is taken; the commands are given --url {runner.url}")
        trio.run(functools.partial(open_sessions, runner, 3, loaded=2))
        yield Operator(runner, directory, url_flags)


def cells(line: str) -> list[str]:
    """The cells of one line of a printed table (a header's, or a row's)."""
    return [cell.strip() for cell in line.replace("┃", "│").strip("│ ").split("│")]


def acme(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the fixture's sessions (of the identity ``acme``)."""
    return [record for record in records if record["handle"]["key"]["identity"] == "acme"]


def rows(table: str) -> dict[str, str]:
    """The lines of a printed table, by the key each begins with."""
    return {
        cells(line)[0]: line for line in table.splitlines() if cells(line)[0].startswith("acme/")
    }


# -- the commands --------------------------------------------------------------------------


def test_sessions_with_no_flags_prints_a_table_of_every_session(operator: Operator) -> None:
    result = operator.run("sessions")
    assert result.status == 0, result.err
    everything = operator.listed()
    assert (
        f"{len(everything)} sessions at {operator.runner.url}, the newest generation of each key"
        in result.out
    )
    listed = acme(everything)  # a test of logs keeps a key of its own beside them
    header = next(line for line in result.out.splitlines() if cells(line)[0] == "key")
    assert cells(header) == [
        "key",
        "generation",
        "phase",
        "age",
        "lease left",
        "child pid",
        "reason",
        "termination",
        "runner",
    ]
    printed = rows(result.out)
    assert len(printed) == len(listed) == 3
    for record in listed:
        key = record["handle"]["key"]
        line = printed[f"{key['identity']}/{key['instance']}"]  # one line a session
        _, generation, phase, age, lease_left, pid, *_ = cells(line)
        assert (generation, phase) == (str(record["handle"]["generation"]), record["phase"])
        if record["phase"] == "Loaded":
            pid_of = (record.get("previous") or record)["child"]["pid"]
            assert pid == str(pid_of)
            assert age.endswith("s")
            assert lease_left.endswith("s")


def test_sessions_json_prints_the_same_rows(operator: Operator) -> None:
    table = rows(operator.run("sessions").out)
    result = operator.run("sessions", "--json")
    assert result.status == 0, result.err
    records = json.loads(result.out)
    assert len(acme(records)) == len(table)
    for record in acme(records):
        key = record["handle"]["key"]
        line = table[f"{key['identity']}/{key['instance']}"]
        assert cells(line)[1:3] == [str(record["handle"]["generation"]), record["phase"]]
        assert "token" not in record["handle"]
    assert {json.dumps(record["handle"]) for record in records} == {
        json.dumps(record["handle"]) for record in operator.listed()
    }


def test_show_prints_a_sessions_record(operator: Operator) -> None:
    result = operator.run("show", "acme", "eu-1")
    assert result.status == 0, result.err
    (line,) = rows(result.out).values()
    assert cells(line)[:3] == ["acme/eu-1", "1", "Loaded"]
    assert '"specifier": "heartbeat:main"' in result.out
    assert '"token"' not in result.out

    result = operator.run("show", "acme", "eu-1", "1", "--json")
    assert result.status == 0, result.err
    (record,) = json.loads(result.out)
    assert record["handle"] == {"key": {"identity": "acme", "instance": "eu-1"}, "generation": 1}


def test_logs_prints_what_the_child_wrote(operator: Operator) -> None:
    printed: list[Result] = []

    def two_beats() -> bool:
        printed.append(operator.run("logs", "acme", "eu-1", "1"))
        assert printed[-1].status == 0, printed[-1].err
        return "beat 2 of acme/eu-1 #1\n" in printed[-1].out

    settled(two_beats, 20, every=0.2)
    assert printed[-1].out.startswith("beat 1 of acme/eu-1 #1\nbeat 2 of acme/eu-1 #1\n")

    # --tail counts lines, --tail-bytes bytes; not both.
    tail = operator.run("logs", "acme", "eu-1", "1", "--tail", "2")
    assert tail.status == 0, tail.err
    assert re.fullmatch(r"beat (\d+) of acme/eu-1 #1\nbeat \d+ of acme/eu-1 #1\n", tail.out)
    tail = operator.run("logs", "acme", "eu-1", "1", "--tail-bytes", "30")
    assert tail.status == 0, tail.err
    assert 0 < len(tail.out.encode()) <= 30
    both = operator.run("logs", "acme", "eu-1", "1", "--tail", "2", "--tail-bytes", "30")
    assert both.status == 2
    assert "Error: give --tail (lines) or --tail-bytes (bytes), not both" in both.err


def test_logs_prints_every_retained_generation_and_names_an_evicted_one(
    operator: Operator,
) -> None:
    # A key of its own, beside acme's: generation 2 supersedes generation 1, and with one
    # Stopped record kept per key, generation 1 is retained until generation 2 stops.
    key = Key(identity="logs", instance="x")
    runner = operator.runner

    async def open_two() -> list[Handle]:
        handles = []
        async with runner.host() as host, runner.operator() as operators:
            for generation in (1, 2):
                handles.append(await heartbeat_heard(host, operators, key, generation))
        return handles

    first, second = trio.run(open_two)
    printed = operator.run("logs", "logs", "x", "1")  # generation 2 is open
    assert printed.status == 0, printed.err
    assert printed.out.startswith("beat 1 of logs/x #1\n")

    async def dispose_second() -> tuple[httpx.Response, str]:
        async with runner.host() as host, runner.http() as operators:
            await host.dispose(second)
            query = {"identity": "logs", "instance": "x", "generation": "1"}
            evicted = await operators.get("/v1/logs", params=query)
            retained = await operators.get("/v1/logs", params={**query, "generation": "2"})
            return evicted, retained.text

    answer, retained = trio.run(dispose_second)
    assert (answer.status_code, answer.json()["code"]) == (404, "StaleSession")
    assert "stopping after" in retained
    printed = operator.run("logs", "logs", "x", "1")
    assert (printed.status, printed.out) == (1, "")
    assert printed.err == "Error: StaleSession: logs/x has no retained generation 1\n"
    # Its log went with its record.
    path = Logs(runner.state).path(first)
    assert settled(lambda: not path.exists(), 20), f"{path} is still there"


def test_dispose_by_key_and_generation_then_show_says_stopped_disposed(
    operator: Operator,
) -> None:
    result = operator.run("dispose", "acme", "eu-2", "1")
    assert result.status == 0, result.err
    assert result.out == "acme/eu-2 #1: exited (code 0)\n"  # the heartbeat's goodbye

    shown = operator.run("show", "acme", "eu-2", "1")
    assert shown.status == 0, shown.err
    (line,) = rows(shown.out).values()
    _, generation, phase, age, lease_left, _, reason, termination, runner = cells(line)
    assert (generation, phase, reason) == ("1", "Stopped", "Disposed")
    assert (age, lease_left, termination) == ("-", "-", "exited (code 0)")
    assert runner == socket.gethostname()  # a runner of its own is named after its host

    again = operator.run("dispose", "acme", "eu-2", "1")  # D3: the same termination
    assert (again.status, again.out) == (0, result.out)


def test_health_says_ready(operator: Operator) -> None:
    result = operator.run("health")
    assert (result.status, result.out) == (0, f"{operator.runner.url}: ready\n")
    result = operator.run("health", "--json")
    assert (result.status, json.loads(result.out)) == (0, {"status": "ready"})


def test_health_from_another_directory_needs_no_token(operator: Operator, tmp_path: Path) -> None:
    # As the README writes it, where no runner-state is: /readyz asks for no token.
    url = operator.runner.url
    assert not (tmp_path / "runner-state").exists()
    result = operator.run("health", "--url", url, cwd=tmp_path, reach=False)
    assert (result.status, result.out, result.err) == (0, f"{url}: ready\n", "")
    result = operator.run("health", "--url", url, "--json", cwd=tmp_path, reach=False)
    assert (result.status, json.loads(result.out)) == (0, {"status": "ready"})
    # A --token-file given and not there is still a mistake worth hearing of.
    result = operator.run(
        "health", "--url", url, "--token-file", "nowhere", cwd=tmp_path, reach=False
    )
    assert result.status == 2
    assert "cannot read the operators' token nowhere" in result.err
    # The other commands do need the token, and say where they looked.
    result = operator.run("sessions", "--url", url, cwd=tmp_path, reach=False)
    assert result.status == 2
    assert "cannot read the operators' token runner-state/operator-token" in result.err


# -- exit statuses ---------------------------------------------------------------------------


def test_a_runners_error_exits_1_with_its_detail(operator: Operator) -> None:
    result = operator.run("dispose", "acme", "nowhere", "7")
    assert result.status == 1
    assert result.out == ""
    assert result.err == "Error: StaleSession: acme/nowhere has no retained generation 7\n"

    # The hosts' token is not the operators' (it may list its own keys, not dispose
    # by key): the runner says so.
    result = operator.run("dispose", "acme", "nowhere", "7", "--token-file", "runner-state/token")
    assert result.status == 1
    assert result.err == "Error: Forbidden: this call is for the runner's operators\n"


@pytest.mark.parametrize("token", ["with a token", "without one"])
def test_a_runner_out_of_reach_exits_1_saying_where(
    operator: Operator, tmp_path: Path, token: str
) -> None:
    where = operator.directory if token == "with a token" else tmp_path
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        result = operator.run("health", "--url", url, reach=False, cwd=where)
    assert result.status == 1
    assert result.err.startswith(
        f"Error: the runner at {url} is not answering (tried for 2.0 s): ConnectError: "
    )


def test_a_usage_error_exits_2(operator: Operator) -> None:
    result = operator.run("dispose", "acme", "eu-1")
    assert result.status == 2
    assert "Error: Missing argument 'GENERATION'." in result.err
    result = operator.run("show", reach=False)
    assert result.status == 2
    assert "Error: Missing argument 'IDENTITY'." in result.err
    result = operator.run("logs", "acme", "eu-1", "first")
    assert result.status == 2
    assert "'first' is not a valid integer" in result.err
    # A key over the documented length, refused before the runner is asked.
    result = operator.run("dispose", "i" * 129, "eu-1", "1")
    assert result.status == 2
    assert "Error: Key.identity must be at most 128 characters, got 129" in result.err
    # No token where the command looks: a usage error, saying where it looked.
    result = operator.run("sessions", "--state", "elsewhere")
    assert result.status == 2
    assert "cannot read the operators' token elsewhere/operator-token" in result.err


def test_sessions_lists_each_keys_newest_generation_and_show_every_one_newest_first(
    operator: Operator,
) -> None:
    runner = operator.runner
    key = Key(identity="history", instance="x")

    async def open_dispose_open() -> None:
        async with runner.host() as host:
            first = await host.open(key, "r1", lease=LEASE)
            await host.dispose(first.handle)
            await host.open(key, "r2", expected_generation=1, lease=LEASE)

    trio.run(open_dispose_open)

    def listed(*flags: str) -> list[list[str]]:
        result = operator.run("sessions", "--identity", "history", *flags)
        assert result.status == 0, result.err
        return [
            cells(line)[:3]
            for line in result.out.splitlines()
            if cells(line)[0].startswith("history/")
        ]

    assert listed() == [["history/x", "2", "Open"]]
    assert listed("--all-generations") == [
        ["history/x", "1", "Stopped"],
        ["history/x", "2", "Open"],
    ]
    shown = operator.run("show", "history", "x")
    assert shown.status == 0, shown.err
    lines = [cells(line)[:3] for line in shown.out.splitlines() if "history/x" in line]
    assert lines == [["history/x", "2", "Open"], ["history/x", "1", "Stopped"]]
    shown = operator.run("show", "history", "x", "--json")
    assert [one["handle"]["generation"] for one in json.loads(shown.out)] == [2, 1]


def test_usage_says_what_its_cpu_ceilings_count(operator: Operator) -> None:
    # A child of its own, asking for no CPU limit: the fixture's may have ended by now
    # (their lease is long, but a loaded machine makes a module's run longer still).
    runner = operator.runner

    async def load_one() -> Handle:
        async with runner.host() as host:
            key = Key(identity="usage", instance="x")
            record = await host.open(key, str(uuid.uuid4()), lease=LEASE)
            await host.load(record.handle, Load(specifier="heartbeat:main"))
            return record.handle

    async def dispose(handle: Handle) -> None:
        async with runner.host() as host:
            await host.dispose(handle)

    handle = trio.run(load_one)
    try:
        _check_usage(operator)
    finally:
        trio.run(dispose, handle)


def _check_usage(operator: Operator) -> None:
    answer = json.loads(operator.run("usage", "--json").out)
    [tenant] = answer["tenants"]  # no tenants file: the hosts' token is tenant default
    used = tenant["usage"]
    cores = os.cpu_count() or 1
    assert answer["unlimited_cpu_percent"] == 100 * cores
    # The fixture's children asked for no CPU limit: each counts as every core.
    without = used["children_without_cpu_limit"]
    assert without == used["children"] >= 1
    assert used["cpu_percent"] == without * 100 * cores

    result = operator.run("usage")
    assert result.status == 0, result.err
    header = next(line for line in result.out.splitlines() if cells(line)[0] == "tenant")
    assert cells(header) == ["tenant", "sessions", "children", "memory ceilings", "CPU ceilings"]
    row = next(line for line in result.out.splitlines() if cells(line)[0] == "default")
    core_text = "1 core" if cores == 1 else f"{cores} cores"
    said = (
        f"1 child without a limit counts as {core_text}"
        if without == 1
        else f"{without} children without a limit count as {core_text} each"
    )
    assert cells(row)[4] == f"{used['cpu_percent']}% ({said})"


def test_dashboard_prints_a_sign_in_link_that_works_once_and_opens_it_if_asked(
    operator: Operator, tmp_path: Path
) -> None:
    result = operator.run("dashboard")
    assert result.status == 0, result.err
    link = result.out.strip()
    assert link.startswith(f"{operator.runner.url}/?code=")
    assert operator.runner.operator_token not in link
    assert "once, within 5 minutes" in result.err
    code = link.partition("?code=")[2]

    async def sign_in(code: str) -> httpx.Response:
        async with httpx.AsyncClient(base_url=operator.runner.url) as client:
            return await client.post("/v1/dashboard/sign-in", json={"code": code})

    first = trio.run(sign_in, code)
    assert first.status_code == 200, first.text
    token = first.json()["token"]
    assert token != operator.runner.operator_token
    again = trio.run(sign_in, code)
    assert (again.status_code, again.json()["code"]) == (401, "Unauthorized")

    async def listed_with(token: str) -> int:
        async with operator.runner.http(token) as client:
            return (await client.get("/v1/sessions")).status_code

    assert trio.run(listed_with, token) == 200  # the sign-in is an operators' token

    # --open hands the link to the browser the environment names (here, a script that
    # writes down what it was given).
    opened = tmp_path / "opened"
    browser = tmp_path / "browser"
    browser.write_text(f'#!/bin/sh\nprintf %s "$1" > {opened}\n')
    browser.chmod(0o755)
    done = subprocess.run(
        [sys.executable, "-m", "trio_supervisor", "dashboard", "--open", *operator.url_flags],
        cwd=operator.directory,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
        env={**os.environ, "BROWSER": f"{browser} %s"},
    )
    assert done.returncode == 0, done.stderr
    assert settled(opened.exists, 10), "the browser was not run"
    assert opened.read_text() == done.stdout.strip()
