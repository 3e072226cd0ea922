"""``trio-supervisor``: the operator's command.

``serve`` runs a runner (``_serve.py``, over ``service/runner.py``); ``tenants`` edits the
tenants file it reads (``_tenants.py``); the other commands ask a runner, as its
operators (``_operate.py``, through the client). ``_common.py`` holds what they share.

Every flag of ``serve`` is also a key of the TOML file given with ``--config`` (``listen =
"127.0.0.1:0"``, ``plugins = [...]``, ``[commands]`` with ``name = ["argv", ...]``); a
flag given on the command line wins.

Exit statuses that scripts can rely on: 0 ok, 1 an error from the runner (its detail is
printed), 2 a usage error.
"""

from __future__ import annotations

from .._extras import needs_extra

# What the command needs beyond the engine comes with the service extra.
with needs_extra(
    "service",
    "the trio-supervisor command",
    *("click", "rich", "httpx", "hypercorn", "starlette", "prometheus_client"),
):
    import click

    from . import _operate, _serve, _tenants

__all__ = ["main"]


@click.group()
@click.version_option(package_name="trio_supervisor")
def main() -> None:
    """Run code for remote hosts, and never lose track of it."""


main.add_command(_serve.serve)
for command in (
    _operate.sessions,
    _operate.runners,
    _operate.show,
    _operate.logs,
    _operate.dispose,
    _operate.health,
    _operate.drain,
    _operate.usage,
    _operate.dashboard,
):
    main.add_command(command)
main.add_command(_tenants.tenants)
