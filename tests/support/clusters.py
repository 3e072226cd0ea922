"""PostgreSQL clusters of the tests' own, and PgBouncer in front of them: for the fleet's
tests through restarts, outages and failovers, which the machine's own server
(127.0.0.1:5432, :mod:`.postgres`) must never go through.

Theory of operation. A cluster is a directory of its own (``ROOT/NAME``: ``data/``, its
``server.log``, its Unix socket) made with the server's own binaries (:func:`binaries`),
run as the machine's ``postgres`` user (initdb refuses root) on a free loopback port. Its
postmaster is started with ``pg_ctl``, which daemonizes it: it is not a child of the test
run but, as the run makes itself a child subreaper (conftest.py), it becomes one when
pg_ctl exits, so each stop reaps it. Whatever a test does, :func:`own_clusters` removes
every cluster and bouncer it made as it ends (``-m immediate``, then ``rm -rf``), and an
``atexit`` hook stops those a caller made by hand and forgot.

Settings are those of a small production server, not of a benchmark: ``fsync`` stays on
and ``synchronous_commit`` at its default, as a failover test is about what a commit
survives. A standby is a ``pg_basebackup -R`` of its primary, streaming from it under its
own name (``application_name``); a synchronous one is named in the primary's
``synchronous_standby_names``, so a commit is acknowledged only once the standby flushed
it (``on``: flushed, not yet replayed, so a read on the standby right after the commit
may still miss it; after a promotion it is there). A standby never inherits a
``synchronous_standby_names``: promoted, it commits alone. While a synchronous standby
is down, each commit on its primary waits for it (without bound: bound the test).

A crash (:meth:`Cluster.kill`) is a power cut: SIGKILL to the postmaster and to every
process of the cluster, so connections drop at once, as with a dead machine.

Lost writes, on purpose (an asynchronous standby that misses commits)::

    standby = clusters.standby(primary, "b", synchronous=False)
    standby.wait_caught_up()   # it has everything so far...
    standby.stop()             # ...and then nothing more
    ...commit on the primary: acknowledged, but only the primary has it
    primary.kill()
    standby.start()            # it cannot reach its primary: it stays a standby
    standby.promote()          # the new primary, without those commits

PgBouncer (:class:`Bouncer`) runs in the foreground as a child process of the test run,
as the ``postgres`` user, in session or transaction pool mode, and passes every database
name to one cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Literal

import psycopg
import pytest

from .processes import IN_SYSTEM_TMP, descendants, reap, running, survivors
from .waits import settled

StopMode = Literal["smart", "fast", "immediate"]
PoolMode = Literal["session", "transaction"]

BOUND: Final = 60.0  # seconds a server may take to start, stop or promote (a loaded machine)
_NAME: Final = re.compile(r"[a-z][a-z0-9_]{0,30}")  # a directory and an application_name
_SETTINGS: Final = """
# tests/support/clusters.py (appended: the last line of a setting wins)
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = '{home}'
max_connections = 100
shared_buffers = 32MB
wal_level = replica
max_wal_senders = 10
hot_standby = on
"""
_HBA: Final = """\
local all all trust
host all all 127.0.0.1/32 trust
local replication all trust
host replication all 127.0.0.1/32 trust
"""
# What a driver may send as it connects that PgBouncer would refuse ("unsupported startup
# parameter"): it drops them instead, so a setting sent this way is lost, not applied.
IGNORED_STARTUP: Final = (
    "extra_float_digits,options,application_name,statement_timeout,lock_timeout,"
    "search_path,tcp_user_timeout"
)
_INI: Final = """\
[databases]
* = host=127.0.0.1 port={target}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir = {home}
auth_type = trust
auth_file = {home}/users.txt
pool_mode = {pool_mode}
max_client_conn = 200
default_pool_size = 50
ignore_startup_parameters = {ignored}
"""

# What may still run: the atexit hook stops it (a caller that forgot to remove it).
_LIVE: set[Cluster | Bouncer] = set()


def _missing(what: str) -> None:
    """Skip, or fail where the tests must run (``CI`` set): :func:`.postgres.server_dsn`'s
    convention."""
    if os.environ.get("CI"):
        pytest.fail(what, pytrace=False)
    pytest.skip(what)


@functools.cache  # (a skip is an exception: not cached)
def binaries() -> Path:
    """The directory of the PostgreSQL server's binaries (initdb, pg_ctl, postgres ...):
    ``pg_config --bindir``, else the newest ``/usr/lib/postgresql/*/bin``. Skips when
    there is none (fails where ``CI`` is set), and likewise when we are root and the
    machine has no ``postgres`` user to run them as."""
    found: list[Path] = []
    if pg_config := shutil.which("pg_config"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            answer = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
            found.append(Path(answer.stdout.strip()))

    def version(path: Path) -> list[int]:
        return [int(number) for number in re.findall(r"\d+", path.parent.name)]

    found += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    usable = [path for path in found if (path / "initdb").is_file() and (path / "pg_ctl").is_file()]
    if not usable:
        _missing(
            "clusters of the tests' own need PostgreSQL's server binaries (initdb, pg_ctl): "
            "neither pg_config --bindir nor /usr/lib/postgresql/*/bin has them"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            _missing("clusters of the tests' own run as the 'postgres' user, which is missing")
    return usable[0]


def pgbouncer() -> Path:
    """PgBouncer's executable (Debian's is /usr/sbin/pgbouncer, off some users' PATH);
    skips or fails as :func:`binaries` does when it is missing."""
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/bin")
    if found is None:
        _missing("the tests through PgBouncer need it (Debian: apt-get install pgbouncer)")
    return Path(str(found))


def _as_postgres() -> dict[str, Any]:
    """Popen's arguments that run a command as ``postgres`` (as root; otherwise as we are).
    Not a preexec function: a test may call us from a worker thread of a Trio run."""
    if os.geteuid() != 0:
        return {}
    return {"user": "postgres", "group": "postgres", "extra_groups": []}


def _run(*command: str | Path, cwd: Path, bound: float = BOUND) -> None:
    """Run a command as ``postgres``; raises with its output if it fails."""
    done = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=bound,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "HOME": str(cwd)},
        check=False,
        **_as_postgres(),
    )
    if done.returncode != 0:
        what = " ".join(str(part) for part in command)
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout}{done.stderr}")


def free_port() -> int:
    """A loopback port nothing listens on now (the kernel's pick; another process may
    take it before we do, a small race a test run accepts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _home(root: Path, name: str) -> Path:
    """``root/name``, a new directory owned by ``postgres`` (``root`` must let it in)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r}: a name is lowercase letters, digits and _, 31 at most")
    home = root / name
    home.mkdir(mode=0o755)
    if os.geteuid() == 0:
        shutil.chown(home, "postgres", "postgres")
    return home


def _accepts(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=3) as connection:
            connection.execute("SELECT 1")
    except psycopg.Error:
        return False
    return True


def _tail(path: Path, last: int) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-last:])
    return f"(no {path.name})"


class Cluster:
    """A PostgreSQL cluster of the tests' own (see the module's docs).

    Attributes:
        name: Its name: its directory's, and a standby's ``application_name``.
        home: Its directory: ``data/``, ``server.log``, its Unix socket.
        data_dir: Its data directory.
        port: The loopback port it listens on.
        primary: The cluster a standby streams from (None: made a primary).
        synchronous: Whether that primary waits for this standby at each commit.
    """

    def __init__(
        self, home: Path, port: int, *, primary: Cluster | None = None, synchronous: bool = False
    ) -> None:
        self.name = home.name
        self.home = home
        self.data_dir = home / "data"
        self.port = port
        self.primary = primary
        self.synchronous = synchronous

    def __repr__(self) -> str:
        return f"<Cluster {self.name} on port {self.port}>"

    @classmethod
    def create(cls, root: Path, *, name: str) -> Cluster:
        """A new primary, in ``root/name``, not started yet (:meth:`start`)."""
        cluster = cls(_home(root, name), free_port())
        options = ["-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C"]
        _run(binaries() / "initdb", *options, "-D", cluster.data_dir, cwd=cluster.home)
        cluster._configure()
        (cluster.data_dir / "pg_hba.conf").write_text(_HBA)
        return cluster

    @classmethod
    def standby_of(cls, primary: Cluster, root: Path, *, name: str, synchronous: bool) -> Cluster:
        """A new standby of ``primary`` (which runs), in ``root/name``, started; once
        ``synchronous``, each commit on ``primary`` waits for it (see the module's docs)."""
        standby = cls(_home(root, name), free_port(), primary=primary, synchronous=synchronous)
        options = ["-R", "-X", "stream", "--no-sync", "-c", "fast", "-d", primary.dsn()]
        _run(binaries() / "pg_basebackup", *options, "-D", standby.data_dir, cwd=standby.home)
        standby._configure()
        # -R wrote a primary_conninfo without a name, which synchronous_standby_names
        # could not match: a later line of the same file wins. And a backup of a primary
        # that has synchronous standbys copies its synchronous_standby_names: promoted,
        # this one would wait for standbys of its own.
        with (standby.data_dir / "postgresql.auto.conf").open("a") as auto:
            auto.write(
                f"primary_conninfo = 'host=127.0.0.1 port={primary.port} user=postgres "
                f"application_name={name}'\nsynchronous_standby_names = ''\n"
            )
        standby.start()
        if synchronous:
            with psycopg.connect(primary.dsn(), autocommit=True) as connection:
                connection.execute(f"ALTER SYSTEM SET synchronous_standby_names = '\"{name}\"'")
                connection.execute("ALTER SYSTEM SET synchronous_commit = on")
                connection.execute("SELECT pg_reload_conf()")
        return standby

    def _configure(self) -> None:
        # A standby's port and socket replace those its backup copied from the primary.
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(_SETTINGS.format(port=self.port, home=self.home))

    def _ctl(self, action: str, *options: str | Path) -> None:
        # -w: each action returns once done (started, stopped, promoted), within BOUND.
        command = ["-w", "-t", str(int(BOUND)), "-D", self.data_dir, *options]
        _run(binaries() / "pg_ctl", action, *command, cwd=self.home, bound=BOUND + 10)

    def dsn(self, dbname: str = "postgres") -> str:
        """A libpq URL of one of its databases, as the superuser ``postgres``."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def postmaster(self) -> int | None:
        """The pid of its postmaster, if one runs."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        return pid if running(pid) else None

    def is_running(self) -> bool:
        """Whether its postmaster runs (it may not accept connections yet, or any more)."""
        return self.postmaster() is not None

    def accepting(self) -> bool:
        """Whether a connection to it works now."""
        return _accepts(self.dsn())

    def start(self) -> None:
        """Start it (a standby streams again, or retries its primary); returns once it
        accepts connections (read-only ones, for a standby)."""
        _LIVE.add(self)
        self._ctl("start", "-l", self.home / "server.log")
        if not settled(self.accepting, BOUND):
            raise RuntimeError(f"{self} started but refuses connections:\n{self.log()}")

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop it (``pg_ctl stop -m mode``); returns once its postmaster exited, reaped.
        The data stays for :meth:`start`."""
        pid = self.postmaster()
        if pid is not None:
            self._ctl("stop", "-m", mode)
            survivors([pid], BOUND)  # its pid file went as it ended: the exit is near
            reap([pid])
        _LIVE.discard(self)

    def restart(self) -> None:
        """A fast restart: :meth:`stop` (``fast``), then :meth:`start`."""
        self.stop("fast")
        self.start()

    def kill(self) -> None:
        """A crash: SIGKILL to the postmaster and to each of its processes, so every
        connection drops at once (the backends would outlive a postmaster killed alone,
        for a while). The data stays; :meth:`start` recovers it, as after a power cut."""
        pid = self.postmaster()
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)  # so it forks nothing between our look and our kill
            pids = {pid, *descendants(pid)}
            for each in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(each, signal.SIGKILL)
            left = survivors(pids, BOUND)
            reap(pids)  # the orphans are ours (conftest.py makes us a subreaper) or init's
            if left:
                raise RuntimeError(f"{self}: {sorted(left)} outlived SIGKILL")
        _LIVE.discard(self)

    def promote(self) -> None:
        """Promote a standby; returns once it is out of recovery and accepts writes."""
        self._ctl("promote")

        def promoted() -> bool:
            with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=3) as connection:
                return connection.execute("SELECT NOT pg_is_in_recovery()").fetchone() == (True,)

        if not settled(promoted, BOUND):
            raise RuntimeError(f"{self} was promoted but is still in recovery")

    def wait_caught_up(self) -> None:
        """For a standby: wait until its primary shows it streaming (as ``sync``, for a
        synchronous one) and it replayed all its primary wrote before this call."""
        assert self.primary is not None, f"{self} is no standby"
        want = "sync" if self.synchronous else "async"
        with psycopg.connect(self.primary.dsn(), autocommit=True) as connection:
            (target,) = connection.execute("SELECT pg_current_wal_lsn()").fetchone() or (None,)

            def caught_up() -> bool:
                row = connection.execute(
                    "SELECT state = 'streaming' AND sync_state = %s AND replay_lsn >= %s"
                    " FROM pg_stat_replication WHERE application_name = %s",
                    (want, target, self.name),
                ).fetchone()
                return row == (True,)

            if not settled(caught_up, BOUND, every=0.05):
                raise RuntimeError(f"{self} did not catch up with {self.primary} ({want})")

    def log(self, last: int = 40) -> str:
        """The last lines of its server log."""
        return _tail(self.home / "server.log", last)

    def remove(self, mode: StopMode = "immediate") -> None:
        """Stop it if it runs (``mode``; its data goes anyway) and remove its directory.
        A postmaster that will not stop is killed: its directory never goes under it."""
        try:
            if self.is_running():
                try:
                    self.stop(mode)
                except Exception:
                    self.kill()
                    raise
            self._release_memory()
        finally:
            _LIVE.discard(self)
            if not self.is_running():
                shutil.rmtree(self.home, ignore_errors=True)

    def _release_memory(self) -> None:
        # A postmaster killed with SIGKILL leaves its System V segment (a few bytes),
        # which its next start would take back: none comes, so it goes here, unattached.
        with contextlib.suppress(OSError, ValueError, IndexError):
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
            key, shmid = (int(n) for n in lines[6].split())
            for row in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]:
                fields = row.split()  # key, shmid, perms, size, cpid, lpid, nattch ...
                if (int(fields[0]), int(fields[1]), int(fields[6])) == (key, shmid, 0):
                    subprocess.run(["ipcrm", "-m", str(shmid)], check=False, capture_output=True)


@dataclasses.dataclass(eq=False, repr=False)
class Bouncer:
    """PgBouncer in front of a cluster, a child process of the test run (not a daemon).

    Attributes:
        cluster: The cluster it passes every database name to.
        pool_mode: ``session`` or ``transaction``.
        port: The loopback port it listens on.
        home: Its directory: its ini, its auth file, its log (its stderr).
        process: The pgbouncer process.
    """

    cluster: Cluster
    pool_mode: PoolMode
    home: Path
    port: int
    process: subprocess.Popen[bytes]

    def __repr__(self) -> str:
        return f"<Bouncer {self.pool_mode} on port {self.port} for {self.cluster}>"

    @classmethod
    def start(
        cls,
        root: Path,
        cluster: Cluster,
        *,
        pool_mode: PoolMode,
        settings: Mapping[str, object] | None = None,
    ) -> Bouncer:
        """PgBouncer for ``cluster`` (which runs) in ``root/bouncer_PORT``, in
        ``pool_mode``, with more ``settings`` of its ``[pgbouncer]`` section, if given;
        returns once a connection through it works.

        Two of its defaults shape an outage: while the cluster is down, a client's query
        waits ``query_wait_timeout`` (120 s) for a server, then fails (08P01) and its
        connection is closed, though a new client's login may succeed meanwhile (PgBouncer
        answers it from what it knows of the server); and once a server login failed, new
        clients are refused (08P01) for ``server_login_retry`` (15 s), even after the
        server is back.
        """
        executable = pgbouncer()
        port = free_port()
        home = _home(root, f"bouncer_{port}")
        (home / "users.txt").write_text('"postgres" ""\n')
        ini = _INI.format(
            target=cluster.port,
            port=port,
            home=home,
            pool_mode=pool_mode,
            ignored=IGNORED_STARTUP,
        )
        ini += "".join(f"{name} = {value}\n" for name, value in (settings or {}).items())
        (home / "pgbouncer.ini").write_text(ini)
        # In the foreground (no -d): our child, which we end and reap. Its own session,
        # so a ^C at the terminal reaches only the test run, which then ends it.
        with (home / "pgbouncer.log").open("ab") as log:
            process = subprocess.Popen(
                [executable, home / "pgbouncer.ini"],
                cwd=home,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                **_as_postgres(),
            )
        bouncer = cls(cluster, pool_mode, home, port, process)
        _LIVE.add(bouncer)
        settled(lambda: process.poll() is not None or bouncer.accepting(), BOUND)
        if process.poll() is not None or not bouncer.accepting():
            bouncer.stop()
            raise RuntimeError(f"{bouncer} did not start:\n{bouncer.log()}")
        return bouncer

    def dsn(self, dbname: str = "postgres") -> str:
        """A libpq URL of one of the cluster's databases, through the bouncer."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def accepting(self) -> bool:
        """Whether a connection through it works now (the cluster must accept, too; while
        the cluster is down this takes its ``query_wait_timeout`` to say no)."""
        return _accepts(self.dsn())

    def stop(self, bound: float = 10.0) -> None:
        """End it: SIGTERM, then SIGKILL after ``bound`` seconds; reaped either way."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(bound)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        _LIVE.discard(self)

    def remove(self) -> None:
        """:meth:`stop`, and remove its directory."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.home, ignore_errors=True)

    def log(self, last: int = 40) -> str:
        """The last lines of its log."""
        return _tail(self.home / "pgbouncer.log", last)


class Clusters:
    """What :func:`own_clusters` gives: clusters and bouncers in one root directory, all
    removed when it ends.

    Attributes:
        root: The directory (``postgres`` may enter it).
        made: What it made and did not remove yet, in order.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: list[Cluster | Bouncer] = []

    def primary(self, name: str) -> Cluster:
        """A new primary, started (:meth:`Cluster.create`)."""
        cluster = Cluster.create(self.root, name=name)
        self.made.append(cluster)
        cluster.start()
        return cluster

    def standby(self, primary: Cluster, name: str, *, synchronous: bool) -> Cluster:
        """A new standby of ``primary``, started (:meth:`Cluster.standby_of`)."""
        standby = Cluster.standby_of(primary, self.root, name=name, synchronous=synchronous)
        self.made.append(standby)
        return standby

    def bouncer(
        self, cluster: Cluster, *, pool_mode: PoolMode, settings: Mapping[str, object] | None = None
    ) -> Bouncer:
        """PgBouncer in front of ``cluster``, started (:meth:`Bouncer.start`)."""
        bouncer = Bouncer.start(self.root, cluster, pool_mode=pool_mode, settings=settings)
        self.made.append(bouncer)
        return bouncer

    def remove(self) -> None:
        """Stop and remove all it made, the last made first, then the root; the first
        error is raised once each had its turn."""
        errors: list[Exception] = []
        # A cluster whose making failed half-way is not in ``made``, but may run (a
        # standby started before its primary's settings failed): its pid file says so.
        strays = [Cluster(pid.parents[1], 0) for pid in self.root.glob("*/data/postmaster.pid")]
        known = {made.home for made in self.made}
        for made in [*reversed(self.made), *(c for c in strays if c.home not in known)]:
            try:
                made.remove()
            except Exception as error:
                errors.append(error)
        self.made.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        if errors:
            raise errors[0]


@contextlib.contextmanager
def own_clusters() -> Iterator[Clusters]:
    """Clusters and bouncers of the caller's own, all removed on the way out, even after
    a failure; in a directory of /tmp named as this run's (IN_SYSTEM_TMP), as the run's
    own temporary directory is not for the ``postgres`` user to enter."""
    binaries()  # skips before anything is made
    root = Path(tempfile.mkdtemp(prefix=f"{IN_SYSTEM_TMP}clusters-", dir="/tmp"))
    root.chmod(0o755)
    made = Clusters(root)
    try:
        yield made
    finally:
        made.remove()


def stop_orphans() -> list[Path]:
    """Stop and remove what test runs that are gone left in /tmp: their clusters and
    bouncers (a process that ends with ``os._exit``, as a mutation run's tests do when a
    mutant hangs one, runs no teardown and no atexit hook). A run is named by the pid in
    its directory's name (:data:`~.processes.IN_SYSTEM_TMP`); a live run's are left
    alone. Returns the directories removed."""
    removed = []
    for root in sorted(Path("/tmp").glob("trio-supervisor-test-*-clusters-*")):
        owner = re.fullmatch(r"trio-supervisor-test-(\d+)-clusters-.*", root.name)
        if owner is None or Path(f"/proc/{owner[1]}").exists():
            continue
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                command = (proc / "cmdline").read_bytes().split(b"\0")
                if (
                    proc.name.isdigit()
                    and b"pgbouncer" in command[0]
                    and any(part.startswith(bytes(root) + b"/") for part in command[1:])
                ):
                    os.kill(int(proc.name), signal.SIGKILL)
        Clusters(root).remove()  # the clusters it finds running by their pid files
        removed.append(root)
    return removed


@atexit.register
def _stop_left() -> None:
    """Stop what still runs as the interpreter exits: a postmaster is no child of ours,
    to end with us, and a bouncer would be left to init."""
    for left in list(_LIVE):
        with contextlib.suppress(Exception):
            if isinstance(left, Bouncer):
                left.stop(bound=5.0)
            else:
                left.stop("immediate")
