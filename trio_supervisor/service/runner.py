"""``trio-supervisor serve``: a supervisor, its store, its execution and an HTTP server.

Theory of operation
-------------------
The configuration, its flags and its checks are ``config.py``'s (:class:`RunnerConfig`).
One ``trio.run`` holds everything (docs/service.md section A): the SQLite store in the state
directory, a subprocess execution over the configured entry paths and named commands
(whose children run isolated unless ``isolation`` is "none": each as a uid of its own
from ``child_users``, on the network ``child_network`` says), the supervisor, and
Hypercorn's Trio server with the app of ``app.py``. In order:

1. the state directory is made (mode 0700) and the tokens are read, or made with
   ``secrets.token_urlsafe(32)`` into files of mode 0600;
2. the supervisor starts, which recovers what an earlier run on this state directory
   left behind (V1-V5), *before* anything listens;
3. the server binds and the first line on stdout is ``listening on URL`` (the real port
   when the port was 0);
4. SIGTERM or SIGINT: the server stops accepting and finishes what it serves, then the
   supervisor shuts down (Z1, Z2: every child reaped), and the process exits 0. A second
   signal during that shutdown skips the children's grace (they are killed at once,
   still confirmed and reaped) and the process exits 1. A drain (``drain.py``: ``POST
   /v1/admin/drain``, or SIGTERM under ``drain_on_sigterm``) takes no new work and ends
   the same way once its sessions have ended or its deadline passed.

With a ``postgresql://`` store (``store``), the runner is a member of that database's
fleet (docs/service.md section C): ``PostgresStore`` under ``runner_id``, advertising
``advertise`` (by default the ``listening on`` URL, known before the store opens because
the runner binds its socket first and hands it to Hypercorn), its row held for
``runner_lease`` seconds at a time. The token files stay in the state directory: every
runner of a fleet is given copies of the same ones.

Plain HTTP is refused on an address that is not loopback unless ``insecure_http`` is
set: the bearer tokens would cross the network in the clear. TLS comes from
``certfile`` and ``keyfile``. No token is ever logged or put in a child's environment.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import signal
import socket
import sys
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Final, Protocol, TextIO

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.utils import repr_socket_addr

from .. import _defaults as defaults
from .._core.lifetime import open_supervisor
from .._core.supervisor import Supervisor
from .._extras import needs_extra
from ..abc import FleetStore, Store
from ..errors import StateStorageError, SupervisorError
from ..executions.subprocess import SubprocessExecution
from ..stores.sqlite import SqliteStore
from .app import create_app
from .capacity import capacity_of, runner_admission
from .config import ConfigError, RunnerConfig
from .drain import Drain
from .fleet import Fleet
from .healing import GAVE_UP, Front, Healer, asgi, restarting_app
from .metrics import Metrics, timed
from .sign_in import SignIns
from .tenants import Tenants, TenantsError, token_hash
from .tenants_file import Roster

__all__ = ["StartupError", "run_runner"]

logger = logging.getLogger(__name__)

GRACEFUL_SECONDS: Final = defaults.SERVER_GRACEFUL
REOPEN_PAUSE: Final = defaults.REOPEN_PAUSE


class StartupError(Exception):
    """The runner cannot start where it was told to: its address is taken, or its store
    is held by another process. The message says why and what to do, in one sentence."""


class _Closable(Protocol):
    """A store the runner opens before anything starts and closes last."""

    async def open(self) -> None: ...

    async def aclose(self) -> None: ...


class _RunnerStore(Store, _Closable, Protocol): ...


def _fleet_store(config: RunnerConfig, advertise: str, memory: Any = None) -> _RunnerStore:
    """The fleet's ``PostgresStore`` (the ``postgres`` extra), not yet opened; ``memory``
    is the last incarnation's store's (B6)."""
    with needs_extra("postgres", "a runner with --store postgresql://...", "psycopg"):
        # Imported here: a runner of its own needs neither psycopg nor this module.
        from ..stores.postgres import PostgresStore

    assert config.store is not None
    store: _RunnerStore = PostgresStore(
        config.store,
        runner_id=config.runner_id,
        advertise=advertise,
        runner_lease=config.runner_lease,
        retention=config.retention,
        store_wait=config.store_wait,
        commit_window=config.store_commit_window,
        memory=memory,
    )
    return store


async def _open_store(config: RunnerConfig, advertise: str, memory: Any = None) -> _RunnerStore:
    """The runner's store, opened; a store another process holds, or a database out of
    reach, is a :class:`StartupError`. ``memory``: what the store of the runner's last
    incarnation remembers of its writes (a fleet's), handed on (B6)."""
    if config.fleet:
        fleet = _fleet_store(config, advertise, memory)
        try:
            await fleet.open()
        except StateStorageError as error:
            await fleet.aclose()
            # Said once: the store's error begins with the database's name too.
            detail = error.detail.removeprefix(f"{getattr(fleet, 'dsn', '')}: ")
            raise StartupError(
                f"cannot open the fleet's store at {_without_password(config.store or '')}: "
                f"{detail}"
            ) from error
        return fleet
    store = SqliteStore(config.state / "runner.db", retention=config.retention)
    try:
        await store.open()
    except StateStorageError as error:
        await store.aclose()
        # Another store owns the file (the store's message names its process: most
        # likely a runner serving there), or a connection held it past the store's wait.
        # The store's own words are kept: they name who holds it.
        if "locked" not in error.detail:
            raise
        raise StartupError(
            f"the store {error.detail}: stop it, or give this runner a state directory of "
            "its own with --state DIR"
        ) from error
    return store


def _execution(config: RunnerConfig) -> SubprocessExecution:
    """The runner's execution, not yet started: its children's uids are its own default
    unless ``child_users`` is given."""
    users: dict[str, Any] = {}
    if config.child_users is not None:
        users["isolation_users"] = config.child_users
    return SubprocessExecution(
        config.state,
        entry_paths=list(config.plugins),
        commands=dict(config.commands),
        standby=config.standby,
        fork_server=config.fork_server,
        isolation=config.isolation,
        network=config.child_network,
        **users,
    )


def _without_password(url: str) -> str:
    """``url`` fit for a message: its password (if any) left out."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


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


def _roster(config: RunnerConfig, operator_token: str) -> Roster:
    """The tenants in force at start: the tenants file's, or the hosts' token (made if
    absent) as tenant ``default``."""
    if config.tenants is None:
        roster = Roster(Tenants.single(read_or_make_token(config.hosts_token_path)))
    else:
        try:
            roster = Roster.from_file(config.tenants)
        except TenantsError as error:
            raise ConfigError(str(error)) from None
    try:
        roster.reserve(token_hash(operator_token))
    except TenantsError as error:
        if config.tenants is None:
            raise ConfigError("the hosts' token and the operators' token must differ") from None
        raise ConfigError(str(error)) from None
    return roster


def _cannot_listen(config: RunnerConfig, failed: BaseException) -> StartupError:
    error = failed
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, OSError)
    if error.errno == errno.EADDRINUSE:
        return StartupError(
            f"cannot listen on {config.listen}: the address is already in use (another "
            "runner?); give --listen another HOST:PORT, or port 0 for a free one"
        )
    return StartupError(f"cannot listen on {config.listen}: {error.strerror or error}")


def _bind(config: RunnerConfig, host: str, port: int) -> socket.socket:
    """The runner's socket, bound now and not yet listening: a fleet's runner needs its
    URL before its store opens (``advertise``), and recovery before it listens."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise _cannot_listen(config, error) from None
    return listener


def _url(bind: str, tls: bool) -> str:
    """Hypercorn's bind (``http://127.0.0.1:8470``) as the URL a host uses."""
    address = bind.partition("://")[2]
    return f"{'https' if tls else 'http'}://{address}"


async def _until_stopped_or_poisoned(
    supervisor: Supervisor, drain: Drain, stop_serving: trio.Event
) -> SupervisorError | None:
    """Wait until the runner is to stop (None) or ``supervisor`` is poisoned (its error)."""
    poisoned: SupervisorError | None = None
    async with trio.open_nursery() as waiting:

        async def failed() -> None:
            nonlocal poisoned
            try:
                await supervisor.wait_failed()
            except SupervisorError as error:
                poisoned = error
            waiting.cancel_scope.cancel()

        async def stopped() -> None:
            await stop_serving.wait()
            waiting.cancel_scope.cancel()

        async def drained() -> None:
            await drain.wait()
            stop_serving.set()

        waiting.start_soon(failed)
        waiting.start_soon(stopped)
        waiting.start_soon(drained)
    # A stop asked for as the supervisor was poisoned is a stop: nothing restarts.
    return None if stop_serving.is_set() else poisoned


async def _reopen(
    config: RunnerConfig, advertise: str, healer: Healer, stop_serving: trio.Event, memory: Any
) -> _RunnerStore | None:
    """The store opened again for a new incarnation (a new epoch in a fleet), after the
    back-off; None when the runner is to stop meanwhile. A store that does not answer is
    tried again at once (each try waits ``store_wait`` for it), so that the runner serves
    within moments of the database's return, whatever the back-off had grown to."""
    async with trio.open_nursery() as pausing:
        # A signal ends the back-off at once.
        async def stop() -> None:
            await stop_serving.wait()
            pausing.cancel_scope.cancel()

        pausing.start_soon(stop)
        await healer.pause()
        pausing.cancel_scope.cancel()
    while not stop_serving.is_set():
        try:
            return await _open_store(config, advertise, memory)
        except (StartupError, StateStorageError) as error:
            healer.failed_start(error)
        with trio.move_on_after(REOPEN_PAUSE):
            await stop_serving.wait()
    return None


async def _close_store(store: _Closable) -> None:
    """Close an incarnation's store; what that meets is logged, not raised."""
    try:
        with trio.CancelScope(shield=True):
            await store.aclose()
    except Exception as error:
        logger.warning("the store did not close cleanly: %s", error)


def _incarnation(store: object) -> str:
    """How the log names a new incarnation: its epoch, in a fleet."""
    epoch = getattr(store, "epoch", None)
    return f"epoch {epoch}" if epoch else "recovered"


def _problems_of(error: BaseException) -> list[BaseException]:
    """The leaves of an exception group, or the error itself."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _problems_of(inner)]
    return [error]


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

    Returns:
        The process's exit status: 0 after a clean shutdown; 1 when a second signal
        cut the children's grace short; 3 once the runner restarted more often than
        ``restart_limit`` allows (B5).

    Raises:
        ConfigError: The configuration cannot work.
        StartupError: The store is held by another process or out of reach (raised as
            it is), or the address is taken (raised as it is for a fleet's runner, which
            binds first; else in the exception group of the runner's nursery).
    """
    host, port = config.check()
    out = stdout or sys.stdout
    config.state.mkdir(parents=True, exist_ok=True)
    os.chmod(config.state, 0o700)
    operator_token = read_or_make_token(config.operator_token_path)
    roster = _roster(config, operator_token)
    try:
        found = capacity_of(config.max_children, config.reserve_memory)
    except ValueError as error:
        raise ConfigError(str(error)) from None

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
    drains: list[Drain] = []  # its drain, once it runs: SIGTERM begins it, if so configured

    async def watch_signals(signals: AsyncIterator[int]) -> None:
        nonlocal exit_status
        async for number in signals:
            name = signal.Signals(number).name
            if number == signal.SIGHUP:
                if roster.path is None:
                    logger.info("SIGHUP: no tenants file to read again (no --tenants)")
                else:
                    roster.reload()
                continue
            if (
                number == signal.SIGTERM
                and config.drain_on_sigterm is not None
                and drains
                and not drains[0].draining
            ):
                logger.info("%s: draining (--drain-on-sigterm)", name)
                try:
                    await drains[0].begin(config.drain_on_sigterm)
                except StateStorageError as error:
                    logger.warning("the fleet's row does not say it drains: %s", error)
                continue
            if not stop_serving.is_set():
                logger.info("%s: stopping; every child is stopped and reaped", name)
                stop_serving.set()
                continue
            logger.warning("%s again: children are killed now, without their grace", name)
            exit_status = 1
            for supervisor in hurry:
                supervisor.skip_grace()

    advertise = config.advertise
    listener: socket.socket | None = None
    if config.fleet:
        listener = _bind(config, host, port)
        bound = repr_socket_addr(listener.family, listener.getsockname())
        advertise = advertise or _url(f"tcp://{bound}", config.tls)
        # Hypercorn listens on it once the supervisor recovered (it is ours until then).
        server.bind = [f"fd://{listener.fileno()}"]

    # Opened before anything else starts, so that a store in use is one plain error.
    try:
        store = await _open_store(config, advertise)
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    metrics = Metrics()
    healer = Healer(config.restarts, metrics)
    sign_ins = SignIns()  # the dashboard's sign-ins by code outlive an incarnation
    front = Front(
        restarting_app(
            healer,
            operator_token=operator_token,
            tenants=roster,
            metrics=metrics,
            sign_ins=sign_ins,
        )
    )
    lost_before = 0  # writes failovers lost, found by the stores of earlier incarnations
    metrics.watch_lost_writes(lambda: lost_before + getattr(store, "lost_writes", 0))
    served = trio.Event()  # Hypercorn stopped serving (it serves every incarnation)
    started: list[str] = []  # the URL, once Hypercorn listens

    async def serve_front(*, task_status: trio.TaskStatus[Sequence[str]]) -> None:
        try:
            await serve(
                asgi(front),  # type: ignore[arg-type]  # Hypercorn's own ASGI type
                server,
                shutdown_trigger=stop_serving.wait,
                task_status=task_status,
            )
        finally:
            served.set()

    async def incarnation(
        store: _RunnerStore, execution: SubprocessExecution, serving: trio.Nursery
    ) -> SupervisorError | None:
        """Run one incarnation of the supervisor over ``store`` until the runner stops
        (None) or the supervisor is poisoned (its error); every child is reaped and the
        store closed when it returns (B5)."""
        nonlocal advertise
        fleet = Fleet(
            config.runner_id,
            store=store if isinstance(store, FleetStore) else None,
            advertise=advertise,
        )
        poisoned: SupervisorError | None = None
        try:
            async with open_supervisor(
                timed(store, metrics.save_seconds),
                execution,
                lease=config.lease,
                grace=config.grace,
                confirmation_timeout=config.confirmation_timeout,
            ) as supervisor:
                hurry[:] = [supervisor]
                if exit_status:  # signalled twice while recovery ran
                    supervisor.skip_grace()
                drain = Drain(supervisor, fleet.store)
                drains[:] = [drain]
                app = create_app(
                    supervisor,
                    tenants=roster,
                    admission=runner_admission(supervisor, execution, found, config.limits),
                    operator_token=operator_token,
                    logs=execution,
                    metrics=metrics,
                    fleet=fleet,
                    drain=drain,
                    sign_ins=sign_ins,
                )
                # Counts until the supervisor shuts down (its events end then).
                serving.start_soon(metrics.follow, supervisor)
                front.serve(app)
                healer.serving()
                if not started:
                    try:
                        binds: Sequence[str] = await serving.start(serve_front)
                    except* OSError as failed:
                        # Hypercorn binds in nurseries of its own: the OSError comes
                        # wrapped in their groups.
                        raise _cannot_listen(config, failed) from None
                    if listener is not None:
                        listener.detach()  # Hypercorn's own socket holds it, and closes it
                    url = _url(binds[0], config.tls)
                    fleet.advertise = fleet.advertise or url
                    advertise = advertise or url
                    started.append(url)
                    print(f"listening on {url}", file=out, flush=True)
                    logger.info("listening on %s; state in %s", url, config.state)
                    task_status.started(url)
                else:
                    logger.info("serving again, as a new incarnation (%s)", _incarnation(store))
                poisoned = await _until_stopped_or_poisoned(supervisor, drain, stop_serving)
                if poisoned is None:
                    # The server stops accepting and finishes what it serves first; the
                    # event streams would never end by themselves.
                    app.state.end_event_streams()
                    await served.wait()
                else:
                    healer.withdrawn(poisoned)
                    front.withdraw(healer.why or "restarting")  # RunnerRestarting from now
        except Exception as error:
            if poisoned is None:
                raise
            # The shutdown of a poisoned supervisor reports its poison and what its stops
            # met (Z3, an ExceptionGroup); every child was reaped all the same. Anything
            # else (a cancellation) goes on out.
            logger.warning(
                "the poisoned incarnation shut down with: %s",
                "; ".join(str(problem) for problem in _problems_of(error)),
            )
        finally:
            await _close_store(store)
        return poisoned

    with (
        listener or contextlib.nullcontext(),
        trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals,
    ):
        async with trio.open_nursery() as watching:
            watching.start_soon(watch_signals, signals)
            async with _execution(config) as execution, trio.open_nursery() as serving:
                while True:
                    try:
                        poisoned = await incarnation(store, execution, serving)
                    except Exception as error:
                        if not started or stop_serving.is_set():
                            raise  # the first start's failure is the runner's (StartupError)
                        # A new incarnation that could not start (its recovery met the
                        # store out of reach, or a disk still full): tried again later.
                        healer.failed_start(error)
                    else:
                        if poisoned is None or stop_serving.is_set():
                            break
                        if not healer.poisoned(poisoned):
                            exit_status = GAVE_UP
                            stop_serving.set()
                            break
                    finally:
                        lost_before += getattr(store, "lost_writes", 0)
                    reopened = await _reopen(
                        config, advertise, healer, stop_serving, getattr(store, "memory", None)
                    )
                    if reopened is None:
                        break
                    store = reopened
                stop_serving.set()
            # Every incarnation stopped every session and reaped every child.
            watching.cancel_scope.cancel()
    return exit_status
