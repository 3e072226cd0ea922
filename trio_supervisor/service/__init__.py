"""The runner service: the supervisor over HTTP (docs/design.md; docs/service.md, section A).

Needs the ``service`` extra: ``pip install 'trio_supervisor[service]'``.
"""

from .._extras import needs_extra

with needs_extra(
    "service", "trio_supervisor.service", "hypercorn", "starlette", "prometheus_client"
):
    from .app import create_app as create_app
    from .config import RunnerConfig as RunnerConfig
    from .runner import run_runner as run_runner
