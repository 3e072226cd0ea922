"""Tools for testing code built on trio_supervisor, and adapters for it.

The fakes (``FakeExecution``, ``FaultyStore``) need nothing beyond the package. The
conformance machine and the fleet machine need Hypothesis, and the contract kits pytest
and pytest-trio: test-only dependencies, so those names are imported on first use, and
``import trio_supervisor.testing`` works without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from .fakes import Behaviour as Behaviour
from .fakes import Call as Call
from .fakes import FakeExecution as FakeExecution
from .fakes import FakeUnit as FakeUnit
from .fakes import FaultyStore as FaultyStore

if TYPE_CHECKING:
    from .conformance import ConformanceMachine as ConformanceMachine
    from .conformance import conformance_machine as conformance_machine
    from .contracts import ExecutionContract as ExecutionContract
    from .contracts import StoreContract as StoreContract
    from .fleet import FleetBackend as FleetBackend
    from .fleet import FleetMachine as FleetMachine
    from .fleet import fleet_machine as fleet_machine
    from .harnesses import FakeHarness as FakeHarness
    from .harnesses import Harness as Harness
    from .harnesses import InProcessHarness as InProcessHarness
    from .harnesses import SubprocessHarness as SubprocessHarness

__all__ = [
    "Behaviour",
    "Call",
    "ConformanceMachine",
    "ExecutionContract",
    "FakeExecution",
    "FakeHarness",
    "FakeUnit",
    "FaultyStore",
    "FleetBackend",
    "FleetMachine",
    "Harness",
    "InProcessHarness",
    "StoreContract",
    "SubprocessHarness",
    "conformance_machine",
    "fleet_machine",
]

# Imported on first use: the module of each name.
_LAZY = {
    "ConformanceMachine": ".conformance",  # needs hypothesis
    "conformance_machine": ".conformance",
    "ExecutionContract": ".contracts",  # needs pytest
    "StoreContract": ".contracts",
    "FleetBackend": ".fleet",  # needs hypothesis
    "FleetMachine": ".fleet",
    "fleet_machine": ".fleet",
    "FakeHarness": ".harnesses",
    "Harness": ".harnesses",
    "InProcessHarness": ".harnesses",
    "SubprocessHarness": ".harnesses",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
