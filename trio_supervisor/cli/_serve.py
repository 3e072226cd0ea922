"""``trio-supervisor serve``: its flags, made from :class:`RunnerConfig`'s fields, its
config file, and how the runner's log lines look."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shlex
import sys
import tomllib
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, Literal

import attrs
import click
import trio

from ..errors import SupervisorError
from ..model import LOG_FIELDS
from ..service.config import FLAG, ConfigError, RunnerConfig
from ..service.runner import StartupError, run_runner
from ..service.tenants import TenantsError
from ..service.tenants_file import (
    ceilings_of,
)
from ._common import CONFIG_FILE, DEFAULTS, checked


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the session's key."""

    FIELDS = LOG_FIELDS

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in self.FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                line[field] = value
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(log_format: str) -> None:
    """Log to stderr, as text or as one JSON object per line."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    # Hypercorn's own lines ("Running on ...") repeat ours; keep its errors only.
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)


class _Command(click.ParamType[tuple[str, tuple[str, ...]], Any]):
    """``NAME=ARGV`` (ARGV split like a shell would); from a TOML table, ``(NAME, ARGV)``."""

    name = "NAME=ARGV"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[str, tuple[str, ...]]:
        if isinstance(value, tuple):
            return value  # a [commands] entry of the config file, read by _read_config
        name, equals, argv = str(value).partition("=")
        if not equals or not name or not argv.strip():
            self.fail(f"expected NAME=ARGV, got {value!r}", param, ctx)
        return name, tuple(shlex.split(argv))


class _Users(click.ParamType[range, Any]):
    """``FIRST-LAST``, two uids, as the range from FIRST to LAST (both in it); whether
    those are uids a child may run as is the field's own check."""

    name = "FIRST-LAST"
    PATTERN: Final = re.compile(r"\s*(-?[0-9]+)\s*-\s*(-?[0-9]+)\s*")

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> range:
        if isinstance(value, range):
            return value  # converted already
        found = self.PATTERN.fullmatch(value) if isinstance(value, str) else None
        users = None
        if found is not None:
            with contextlib.suppress(ValueError):  # more digits than int() reads: no uid
                users = range(int(found[1]), int(found[2]) + 1)
        if users is None:
            self.fail(f"expected FIRST-LAST, two uids, got {value!r}", param, ctx)
        return users


class _Duration(click.ParamType[float, Any]):
    """A duration: seconds (``90``, ``0.5``), or numbers each with a unit (``90s``,
    ``30m``, ``1h``, ``2d``, ``1h30m``), as seconds; a TOML number is seconds. Whether
    the field takes it (not negative) is the field's own check."""

    name = "DURATION"
    UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    PART: Final = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([smhd])")
    WHOLE: Final = re.compile(f"(?:{PART.pattern})+")

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)  # seconds: a TOML number, or converted already
        text = value.strip() if isinstance(value, str) else ""
        with contextlib.suppress(ValueError):
            return float(text)  # plain seconds (nan and inf are the field's to refuse)
        if not self.WHOLE.fullmatch(text):
            self.fail(
                f"expected a duration such as 90s, 30m, 1h or 1h30m, or seconds, got {value!r}",
                param,
                ctx,
            )
        return sum(float(number) * self.UNITS[unit] for number, unit in self.PART.findall(text))


_LIMITS: Final = "trio_supervisor.limits"  # where the file's [limits] are kept
_HINTS: Final = typing.get_type_hints(RunnerConfig)  # each flag's type is its field's


def _table_commands(value: object, path: Path) -> list[tuple[str, tuple[str, ...]]]:
    if not isinstance(value, dict):
        raise click.BadParameter(
            f"{path}: commands must be a table of NAME = [ARGV...]", param_hint="--config"
        )
    commands = []
    for name, argv in value.items():
        if isinstance(argv, str):
            argv = shlex.split(argv)
        if not argv or not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise click.BadParameter(
                f"{path}: commands.{name} must be an argv (a list of strings, or one string "
                "split like a shell would)",
                param_hint="--config",
            )
        commands.append((name, tuple(argv)))
    return commands


def _read_config(ctx: click.Context, param: click.Parameter, path: Path | None) -> Path | None:
    """Make the TOML file's keys the defaults of ``serve``'s flags (flags given win).

    An eager option's callback: it runs before the other options are read, and they take
    their defaults from ``ctx.default_map``.
    """
    if path is None:
        return None
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise click.BadParameter(f"{path}: {error}", param_hint="--config") from error
    fields = attrs.fields_dict(RunnerConfig)
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in fields:
            known = ", ".join(fields)
            raise click.BadParameter(
                f"unknown key {key!r} in {path} (the keys are {known})", param_hint="--config"
            )
        if name == "commands":
            value = _table_commands(value, path)
        elif name == "limits":  # no flag: kept for serve, beside the flags' defaults
            try:
                ctx.meta[_LIMITS] = ceilings_of(value, f"{path}: limits")
            except TenantsError as error:
                raise click.BadParameter(str(error), param_hint="--config") from None
            continue
        elif _is_repeated(fields[name]) and not isinstance(value, list):
            raise click.BadParameter(
                f"{path}: {key} must be an array, not {value!r}", param_hint="--config"
            )
        defaults[name] = value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    ctx.meta[CONFIG_FILE] = path
    return path


def _is_repeated(field: attrs.Attribute[Any]) -> bool:
    """Whether the field's flag is repeatable (its TOML key, an array or a table)."""
    kind = _HINTS[field.name]
    return typing.get_origin(kind) in (tuple, Mapping)


def _option(field: attrs.Attribute[Any]) -> Callable[[Any], Any]:
    """``serve``'s flag for a field of :class:`RunnerConfig`, from its type and metadata."""
    meta = field.metadata[FLAG]
    kind = _HINTS[field.name]
    flag = meta["flag"] or "--" + field.name.replace("_", "-")
    options: dict[str, Any] = {"help": meta["help"], "metavar": meta["metavar"]}
    default = getattr(DEFAULTS, field.name)
    if meta["path"] is not None:
        options["type"] = click.Path(
            path_type=Path,
            exists=meta["exists"],
            file_okay=meta["path"] == "file",
            dir_okay=meta["path"] == "dir",
        )
    elif kind is bool:
        flag = f"{flag}/--no-{flag.removeprefix('--')}"
    elif field.name == "retain_for":
        options["type"] = _Duration()
    elif kind in (float, float | None):
        options["type"] = float
    elif kind in (int, int | None):
        options["type"] = int
    elif typing.get_origin(kind) is Literal:
        options["type"] = click.Choice(typing.get_args(kind))
    elif field.name == "commands":
        options["type"] = _Command()
    elif field.name == "child_users":
        options["type"] = _Users()
    if _is_repeated(field):
        options["multiple"] = True
        default = tuple(default.items() if isinstance(default, Mapping) else default)
    options["default"] = default
    # A default the help text names already ("[default: the host name]") is not repeated.
    options["show_default"] = default not in (None, ()) and "[default:" not in meta["help"]
    return click.option(flag, field.name, callback=checked(field, flag), **options)


def _runner_options(command: Any) -> Any:
    """Every field of :class:`RunnerConfig` as a flag of ``command``, in their order."""
    for field in reversed(attrs.fields(RunnerConfig)):
        if FLAG in field.metadata:  # a field without one is the TOML file's alone
            command = _option(field)(command)
    return command


@click.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    is_eager=True,
    expose_value=False,
    callback=_read_config,
    help="A TOML file whose keys are these flags' names (plugins = [...], [commands]); "
    "a flag given here wins over its key.",
)
@_runner_options
def serve(**values: Any) -> None:
    """Run a runner: hosts open, load, renew and dispose sessions over HTTP."""
    values["commands"] = dict(values["commands"])
    values["limits"] = click.get_current_context().meta.get(_LIMITS)
    try:
        config = RunnerConfig(**values)
        config.check()
    except (ConfigError, ValueError, TypeError) as error:
        raise click.UsageError(str(error)) from error
    configure_logging(config.log_format)
    try:
        status = trio.run(run_runner, config)
    except ConfigError as error:
        raise click.UsageError(str(error)) from error
    except (SupervisorError, StartupError, BaseExceptionGroup) as error:
        # The runner's nursery wraps what failed in it (an address in use, a shutdown's
        # problems): status 1 and each one's sentence, never a traceback.
        problems = _problems(error)
        if problems is None:
            raise
        raise click.ClickException("; ".join(problems)) from error
    sys.exit(status)


def _problems(error: BaseException) -> list[str] | None:
    """The sentence of each error in ``error`` (a group, or one), or None if any is not
    one of ours (a bug, whose traceback is worth seeing)."""
    if isinstance(error, BaseExceptionGroup):
        problems: list[str] = []
        for inner in error.exceptions:
            found = _problems(inner)
            if found is None:
                return None
            problems += found
        return problems
    if isinstance(error, SupervisorError):
        return [error.detail]
    if isinstance(error, StartupError):
        return [str(error)]
    return None
