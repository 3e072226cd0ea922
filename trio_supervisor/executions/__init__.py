"""Executions: what spawns a session's child, and finds it again after a crash."""

from .base import Execution as Execution
from .base import Unit as Unit
from .inprocess import InProcessExecution as InProcessExecution
from .inprocess import Plugin as Plugin
from .inprocess import PluginContext as PluginContext
from .subprocess import SubprocessExecution as SubprocessExecution
