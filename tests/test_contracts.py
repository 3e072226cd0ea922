"""The contract kits against the built-in adapters."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from trio_supervisor import MemoryStore, Retention, SqliteStore
from trio_supervisor.stores.base import Store
from trio_supervisor.testing.contracts import ExecutionContract, StoreContract, StoreFactory
from trio_supervisor.testing.harnesses import (
    FakeHarness,
    Harness,
    InProcessHarness,
    SubprocessHarness,
)


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        def make(previous: Store | None, retention: Retention) -> Store:
            return previous or MemoryStore(retention=retention)

        return make


class TestSqliteStore(StoreContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> StoreFactory:
        def make(previous: Store | None, retention: Retention) -> Store:
            return SqliteStore(tmp_path / "state.db", retention=retention)

        return make


class TestFakeExecution(ExecutionContract):
    @pytest.fixture
    def harness_factory(self) -> type[Harness]:
        return FakeHarness


class TestInProcessExecution(ExecutionContract):
    @pytest.fixture
    def harness_factory(self) -> type[Harness]:
        return InProcessHarness


class TestSubprocessExecution(ExecutionContract):
    @pytest.fixture
    def harness_factory(self, tmp_path: Path) -> Callable[[], Harness]:
        return lambda: SubprocessHarness(tmp_path)


class TestSubprocessExecutionWithStandby(ExecutionContract):
    @pytest.fixture
    def harness_factory(self, tmp_path: Path) -> Callable[[], Harness]:
        return lambda: SubprocessHarness(tmp_path, standby=True)
