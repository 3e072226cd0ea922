"""The operator's commands: a runner's sessions, runners, logs, dispose, drain and health,
through the client (``client.py``)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import click
import httpx
import trio
from rich.console import Console
from rich.table import Table

from .._fields import Seconds
from ..client import RemoteSupervisor, connect
from ..codec import converter
from ..errors import RunnerUnreachableError, SupervisorError
from ..model import Key, Phase, RunnerInfo, Termination
from ..service.wire import DEFAULT_DRAIN_DEADLINE, DRAIN_DEADLINE
from ._common import count, moment, print_table

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


@click.command()
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
    print_table(Console(), _table(found, title=f"{count(len(found), 'session')} at {url}"))


_RUNNER_COLUMNS = ("runner", "epoch", "advertise", "started", "lease until", "alive", "sessions")


@click.command()
@_client_options
@click.option("--json", "as_json", is_flag=True, help="Print the runners as JSON.")
def runners(url: str, state: Path, token_file: Path | None, as_json: bool) -> None:
    """List the fleet's runners (this runner alone when it has no fleet)."""
    found: list[RunnerInfo] = _run_client(url, state, token_file, lambda runner: runner.runners())
    if as_json:
        click.echo(json.dumps([converter.unstructure(info) for info in found], indent=2))
        return
    table = Table(title=f"{count(len(found), 'runner')} seen from {url}", header_style="bold")
    for column in _RUNNER_COLUMNS:
        table.add_column(column, no_wrap=column in ("runner", "advertise"))
    for info in found:
        table.add_row(
            info.runner_id,
            str(info.epoch),
            info.advertise or "-",
            moment(info.started_at),
            moment(info.lease_until),
            ("draining" if info.draining else "yes") if info.alive else "no",
            str(info.sessions),
        )
    print_table(Console(), table)


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


@click.command()
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
    print_table(console, _table(chosen))
    for record in chosen:
        console.print_json(json.dumps(record))


@click.command()
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


@click.command()
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


@click.command()
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


@click.command()
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
        f"{moment(float(answer['until']))} at the latest"
    )
