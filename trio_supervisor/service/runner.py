"""``trio-supervisor serve``: a supervisor, its store, its execution and an HTTP server.

Theory of operation
-------------------
One ``trio.run`` holds everything (docs/service.md section A): the SQLite store in the state
directory, a subprocess execution over the configured entry paths and named commands,
the supervisor, and Hypercorn's Trio server with the app of ``app.py``. In order:

1. the state directory is made (mode 0700) and the tokens are read, or made with
   ``secrets.token_urlsafe(32)`` into files of mode 0600;
2. the supervisor starts, which recovers what an earlier run on this state directory
   left behind (V1-V5), *before* anything listens;
3. the server binds and the first line on stdout is ``listening on URL`` (the real port
   when the port was 0);
4. SIGTERM or SIGINT: the server stops accepting and finishes what it serves, then the
   supervisor shuts down (Z1, Z2: every child reaped), and the process exits 0. A second
   signal during that shutdown skips the children's grace (they are killed at once,
   still confirmed and reaped) and the process exits 1.

Plain HTTP is refused on an address that is not loopback unless ``insecure_http`` is
set: the bearer tokens would cross the network in the clear. TLS comes from
``certfile`` and ``keyfile``. No token is ever logged or put in a child's environment.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal, TextIO

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from .. import _fields as fields
from .._core.lifetime import open_supervisor
from .._core.supervisor import Supervisor
from ..errors import StateStorageError
from ..executions.subprocess import SubprocessExecution
from ..stores.sqlite import SqliteStore
from .app import create_app
from .metrics import Metrics, TimedStore

__all__ = ["ConfigError", "RunnerConfig", "StartupError", "run_runner"]

logger = logging.getLogger(__name__)

DEFAULT_LISTEN: Final = "127.0.0.1:8470"
GRACEFUL_SECONDS: Final = 5.0  # how long the server lets requests in flight finish


class ConfigError(ValueError):
    """The runner's configuration cannot work; the message says why."""


class StartupError(Exception):
    """The runner cannot start where it was told to: its address is taken, or its store
    is held by another process. The message says why and what to do, in one sentence."""


async def _open_store(config: RunnerConfig) -> SqliteStore:
    """The runner's store, opened; a store another process holds is a :class:`StartupError`."""
    store = SqliteStore(config.state / "runner.db")
    try:
        await store.open()
    except StateStorageError as error:
        await store.aclose()
        # SQLite says "database is locked" when another connection holds the file
        # (ours keep it with locking_mode=EXCLUSIVE): most likely a runner serving there.
        if "locked" not in error.detail:
            raise
        raise StartupError(
            f"the store {store.path} is locked by another process (a runner serving on "
            f"{config.state}?): stop it, or give this runner a state directory of its own "
            "with --state DIR"
        ) from error
    return store


FLAG: Final = "trio_supervisor.flag"  # a RunnerConfig field's metadata: its serve flag


def _flag(
    text: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    path: Literal["dir", "file"] | None = None,
    exists: bool = False,
) -> dict[str, dict[str, Any]]:
    """A field's ``serve`` flag, as attrs metadata: the CLI makes the flag from it.

    Args:
        text: The flag's help text.
        flag: Its name, when not ``--`` and the field's name with dashes.
        metavar: What its value is called in the help.
        path: Whether its value is a directory or a file.
        exists: Whether that path must exist.
    """
    return {FLAG: {"help": text, "flag": flag, "metavar": metavar, "path": path, "exists": exists}}


def _paths(value: Iterable[str | os.PathLike[str]]) -> tuple[Path, ...]:
    # A lone path is a sequence of characters: never read it as one path per character.
    if isinstance(value, str | os.PathLike):
        raise TypeError(f"RunnerConfig.plugins must be a sequence of paths, not {value!r}")
    return tuple(Path(path) for path in value)


@attrs.frozen(kw_only=True)
class RunnerConfig:
    """What ``trio-supervisor serve`` is told: each field is a flag of ``serve`` and a key
    of its TOML file (the CLI makes both from these fields and their metadata).

    Attributes:
        state: The state directory: the store, the children's logs, the token files.
        listen: ``HOST:PORT`` to bind; port 0 picks a free one.
        plugins: Entry paths for ``module:function`` specifiers.
        commands: Named commands, ``name -> argv``.
        lease, grace, confirmation_timeout: The supervisor's, in seconds.
        token_file: The hosts' token; ``state/token`` by default.
        operator_token_file: The operators' token; ``state/operator-token`` by default.
        certfile, keyfile: TLS; both or neither.
        insecure_http: Allow plain HTTP on an address that is not loopback.
        standby: Keep one interpreter started ahead of the next load.
        fork_server: Fork each load's child from a fork server (see
            ``SubprocessExecution``); the standby serves loads while it restarts.
        log_format: How the runner's log lines look on stderr (``text`` or ``json``);
            the CLI sets logging up, :func:`run_runner` leaves it to its caller.
    """

    state: Path = attrs.field(
        default=Path("runner-state"),
        converter=Path,
        metadata=_flag(
            "The state directory: store, children's logs, tokens (made 0700).",
            metavar="DIR",
            path="dir",
        ),
    )
    listen: str = attrs.field(
        default=DEFAULT_LISTEN,
        metadata=_flag("HOST:PORT to listen on; port 0 picks a free one.", metavar="HOST:PORT"),
    )
    plugins: tuple[Path, ...] = attrs.field(
        default=(),
        converter=_paths,
        metadata=_flag(
            "An entry path for module:function specifiers (repeatable; it must exist).",
            metavar="DIR",
            path="dir",
            exists=True,
        ),
    )
    commands: Mapping[str, tuple[str, ...]] = attrs.field(
        factory=dict,
        metadata=_flag(
            "A named command a host may load by NAME (repeatable; split like a shell "
            "would, run with no shell). In TOML: a [commands] table, NAME = [ARGV...].",
            flag="--command",
            metavar="NAME=ARGV",
        ),
    )
    lease: float = attrs.field(
        default=15.0,
        validator=fields.LEASE,
        metadata=_flag(
            f"The default lease, in seconds ({fields.MIN_LEASE:g} at least).", metavar="SECONDS"
        ),
    )
    grace: float = attrs.field(
        default=5.0,
        validator=fields.GRACE,
        metadata=_flag(
            "Seconds a child has to exit after its interrupt, before it is killed.",
            metavar="SECONDS",
        ),
    )
    confirmation_timeout: float = attrs.field(
        default=5.0,
        validator=fields.TIMEOUT,
        metadata=_flag("Seconds to wait for a killed child's exit to be seen.", metavar="SECONDS"),
    )
    token_file: Path | None = attrs.field(
        default=None,
        metadata=_flag("The hosts' token [default: STATE/token]; made if absent.", path="file"),
    )
    operator_token_file: Path | None = attrs.field(
        default=None,
        metadata=_flag(
            "The operators' token [default: STATE/operator-token]; made if absent.",
            path="file",
        ),
    )
    certfile: Path | None = attrs.field(
        default=None, metadata=_flag("TLS: the certificate chain (PEM).", path="file")
    )
    keyfile: Path | None = attrs.field(
        default=None, metadata=_flag("TLS: the certificate's private key (PEM).", path="file")
    )
    insecure_http: bool = attrs.field(
        default=False,
        metadata=_flag("Allow plain HTTP on an address that is not loopback."),
    )
    standby: bool = attrs.field(
        default=True,
        metadata=_flag("Keep one interpreter started ahead of the next load."),
    )
    fork_server: bool = attrs.field(
        default=True,
        metadata=_flag("Fork each load's child from a fork server, not a fresh interpreter."),
    )
    log_format: Literal["text", "json"] = attrs.field(
        default="text",
        validator=attrs.validators.in_(("text", "json")),
        metadata=_flag("How stderr logging looks: text, or one JSON object per line."),
    )

    @property
    def hosts_token_path(self) -> Path:
        return self.token_file or self.state / "token"

    @property
    def operator_token_path(self) -> Path:
        return self.operator_token_file or self.state / "operator-token"

    @property
    def tls(self) -> bool:
        return self.certfile is not None

    def check(self) -> tuple[str, int]:
        """The host and port to bind, once the configuration is known to work.

        Raises:
            ConfigError: The listen address is malformed, TLS is half configured, or
                plain HTTP would leave loopback without ``insecure_http``.
        """
        host, port = parse_listen(self.listen)
        if (self.certfile is None) != (self.keyfile is None):
            raise ConfigError("--certfile and --keyfile go together")
        if not self.tls and not self.insecure_http and not _is_loopback(host):
            raise ConfigError(
                f"refusing plain HTTP on {host}, which is not a loopback address: the "
                "bearer tokens would cross the network in the clear. Give --certfile and "
                "--keyfile, or --insecure-http if something else encrypts the traffic"
            )
        return host, port


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as a host and a port."""
    host, colon, port_text = listen.rpartition(":")
    if not colon or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"--listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port_text)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_or_make_token(path: Path) -> str:
    """The token in ``path``; a new one (CSPRNG, mode 0600) if the file does not exist."""
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        token = secrets.token_urlsafe(32)
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_EXCL: never overwrite a token another process just made.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(token + "\n")
        return token
    if not token:
        raise ConfigError(f"the token file {path} is empty")
    return token


def _cannot_listen(config: RunnerConfig, failed: BaseExceptionGroup[OSError]) -> StartupError:
    error: BaseException = failed
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, OSError)
    if error.errno == errno.EADDRINUSE:
        return StartupError(
            f"cannot listen on {config.listen}: the address is already in use (another "
            "runner?); give --listen another HOST:PORT, or port 0 for a free one"
        )
    return StartupError(f"cannot listen on {config.listen}: {error.strerror or error}")


def _url(bind: str, tls: bool) -> str:
    """Hypercorn's bind (``http://127.0.0.1:8470``) as the URL a host uses."""
    address = bind.partition("://")[2]
    return f"{'https' if tls else 'http'}://{address}"


async def run_runner(
    config: RunnerConfig,
    *,
    stdout: TextIO | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Run the runner until SIGTERM or SIGINT; return the process's exit status.

    Args:
        config: What to run, and where.
        stdout: Where the ``listening on URL`` line goes (standard output by default).
        task_status: Given the URL once the server listens.

    Raises:
        ConfigError: The configuration cannot work.
        StartupError: The store is held by another process (raised as it is), or the
            address is taken (raised in the exception group of the runner's nursery).
    """
    host, port = config.check()
    out = stdout or sys.stdout
    config.state.mkdir(parents=True, exist_ok=True)
    os.chmod(config.state, 0o700)
    hosts_token = read_or_make_token(config.hosts_token_path)
    operator_token = read_or_make_token(config.operator_token_path)
    if hosts_token == operator_token:
        raise ConfigError("the hosts' token and the operators' token must differ")

    server = Config()
    server.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    server.graceful_timeout = GRACEFUL_SECONDS
    server.accesslog = None  # an access log would list every caller's path; errors still log
    server.errorlog = logging.getLogger("hypercorn.error")  # through our handlers
    if config.certfile is not None and config.keyfile is not None:
        server.certfile = str(config.certfile)
        server.keyfile = str(config.keyfile)

    stop_serving = trio.Event()
    exit_status = 0
    hurry: list[Supervisor] = []  # the supervisor, once it runs: a second signal hurries it

    async def watch_signals(signals: AsyncIterator[int]) -> None:
        nonlocal exit_status
        async for number in signals:
            name = signal.Signals(number).name
            if not stop_serving.is_set():
                logger.info("%s: stopping; every child is stopped and reaped", name)
                stop_serving.set()
                continue
            logger.warning("%s again: children are killed now, without their grace", name)
            exit_status = 1
            for supervisor in hurry:
                supervisor.skip_grace()

    # Opened before anything else starts, so that a store in use is one plain error.
    sqlite = await _open_store(config)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as watching:
            watching.start_soon(watch_signals, signals)
            metrics = Metrics()
            async with (
                sqlite,
                SubprocessExecution(
                    config.state,
                    entry_paths=list(config.plugins),
                    commands=dict(config.commands),
                    standby=config.standby,
                    fork_server=config.fork_server,
                ) as execution,
                open_supervisor(
                    TimedStore(sqlite, metrics.save_seconds),
                    execution,
                    lease=config.lease,
                    grace=config.grace,
                    confirmation_timeout=config.confirmation_timeout,
                ) as supervisor,
            ):
                hurry.append(supervisor)
                if exit_status:  # signalled twice while recovery ran
                    supervisor.skip_grace()
                app = create_app(
                    supervisor,
                    hosts_token=hosts_token,
                    operator_token=operator_token,
                    logs=execution,
                    metrics=metrics,
                )
                # Counts until the supervisor shuts down (its events end then).
                watching.start_soon(metrics.follow, supervisor)

                async def end_event_streams() -> None:
                    await stop_serving.wait()
                    app.state.end_event_streams()

                watching.start_soon(end_event_streams)
                async with trio.open_nursery() as serving:
                    # serve returns once stop_serving is set and what it served is done.
                    try:
                        binds: Sequence[str] = await serving.start(
                            functools.partial(
                                serve,
                                app,  # type: ignore[arg-type]  # Starlette is an ASGI app
                                server,
                                shutdown_trigger=stop_serving.wait,
                            )
                        )
                    except* OSError as failed:
                        # Hypercorn binds in nurseries of its own: the OSError comes
                        # wrapped in their groups.
                        raise _cannot_listen(config, failed) from None
                    url = _url(binds[0], config.tls)
                    print(f"listening on {url}", file=out, flush=True)
                    logger.info("listening on %s; state in %s", url, config.state)
                    task_status.started(url)
            # Leaving open_supervisor stopped every session and reaped every child.
            watching.cancel_scope.cancel()
    return exit_status
