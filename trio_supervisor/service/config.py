"""``serve``'s configuration: :class:`RunnerConfig`, whose fields are the runner's flags
and the keys of its TOML file (docs/service.md section A, "Flags"), and the checks that
refuse a configuration that cannot work (:class:`ConfigError`, a usage error).

Each field's ``metadata`` holds its flag (:func:`_flag`): the CLI makes ``serve``'s
options from the fields, so a field is a flag and a key at once, with one default and
one check. :meth:`RunnerConfig.check` then checks the fields together.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final, Literal

import attrs

from .. import _defaults as defaults
from .. import _fields as fields
from ..retention import Retention
from .tenants import Ceilings
from .wire import DRAIN_DEADLINE

__all__ = ["DEFAULT_LISTEN", "FLAG", "ConfigError", "RunnerConfig", "parse_listen"]


DEFAULT_LISTEN: Final = defaults.LISTEN


class ConfigError(ValueError):
    """The runner's configuration cannot work; the message says why."""


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
STORE_WAIT: Final = fields.Seconds(minimum=0.0, inclusive=True, maximum=3600.0)
COMMIT_WINDOW: Final = fields.Seconds(minimum=0.0, inclusive=True, maximum=1.0)
# How long a Stopped record is kept past --retain-per-key: any duration, 0 for none.
RETAIN_FOR: Final = fields.Seconds(minimum=0.0, inclusive=True)


def _refuse_retained(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        fields.count.check(name, value)  # refused in a count's words
    elif value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


# Stopped records kept, per key or in all: one at least (retention.Retention's bounds).
RETAINED: Final = fields.Check(_refuse_retained, minimum=1)
DEFAULT_RESTART_LIMIT: Final = f"{defaults.RESTART_LIMIT[0]}/{defaults.RESTART_LIMIT[1]:g}"


def parse_restart_limit(text: str) -> tuple[int, float]:
    """``N/SECONDS`` (at most N restarts within SECONDS) as a count and seconds."""
    count, slash, seconds = str(text).partition("/")
    try:
        limit = (int(count), float(seconds))
    except ValueError:
        limit = (-1, -1.0)
    if not slash or limit[0] < 0 or not 0 < limit[1] <= 86400.0:
        raise ConfigError(
            f"--restart-limit must be N/SECONDS (N >= 0 restarts within 0 < SECONDS <= "
            f"86400, as {DEFAULT_RESTART_LIMIT}), got {text!r}"
        )
    return limit


def _restart_limit(instance: object, attribute: object, value: str) -> None:
    parse_restart_limit(value)


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
            gets out of the box (``service.capacity.out_of_the_box``).
        max_children: Children at once; None: ``_defaults.CHILDREN_PER_CORE`` per core.
        reserve_memory: Bytes of the machine's memory the children's memory ceilings
            may not take.
        store_wait: Seconds a store call out of reach is tried again (docs/design.md, B1).
        store_commit_window: Seconds a save to a fleet's database may wait for others to
            share its commit (``PostgresStore(commit_window=...)``).
        retain_per_key, retain_total, retain_for: The store's retention
            (:class:`~trio_supervisor.retention.Retention`'s ``stopped_per_key``,
            ``stopped_total`` and ``stopped_for``, in seconds).
        restart_limit: ``N/SECONDS``: how often the runner makes a new incarnation of a
            poisoned supervisor before it exits for its service manager (B5).
        drain_on_sigterm: Seconds: SIGTERM drains the runner with this deadline
            (``drain.py``) instead of stopping it; None: SIGTERM stops it.
    """

    state: Path = attrs.field(
        default=Path(defaults.STATE),
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
            f"Children at once, at most [default: {defaults.CHILDREN_PER_CORE} per core].",
            metavar="N",
        ),
    )
    reserve_memory: int = attrs.field(
        default=defaults.RESERVE_MEMORY,
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

    store_wait: float = attrs.field(
        default=defaults.STORE_WAIT,
        validator=STORE_WAIT,
        metadata=_flag(
            "Seconds a call that meets its store out of reach (a broken or refused "
            "connection, a database restarting, a read-only standby) reconnects and tries "
            f"again before it answers 503 StoreUnavailable ({STORE_WAIT.bounds}).",
            metavar="SECONDS",
        ),
    )
    store_commit_window: float = attrs.field(
        default=0.0,
        validator=COMMIT_WINDOW,
        metadata=_flag(
            "Seconds a save to a fleet's database may wait for others to share its commit "
            f"({COMMIT_WINDOW.bounds}; 0: none): a runner of a large fleet trades that much "
            "of each save's latency for fewer commits on the database.",
            metavar="SECONDS",
        ),
    )
    retain_per_key: int = attrs.field(
        default=defaults.STOPPED_PER_KEY,
        validator=RETAINED,
        metadata=_flag(
            "Stopped records of a key the store keeps, newest first (1 at least); older "
            "ones go, with their children's logs, unless --retain-for keeps them.",
            metavar="N",
        ),
    )
    retain_total: int = attrs.field(
        default=defaults.STOPPED_TOTAL,
        validator=RETAINED,
        metadata=_flag(
            "Stopped records the store keeps in all (a fleet's database: the fleet's), the "
            "cap on storage: past it the oldest go, however young.",
            metavar="N",
        ),
    )
    retain_for: float = attrs.field(
        default=defaults.STOPPED_FOR,
        converter=fields.as_float,
        validator=RETAIN_FOR,
        metadata=_flag(
            "How long a Stopped record and its log are kept after it stopped, even past "
            "--retain-per-key, so that a lost runner's records can still be read: 90s, "
            "30m, 1h, 2d, or seconds (0: none).",
            metavar="DURATION",
        ),
    )
    restart_limit: str = attrs.field(
        default=DEFAULT_RESTART_LIMIT,
        validator=_restart_limit,
        metadata=_flag(
            "At most N restarts of a poisoned supervisor within SECONDS; past it the "
            "runner exits 3 for its service manager to restart or report.",
            metavar="N/SECONDS",
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
    def retention(self) -> Retention:
        """The store's retention, from ``retain_per_key``, ``retain_total``, ``retain_for``."""
        return Retention(
            stopped_per_key=self.retain_per_key,
            stopped_total=self.retain_total,
            stopped_for=self.retain_for,
        )

    @property
    def hosts_token_path(self) -> Path:
        """The file of the hosts' bearer token: ``token_file``, or ``token`` in the state
        directory."""
        return self.token_file or self.state / "token"

    @property
    def operator_token_path(self) -> Path:
        """The file of the operators' bearer token: ``operator_token_file``, or
        ``operator-token`` in the state directory."""
        return self.operator_token_file or self.state / "operator-token"

    @property
    def restarts(self) -> tuple[int, float]:
        """``restart_limit`` read: at most this many restarts within these seconds."""
        return parse_restart_limit(self.restart_limit)

    @property
    def tls(self) -> bool:
        """Whether the runner serves HTTPS (a ``certfile`` was given)."""
        return self.certfile is not None

    @property
    def fleet(self) -> bool:
        """Whether this runner is a member of a fleet (its store is PostgreSQL)."""
        return self.store is not None

    def check(self) -> tuple[str, int]:
        """The host and port to bind, once the configuration is known to work.

        Returns:
            The host and port of ``listen``.

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
        elif self.store_commit_window:
            raise ConfigError(
                "--store-commit-window is for a fleet: it needs --store postgresql://..."
            )
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
