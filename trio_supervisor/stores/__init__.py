"""Stores: where records are made durable (the protocols are in :mod:`trio_supervisor.abc`)."""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ..abc import BatchStore as BatchStore
from ..abc import FleetStore as FleetStore
from ..abc import Store as Store

if TYPE_CHECKING:
    from .memory import MemoryStore as MemoryStore
    from .postgres import PostgresStore as PostgresStore
    from .sqlite import SqliteStore as SqliteStore

# Loaded on first use, so importing one adapter does not load the others.
_ADAPTERS = {
    "MemoryStore": ".memory",
    "PostgresStore": ".postgres",
    "SqliteStore": ".sqlite",
}


__getattr__, __dir__ = lazy_exports(__name__, _ADAPTERS)
