"""``trio-supervisor serve``: a supervisor, its store, its execution and an HTTP server.

Theory of operation
-------------------
One ``trio.run`` holds everything (SERVICE.md section A): the SQLite store in the state
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

import functools
import ipaddress
import logging
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Final, TextIO

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from .. import _fields as fields
from .._core.lifetime import open_supervisor
from .._core.supervisor import Supervisor
from ..executions.subprocess import SubprocessExecution
from ..stores.sqlite import SqliteStore
from .app import create_app
from .metrics import Metrics, TimedStore

__all__ = ["ConfigError", "RunnerConfig", "run_runner"]

logger = logging.getLogger(__name__)

DEFAULT_LISTEN: Final = "127.0.0.1:8470"
GRACEFUL_SECONDS: Final = 5.0  # how long the server lets requests in flight finish


class ConfigError(ValueError):
    """The runner's configuration cannot work; the message says why."""


@attrs.frozen(kw_only=True)
class RunnerConfig:
    """What ``trio-supervisor serve`` is told (its flags, or the keys of its TOML file).

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
    """

    state: Path = Path("runner-state")
    listen: str = DEFAULT_LISTEN
    plugins: tuple[Path, ...] = ()
    commands: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    lease: float = attrs.field(default=15.0, validator=fields.LEASE)
    grace: float = attrs.field(default=5.0, validator=fields.GRACE)
    confirmation_timeout: float = attrs.field(default=5.0, validator=fields.TIMEOUT)
    token_file: Path | None = None
    operator_token_file: Path | None = None
    certfile: Path | None = None
    keyfile: Path | None = None
    insecure_http: bool = False
    standby: bool = True
    fork_server: bool = True

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

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as watching:
            watching.start_soon(watch_signals, signals)
            metrics = Metrics()
            async with (
                SqliteStore(config.state / "runner.db") as sqlite,
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
                    binds: Sequence[str] = await serving.start(
                        functools.partial(
                            serve,
                            app,  # type: ignore[arg-type]  # Starlette is an ASGI app
                            server,
                            shutdown_trigger=stop_serving.wait,
                        )
                    )
                    url = _url(binds[0], config.tls)
                    print(f"listening on {url}", file=out, flush=True)
                    logger.info("listening on %s; state in %s", url, config.state)
                    task_status.started(url)
            # Leaving open_supervisor stopped every session and reaped every child.
            watching.cancel_scope.cancel()
    return exit_status
