"""``trio-supervisor``: the operator's command.

``serve`` runs a runner (``service/runner.py``); ``tenants`` edits the tenants file it
reads (``service/tenants.py``); the other commands ask a runner, as its operators.

Every flag of ``serve`` is also a key of the TOML file given with ``--config`` (``listen =
"127.0.0.1:0"``, ``plugins = [...]``, ``[commands]`` with ``name = ["argv", ...]``); a
flag given on the command line wins.

Exit statuses that scripts can rely on: 0 ok, 1 an error from the runner (its detail is
printed), 2 a usage error.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import secrets
import shlex
import sys
import tomllib
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, Literal

import attrs
import trio

from ._extras import needs_extra
from ._fields import Check, Seconds
from .codec import converter
from .errors import RunnerUnreachableError, SupervisorError
from .model import LOG_FIELDS, Key, Phase, RunnerInfo, Termination

# What the command needs beyond the engine comes with the service extra.
with needs_extra(
    "service",
    "the trio-supervisor command",
    *("click", "rich", "httpx", "hypercorn", "starlette", "prometheus_client"),
):
    import click
    import httpx
    from rich.console import Console
    from rich.table import Table

    from .client import RemoteSupervisor, connect
    from .service.config import FLAG, ConfigError, RunnerConfig
    from .service.runner import StartupError, run_runner
    from .service.tenants import Quota, Tenant, TenantsError, token_hash
    from .service.tenants_file import (
        ceilings_of,
        locked,
        parse,
        read,
        read_text,
        replace,
        table_text,
        without_table,
    )
    from .service.wire import DEFAULT_DRAIN_DEADLINE, DRAIN_DEADLINE

__all__ = ["main"]


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


_CONFIG_FILE: Final = "trio_supervisor.config_file"  # where the --config path is kept
_LIMITS: Final = "trio_supervisor.limits"  # where the file's [limits] are kept
_HINTS: Final = typing.get_type_hints(RunnerConfig)  # each flag's type is its field's
_DEFAULTS: Final = RunnerConfig()  # and so is its default


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
    ctx.meta[_CONFIG_FILE] = path
    return path


def _is_repeated(field: attrs.Attribute[Any]) -> bool:
    """Whether the field's flag is repeatable (its TOML key, an array or a table)."""
    kind = _HINTS[field.name]
    return typing.get_origin(kind) in (tuple, Mapping)


def _checked(field: attrs.Attribute[Any], flag: str) -> Any:
    """The option's callback: the field's own check, naming the flag (or the file's key)."""
    check = field.validator if isinstance(field.validator, Check) else None

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if check is not None and value is not None:
            name = flag
            if ctx.get_parameter_source(field.name) is click.core.ParameterSource.DEFAULT_MAP:
                name = f"{field.name} (in {ctx.meta[_CONFIG_FILE]})"
            try:
                check.check(name, value)
            except (TypeError, ValueError) as error:
                raise click.UsageError(str(error), ctx) from None
        return value

    return callback


def _option(field: attrs.Attribute[Any]) -> Callable[[Any], Any]:
    """``serve``'s flag for a field of :class:`RunnerConfig`, from its type and metadata."""
    meta = field.metadata[FLAG]
    kind = _HINTS[field.name]
    flag = meta["flag"] or "--" + field.name.replace("_", "-")
    options: dict[str, Any] = {"help": meta["help"], "metavar": meta["metavar"]}
    default = getattr(_DEFAULTS, field.name)
    if meta["path"] is not None:
        options["type"] = click.Path(
            path_type=Path,
            exists=meta["exists"],
            file_okay=meta["path"] == "file",
            dir_okay=meta["path"] == "dir",
        )
    elif kind is bool:
        flag = f"{flag}/--no-{flag.removeprefix('--')}"
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
    return click.option(flag, field.name, callback=_checked(field, flag), **options)


def _runner_options(command: Any) -> Any:
    """Every field of :class:`RunnerConfig` as a flag of ``command``, in their order."""
    for field in reversed(attrs.fields(RunnerConfig)):
        if FLAG in field.metadata:  # a field without one is the TOML file's alone
            command = _option(field)(command)
    return command


@click.group()
@click.version_option(package_name="trio_supervisor")
def main() -> None:
    """Run code for remote hosts, and never lose track of it."""


@main.command()
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


# -- the operator's commands: a runner's sessions, runners, logs, dispose, health ----------

DEFAULT_URL = "http://127.0.0.1:8470"
CONNECT_FOR: Final = 2.0  # seconds the client commands try a runner that refuses them


def _client_options(command: Any) -> Any:
    """``--url``, ``--token-file``, ``--state``: on the runner's machine, none is needed."""
    command = click.option(
        "--url", default=DEFAULT_URL, show_default=True, help="The runner's URL."
    )(command)
    command = click.option(
        "--token-file",
        type=click.Path(path_type=Path, dir_okay=False),
        help="The operators' token [default: STATE/operator-token].",
    )(command)
    return click.option(
        "--state",
        type=click.Path(path_type=Path, file_okay=False),
        default=Path("runner-state"),
        show_default=True,
        help="The runner's state directory, where its operator token is.",
    )(command)


def _operator_token(state: Path, token_file: Path | None) -> str:
    path = token_file or state / "operator-token"
    try:
        return path.read_text().strip()
    except OSError as error:
        raise click.UsageError(
            f"cannot read the operators' token {path}: {error.strerror}; give --token-file "
            "or run this where the runner's state directory is"
        ) from error


def _run_client(
    url: str, state: Path, token_file: Path | None, call: Callable[[RemoteSupervisor], Any]
) -> Any:
    """Run ``call`` with a client; a runner's error is printed, with exit status 1."""
    token = _operator_token(state, token_file)

    async def main() -> Any:
        # An operator at a terminal wants to hear soon that nothing answers.
        async with connect(url, token=token, connect_for=CONNECT_FOR) as runner:
            return await call(runner)

    try:
        return trio.run(main)
    except RunnerUnreachableError as error:
        raise click.ClickException(error.detail) from error
    except SupervisorError as error:
        raise click.ClickException(f"{error.code}: {error.detail}") from error
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    except httpx.HTTPError as error:
        raise click.ClickException(f"cannot reach the runner at {url}: {error}") from error


def _termination(record: dict[str, Any]) -> str:
    """How the session's child ended, as the runner described it (the dashboard shows
    the same words); from an older runner that sent no words, as this one describes it."""
    described = record.get("described")
    if isinstance(described, str):
        return described
    termination = record.get("termination")
    if termination is None:
        return ""
    try:
        return str(converter.structure(termination, Termination).describe())
    except Exception:
        return str(termination.get("kind", ""))


def _child_pid(record: dict[str, Any]) -> str:
    active = record.get("previous") or record
    child = active.get("child") or {}
    return str(child.get("pid") or "-")


def _seconds_text(value: object) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.1f}s"


def _row(record: dict[str, Any]) -> list[str]:
    key = record["handle"]["key"]
    reason = record.get("reason") or {}
    return [
        f"{key['identity']}/{key['instance']}",
        str(record["handle"]["generation"]),
        record["phase"],
        _seconds_text(record.get("age")),
        _seconds_text(record.get("lease_left")),
        _child_pid(record),
        reason.get("kind", ""),
        _termination(record),
        str(record.get("runner", "")),
    ]


_COLUMNS = (
    "key",
    "generation",
    "phase",
    "age",
    "lease left",
    "child pid",
    "reason",
    "termination",
    "runner",
)


def _table(records: list[dict[str, Any]], title: str | None = None) -> Table:
    table = Table(title=title, header_style="bold")
    for column in _COLUMNS:
        table.add_column(column, no_wrap=column in ("key", "phase"))
    for record in records:
        table.add_row(*_row(record))
    return table


_UNBOUNDED: Final = 10_000  # columns: wider than any table of sessions


def _print_table(console: Console, table: Table) -> None:
    """Print ``table``; into a pipe or a file, as wide as it needs.

    Rich lays out for 80 columns when standard output is not a terminal, which cuts the
    headers ("genera…") and wraps a termination over three lines: a script or a grep
    would read a session's row as several. A terminal keeps its own width.
    """
    if not console.is_terminal:
        unbounded = console.options.update_width(_UNBOUNDED)
        console.width = max(console.width, console.measure(table, options=unbounded).maximum)
    console.print(table)


@main.command()
@_client_options
@click.option("--phase", type=click.Choice([phase.value for phase in Phase]), help="Only these.")
@click.option("--identity", help="Only the sessions of this identity.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def sessions(
    url: str,
    state: Path,
    token_file: Path | None,
    phase: str | None,
    identity: str | None,
    as_json: bool,
) -> None:
    """List a runner's sessions: what runs, and why things stopped."""
    found: list[dict[str, Any]] = _run_client(
        url, state, token_file, lambda runner: runner.sessions(phase=phase, identity=identity)
    )
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    _print_table(Console(), _table(found, title=f"{_count(len(found), 'session')} at {url}"))


def _count(number: int, noun: str) -> str:
    """``1 session``, ``3 sessions``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _moment(seconds: float) -> str:
    """A time the fleet's database gave (seconds since the Unix epoch), in ISO 8601, UTC."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds")


_RUNNER_COLUMNS = ("runner", "epoch", "advertise", "started", "lease until", "alive", "sessions")


@main.command()
@_client_options
@click.option("--json", "as_json", is_flag=True, help="Print the runners as JSON.")
def runners(url: str, state: Path, token_file: Path | None, as_json: bool) -> None:
    """List the fleet's runners (this runner alone when it has no fleet)."""
    found: list[RunnerInfo] = _run_client(url, state, token_file, lambda runner: runner.runners())
    if as_json:
        click.echo(json.dumps([converter.unstructure(info) for info in found], indent=2))
        return
    table = Table(title=f"{_count(len(found), 'runner')} seen from {url}", header_style="bold")
    for column in _RUNNER_COLUMNS:
        table.add_column(column, no_wrap=column in ("runner", "advertise"))
    for info in found:
        table.add_row(
            info.runner_id,
            str(info.epoch),
            info.advertise or "-",
            _moment(info.started_at),
            _moment(info.lease_until),
            ("draining" if info.draining else "yes") if info.alive else "no",
            str(info.sessions),
        )
    _print_table(Console(), table)


def _seconds_option(check: Seconds) -> Callable[[click.Context, click.Parameter, float], float]:
    """An option's callback: ``check`` refuses its value as a usage error naming it."""

    def callback(ctx: click.Context, param: click.Parameter, value: float) -> float:
        try:
            return check.seconds(f"--{param.name}", value)
        except (TypeError, ValueError) as error:
            raise click.UsageError(str(error), ctx) from None

    return callback


def _key(identity: str, instance: str) -> Key:
    try:
        return Key(identity=identity, instance=instance)
    except (ValueError, TypeError) as error:
        raise click.UsageError(str(error)) from error


@main.command()
@_client_options
@click.argument("identity")
@click.argument("instance")
@click.argument("generation", type=click.IntRange(min=1), required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON.")
def show(
    url: str,
    state: Path,
    token_file: Path | None,
    identity: str,
    instance: str,
    generation: int | None,
    as_json: bool,
) -> None:
    """Show a session's records (every retained generation, or the one given)."""
    _key(identity, instance)
    found: list[dict[str, Any]] = _run_client(
        url, state, token_file, lambda runner: runner.sessions(identity=identity)
    )
    chosen = [
        record
        for record in found
        if record["handle"]["key"]["instance"] == instance
        and (generation is None or record["handle"]["generation"] == generation)
    ]
    if not chosen:
        which = f" generation {generation}" if generation is not None else ""
        raise click.ClickException(f"StaleSession: no retained {identity}/{instance}{which}")
    if as_json:
        click.echo(json.dumps(chosen, indent=2))
        return
    console = Console()
    _print_table(console, _table(chosen))
    for record in chosen:
        console.print_json(json.dumps(record))


@main.command()
@_client_options
@click.argument("identity")
@click.argument("instance")
@click.argument("generation", type=click.IntRange(min=1))
@click.option("--tail", type=click.IntRange(min=1), help="Only the last TAIL bytes.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing what the child writes.")
def logs(
    url: str,
    state: Path,
    token_file: Path | None,
    identity: str,
    instance: str,
    generation: int,
    tail: int | None,
    follow: bool,
) -> None:
    """Print what a session's child wrote."""
    key = _key(identity, instance)

    async def read(runner: RemoteSupervisor) -> None:
        text = await runner.logs(key, generation, tail=tail)
        click.echo(text, nl=False)
        if not follow:
            return
        seen = len((await runner.logs(key, generation)).encode())
        while True:
            await trio.sleep(0.5)
            whole = (await runner.logs(key, generation)).encode()
            if len(whole) > seen:
                click.echo(whole[seen:].decode(errors="replace"), nl=False)
                seen = len(whole)
            if not await _still_running(runner, key, generation):
                return

    with contextlib.suppress(KeyboardInterrupt):
        _run_client(url, state, token_file, read)


async def _still_running(runner: RemoteSupervisor, key: Key, generation: int) -> bool:
    for record in await runner.sessions(identity=key.identity):
        handle = record["handle"]
        if handle["key"]["instance"] == key.instance and handle["generation"] == generation:
            return bool(record["phase"] != Phase.STOPPED.value)
    return False


@main.command()
@_client_options
@click.argument("identity")
@click.argument("instance")
@click.argument("generation", type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print the termination as JSON.")
def dispose(
    url: str,
    state: Path,
    token_file: Path | None,
    identity: str,
    instance: str,
    generation: int,
    as_json: bool,
) -> None:
    """Dispose a session by key and generation (no session token needed)."""
    key = _key(identity, instance)
    with Console(stderr=True).status(f"disposing {identity}/{instance} #{generation}"):
        termination: Termination = _run_client(
            url, state, token_file, lambda runner: runner.admin_dispose(key, generation)
        )
    if as_json:
        click.echo(json.dumps(converter.unstructure(termination)))
    else:
        click.echo(f"{identity}/{instance} #{generation}: {termination.describe()}")


@main.command()
@_client_options
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def health(url: str, state: Path, token_file: Path | None, as_json: bool) -> None:
    """Whether the runner takes work; exit status 1 when it does not."""
    answer: dict[str, Any] = _run_client(url, state, token_file, lambda runner: runner.health())
    if as_json:
        click.echo(json.dumps(answer))
    elif answer.get("status") == "ready":
        click.echo(f"{url}: ready")
    if answer.get("status") != "ready":
        if not as_json:
            click.echo(f"{url}: not ready: {answer.get('detail', answer)}", err=True)
        sys.exit(1)


@main.command()
@_client_options
@click.option(
    "--deadline",
    type=float,
    default=DEFAULT_DRAIN_DEADLINE,
    show_default=True,
    callback=_seconds_option(DRAIN_DEADLINE),
    metavar="SECONDS",
    help="Stop the sessions still running after this many seconds.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def drain(url: str, state: Path, token_file: Path | None, deadline: float, as_json: bool) -> None:
    """Drain the runner: it takes no new sessions or children (and /readyz says so), its
    sessions run on until their hosts dispose them or their leases run out, and at the
    deadline the rest are stopped; then it exits 0. Its fleet's other runners take the
    new work: drain one runner at a time."""
    answer: dict[str, Any] = _run_client(
        url, state, token_file, lambda runner: runner.drain(deadline)
    )
    if as_json:
        click.echo(json.dumps(answer))
        return
    left = int(answer["sessions"])
    click.echo(
        f"{url}: draining; {left} session{'' if left == 1 else 's'} left, stopped by "
        f"{_moment(float(answer['until']))} at the latest"
    )


# -- the tenants file: tenants add, list, revoke (docs/service.md section D) ---------------

_TENANTS_FILE: Final = _DEFAULTS.state / "tenants.toml"
_RELOAD_HINT: Final = "A running runner takes the change on SIGHUP (kill -HUP <its pid>)."


def _tenants_file_option(command: Any) -> Any:
    return click.option(
        "--file",
        "path",
        type=click.Path(path_type=Path, dir_okay=False),
        default=_TENANTS_FILE,
        show_default=True,
        help="The tenants file (serve --tenants FILE).",
    )(command)


def _quota_options(command: Any) -> Any:
    """A flag per field of :class:`Quota` (``--memory-bytes N``), checked by its field."""
    for field in reversed(attrs.fields(Quota)):
        flag = "--" + field.name.replace("_", "-")
        command = click.option(
            flag,
            field.name,
            type=int,
            metavar="N",
            callback=_checked(field, flag),
            help=f"Quota: at most N {field.name.replace('_', ' ')} (none by default).",
        )(command)
    return command


def _refuse_input(field: str, name: str, value: object) -> None:
    """Tenant's own check of ``field``, naming the value ``name``: status 2 if it fails, so
    the command and the tenants file word a bad name alike."""
    check = getattr(attrs.fields(Tenant), field).validator
    assert isinstance(check, Check)
    try:
        check.check(name, value)
    except (TypeError, ValueError) as error:
        raise click.UsageError(str(error)) from None


def _current(path: Path, *, missing_ok: bool) -> tuple[str, dict[str, Tenant]]:
    """The tenants file's text and tenants; status 1 if it cannot work as it is."""
    if missing_ok and not path.exists():
        return "", {}
    try:
        text = read_text(path)
        data = tomllib.loads(text)
    except TenantsError as error:
        raise click.ClickException(str(error)) from None
    except tomllib.TOMLDecodeError as error:
        raise click.ClickException(f"the tenants file {path} is not TOML: {error}") from None
    if data in ({}, {"tenants": {}}):
        return text, {}  # made empty (touch): a runner refuses it, and add may fill it
    try:
        return text, dict(parse(data, str(path)).by_name)
    except TenantsError as error:
        raise click.ClickException(f"{error}; nothing was changed") from None


def _write(path: Path, text: str, intended: Mapping[str, Tenant]) -> None:
    """Replace the tenants file by ``text``, once ``text`` reads as the ``intended``
    tenants exactly; the file is never seen half written."""
    try:
        found = dict(parse(tomllib.loads(text), str(path)).by_name)
    except (TenantsError, tomllib.TOMLDecodeError) as error:
        raise click.ClickException(f"{path} would not work after the change: {error}") from None
    if found != intended:
        # Edited by its lines (add appends, revoke removes), a file laid out otherwise
        # could change more than meant: refuse rather than write it.
        raise click.ClickException(
            f"{path} is laid out in a way this command cannot change by its lines alone: "
            "edit it by hand"
        )
    try:
        replace(path, text)
    except (OSError, TenantsError) as error:
        raise click.ClickException(f"cannot write the tenants file {path}: {error}") from None


@main.group()
def tenants() -> None:
    """Edit the tenants file of serve --tenants: who may call the runner, on which keys."""


@tenants.command("add")
@click.argument("name")
@click.option(
    "--identity",
    "identities",
    multiple=True,
    required=True,
    metavar="PATTERN",
    help="An fnmatch pattern of the key identities the tenant may use (repeatable).",
)
@_quota_options
@_tenants_file_option
def add_tenant(name: str, identities: tuple[str, ...], path: Path, **quota: int | None) -> None:
    """Add tenant NAME and print its new token, once: the file keeps only its hash."""
    _refuse_input("name", "NAME", name)
    _refuse_input("identities", "--identity", identities)
    token = secrets.token_urlsafe(32)
    tenant = Tenant(
        name=name, token_sha256=token_hash(token), identities=identities, quota=Quota(**quota)
    )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # as serve makes --state
    with locked(Path(os.path.realpath(path)).parent):
        text, found = _current(path, missing_ok=True)
        if name in found:
            raise click.ClickException(
                f"tenant {name!r} is in {path} already: revoke it first to give it a new token"
            )
        if not text.strip():
            text = "# The runner's tenants (serve --tenants): docs/service.md section D.\n"
        added = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        table = table_text(tenant, comment=f"added {added} by trio-supervisor tenants add")
        _write(path, f"{text.rstrip()}\n\n{table}", {**found, name: tenant})
    click.echo(token)
    click.echo(
        f"tenant {name!r} added to {path}. Its token is above and will not be shown again "
        f"(the file keeps only its SHA-256): give it to the tenant's hosts now. " + _RELOAD_HINT,
        err=True,
    )


@tenants.command("list")
@_tenants_file_option
@click.option("--json", "as_json", is_flag=True, help="Print the tenants as JSON.")
def list_tenants(path: Path, as_json: bool) -> None:
    """List the tenants: names, identities, quotas, ceilings (never a token's hash)."""
    try:
        found = read(path)
    except TenantsError as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        shown = [
            attrs.asdict(
                tenant,
                filter=lambda field, value: field.name != "token_sha256" and value is not None,
            )
            for tenant in found
        ]
        click.echo(json.dumps(shown, indent=2))
        return
    table = Table(title=f"{_count(len(found), 'tenant')} in {path}", header_style="bold")
    for column in ("tenant", "identities", "quota", "limits", "fairness"):
        table.add_column(column, no_wrap=column == "tenant")
    for tenant in found:
        table.add_row(
            tenant.name,
            ", ".join(tenant.identities),
            tenant.quota.described(),
            tenant.limits.described(),
            tenant.fairness.described(),
        )
    _print_table(Console(), table)


@tenants.command("revoke")
@click.argument("name")
@_tenants_file_option
def revoke_tenant(name: str, path: Path) -> None:
    """Remove tenant NAME: its token is refused from the runner's next reading on."""
    with locked(Path(os.path.realpath(path)).parent):
        text, found = _current(path, missing_ok=False)
        if name not in found:
            raise click.ClickException(f"no tenant {name!r} in {path}")
        if len(found) == 1:
            raise click.ClickException(
                f"{name!r} is the only tenant in {path}, and a runner refuses a file without "
                "tenants: add the next tenant first"
            )
        try:
            changed = without_table(text, name)
        except TenantsError as error:
            raise click.ClickException(f"{path}: {error}; edit it by hand") from None
        _write(path, changed, {other: found[other] for other in found if other != name})
    click.echo(f"tenant {name!r} revoked from {path}")
    click.echo(_RELOAD_HINT, err=True)
