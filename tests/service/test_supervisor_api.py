"""One API, two supervisors: the embedded ``Supervisor`` and the runner's client.

``SupervisorAPI`` (``trio_supervisor.abc``) names the calls a host makes. The two
assignments below are checked by mypy: if either class drifts from the protocol (a
renamed parameter, another return type), the type check fails. The tests check the same
at run time, parameter by parameter, and run one host function, written against the
protocol alone, on both.
"""

from __future__ import annotations

import inspect
from typing import Final

import pytest
import trio

from trio_supervisor import (
    Key,
    Load,
    MemoryStore,
    StaleSessionError,
    StoppedRecord,
    Supervisor,
    SupervisorAPI,
)
from trio_supervisor.client import RemoteSupervisor
from trio_supervisor.testing import FakeExecution

from ..support.service import served
from ..support.sessions import supervise_embedded

EMBEDDED: Final[type[SupervisorAPI]] = Supervisor
REMOTE: Final[type[SupervisorAPI]] = RemoteSupervisor

CALLS: Final = ("open", "renew", "load", "dispose", "status", "high_water")


def test_the_protocol_names_the_calls_both_supervisors_offer() -> None:
    offered = {
        name
        for name, value in vars(SupervisorAPI).items()
        if inspect.iscoroutinefunction(value) and not name.startswith("_")
    }
    assert offered == set(CALLS)


# The owner's parameters of the embedded supervisor, which no host passes: a tenant's
# quota, checked by a fleet's store (docs/design.md, F9). Keyword-only, None by default.
OWNERS: Final = {"quota"}


@pytest.mark.parametrize("implementation", [Supervisor, RemoteSupervisor])
@pytest.mark.parametrize("call", CALLS)
def test_each_call_has_the_protocol_s_exact_signature(implementation: type, call: str) -> None:
    expected = inspect.signature(getattr(SupervisorAPI, call))
    actual = inspect.signature(getattr(implementation, call))
    owners = [parameter for name, parameter in actual.parameters.items() if name in OWNERS]
    assert implementation is Supervisor or not owners  # a host has none to pass
    for parameter in owners:
        assert (parameter.kind, parameter.default) == (inspect.Parameter.KEYWORD_ONLY, None)
    hosts = [parameter for name, parameter in actual.parameters.items() if name not in OWNERS]
    assert str(actual.replace(parameters=hosts)) == str(expected)
    assert inspect.iscoroutinefunction(getattr(implementation, call))


async def host(supervisor: SupervisorAPI, key: Key) -> list[str]:
    """A host written against the protocol only: one session's life, as it saw it."""
    seen = []
    high = await supervisor.high_water(key)
    record = await supervisor.open(key, "api-1", expected_generation=high, lease=5.0)
    seen.append(f"opened generation {record.handle.generation}")
    code = await supervisor.load(record.handle, Load(specifier="plugin"))
    seen.append(f"loaded {code.specifier}")
    seen.append(f"renewed for {await supervisor.renew(record.handle)} s")
    seen.append(f"status {(await supervisor.status(record.handle)).phase.value}")
    seen.append(f"disposed: {(await supervisor.dispose(record.handle)).describe()}")
    stopped = await supervisor.status(record.handle)
    assert isinstance(stopped, StoppedRecord)
    seen.append(f"stopped, {stopped.reason.kind}")
    try:
        await supervisor.open(key, "api-2", expected_generation=high)
    except StaleSessionError as error:
        seen.append(f"a stale open is refused: {error.code}")
    seen.append(f"high-water {await supervisor.high_water(key)}")
    return seen


async def test_one_host_function_runs_the_same_on_both(
    autojump_clock: trio.testing.MockClock,
) -> None:
    key = Key(identity="api", instance="one")
    async with supervise_embedded(MemoryStore(), FakeExecution()) as embedded:
        alone = await host(embedded, key)
    async with (
        supervise_embedded(MemoryStore(), FakeExecution()) as behind,
        served(behind) as remote,
    ):
        over_the_wire = await host(remote, key)
    assert alone == over_the_wire
    assert alone == [
        "opened generation 1",
        "loaded plugin",
        "renewed for 5.0 s",
        "status Loaded",
        "disposed: exited (SIGTERM)",
        "stopped, Disposed",
        "a stale open is refused: StaleSession",
        "high-water 1",
    ]
