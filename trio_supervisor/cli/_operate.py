"""The operator's commands: a runner's sessions, runners, logs, dispose, drain, health,
its tenants' usage and a sign-in link to its dashboard, through the client (``client/``)."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import webbrowser
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import attrs
import click
import httpx
import trio
from rich.console import Console
from rich.table import Table

from .. import _defaults as defaults
from .._fields import Seconds
from ..client import RemoteSupervisor, connect
from ..codec import converter
from ..errors import RunnerUnreachableError, SupervisorError
from ..model import Key, Phase, RunnerInfo, Termination
from ..service.wire import DEFAULT_DRAIN_DEADLINE, DRAIN_DEADLINE
from ._common import DEFAULTS, count, moment, print_table

# -- the operator's commands: a runner's sessions, runners, logs, dispose, health ----------

DEFAULT_URL: Final = f"http://{defaults.LISTEN}"  # where serve listens by default


@attrs.frozen
class RunnerAt:
    """The runner an operator's command calls: its URL, and where its token is.

    Attributes:
        url: The runner's URL.
        state: Its state directory, where it keeps the operators' token.
        token_file: The operators' token given elsewhere (``--token-file``), if it is.
    """

    url: str
    state: Path
    token_file: Path | None

    def token(self, *, needed: bool = True) -> str | None:
        """The operators' token, from ``token_file`` or where a runner on ``state``
        keeps it.

        Args:
            needed: Whether the call needs it; if not, a token missing where the runner
                would keep it is None (a ``--token-file`` given and not read is still an
                error).
        """
        path = attrs.evolve(
            DEFAULTS, state=self.state, operator_token_file=self.token_file
        ).operator_token_path
        try:
            return path.read_text().strip()
        except OSError as error:
            if not needed and self.token_file is None:
                return None
            raise click.UsageError(
                f"cannot read the operators' token {path}: {error.strerror}; give "
                "--token-file or run this where the runner's state directory is"
            ) from error

    def call(self, call: Callable[[RemoteSupervisor], Any], *, token_needed: bool = True) -> Any:
        """Run ``call`` with a client; a runner's error is printed, with exit status 1.

        Args:
            call: What to ask of the runner.
            token_needed: Whether the call needs the operators' token; if not, it is sent
                when it can be read, and the call is made without it when it cannot.
        """
        token = self.token(needed=token_needed)

        async def main() -> Any:
            # An operator at a terminal wants to hear soon that nothing answers: the
            # client tries a refused connection for OPERATOR_CONNECT_FOR, not a host's 5 s.
            async with connect(
                self.url, token=token, connect_for=defaults.OPERATOR_CONNECT_FOR
            ) as runner:
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
            raise click.ClickException(f"cannot reach the runner at {self.url}: {error}") from error


def _client_options(command: Callable[..., None]) -> Callable[..., None]:
    """``--url``, ``--token-file``, ``--state``, given to the command as one ``at``
    (:class:`RunnerAt`): on the runner's machine, none is needed."""

    @functools.wraps(command)
    def with_runner(
        *args: Any, url: str, state: Path, token_file: Path | None, **kwargs: Any
    ) -> None:
        command(*args, at=RunnerAt(url=url, state=state, token_file=token_file), **kwargs)

    with_runner = click.option(
        "--url", default=DEFAULT_URL, show_default=True, help="The runner's URL."
    )(with_runner)
    with_runner = click.option(
        "--token-file",
        type=click.Path(path_type=Path, dir_okay=False),
        help="The operators' token [default: STATE/operator-token].",
    )(with_runner)
    return click.option(
        "--state",
        type=click.Path(path_type=Path, file_okay=False),
        default=DEFAULTS.state,
        show_default=True,
        help="The runner's state directory, where its operator token is.",
    )(with_runner)


def _generation_of_key(command: Callable[..., None]) -> Callable[..., None]:
    """The arguments ``IDENTITY INSTANCE GENERATION`` of a command on one session, given
    to it as ``key`` (checked) and ``generation``."""

    @functools.wraps(command)
    def with_session(*args: Any, identity: str, instance: str, **kwargs: Any) -> None:
        command(*args, key=_key(identity, instance), **kwargs)

    with_session = click.argument("generation", type=click.IntRange(min=1))(with_session)
    with_session = click.argument("instance")(with_session)
    return click.argument("identity")(with_session)


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
@click.option(
    "--all-generations",
    is_flag=True,
    help="Every retained generation of each key, not only its newest.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def sessions(
    at: RunnerAt,
    phase: str | None,
    identity: str | None,
    all_generations: bool,
    as_json: bool,
) -> None:
    """List a runner's sessions, the newest generation of each key: what runs, and why
    things stopped."""
    found: list[dict[str, Any]] = at.call(
        lambda runner: runner.sessions(
            phase=phase, identity=identity, all_generations=all_generations
        ),
    )
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    which = "" if all_generations else ", the newest generation of each key"
    print_table(
        Console(), _table(found, title=f"{count(len(found), 'session')} at {at.url}{which}")
    )


_RUNNER_COLUMNS = (
    "runner",
    "epoch",
    "advertise",
    "started",
    "lease until",
    "alive",
    "sessions",
    "taken over",
)


def _taken_over(info: RunnerInfo) -> str:
    """When and by whom a dead runner's records were taken over (its epoch moved on to
    fence it: no new incarnation), or "-"."""
    if info.taken_over_at is None:
        return "-"
    return f"{moment(info.taken_over_at)} by {info.taken_over_by or 'another runner'}"


@click.command()
@_client_options
@click.option("--json", "as_json", is_flag=True, help="Print the runners as JSON.")
def runners(at: RunnerAt, as_json: bool) -> None:
    """List the fleet's runners (this runner alone when it has no fleet)."""
    found: list[RunnerInfo] = at.call(lambda runner: runner.runners())
    if as_json:
        click.echo(json.dumps([converter.unstructure(info) for info in found], indent=2))
        return
    table = Table(title=f"{count(len(found), 'runner')} seen from {at.url}", header_style="bold")
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
            _taken_over(info),
        )
    print_table(Console(), table)


def _bytes_text(value: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:.1f} {unit}".replace(".0 ", " ")
    return f"{value} B"


def _against(used: int, quota: int | None, text: Callable[[int], str] = str) -> str:
    return text(used) if quota is None else f"{text(used)} of {text(quota)}"


def _cpu_ceilings(usage: dict[str, Any], quota: int | None, unlimited: int) -> str:
    """The children's summed CPU ceilings, and why they may read high: a child without
    one counts as every core."""
    text = _against(int(usage["cpu_percent"]), quota, lambda percent: f"{percent}%")
    without = int(usage.get("children_without_cpu_limit", 0))
    if without:
        cores = f"{unlimited / 100:g} core{'' if unlimited == 100 else 's'}"
        if without == 1:
            text += f" (1 child without a limit counts as {cores})"
        else:
            text += f" ({without} children without a limit count as {cores} each)"
    return text


_USAGE_COLUMNS = ("tenant", "sessions", "children", "memory ceilings", "CPU ceilings")


@click.command()
@_client_options
@click.option("--json", "as_json", is_flag=True, help="Print the runner's answer as JSON.")
def usage(at: RunnerAt, as_json: bool) -> None:
    """What each tenant holds, against its quota: its live sessions, its children, and
    their summed memory and CPU ceilings (not what they use). A child without a CPU
    ceiling counts as every core of the runner's machine, one without a memory ceiling
    as the memory the runner gives its children."""
    answer: dict[str, Any] = at.call(lambda runner: runner.tenants())
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    unlimited = int(answer.get("unlimited_cpu_percent", 100))
    found = sorted(answer["tenants"], key=lambda tenant: str(tenant["name"]))
    table = Table(title=f"{count(len(found), 'tenant')} at {at.url}", header_style="bold")
    for column in _USAGE_COLUMNS:
        table.add_column(column, no_wrap=column == "tenant")
    for tenant in found:
        used, quota = tenant["usage"], tenant.get("quota") or {}
        table.add_row(
            str(tenant["name"]),
            _against(int(used["sessions"]), quota.get("sessions")),
            _against(int(used["children"]), quota.get("children")),
            _against(int(used["memory_bytes"]), quota.get("memory_bytes"), _bytes_text),
            _cpu_ceilings(used, quota.get("cpu_percent"), unlimited),
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
    at: RunnerAt,
    identity: str,
    instance: str,
    generation: int | None,
    as_json: bool,
) -> None:
    """Show a key's records: every retained generation, newest first, or the one given."""
    _key(identity, instance)
    found: list[dict[str, Any]] = at.call(
        lambda runner: runner.sessions(identity=identity, instance=instance, all_generations=True),
    )
    chosen = sorted(
        (
            record
            for record in found
            if record["handle"]["key"]["instance"] == instance
            and (generation is None or record["handle"]["generation"] == generation)
        ),
        key=lambda record: -int(record["handle"]["generation"]),
    )
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
@_generation_of_key
@click.option(
    "--tail",
    type=click.IntRange(min=1),
    metavar="N",
    help="Only the last N lines (a last line without a newline counts).",
)
@click.option(
    "--tail-bytes", type=click.IntRange(min=1), metavar="N", help="Only the last N bytes."
)
@click.option("--follow", "-f", is_flag=True, help="Keep printing what the child writes.")
def logs(
    at: RunnerAt,
    key: Key,
    generation: int,
    tail: int | None,
    tail_bytes: int | None,
    follow: bool,
) -> None:
    """Print what a session's child wrote."""
    if tail is not None and tail_bytes is not None:
        raise click.UsageError("give --tail (lines) or --tail-bytes (bytes), not both")

    async def read(runner: RemoteSupervisor) -> None:
        text = await runner.logs(key, generation, tail=tail, tail_bytes=tail_bytes)
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
        at.call(read)


async def _still_running(runner: RemoteSupervisor, key: Key, generation: int) -> bool:
    listed = await runner.sessions(
        identity=key.identity, instance=key.instance, all_generations=True
    )
    for record in listed:
        handle = record["handle"]
        if handle["key"]["instance"] == key.instance and handle["generation"] == generation:
            return bool(record["phase"] != Phase.STOPPED.value)
    return False


@click.command()
@_client_options
@_generation_of_key
@click.option("--json", "as_json", is_flag=True, help="Print the termination as JSON.")
def dispose(
    at: RunnerAt,
    key: Key,
    generation: int,
    as_json: bool,
) -> None:
    """Dispose a session by key and generation (no session token needed)."""
    with Console(stderr=True).status(f"disposing {key.identity}/{key.instance} #{generation}"):
        termination: Termination = at.call(lambda runner: runner.admin_dispose(key, generation))
    if as_json:
        click.echo(json.dumps(converter.unstructure(termination)))
    else:
        click.echo(f"{key.identity}/{key.instance} #{generation}: {termination.describe()}")


@click.command()
@_client_options
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def health(at: RunnerAt, as_json: bool) -> None:
    """Whether the runner takes work; exit status 1 when it does not. Needs no token
    (``/readyz`` asks for none): from any machine, ``--url`` is all it takes."""
    answer: dict[str, Any] = at.call(lambda runner: runner.health(), token_needed=False)
    if as_json:
        click.echo(json.dumps(answer))
    elif answer.get("status") == "ready":
        click.echo(f"{at.url}: ready")
    if answer.get("status") != "ready":
        if not as_json:
            click.echo(f"{at.url}: not ready: {answer.get('detail', answer)}", err=True)
        sys.exit(1)


@click.command()
@_client_options
@click.option("--open", "open_it", is_flag=True, help="Open the link in a browser here.")
def dashboard(at: RunnerAt, open_it: bool) -> None:
    """Print a sign-in link to the runner's dashboard: it works once, within minutes, and
    holds no token (it signs its browser tab in for some hours). Hand it to an operator,
    or open it with --open."""
    answer: dict[str, Any] = at.call(lambda runner: runner.dashboard_code())
    link = at.url.rstrip("/") + str(answer["path"])
    minutes = float(answer["expires_in"]) / 60
    click.echo(link)
    click.echo(f"It signs one browser tab in, once, within {minutes:g} minutes.", err=True)
    if open_it and not webbrowser.open(link):
        raise click.ClickException("no browser could be opened here: open the link above")


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
def drain(at: RunnerAt, deadline: float, as_json: bool) -> None:
    """Drain the runner: it takes no new sessions or children (and /readyz says so), its
    sessions run on until their hosts dispose them or their leases run out, and at the
    deadline the rest are stopped; then it exits 0. Its fleet's other runners take the
    new work: drain one runner at a time."""
    answer: dict[str, Any] = at.call(lambda runner: runner.drain(deadline))
    if as_json:
        click.echo(json.dumps(answer))
        return
    left = int(answer["sessions"])
    click.echo(
        f"{at.url}: draining; {left} session{'' if left == 1 else 's'} left, stopped by "
        f"{moment(float(answer['until']))} at the latest"
    )
