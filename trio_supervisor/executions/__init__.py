"""Executions: what spawns a session's child, and finds it again after a crash (the
protocols are in :mod:`trio_supervisor.abc`).
"""

import importlib
from typing import TYPE_CHECKING

from ..abc import Execution as Execution
from ..abc import Unit as Unit

if TYPE_CHECKING:
    from .inprocess import InProcessExecution as InProcessExecution
    from .inprocess import Plugin as Plugin
    from .inprocess import PluginContext as PluginContext
    from .subprocess import SubprocessExecution as SubprocessExecution

# Loaded on first use, so importing one adapter does not load the others.
_ADAPTERS = {
    "InProcessExecution": ".inprocess",
    "Plugin": ".inprocess",
    "PluginContext": ".inprocess",
    "SubprocessExecution": ".subprocess",
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
