"""The conformance machine finds broken adapters.

A suite that passes everything is worthless: each adapter here is broken in one way a
real adapter could be, and the machine, as it runs by default (the ``ci`` profile, the
retention it draws), must fail on it. Only shrinking is left out, to keep this quick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import trio
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from trio_supervisor import (
    ChildIdentity,
    ExitStatus,
    Handle,
    Key,
    Limits,
    Load,
    MemoryStore,
    Retention,
    SessionRecord,
    StoppedRecord,
    Termination,
)
from trio_supervisor.abc import Store
from trio_supervisor.testing import Call, FakeExecution, FakeHarness, FakeUnit, conformance_machine

# The default profile; no shrinking, no example database.
HUNT = settings(
    settings.get_profile("trio_supervisor-ci"),
    phases=[Phase.generate],
    report_multiple_bugs=False,
    database=None,
)


def memory(previous: Store | None, retention: Retention) -> Store:
    return previous or MemoryStore(retention=retention)


STORE = "and it differs|no interleaving of the burst explains"


def finds(store_factory: Any = memory, harness_factory: Any = None, *, match: str) -> None:
    """Run the machine, which must fail with a message matching ``match``.

    Which check trips first depends on the steps Hypothesis happened to draw; ``match``
    lists the checks that can see the defect.
    """
    machine = conformance_machine(store_factory, harness_factory)
    with pytest.raises(AssertionError, match=match):
        run_state_machine_as_test(machine, settings=HUNT)


class DroppingStore(MemoryStore):
    """Acknowledges every Stopped record, and keeps only every other one."""

    dropped = 0

    async def save(self, record: SessionRecord) -> None:
        if isinstance(record, StoppedRecord):
            self.dropped += 1
            if self.dropped % 2:
                return
        await super().save(record)


class OnePerKeyStore(MemoryStore):
    """Files records by key instead of by token: a new generation overwrites the old."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.latest: dict[Key, SessionRecord] = {}

    async def save(self, record: SessionRecord) -> None:
        await super().save(record)
        self.latest[record.handle.key] = record

    async def list(self) -> Sequence[SessionRecord]:
        await super().list()
        return list(self.latest.values())


class NoHighWaterStore(MemoryStore):
    """Keeps no high-water marks of its own (docs/design.md, "Adapters", asks for them)."""

    async def high_water(self) -> Mapping[Key, int]:
        await super().high_water()
        return {}


class HoardingStore(MemoryStore):
    """Ignores its retention policy and keeps every Stopped record."""

    def __init__(self, retention: Retention) -> None:
        super().__init__(retention=Retention(stopped_per_key=10_000, stopped_total=100_000))
        self._claimed = retention

    @property
    def retention(self) -> Retention:
        return self._claimed


class DerivedHighWaterStore(MemoryStore):
    """Derives each key's high-water from the records it retains, as the reference does
    (docs/design.md, deviation (i)): a key whose records were all evicted is forgotten."""

    async def high_water(self) -> Mapping[Key, int]:
        marks: dict[Key, int] = {}
        for record in await self.list():
            key = record.handle.key
            marks[key] = max(marks.get(key, 0), record.handle.generation)
        return marks


class _EarlyUnit(FakeUnit):
    async def wait(self) -> ExitStatus:
        await super().renew(0)  # a checkpoint, and a call on the log
        return ExitStatus(code=0)


class EarlyWaitExecution(FakeExecution):
    """Its units' wait returns before the child exited."""

    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> FakeUnit:
        unit = await super().spawn(handle, load, limits)
        unit.__class__ = _EarlyUnit
        return unit


class _OffByOneUnit(FakeUnit):
    def exit(self, code: int | None = 0, signal: int | None = None) -> None:
        super().exit(code=None if code is None else code + 1, signal=signal)


class WrongExitCodeExecution(FakeExecution):
    """Its units report code + 1 when they exit by themselves."""

    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> FakeUnit:
        unit = await super().spawn(handle, load, limits)
        unit.__class__ = _OffByOneUnit
        return unit


class LyingRecoveryExecution(FakeExecution):
    """Reports an orphan killed without killing it."""

    async def recover(self, child: ChildIdentity) -> Termination:
        self.calls.append(Call("recover", child.ref))
        await trio.lowlevel.checkpoint()
        return Termination(kind="killed", exit=ExitStatus(signal=9))


def harness_of(execution_class: type[FakeExecution]) -> Any:
    def make() -> FakeHarness:
        harness = FakeHarness()
        fake = execution_class()
        fake.behaviours = harness.fake.behaviours
        harness.fake = fake
        harness.execution = fake
        return harness

    return make


def test_it_finds_a_store_that_drops_acknowledged_records() -> None:
    finds(lambda previous, retention: previous or DroppingStore(retention=retention), match=STORE)


def test_it_finds_a_store_that_returns_the_records_of_another_session() -> None:
    finds(lambda previous, retention: previous or OnePerKeyStore(retention=retention), match=STORE)


def test_it_finds_a_store_that_keeps_no_high_water() -> None:
    finds(
        lambda previous, retention: previous or NoHighWaterStore(retention=retention),
        match=f"high-water|{STORE}",
    )


def test_it_finds_a_store_that_ignores_its_retention() -> None:
    finds(lambda previous, retention: previous or HoardingStore(retention), match=STORE)


def test_it_finds_a_store_that_derives_the_high_water_from_retained_records() -> None:
    # Only the cap in all can evict every record of a key: the machine draws small ones.
    finds(
        lambda previous, retention: previous or DerivedHighWaterStore(retention=retention),
        match=r"high-water is kept apart from retention and never evicted \(V5",
    )


def test_it_finds_an_execution_whose_wait_returns_before_the_exit() -> None:
    finds(
        harness_factory=harness_of(EarlyWaitExecution),
        match=f"the model expects|{STORE}|alive|got the calls",
    )


def test_it_finds_an_execution_whose_units_report_a_wrong_exit_code() -> None:
    finds(
        harness_factory=harness_of(WrongExitCodeExecution),
        match=r"its termination differs \(P3.*X1|the model expects \('ok', Termination",
    )


def test_it_finds_an_execution_that_lies_about_recovery() -> None:
    finds(
        harness_factory=harness_of(LyingRecoveryExecution),
        match=f"is alive, the model says gone|recovery must fail|{STORE}",
    )
