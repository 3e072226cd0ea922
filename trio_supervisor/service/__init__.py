"""The runner service: the supervisor over HTTP (docs/design.md; SERVICE.md section A)."""

from .app import create_app as create_app
from .runner import RunnerConfig as RunnerConfig
from .runner import run_runner as run_runner
