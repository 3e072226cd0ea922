"""``trio-supervisor serve``: a supervisor, its store, its execution and an HTTP server.

Theory of operation
-------------------
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
import functools
import ipaddress
import logging
import os
import secrets
import signal
import socket
import sys
import urllib.parse
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal, Protocol, TextIO

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.utils import repr_socket_addr

from .. import _defaults as defaults
from .. import _fields as fields
from .._core.lifetime import open_supervisor
from .._core.supervisor import Supervisor
from .._extras import needs_extra
from ..abc import FleetStore, Store
from ..errors import StateStorageError
from ..executions.subprocess import SubprocessExecution
from ..stores.sqlite import SqliteStore
from .app import create_app
from .capacity import CHILDREN_PER_CORE, DEFAULT_RESERVE, capacity_of, runner_admission
from .drain import Drain
from .fleet import Fleet
from .metrics import Metrics, timed
from .tenants import Ceilings, Tenants, TenantsError, token_hash
from .tenants_file import Roster
from .wire import DRAIN_DEADLINE

__all__ = ["ConfigError", "RunnerConfig", "StartupError", "run_runner"]

logger = logging.getLogger(__name__)

DEFAULT_LISTEN: Final = "127.0.0.1:8470"
GRACEFUL_SECONDS: Final = 5.0  # how long the server lets requests in flight finish


class ConfigError(ValueError):
    """The runner's configuration cannot work; the message says why."""


class StartupError(Exception):
    """The runner cannot start where it was told to: its address is taken, or its store
    is held by another process. The message says why and what to do, in one sentence."""


class _Closable(Protocol):
    """A store the runner opens before anything starts and closes last."""

    async def open(self) -> None: ...

    async def aclose(self) -> None: ...


class _RunnerStore(Store, _Closable, Protocol): ...


def _fleet_store(config: RunnerConfig, advertise: str) -> _RunnerStore:
    """The fleet's ``PostgresStore`` (the ``postgres`` extra), not yet opened."""
    with needs_extra("postgres", "a runner with --store postgresql://...", "psycopg"):
        # Imported here: a runner of its own needs neither psycopg nor this module.
        from ..stores.postgres import PostgresStore

    assert config.store is not None
    store: _RunnerStore = PostgresStore(
        config.store,
        runner_id=config.runner_id,
        advertise=advertise,
        runner_lease=config.runner_lease,
    )
    return store


async def _open_store(config: RunnerConfig, advertise: str) -> _RunnerStore:
    """The runner's store, opened; a store another process holds, or a database out of
    reach, is a :class:`StartupError`."""
    if config.fleet:
        fleet = _fleet_store(config, advertise)
        try:
            await fleet.open()
        except StateStorageError as error:
            await fleet.aclose()
            raise StartupError(
                f"cannot open the fleet's store at {_without_password(config.store or '')}: "
                f"{error.detail}"
            ) from error
        return fleet
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


STORE_SCHEMES: Final = ("postgresql", "postgres")  # a --store URL's: the fleet's database
DEFAULT_RUNNER_LEASE: Final = defaults.RUNNER_LEASE
# A runner's row: renewed every third of it, so a second is a database round trip every
# third of a second at least; an hour is past any takeover anyone wants to wait for.
RUNNER_LEASE: Final = fields.Seconds(minimum=1.0, inclusive=True, maximum=3600.0)


UID_MAX: Final = 2**32 - 2  # uids are 32 bits, and (uid_t) -1 is "unchanged" to setuid()


def _refuse_child_users(name: str, value: object) -> None:
    if value is None:
        return  # the execution's own uids
    if not isinstance(value, range) or value.step != 1:
        raise TypeError(f"{name} must be a range of uids (step 1) or None, not {value!r}")
    first, last = value.start, value.stop - 1
    given = f"{first}-{last}"
    if first < 0 or last < 0:
        raise ValueError(f"{name} must be two uids FIRST-LAST, neither negative, got {given}")
    if first == 0:
        raise ValueError(f"{name} must not start at 0, root's uid, got {given}")
    if first > last:
        raise ValueError(f"{name} must be FIRST-LAST with FIRST <= LAST, got {given}")
    if last > UID_MAX:
        raise ValueError(
            f"{name} must end at {UID_MAX} at most (uids are 32 bits, and {UID_MAX + 1} "
            f"means 'unchanged' to setuid), got {given}"
        )


# The uids isolated children run as: None for the execution's own range.
CHILD_USERS: Final = fields.Check(_refuse_child_users)
ISOLATIONS: Final = ("auto", "users", "namespace", "none")
NETWORKS: Final = ("host", "none")


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
        isolation: "users": each child runs as a uid of its own, with no new
            privileges, a private working directory and ``TMPDIR``, in a view of the file
            system without the state directory (the runner must be root); "namespace":
            each child hides the state directory in user and mount namespaces of its
            own and drops every capability, but keeps the runner's uid; "auto": "users"
            as root, else "namespace"; "none": children run as the runner's user.
        child_users: The uids isolated children run as, one per running child; None
            for the execution's own (``DEFAULT_CHILD_USERS``).
        child_network: "host": children share the runner's network; "none": each
            isolated child has a network namespace with loopback alone.
        log_format: How the runner's log lines look on stderr (``text`` or ``json``);
            the CLI sets logging up, :func:`run_runner` leaves it to its caller.
        store: A ``postgresql://`` (or ``postgres://``) URL: the fleet's database; None:
            SQLite in ``state/runner.db``, a runner of its own.
        runner_id: This runner's id in its fleet, stable across its restarts (the host
            name by default); also how a runner of its own names itself to operators.
        advertise: Where hosts and other runners reach this runner (a fleet only); ""
            for the ``listening on`` URL.
        runner_lease: Seconds this runner's row in the fleet's database stays valid
            without a renewal (a fleet only); renewed every third of it.
        tenants: The tenants file (``tenants.py``); None: the hosts' token is tenant
            ``default``.
        limits: The runner's ceilings (``[limits]`` in TOML), over the ones every child
            gets out of the box (:func:`out_of_the_box`).
        max_children: Children at once; None: ``CHILDREN_PER_CORE`` per core.
        reserve_memory: Bytes of the machine's memory the children's memory ceilings
            may not take.
        drain_on_sigterm: Seconds: SIGTERM drains the runner with this deadline
            (``drain.py``) instead of stopping it; None: SIGTERM stops it.
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
        default=defaults.LEASE,
        validator=fields.LEASE,
        metadata=_flag(
            f"The default lease, in seconds ({fields.MIN_LEASE:g} at least).", metavar="SECONDS"
        ),
    )
    grace: float = attrs.field(
        default=defaults.GRACE,
        validator=fields.GRACE,
        metadata=_flag(
            "Seconds a child has to exit after its interrupt, before it is killed.",
            metavar="SECONDS",
        ),
    )
    confirmation_timeout: float = attrs.field(
        default=defaults.CONFIRMATION,
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
    isolation: Literal["auto", "users", "namespace", "none"] = attrs.field(
        default="auto",
        validator=attrs.validators.in_(ISOLATIONS),
        metadata=_flag(
            "users: each child runs as a uid of its own (--child-users), with no new "
            "privileges, a private working directory, and the state directory out of "
            "sight; the runner must be root. namespace: the state directory out of sight "
            "and no capabilities, as the runner's uid. auto: users as root, else "
            "namespace. none: children run as the runner's user."
        ),
    )
    child_users: range | None = attrs.field(
        default=None,
        validator=CHILD_USERS,
        metadata=_flag(
            "The uids isolated children run as, one each while it runs; nothing else may "
            "use them [default: the execution's 1024 uids].",
            metavar="FIRST-LAST",
        ),
    )
    child_network: Literal["host", "none"] = attrs.field(
        default="host",
        validator=attrs.validators.in_(NETWORKS),
        metadata=_flag(
            "host: children share the runner's network; none: each isolated child has "
            "loopback alone."
        ),
    )
    log_format: Literal["text", "json"] = attrs.field(
        default="text",
        validator=attrs.validators.in_(("text", "json")),
        metadata=_flag("How stderr logging looks: text, or one JSON object per line."),
    )
    store: str | None = attrs.field(
        default=None,
        validator=fields.optional_text,
        metadata=_flag(
            "A postgresql:// URL: this runner joins the fleet on that database "
            "[default: STATE/runner.db, SQLite: a runner of its own].",
            metavar="URL",
        ),
    )
    runner_id: str = attrs.field(
        factory=socket.gethostname,
        validator=fields.text,
        metadata=_flag(
            "This runner's id in its fleet, stable across restarts [default: the host name].",
            metavar="ID",
        ),
    )
    advertise: str = attrs.field(
        default="",
        metadata=_flag(
            "Where hosts and other runners reach this runner (a fleet only) "
            "[default: the 'listening on' URL].",
            metavar="URL",
        ),
    )
    tenants: Path | None = attrs.field(
        default=None,
        metadata=_flag(
            "A TOML file of tenants: each one's token hash, key identities, quota, "
            "ceilings and fairness; reread on SIGHUP. Without it, the hosts' token is one "
            "tenant that may use every key.",
            path="file",
            exists=True,
        ),
    )
    limits: Ceilings | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.instance_of(Ceilings)),
    )  # TOML only: [limits] default = {...}, max = {...}; within the out-of-the-box ones
    max_children: int | None = attrs.field(
        default=None,
        validator=fields.optional(fields.at_least(1)),
        metadata=_flag(
            f"Children at once, at most [default: {CHILDREN_PER_CORE} per core].",
            metavar="N",
        ),
    )
    reserve_memory: int = attrs.field(
        default=DEFAULT_RESERVE,
        validator=fields.count,
        metadata=_flag(
            "Bytes of the machine's memory kept from the children: their memory ceilings "
            "sum to the rest at most.",
            metavar="BYTES",
        ),
    )
    runner_lease: float = attrs.field(
        default=DEFAULT_RUNNER_LEASE,
        validator=RUNNER_LEASE,
        metadata=_flag(
            f"Seconds this runner's row in the fleet's database stays valid unrenewed "
            f"({RUNNER_LEASE.bounds}; a fleet only); renewed every third of it.",
            metavar="SECONDS",
        ),
    )

    drain_on_sigterm: float | None = attrs.field(
        default=None,
        validator=fields.optional(DRAIN_DEADLINE),
        metadata=_flag(
            "Make SIGTERM a drain with this deadline, in seconds (as a Kubernetes preStop "
            "would): no new sessions, the ones held run on until they end or the deadline "
            "passes, then exit 0. A second SIGTERM stops at once.",
            metavar="SECONDS",
        ),
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

    @property
    def fleet(self) -> bool:
        """Whether this runner is a member of a fleet (its store is PostgreSQL)."""
        return self.store is not None

    def check(self) -> tuple[str, int]:
        """The host and port to bind, once the configuration is known to work.

        Raises:
            ConfigError: The listen address is malformed, TLS is half configured,
                plain HTTP would leave loopback without ``insecure_http``, the store is
                not a PostgreSQL URL, a fleet's setting is given without a fleet, or an
                isolated child's setting is given with ``isolation`` "none", the hosts'
                token file is given with a tenants file, or the store's URL holds a
                password.
        """
        host, port = parse_listen(self.listen)
        self._check_fleet(host)
        self._check_isolation()
        self._check_tenants()
        if (self.certfile is None) != (self.keyfile is None):
            raise ConfigError("--certfile and --keyfile go together")
        if not self.tls and not self.insecure_http and not _is_loopback(host):
            raise ConfigError(
                f"refusing plain HTTP on {host}, which is not a loopback address: the "
                "bearer tokens would cross the network in the clear. Give --certfile and "
                "--keyfile, or --insecure-http if something else encrypts the traffic"
            )
        return host, port

    def _check_tenants(self) -> None:
        if self.tenants is not None and self.token_file is not None:
            raise ConfigError(
                "--token-file is the hosts' single token, which --tenants replaces: give "
                "each host a tenant (trio-supervisor tenants add) and leave --token-file out"
            )
        if self.store is not None and urllib.parse.urlsplit(self.store).password is not None:
            # Not repeated: it may be seen by anyone who lists the machine's processes.
            raise ConfigError(
                "--store must not hold a password: a command line is visible to every "
                "process of the machine. Put it in libpq's password file (PGPASSFILE, "
                "~/.pgpass) or PGPASSWORD"
            )

    def _check_isolation(self) -> None:
        # Children that are not isolated run as the runner's user, on its network: a
        # setting for isolated ones would be silently ignored.
        if self.isolation == "namespace" and self.child_users is not None:
            raise ConfigError(
                "--child-users is for children with uids of their own: it needs "
                "--isolation users or auto (namespace keeps the runner's uid)"
            )
        if self.isolation != "none":
            return
        if self.child_users is not None:
            raise ConfigError("--child-users is for isolated children: it needs --isolation auto")
        if self.child_network != "host":
            raise ConfigError(
                f"--child-network {self.child_network} is for isolated children: it needs "
                "--isolation auto (with --isolation none, children use the runner's network)"
            )

    def _check_fleet(self, host: str) -> None:
        if self.store is not None:
            scheme = urllib.parse.urlsplit(self.store).scheme
            if scheme not in STORE_SCHEMES:
                # The URL itself is not repeated: it may hold a password.
                raise ConfigError(
                    "--store must be a postgresql://... or postgres://... URL (the fleet's "
                    "database); leave it out for SQLite in STATE/runner.db"
                    + (f"; got a {scheme}: URL" if scheme else "; got no URL scheme")
                )
        elif self.advertise:
            raise ConfigError("--advertise is for a fleet: it needs --store postgresql://...")
        elif self.runner_lease != DEFAULT_RUNNER_LEASE:
            raise ConfigError("--runner-lease is for a fleet: it needs --store postgresql://...")
        if self.fleet and not self.advertise and _is_wildcard(host):
            raise ConfigError(
                f"--listen {self.listen} is every address of this machine, which is no URL "
                "another runner or a host can reach: give --advertise URL"
            )
        if self.advertise:
            url = urllib.parse.urlsplit(self.advertise)
            if url.scheme not in ("http", "https") or not url.netloc:
                raise ConfigError(
                    f"--advertise must be an http:// or https:// URL, got {self.advertise!r}"
                )


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


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as a host and a port."""
    host, colon, port_text = listen.rpartition(":")
    if not colon or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"--listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port_text)


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


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
    with (
        listener or contextlib.nullcontext(),
        trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals,
    ):
        async with contextlib.AsyncExitStack() as closing, trio.open_nursery() as watching:
            closing.push_async_callback(store.aclose)
            watching.start_soon(watch_signals, signals)
            metrics = Metrics()
            fleet = Fleet(
                config.runner_id,
                store=store if isinstance(store, FleetStore) else None,
                advertise=advertise,
            )
            async with (
                _execution(config) as execution,
                open_supervisor(
                    timed(store, metrics.save_seconds),
                    execution,
                    lease=config.lease,
                    grace=config.grace,
                    confirmation_timeout=config.confirmation_timeout,
                ) as supervisor,
            ):
                hurry.append(supervisor)
                if exit_status:  # signalled twice while recovery ran
                    supervisor.skip_grace()
                drain = Drain(supervisor, fleet.store)
                drains.append(drain)
                app = create_app(
                    supervisor,
                    tenants=roster,
                    admission=runner_admission(supervisor, execution, found, config.limits),
                    operator_token=operator_token,
                    logs=execution,
                    metrics=metrics,
                    fleet=fleet,
                    drain=drain,
                    operator_token_file=config.operator_token_path.absolute(),
                )

                async def stop_once_drained() -> None:
                    await drain.wait()
                    stop_serving.set()

                watching.start_soon(stop_once_drained)
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
                    if listener is not None:
                        listener.detach()  # Hypercorn's own socket holds it, and closes it
                    url = _url(binds[0], config.tls)
                    fleet.advertise = fleet.advertise or url
                    print(f"listening on {url}", file=out, flush=True)
                    logger.info("listening on %s; state in %s", url, config.state)
                    task_status.started(url)
            # Leaving open_supervisor stopped every session and reaped every child.
            watching.cancel_scope.cancel()
    return exit_status
