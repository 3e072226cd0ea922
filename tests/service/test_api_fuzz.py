"""The runner's API, fuzzed from its own OpenAPI document (schemathesis).

A real ``trio-supervisor serve`` process (``tests/support/runners.py``'s ``serving``)
serves the document at ``GET /openapi.json``; schemathesis reads it from there and, for
every operation in it, generates requests that fit the document (positive) and requests
that do not (negative). Each answer must hold to the document: no 5xx, a documented
status code, a documented content type and a body of the documented schema
(docs/service.md section A, "Errors": nothing a client sends yields a 5xx).

Random handles almost never name a real session, so the fuzzer would only ever meet
404s past ``open``. The session and operator calls therefore also get real sessions:
for a drawn share of their examples, the generated handle, key or generation is swapped
for one of a pool of real sessions (the test's own, some loaded with an example plugin,
and those the fuzzed ``open`` calls opened, with their drawn leases; some stopped or
superseded by earlier examples), and a load's specifier may be swapped for a real
plugin's. The rest of the generated body stays as drawn.

After the fuzzing, a few inputs the generator cannot produce (and what the fuzzer found)
are checked one by one.

Examples per operation: ``TRIO_SUPERVISOR_API_EXAMPLES`` (``nox -s api`` sets it high;
plain pytest, and so CI, runs a short pass). Schemathesis' pytest plugin is not used for
the parametrisation (its fixture-loaded schemas need a pytest internal that pytest 9
removed); its Python API is: ``from_url``, ``as_strategy``, ``Case.call`` and
``Case.validate_response`` with the checks named below.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from trio_supervisor.model import MAX_LEASE, MIN_LEASE
from trio_supervisor.service.openapi import document

from ..support.runners import Runner, serving

EXAMPLES_VARIABLE: Final = "TRIO_SUPERVISOR_API_EXAMPLES"
DEFAULT_EXAMPLES: Final = 25  # per operation: the short pass of plain pytest (and CI)


def examples_per_operation() -> int:
    """The number of generated examples per operation: the variable's, or the default."""
    raw = os.environ.get(EXAMPLES_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_EXAMPLES
    number = int(raw)
    if number < 1:
        raise ValueError(f"{EXAMPLES_VARIABLE} must be >= 1, got {raw!r}")
    return number


Case = schemathesis.Case[Any]

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

EXAMPLES = examples_per_operation()
DRAIN = "/v1/admin/drain"
LONGEST = 30 * 86400.0  # a drain's longest deadline: the runner outlives the test
SMALL = 128 << 20  # each child's memory ceiling, unless it asks for another

# Every operation of the document, known at collection time from the package's own
# document; the test reads each from the document the live runner serves.
OPERATIONS = [
    (method.upper(), path)
    for path, methods in document()["paths"].items()
    for method in methods
    # The event stream never ends by design: tests/service/test_operators.py reads it
    # instead. A drain is for good: it is fuzzed by the module's last test.
    if path not in ("/v1/events", DRAIN)
]

POOL = 12  # real sessions the session calls may be pointed at (the latest ones)
SPECIFIERS = ("heartbeat:main", "crasher:main", "inspector:main")
POOL_LEASE = 5.0  # seconds: the pool's own sessions (and their children) do not linger
TIMEOUT = 30.0  # seconds for one call (a dispose waits for its child to end)
# Limits that become setrlimit calls or cgroup limits of the child. A load under limits
# the child cannot start with is a 500 for now (see
# test_a_load_under_limits_its_child_cannot_meet...), so sessions that ask for any of
# them are kept out of the pool.
RLIMITS = (
    "memory_bytes",
    "cpu_seconds",
    "open_files",
    "file_size_bytes",
    "processes",
    "cpu_percent",
)


@dataclass
class Pool:
    """Real sessions of the live runner: their records (from ``open`` answers, as JSON).

    Some are opened here (and loaded with an example plugin), the others are what the
    fuzzed ``open`` calls opened; later examples renew, load, dispose or supersede them.
    """

    runner: Runner
    http: requests.Session
    records: list[dict[str, Any]] = field(default_factory=list)
    opened: Iterator[int] = field(default_factory=itertools.count)

    def draw(self, data: st.DataObject, *, loaded: bool, fresh: bool) -> dict[str, Any]:
        """A session's record: a fresh one, or one of the pool's."""
        # A fixed range (Hypothesis wants the same draws for the same choices): an index
        # past the pool's end is a fresh session.
        choice = data.draw(st.integers(0, POOL), label="session")
        if choice < len(self.records) and not fresh:
            return self.records[choice]
        number = next(self.opened)
        key = {"identity": "fuzz", "instance": f"pool-{number}"}
        body = {"key": key, "request_id": f"pool-{number}", "lease": POOL_LEASE}
        record: dict[str, Any] = self.call("/v1/open", body)["record"]
        if loaded:
            load = {"specifier": "heartbeat:main", "config": {"period": 0.5}}
            self.call("/v1/load", {"handle": record["handle"], "load": load})
        self.add(record)
        return record

    def add(self, record: Any) -> None:
        """Keep a session an ``open`` answered, unless it asks for limits."""
        limits = record.get("limits") if isinstance(record, dict) else None
        if isinstance(limits, dict) and any(limits.get(name) is not None for name in RLIMITS):
            return
        self.records.append(record)
        del self.records[:-POOL]

    def call(self, path: str, body: dict[str, Any]) -> Any:
        answer = self.http.post(
            self.runner.url + path,
            json=body,
            headers={"Authorization": f"Bearer {self.runner.operator_token}"},
            timeout=TIMEOUT,
        )
        assert answer.status_code == 200, (path, answer.status_code, answer.text)
        return answer.json()


@dataclass
class Fuzz:
    """What the tests share: the runner, its document, a pool, and the counts."""

    runner: Runner
    schema: Any
    pool: Pool
    http: requests.Session
    examples: Counter[str] = field(default_factory=Counter)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[Fuzz]:
    directory = tmp_path_factory.mktemp("fuzz")
    # Room for every child the fuzzer loads: with the default 1 GiB memory ceiling a
    # machine of 24 GiB takes 22, and a real session's load past those is a 503.
    config = directory / "runner.toml"
    config.write_text(f"max_children = 1000\n[limits]\ndefault = {{ memory_bytes = {SMALL} }}\n")
    with (
        serving(directory / "state", "--config", config) as runner,
        requests.Session() as http,
    ):
        schema = schemathesis.openapi.from_url(f"{runner.url}/openapi.json", timeout=TIMEOUT)
        shared = Fuzz(runner=runner, schema=schema, pool=Pool(runner, http), http=http)
        yield shared
        status = runner.stop()  # every child reaped
        assert status == 0, f"the runner exited {status} on SIGTERM; its log:\n{runner.stderr(60)}"
    _report(pytestconfig, shared)


def _report(config: pytest.Config, fuzz: Fuzz) -> None:
    """Say how many examples ran, per operation, and what they were answered."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or not fuzz.examples:
        return
    lines = [
        f"api fuzz: {sum(fuzz.examples.values())} examples over {len(fuzz.examples)} "
        f"operations ({EXAMPLES} per operation; {EXAMPLES_VARIABLE} sets it)"
    ]
    for label, count in sorted(fuzz.examples.items()):
        seen = ", ".join(
            f"{status} x{n}" for (name, status), n in sorted(fuzz.statuses.items()) if name == label
        )
        lines.append(f"  {label}: {count} ({seen})")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        reporter.write_line("")
        for line in lines:
            reporter.write_line(line)


def _real(case: Case, data: st.DataObject, pool: Pool) -> None:
    """Point a session or operator call at a real session, for a drawn share of cases."""
    path = case.operation.path
    body = case.body
    if path not in REAL or not data.draw(st.booleans(), label="real session"):
        return
    # A load mostly meets a session with no child yet, the other calls any session.
    loading = path == "/v1/load"
    fresh = loading and data.draw(st.booleans(), label="fresh")
    record = pool.draw(data, loaded=not loading and data.draw(st.booleans()), fresh=fresh)
    handle = record["handle"]
    key = handle["key"]
    if path == "/v1/logs":
        case.query = {
            **(case.query or {}),
            "identity": key["identity"],
            "instance": key["instance"],
            "generation": handle["generation"],
        }
        return
    if not isinstance(body, dict):
        return
    if isinstance(body.get("key"), dict):
        body["key"] = dict(key)
    if path == "/v1/open" and "key" in body:
        # The key's next generation: supersedes (and stops) the session it has now.
        water = pool.call("/v1/high-water", {"key": key})["generation"]
        body["expected_generation"] = water
    if path == "/v1/admin/dispose" and "generation" in body:
        body["generation"] = handle["generation"]
    if isinstance(body.get("handle"), dict):
        body["handle"] = json.loads(json.dumps(handle))
    load = body.get("load")
    if isinstance(load, dict) and data.draw(st.booleans(), label="real plugin"):
        load["specifier"] = data.draw(st.sampled_from(SPECIFIERS), label="plugin")


# The calls whose examples may be pointed at real sessions.
REAL = frozenset(
    [
        "/v1/open",
        "/v1/renew",
        "/v1/load",
        "/v1/dispose",
        "/v1/status",
        "/v1/high-water",
        "/v1/logs",
        "/v1/admin/dispose",
    ]
)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_every_answer_holds_to_the_document(fuzz: Fuzz, method: str, path: str) -> None:
    _fuzz(fuzz, method, path)


def _fuzz(fuzz: Fuzz, method: str, path: str) -> None:
    """Fuzz one operation of the live runner's document, checking every answer."""
    operation = fuzz.schema[path][method]
    label = f"{method} {path}"
    cases = st.one_of([operation.as_strategy(generation_mode=mode) for mode in GenerationMode])
    tokens = {
        "operators": fuzz.runner.operator_token,
        "hosts": fuzz.runner.hosts_token,
    }
    if path == DRAIN:
        # A session that outlives the test, so that a drained runner does not exit.
        fuzz.pool.call("/v1/open", {"key": {"identity": "fuzz", "instance": "anchor"},
                                    "request_id": "anchor", "lease": 86400.0})  # fmt: skip

    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,  # the server's state moves on; a replayed example means little
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.given(case=cases, data=st.data())
    def run(case: Case, data: st.DataObject) -> None:
        _real(case, data, fuzz.pool)
        if path == DRAIN and isinstance(case.body, dict):
            deadline = case.body.get("deadline")
            if (
                isinstance(deadline, int | float)
                and not isinstance(deadline, bool)
                and 0 <= deadline <= LONGEST
            ):
                case.body["deadline"] = LONGEST  # 0 would stop the runner now
        # Mostly the operators' token (every call); the hosts' sometimes (403 on the
        # operator calls, the session calls as a host makes them).
        role = data.draw(st.sampled_from(["operators", "operators", "hosts"]), label="role")
        headers = {"Authorization": f"Bearer {tokens[role]}"}
        fuzz.examples[label] += 1
        try:
            response = case.call(session=fuzz.http, headers=headers, timeout=TIMEOUT)
        except BaseException:
            print(f"{label} got no answer; the runner's log:\n{fuzz.runner.stderr(last=60)}")
            raise
        fuzz.statuses[(label, response.status_code)] += 1
        if path == "/v1/open" and response.status_code == 200:
            fuzz.pool.add(response.json()["record"])
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except BaseException:
            print(f"{label} answered {response.status_code}: {response.text[:2000]}")
            print(f"the runner's log:\n{fuzz.runner.stderr(last=60)}")
            raise

    run()


# -- one by one --------------------------------------------------------------------------
# Schemathesis draws JSON that its document allows or that breaks one of its rules; the
# first three inputs are neither (raw bodies), and each was a 5xx or worse until the wire
# refused it. The lease is what the fuzzer found; so were the limits.


def _post(fuzz: Fuzz, path: str, raw: bytes) -> requests.Response:
    return fuzz.http.post(
        fuzz.runner.url + path,
        data=raw,
        headers={
            "Authorization": f"Bearer {fuzz.runner.operator_token}",
            "Content-Type": "application/json",
        },
        timeout=TIMEOUT,
    )


def _refused(answer: requests.Response, status: int, detail: str) -> None:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert detail in answer.json()["detail"], answer.text


def test_a_body_nested_too_deeply_is_a_400_not_a_500(fuzz: Fuzz) -> None:
    deep = b'{"key": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _refused(_post(fuzz, "/v1/high-water", deep), 400, "nested too deeply")


def test_a_lone_surrogate_is_a_422_and_does_not_poison_the_runner(fuzz: Fuzz) -> None:
    # JSON may escape half a surrogate pair; no store can save the string it makes.
    for raw in (
        rb'{"key": {"identity": "\ud800", "instance": "a"}, "request_id": "r"}',
        rb'{"key": {"identity": "a", "instance": "b"}, "request_id": "\udfff"}',
        rb'{"key": {"identity": "a", "instance": "b"}, "request_id": "r", "\udfff": {"a": 1}}',
    ):
        _refused(_post(fuzz, "/v1/open", raw), 422, "lone UTF-16 surrogate")
    assert fuzz.http.get(fuzz.runner.url + "/readyz", timeout=TIMEOUT).status_code == 200
    # A whole pair is a character like any other.
    raw = rb'{"key": {"identity": "\ud83d\ude00", "instance": "a"}, "request_id": "r"}'
    assert _post(fuzz, "/v1/open", raw).status_code == 200


def test_a_key_with_a_nul_is_refused_before_it_reaches_a_child(fuzz: Fuzz) -> None:
    # It goes into the child's environment: opened, its load was a 500.
    raw = rb'{"key": {"identity": "nul\u0000", "instance": "a"}, "request_id": "r"}'
    _refused(_post(fuzz, "/v1/open", raw), 422, "must not hold a NUL @ $.key.identity")


def test_the_longest_lease_still_loads_and_a_longer_one_is_refused(fuzz: Fuzz) -> None:
    # Found by the fuzzer: with a lease past ~9.2e9 s the child's lease watchdog died
    # (select() cannot wait that long) and the load never answered.
    key = {"identity": "lease", "instance": "longest"}
    body = {"key": key, "request_id": "r", "lease": MAX_LEASE}
    record = fuzz.pool.call("/v1/open", body)["record"]
    load = {"handle": record["handle"], "load": {"specifier": "heartbeat:main"}}
    assert fuzz.pool.call("/v1/load", load)["code"]["specifier"] == "heartbeat:main"
    assert fuzz.pool.call("/v1/renew", {"handle": record["handle"]}) == {"lease": MAX_LEASE}
    fuzz.pool.call("/v1/dispose", {"handle": record["handle"]})
    longer = {"key": key, "request_id": "r2", "expected_generation": 1, "lease": 1e10}
    _refused(
        _post(fuzz, "/v1/open", json.dumps(longer).encode()),
        422,
        "lease must be a finite number of seconds >= 0.1 and <= 1000000000, "
        "got 10000000000.0 @ $.lease",
    )
    shorter = {"key": key, "request_id": "r3", "expected_generation": 1, "lease": MIN_LEASE / 2}
    _refused(_post(fuzz, "/v1/open", json.dumps(shorter).encode()), 422, "got 0.05 @ $.lease")


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        # The tree's cgroup here: its OOM killer ends the child before it reports (under
        # RLIMIT_AS, a runner without cgroups, it reports a MemoryError).
        ({"memory_bytes": 1}, "memory_bytes=1"),
        ({"open_files": 10**12}, "the limit open_files=1000000000000 cannot be applied"),
        # Accepted by setrlimit, but past what the kernel's CPU timer can count.
        ({"cpu_seconds": 2**62}, "the limit cpu_seconds=4611686018427387904 cannot be applied"),
    ],
    ids=str,
)
def test_a_load_under_limits_its_child_cannot_meet_is_a_package_error(
    fuzz: Fuzz, limits: dict[str, int], named: str
) -> None:
    record = fuzz.pool.call(
        "/v1/open",
        {
            "key": {"identity": "limits", "instance": str(limits)},
            "request_id": "r",
            "limits": limits,
        },
    )["record"]
    load = {"handle": record["handle"], "load": {"specifier": "heartbeat:main"}}
    answer = _post(fuzz, "/v1/load", json.dumps(load).encode())
    fuzz.pool.call("/v1/dispose", {"handle": record["handle"]})
    # The host asked for limits no child can run under: its request's fault, not ours.
    _refused(answer, 422, named)


def test_no_cpu_time_at_all_is_refused_at_open(fuzz: Fuzz) -> None:
    body = {"key": {"identity": "limits", "instance": "cpu0"}, "request_id": "r"}
    answer = _post(fuzz, "/v1/open", json.dumps({**body, "limits": {"cpu_seconds": 0}}).encode())
    _refused(answer, 422, "cpu_seconds must be None (no limit) or >= 1")


def test_the_drain_holds_to_the_document_too(fuzz: Fuzz) -> None:
    """Last in the module: the runner drains from here on (it takes no new work)."""
    _fuzz(fuzz, "POST", DRAIN)
