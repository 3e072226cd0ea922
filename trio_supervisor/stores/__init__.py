"""Stores: where records are made durable (the protocols are in :mod:`trio_supervisor.abc`)."""

import importlib
from typing import TYPE_CHECKING

from ..abc import BatchStore as BatchStore
from ..abc import Store as Store

if TYPE_CHECKING:
    from .memory import MemoryStore as MemoryStore
    from .sqlite import SqliteStore as SqliteStore

# Loaded on first use, so importing one adapter does not load the others.
_ADAPTERS = {
    "MemoryStore": ".memory",
    "SqliteStore": ".sqlite",
}


def __getattr__(name: str) -> object:
    module = _ADAPTERS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_ADAPTERS})
