"""``trio-supervisor``: the operator's command.

``serve`` runs a runner (``service/runner.py``). Every flag of ``serve`` is also a key of
the TOML file given with ``--config`` (``listen = "127.0.0.1:0"``, ``plugins = [...]``,
``[commands]`` with ``name = ["argv", ...]``); a flag given on the command line wins.

Exit statuses that scripts can rely on: 0 ok, 1 an error from the runner (its detail is
printed), 2 a usage error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import trio

from ._extras import needs_extra
from .codec import converter
from .errors import SupervisorError
from .model import Key, Phase, Termination

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
    from .service.runner import DEFAULT_LISTEN, ConfigError, RunnerConfig, run_runner

__all__ = ["main"]


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the session's key."""

    FIELDS = ("identity", "instance", "generation", "pid")

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


def _command(text: str) -> tuple[str, tuple[str, ...]]:
    name, equals, argv = text.partition("=")
    if not equals or not name or not argv.strip():
        raise click.BadParameter(f"expected NAME=ARGV, got {text!r}", param_hint="--command")
    return name, tuple(shlex.split(argv))


def _from_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise click.BadParameter(f"{path}: {error}", param_hint="--config") from error
    return {name.replace("-", "_"): value for name, value in data.items()}


_FLAGS = (
    "state",
    "listen",
    "plugins",
    "command",
    "commands",
    "lease",
    "grace",
    "confirmation_timeout",
    "token_file",
    "operator_token_file",
    "certfile",
    "keyfile",
    "insecure_http",
    "log_format",
)


@click.group()
@click.version_option(package_name="trio_supervisor")
def main() -> None:
    """Run code for remote hosts, and never lose track of it."""


@main.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="A TOML file whose keys are these flags; flags win.",
)
@click.option(
    "--state",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("runner-state"),
    show_default=True,
    help="The state directory: store, children's logs, tokens (made 0700).",
)
@click.option(
    "--listen",
    default=DEFAULT_LISTEN,
    show_default=True,
    help="HOST:PORT to listen on; port 0 picks a free one.",
)
@click.option(
    "--plugins",
    multiple=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="An entry path for module:function specifiers (repeatable).",
)
@click.option(
    "--command",
    multiple=True,
    metavar="NAME=ARGV",
    help="A named command a host may load by NAME (repeatable; no shell).",
)
@click.option("--lease", type=float, default=15.0, show_default=True, help="Seconds.")
@click.option("--grace", type=float, default=5.0, show_default=True, help="Seconds.")
@click.option("--confirmation-timeout", type=float, default=5.0, show_default=True, help="Seconds.")
@click.option(
    "--token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="The hosts' token [default: STATE/token]; made if absent.",
)
@click.option(
    "--operator-token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="The operators' token [default: STATE/operator-token]; made if absent.",
)
@click.option("--certfile", type=click.Path(path_type=Path, dir_okay=False), help="TLS.")
@click.option("--keyfile", type=click.Path(path_type=Path, dir_okay=False), help="TLS.")
@click.option(
    "--insecure-http", is_flag=True, help="Allow plain HTTP on an address that is not loopback."
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="How stderr logging looks.",
)
@click.pass_context
def serve(context: click.Context, /, config_file: Path | None, **flags: Any) -> None:
    """Run a runner: hosts open, load, renew and dispose sessions over HTTP."""
    if config_file is not None:
        for name, value in _from_file(config_file).items():
            if name not in _FLAGS:
                raise click.BadParameter(
                    f"unknown key {name!r} in {config_file}", param_hint="--config"
                )
            source = context.get_parameter_source(name)
            if name == "commands" or source is click.core.ParameterSource.DEFAULT:
                flags[name] = value
    configure_logging(flags["log_format"])
    commands = dict(_command(text) for text in flags["command"])
    for name, argv in dict(flags.get("commands") or {}).items():
        commands.setdefault(name, tuple(shlex.split(argv) if isinstance(argv, str) else argv))
    try:
        config = RunnerConfig(
            state=Path(flags["state"]),
            listen=str(flags["listen"]),
            plugins=tuple(Path(path) for path in flags["plugins"]),
            commands=commands,
            lease=float(flags["lease"]),
            grace=float(flags["grace"]),
            confirmation_timeout=float(flags["confirmation_timeout"]),
            token_file=_path(flags["token_file"]),
            operator_token_file=_path(flags["operator_token_file"]),
            certfile=_path(flags["certfile"]),
            keyfile=_path(flags["keyfile"]),
            insecure_http=bool(flags["insecure_http"]),
        )
        config.check()
    except (ConfigError, ValueError, TypeError) as error:
        raise click.UsageError(str(error)) from error
    try:
        status = trio.run(run_runner, config)
    except ConfigError as error:
        raise click.UsageError(str(error)) from error
    except SupervisorError as error:
        raise click.ClickException(error.detail) from error
    except BaseExceptionGroup as group:
        # The runner's nursery wraps what failed in it (a store another runner holds, a
        # shutdown's problems): status 1 and each detail, as for a bare error.
        failed, rest = group.split(SupervisorError)
        if failed is None or rest is not None:
            raise
        raise click.ClickException("; ".join(_details(failed))) from group
    sys.exit(status)


def _details(group: BaseExceptionGroup[SupervisorError]) -> list[str]:
    details: list[str] = []
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            details += _details(error)
        else:
            details.append(error.detail)
    return details


def _path(value: object) -> Path | None:
    return None if value is None else Path(str(value))


# -- the operator's commands: a runner's sessions, logs, dispose, health -------------------

DEFAULT_URL = "http://127.0.0.1:8470"


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
        async with connect(url, token=token) as runner:
            return await call(runner)

    try:
        return trio.run(main)
    except SupervisorError as error:
        raise click.ClickException(f"{error.code}: {error.detail}") from error
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    except httpx.HTTPError as error:
        raise click.ClickException(f"cannot reach the runner at {url}: {error}") from error


def _termination(record: dict[str, Any]) -> str:
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
    ]


_COLUMNS = ("key", "generation", "phase", "age", "lease left", "child pid", "reason", "termination")


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
    _print_table(Console(), _table(found, title=f"{len(found)} sessions at {url}"))


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
