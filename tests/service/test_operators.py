"""What operators get from a runner (docs/service.md section B): metrics, events and logs.

Each test starts a real ``trio-supervisor serve`` on an ephemeral loopback port, waits
for its readiness line (``listening on URL``, never a guessed while), reads its tokens
from its state directory, and stops it with SIGTERM on the way out (killed if it does
not exit in time). Hosts reach it with the hosts' token through the client; operators
with the operators' token. What a runner logs goes to a file, read when a test asks.

The runner is ``tests/support/runners.py``'s :func:`serving`: plain (not async), so that
the sync tests of ``test_cli.py`` and ``test_dashboard.py`` use it too.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from trio_supervisor import Key, Load, PackageError, StaleSessionError
from trio_supervisor.client import RemoteSupervisor
from trio_supervisor.model import Handle
from trio_supervisor.service.routes.operators import EVENT_BUFFER

from ..support.processes import SHUTDOWN
from ..support.runners import LEASE, Runner, open_sessions, serving
from ..support.waits import until


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[Runner]:
    with serving(tmp_path / "state") as started:
        yield started


# -- metrics --------------------------------------------------------------------------------


async def scrape(runner: Runner) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``/metrics``, read by Prometheus' own parser: sample name and labels -> value."""
    async with runner.http() as operator:
        answer = await operator.get("/metrics")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }


def sample(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def test_metrics_parse_and_the_sessions_by_phase_match_the_listing(runner: Runner) -> None:
    handles = await open_sessions(runner, 4, loaded=2)
    async with runner.host() as host:
        await host.dispose(handles[3])  # an Open session, stopped: Open, Loaded, Stopped
    async with runner.operator() as operator:
        listed = await operator.sessions()
    phases = [record["phase"] for record in listed]
    assert sorted(phases) == ["Loaded", "Loaded", "Open", "Stopped"]

    samples = await scrape(runner)
    for phase in ("Open", "Loading", "Loaded", "Stopping", "Stopped"):
        assert sample(samples, "trio_supervisor_sessions", phase=phase) == phases.count(phase)
    assert sample(samples, "trio_supervisor_children_alive") == 2
    assert sample(samples, "trio_supervisor_poisoned") == 0
    # Every save was timed: 4 Open, 2 x (Loading, Loading, Loaded), and the childless
    # stop's Stopping and Stopped in one transaction.
    assert sample(samples, "trio_supervisor_store_save_seconds_count") >= 11


async def test_calls_are_counted_by_outcome_and_a_dispose_by_kind_and_reason(
    runner: Runner,
) -> None:
    before = await scrape(runner)
    (handle,) = await open_sessions(runner, 1, loaded=1)
    async with runner.host() as host:
        stale = Handle(key=handle.key, token=str(uuid.uuid4()), generation=handle.generation)
        with pytest.raises(StaleSessionError):
            await host.renew(stale)
        termination = await host.dispose(handle)

    async def counted() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
        samples = await scrape(runner)
        # The terminations are counted from the events, a moment after the answer.
        reason = {"kind": termination.kind, "reason": "Disposed"}
        moved = sample(samples, "trio_supervisor_terminations_total", **reason)
        return samples if moved else None

    after = await until(counted, "the dispose counted in trio_supervisor_terminations_total")

    def moved(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert moved("trio_supervisor_calls_total", call="open", outcome="ok", tenant="default") == 1
    assert moved("trio_supervisor_calls_total", call="load", outcome="ok", tenant="default") == 1
    assert (
        moved("trio_supervisor_calls_total", call="renew", outcome="StaleSession", tenant="default")
        == 1
    )
    assert moved("trio_supervisor_calls_total", call="renew", outcome="ok", tenant="default") == 0
    assert moved("trio_supervisor_calls_total", call="dispose", outcome="ok", tenant="default") == 1
    assert moved("trio_supervisor_terminations_total", kind="exited", reason="Disposed") == 1
    assert moved("trio_supervisor_termination_seconds_count") == 1
    assert sample(after, "trio_supervisor_children_alive") == 0


async def test_metrics_are_for_operators_only_and_events_need_a_token(runner: Runner) -> None:
    async with runner.http(runner.hosts_token) as host:
        answer = await host.get("/metrics")
    assert answer.status_code == 403, answer.text
    assert answer.json()["code"] == "Forbidden"
    # A tenant (the hosts' token is tenant "default") watches the events of its own keys.
    for path in ("/metrics", "/v1/events"):
        async with httpx.AsyncClient(base_url=runner.url) as anyone:
            answer = await anyone.get(path)
        assert answer.status_code == 401, (path, answer.text)
        assert answer.headers["www-authenticate"] == "Bearer"


# -- events -----------------------------------------------------------------------------------


# httpx's streamed responses are chains of async generators (httpx's and httpcore's) that
# are never closed, so a reader that stops early (this one stops at the Stopped record)
# leaves them to the garbage collector, and Trio warns (encode/httpx#3686; its fix, #3777,
# is unreleased). Only those generators are excused: ``events()`` itself is closed.
HTTPX_GENERATORS: Final = "ignore:Async generator '(httpx|httpcore)[.]:ResourceWarning"


def closing_events(
    operator: RemoteSupervisor,
) -> contextlib.aclosing[AsyncGenerator[dict[str, Any], None]]:
    """``operator.events()``, closed when the block ends (Trio warns of one left open)."""
    events = operator.events()
    assert isinstance(events, AsyncGenerator)  # typed as an AsyncIterator, which has no aclose
    return contextlib.aclosing(events)


@pytest.mark.filterwarnings(HTTPX_GENERATORS)
async def test_events_deliver_each_record_of_a_session_without_its_token(runner: Runner) -> None:
    seen: list[dict[str, Any]] = []
    key = {"identity": "acme", "instance": "eu-1"}

    async def watch(operator: RemoteSupervisor, done: trio.Event) -> None:
        async with closing_events(operator) as events:
            async for event in events:
                seen.append(event)
                if event.get("phase") == "Stopped" and event["handle"]["key"] == key:
                    done.set()
                    return

    async with runner.operator() as operator, runner.host() as host, trio.open_nursery() as tasks:
        done = trio.Event()
        tasks.start_soon(watch, operator, done)

        # The stream has no "subscribed" signal: open probes until the watcher hears one.
        async def heard() -> bool:
            probe = Key(identity="probe", instance=str(uuid.uuid4()))
            await host.open(probe, f"open-{uuid.uuid4()}", lease=LEASE)
            return bool(seen)

        await until(heard, "the events stream hears of an open")
        (handle,) = await open_sessions(runner, 1, loaded=1)
        await host.dispose(handle)
        with trio.fail_after(20):
            await done.wait()

    mine = [event for event in seen if event.get("handle", {}).get("key") == key]
    assert [event["phase"] for event in mine] == [
        "Open",
        "Loading",
        "Loading",
        "Loaded",
        "Stopping",
        "Stopped",
    ]
    assert all(event["handle"] == {"key": key, "generation": 1} for event in mine)
    assert mine[-1]["reason"] == {"kind": "Disposed"}
    assert handle.token not in json.dumps(seen)


@pytest.mark.filterwarnings(HTTPX_GENERATORS)
async def test_events_end_when_the_runner_shuts_down(runner: Runner) -> None:
    seen: list[dict[str, Any]] = []
    ended = trio.Event()

    async def watch(operator: RemoteSupervisor) -> None:
        async with closing_events(operator) as events:
            async for event in events:
                seen.append(event)
        ended.set()

    async with runner.operator() as operator, runner.host() as host, trio.open_nursery() as tasks:
        tasks.start_soon(watch, operator)

        async def heard() -> bool:
            probe = Key(identity="probe", instance=str(uuid.uuid4()))
            await host.open(probe, f"open-{uuid.uuid4()}", lease=LEASE)
            return bool(seen)

        await until(heard, "the events stream hears of an open")
        runner.process.send_signal(signal.SIGTERM)
        # The stream ends, without an error, once the runner begins to shut down: a
        # reader (a dashboard left open) neither holds the shutdown up nor sees it fail.
        with trio.fail_after(SHUTDOWN):  # a bound against a hang: it ends at once
            await ended.wait()
    # One SIGTERM (a second would skip the grace, and exit 1): wait for the clean exit.
    assert runner.process.wait(SHUTDOWN) == 0


def _stuck_reader(runner: Runner) -> socket.socket:
    """A connection that asks for the events and then never reads a byte."""
    address = httpx.URL(runner.url)
    assert address.host
    assert address.port
    reader = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A small window, so that the runner's writes block soon rather than fill megabytes.
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect((address.host, address.port))
    reader.sendall(
        f"GET /v1/events HTTP/1.1\r\nHost: {address.host}\r\n"
        f"Authorization: Bearer {runner.operator_token}\r\n\r\n".encode()
    )
    return reader


def _read_until(reader: socket.socket, wanted: bytes, bound: float) -> bytes:
    data = b""
    deadline = time.monotonic() + bound
    while wanted not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        reader.settimeout(left)
        try:
            chunk = reader.recv(1 << 16)
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
    return data


# Each open + dispose of a session that loads nothing makes 3 records (Open, Stopping,
# Stopped); this many cycles make more than the reader's buffer and the sockets can hold.
CYCLES: Final = max(300, EVENT_BUFFER // 2)


async def test_an_events_reader_that_never_reads_does_not_slow_the_runner(
    runner: Runner,
) -> None:
    with _stuck_reader(runner) as reader:
        # Its buffer is registered before the answer's headers go out.
        assert _read_until(reader, b"\r\n\r\n", 10.0).startswith(b"HTTP/1.1 200 ")
        began = time.monotonic()
        async with runner.host() as host:
            with trio.fail_after(120):
                for number in range(CYCLES):
                    key = Key(identity="cycle", instance=f"c{number}")
                    record = await host.open(key, f"open-{uuid.uuid4()}", lease=LEASE)
                    await host.dispose(record.handle)
        took = time.monotonic() - began
        # The runner kept what fit and dropped the rest; reading now, the reader hears so.
        data = _read_until(reader, b"event: overflow", 30.0)
    assert b"event: overflow" in data, f"no overflow after {CYCLES} cycles ({took:.1f} s)"
    overflow = data[data.index(b"event: overflow") :].split(b"\n")[1]
    lost = json.loads(overflow.removeprefix(b"data:"))["lost"]
    assert 0 < lost <= 3 * CYCLES
    kept = data.count(b"event: record")
    assert kept >= EVENT_BUFFER
    assert kept + lost == 3 * CYCLES


# -- logs ----------------------------------------------------------------------------------------


async def test_json_logs_are_one_object_a_line_with_session_fields_and_no_token(
    tmp_path: Path,
) -> None:
    with serving(tmp_path / "state", "--log-format", "json") as runner:
        async with runner.host() as host:
            key = Key(identity="acme", instance="broken")
            record = await host.open(key, "open-broken", lease=LEASE)
            with pytest.raises(PackageError):
                await host.load(record.handle, Load(specifier="no_such_plugin:main"))
            # Refused requests are logged: a wrong bearer, and the hosts' on /metrics.
            async with runner.http("not-a-token") as stranger:
                assert (await stranger.get("/v1/sessions")).status_code == 401
            async with runner.http(runner.hosts_token) as other_host:
                assert (await other_host.get("/metrics")).status_code == 403
        async with runner.operator() as operator:
            (listed,) = await operator.sessions(identity="acme")
            assert listed["reason"]["kind"] == "LoadFailed"
        tokens = {
            "hosts'": runner.hosts_token,
            "operators'": runner.operator_token,
            "session": record.handle.token,
        }
        assert runner.stop() == 0

    lines = runner.stderr().splitlines()
    assert lines
    logged = []
    for line in lines:
        entry = json.loads(line)  # every line is one JSON object
        assert isinstance(entry, dict), line
        assert {"level", "logger", "message"} <= entry.keys(), line
        logged.append(entry)
    failures = [entry for entry in logged if "no_such_plugin" in entry["message"]]
    assert failures, "the load failure is not logged"
    assert failures[0]["level"] == "warning"
    assert failures[0]["logger"].startswith("trio_supervisor.")
    assert (failures[0]["identity"], failures[0]["instance"], failures[0]["generation"]) == (
        "acme",
        "broken",
        1,
    )
    refused = [entry for entry in logged if entry["message"].startswith("refused")]
    assert len(refused) == 2, refused
    for whose, token in tokens.items():
        leaks = [line for line in lines if token in line]
        assert not leaks, f"the {whose} token is logged: {leaks}"


# -- a log's tail, and a key's generations -------------------------------------------------

# A child that writes known lines, the last without its newline, then waits to be stopped.
LINES_PLUGIN: Final = """
import sys
import time


def main(context):
    for number in range(1, 6):
        print(f"line {number}")
    sys.stdout.write("partial")
    sys.stdout.flush()
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
"""
WHOLE_LOG: Final = "line 1\nline 2\nline 3\nline 4\nline 5\npartial"


async def test_a_logs_tail_counts_lines_and_tail_bytes_counts_bytes(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "lines.py").write_text(LINES_PLUGIN)
    key = Key(identity="lines", instance="a")
    with serving(tmp_path / "state", plugins=(plugins,)) as runner:
        async with runner.host() as host, runner.operator() as operator, runner.http() as bare:
            record = await host.open(key, "r1", lease=LEASE)
            await host.load(record.handle, Load(specifier="lines:main"))

            async def written() -> bool:
                return await operator.logs(key, 1) == WHOLE_LOG

            await until(written, "the child's lines in its log")
            # The last N lines; a last line without its newline is one.
            assert await operator.logs(key, 1, tail=2) == "line 5\npartial"
            assert await operator.logs(key, 1, tail=1) == "partial"
            assert await operator.logs(key, 1, tail=6) == WHOLE_LOG
            assert await operator.logs(key, 1, tail=1000) == WHOLE_LOG
            # The last N bytes, for those who want bytes.
            assert await operator.logs(key, 1, tail_bytes=5) == "rtial"
            assert await operator.logs(key, 1, tail_bytes=1000) == WHOLE_LOG
            with pytest.raises(
                ValueError, match=re.escape("tail (lines) or tail_bytes (bytes), not both")
            ):
                await operator.logs(key, 1, tail=1, tail_bytes=1)
            # Over HTTP: both at once, or a tail of no line, is refused naming them.
            query = {"identity": "lines", "instance": "a", "generation": "1"}
            both = await bare.get("/v1/logs", params={**query, "tail": "2", "tail_bytes": "5"})
            assert (both.status_code, both.json()["code"]) == (422, "InvalidRequest")
            assert "'tail' (lines) and 'tail_bytes' (bytes)" in both.json()["detail"]
            none = await bare.get("/v1/logs", params={**query, "tail": "0"})
            assert none.status_code == 422
            assert none.json()["detail"] == "the query parameter 'tail' must be >= 1"
            # The document says what each counts.
            document = (await bare.get("/openapi.json")).json()
            described = {
                param["name"]: param.get("description", "")
                for param in document["paths"]["/v1/logs"]["get"]["parameters"]
            }
            assert "last TAIL lines" in described["tail"]
            assert "last TAIL_BYTES bytes" in described["tail_bytes"]
        assert await runner.terminate() == 0


async def test_the_listing_shows_each_keys_newest_generation_or_every_retained_one(
    runner: Runner,
) -> None:
    key = Key(identity="again", instance="a")
    async with runner.host() as host, runner.operator() as operator, runner.http() as bare:
        first = await host.open(key, "r1", lease=LEASE)
        await host.dispose(first.handle)
        await host.open(key, "r2", expected_generation=1, lease=LEASE)
        await host.open(Key(identity="again", instance="b"), "r3", lease=LEASE)

        def generations(listed: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
            return [
                (one["handle"]["key"]["instance"], one["handle"]["generation"], one["phase"])
                for one in listed
            ]

        newest = await operator.sessions(identity="again")
        assert generations(newest) == [("a", 2, "Open"), ("b", 1, "Open")]
        every = await operator.sessions(identity="again", all_generations=True)
        assert generations(every) == [("a", 1, "Stopped"), ("a", 2, "Open"), ("b", 1, "Open")]
        only_a = await operator.sessions(identity="again", instance="a", all_generations=True)
        assert generations(only_a) == [("a", 1, "Stopped"), ("a", 2, "Open")]
        # The phase filters what is listed: a key shows as it is now, or not at all.
        assert await operator.sessions(identity="again", phase="Stopped") == []
        stopped = await operator.sessions(identity="again", phase="Stopped", all_generations=True)
        assert generations(stopped) == [("a", 1, "Stopped")]
        # The query parameter, as the document states it.
        asked = {"identity": "again", "all_generations": "true"}
        answer = await bare.get("/v1/sessions", params=asked)
        assert generations(answer.json()["sessions"]) == generations(every)
        answer = await bare.get("/v1/sessions", params={**asked, "all_generations": "yes"})
        assert answer.status_code == 422
        assert answer.json()["detail"] == (
            "the query parameter 'all_generations' must be true or false"
        )
        # Pages of one record still reach every key's newest generation.
        one_each = await bare.get("/v1/sessions", params={"identity": "again", "limit": "1"})
        page = one_each.json()
        assert generations(page["sessions"]) == [("a", 2, "Open")]
        rest = await bare.get(
            "/v1/sessions", params={"identity": "again", "limit": "1", "after": page["next"]}
        )
        assert generations(rest.json()["sessions"]) == [("b", 1, "Open")]
