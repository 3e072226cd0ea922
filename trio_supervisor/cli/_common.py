"""What the command's parts share: the configuration's defaults, and how a table, a
count and a moment are printed."""

from __future__ import annotations

import datetime
from typing import Any, Final

import attrs
import click
from rich.console import Console
from rich.table import Table

from .._fields import Check
from ..service.config import RunnerConfig

CONFIG_FILE: Final = "trio_supervisor.config_file"  # where the --config path is kept
DEFAULTS: Final = RunnerConfig()  # each flag's default, and the operator commands' state


def count(number: int, noun: str) -> str:
    """``1 session``, ``3 sessions``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def moment(seconds: float) -> str:
    """A time the fleet's database gave (seconds since the Unix epoch), in ISO 8601, UTC."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds")


_UNBOUNDED: Final = 10_000  # columns: wider than any table of sessions


def print_table(console: Console, table: Table) -> None:
    """Print ``table``; into a pipe or a file, as wide as it needs.

    Rich lays out for 80 columns when standard output is not a terminal, which cuts the
    headers ("genera…") and wraps a termination over three lines: a script or a grep
    would read a session's row as several. A terminal keeps its own width.
    """
    if not console.is_terminal:
        unbounded = console.options.update_width(_UNBOUNDED)
        console.width = max(console.width, console.measure(table, options=unbounded).maximum)
    console.print(table)


def checked(field: attrs.Attribute[Any], flag: str) -> Any:
    """The option's callback: the field's own check, naming the flag (or the file's key)."""
    check = field.validator if isinstance(field.validator, Check) else None

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if check is not None and value is not None:
            name = flag
            if ctx.get_parameter_source(field.name) is click.core.ParameterSource.DEFAULT_MAP:
                name = f"{field.name} (in {ctx.meta[CONFIG_FILE]})"
            try:
                check.check(name, value)
            except (TypeError, ValueError) as error:
                raise click.UsageError(str(error), ctx) from None
        return value

    return callback
