"""Tools for testing code built on trio_supervisor, and adapters for it."""

from .fakes import Behaviour as Behaviour
from .fakes import Call as Call
from .fakes import FakeExecution as FakeExecution
from .fakes import FakeUnit as FakeUnit
from .fakes import FaultyStore as FaultyStore
