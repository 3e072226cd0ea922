"""Executions: what spawns a session's child, and finds it again after a crash (the
protocols are in :mod:`trio_supervisor.abc`).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ..abc import Execution as Execution
from ..abc import Unit as Unit

if TYPE_CHECKING:
    from .inprocess import InProcessExecution as InProcessExecution
    from .inprocess import Plugin as Plugin
    from .inprocess import PluginContext as PluginContext
    from .subprocess import DEFAULT_CHILD_USERS as DEFAULT_CHILD_USERS
    from .subprocess import SubprocessExecution as SubprocessExecution

# Loaded on first use, so importing one adapter does not load the others.
_ADAPTERS = {
    "InProcessExecution": ".inprocess",
    "Plugin": ".inprocess",
    "PluginContext": ".inprocess",
    "SubprocessExecution": ".subprocess",
    "DEFAULT_CHILD_USERS": ".subprocess",
}


__getattr__, __dir__ = lazy_exports(__name__, _ADAPTERS)
