"""Children as OS processes that cannot escape (Linux).

Each child is ``python -I`` running ``_bootstrap.py`` (compiled once into the state
directory), started in a session and process group of its own, talking to us over a
socket pair (see ``_bootstrap.py`` for the protocol and its two processes: the tracked
process T we record, which is PID 1 of the child's namespace where there is one, and the
plugin P). What a remote host may run is decided here, by the runner's owner:

* **entry points** ``package.module:function``, found only on the ``entry_paths`` the
  owner configured: a sync function, or an async one run under ``trio.run``, called with
  a context (``identity``, ``instance``, ``generation``, ``config``);
* **named commands**: a table ``name -> argv``, so a host picks a name, never an argv.
  No shell is ever involved.

Guarantees, and how:

* The child's identity (pid, process group, start time, boot id) is known and returned
  by ``spawn`` before any of the caller's code runs: the bootstrap resolves, reports and
  applies the limits, then waits for ``start``.
* Containment: nothing the plugin starts outlives its child, whatever it does
  (``setsid``, ``setpgid``, a double fork, a cleared environment). Each child gets a
  PID namespace where the kernel allows it, else the subreaper sweep (``_containment``
  says which, chosen once and logged at start-up; ``containment=`` forces one).
* ``interrupt`` is SIGTERM to T's process group, passed on to the plugin's group, where
  an entry point gets it as a KeyboardInterrupt; ``kill`` ends the whole tree.
* ``wait`` returns once T exited (Trio watches it through a pidfd) *and* all of its
  tree is gone: what the plugin leaves when it ends is killed then, and a plugin's
  descendant that ignores SIGTERM keeps the child "running" until the kill.
* Dead-man switch: if the supervisor dies, the socket reaches EOF and the bootstrap
  ends its tree; if it hangs, it does so one second after the lease it was last given.
* ``recover`` never signals a process that is not the recorded child: a different boot
  id, or a different start time for the pid, means the child is gone. A live one is
  killed with its whole tree, as a kill does.
* Output: stdout and stderr go to one log file per session under the state directory,
  kept for as long as the session's record is (``_logs``: the execution is
  ``abc.Retaining``). Without ``Limits.output_bytes`` the child writes into that file
  itself. With it, we copy the output and keep the **head**: the first bytes, then a
  line saying the rest was dropped.

Races ``recover`` guards against: the recorded pid was reused by a stranger (its start
time differs, so it is left alone), and the pid exits and is reused between our check
and our signal (a pidfd pins the process while its start time is checked again).

Where the parts live: this module is the face (construction, spawn, recover, logs);
``_options`` checks the options it is made with; ``_bringup`` makes the host ready as
it starts (cgroups, isolation, containment, fork server); ``_protocol`` types the
messages to and from the bootstrap; ``_containment`` chooses the mechanism;
``_groups`` reads ``/proc`` and signals, reaps and waits for process groups; ``_trees``
finds, freezes and kills process trees; ``_unit`` is a child and the control-socket
protocol; ``_standby`` starts interpreters, and the one kept ahead of the next load;
``_forkserver`` forks them from a prepared one; ``_output`` copies capped output;
``_logs`` keeps the logs; ``_claims`` claims what a runner holds of the machine (uids,
cgroups) in its name, and takes back what runners that are gone held.

Known limits: a child that is not isolated (``isolation="none"``) sees the host's
``/proc`` from its namespace, so its ``os.getpid()`` (the namespace's) names another
process there (an isolated child mounts its namespace's own ``/proc``).
The sweep holds everything while T lives; if T itself is killed by
someone else (the OOM killer, an operator) before it could sweep, what it left is found
by its session and (with ``subreaper=True``, as they then come to us) by an inherited
marker pipe, so a process that both left the session and closed its inherited
descriptors escapes; and a process that stays in uninterruptible sleep is killed
without being frozen first. In a user namespace (an unprivileged runner) the plugin
holds capabilities over that namespace only, none over the host.

Hard limits for the whole tree (``_cgroups``): where a cgroup can be written, each child
asking for a tree limit (``memory_bytes``, ``processes``, ``cpu_percent``) has one, which
T is in before it forks the plugin: made and joined ahead where it can be (the standby
joins one while it waits, a cold start's interpreter is moved into one as Python boots),
so that the load writes only its limits. A child without a tree limit is contained as before, and
pays nothing for cgroups (but for a standby prepared once loads asked for them, whose
cgroup then holds its tree with no limit). ``memory_bytes`` is then the tree's
memory plus swap (no ``RLIMIT_AS``), ``processes`` its ``pids.max`` and
``cpu_percent`` its CPU quota; the kill adds ``cgroup.kill``, and ``wait`` returns only
once the cgroup is empty, which is then kept for a later child (reset, a few at most) or
removed (``_cgroups.Pool``). An OOM kill is reported in the exit status.
Where none can be written, ``memory_bytes`` is ``RLIMIT_AS`` (address space, not
resident memory) per process, and a load asking for ``processes`` or ``cpu_percent`` is
refused.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import subprocess
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

import attrs
import trio

from .._background import open_background_nursery, when_idle
from ..abc import Unit
from ..errors import ExecutionError, PackageError
from ..model import ChildIdentity, ExitStatus, Handle, Limits, Load, Termination, thaw
from ..realtime import outside_the_run
from ._bootstrap import LEASE_SLACK
from ._bringup import Host
from ._cgroups import ROOT as CGROUP_ROOT
from ._cgroups import Hierarchies, Pool, TreeCgroup
from ._containment import Containment, Mechanism
from ._forkserver import Broken
from ._groups import boot_id, group_gone, read_stat, reap_group
from ._isolation import DEFAULT_CHILD_USERS, Grant, Isolated, Isolation, Network
from ._logs import Logs
from ._options import Options
from ._output import copy_output
from ._protocol import SpawnCommand
from ._standby import Interpreter, Standby, start_interpreter
from ._trees import Tree, kill_recorded, process_table
from ._unit import ProcessUnit, failure

__all__ = ["DEFAULT_CHILD_USERS", "SubprocessExecution"]

logger = logging.getLogger(__name__)

ADAPTER = "subprocess"
# package.module:function, the function's parts public names (see _bootstrap.entry_point).
ENTRY_POINT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z]\w*(\.[A-Za-z]\w*)*$")
# Interpreters that may boot at once: one per core the runner may use.
BOOTING = max(len(os.sched_getaffinity(0)), 1)


class SubprocessExecution:
    """An execution whose units are OS processes; use it as ``async with``.

    Args:
        state_directory: Where the per-session log files go (``logs/``).
        entry_paths: Directories searched for ``package.module:function`` specifiers.
            Empty: no entry point may be loaded.
        commands: Named commands, ``name -> argv``.
        environment: Extra environment variables for every child, on top of a minimal
            allowlist (``PATH``, ``LANG``, ...) and ``TRIO_SUPERVISOR_IDENTITY``,
            ``TRIO_SUPERVISOR_INSTANCE``, ``TRIO_SUPERVISOR_GENERATION``.
        python: The interpreter that runs the bootstrap.
        subreaper: Make this process a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``)
            while the execution runs, so a grandchild whose parent died is re-parented
            to us, not to PID 1 (which in a container may never reap it), and is reaped
            when its group is waited for. Orphans of *other* children of this process
            then come to it as well; turn this off if something else reaps them. A PID
            namespace needs it (each child's tracked process is forked into its
            namespace and re-parented to us): without it, "auto" means the sweep.
        standby: Keep one bootstrap interpreter started ahead of the next load, so a
            load does not wait for Python to start (most of a minimal child's load
            time). The standby runs none of the caller's code: it waits for its spawn
            message, then takes the session's environment and log file like a child
            started for it. It costs one idle interpreter while the execution runs, and
            serves loads without ``Limits.output_bytes`` (capped output is copied
            through a pipe made at spawn). Where children run as uids of their own,
            the standby's child is granted its uid and private directory while it
            waits (so it holds one uid of ``isolation_users``), and its plugin's
            namespaces are made then (see ``_isolation``). If the supervisor dies,
            the standby sees its socket close and exits. With ``fork_server``, the
            standby is forked by it too, so a load waits for neither Python's start
            nor a fork.
        containment: How a child's whole process tree is held (see ``_containment``):
            "namespace" (a PID namespace per child; entering the execution fails where
            the kernel allows none), "sweep" (the child subreaper sweep), or "auto"
            (a namespace where allowed, else the sweep).
        fork_server: Start one bootstrap interpreter with the execution and fork each
            load's child from it (see ``_forkserver``), so that no load waits for Python
            to start; loads that find it gone start their own interpreter while it is
            started again. The children are the same as started ones: their own
            session, process group, namespace, limits, environment and log. They share
            what the server's interpreter fixed at start-up (its hash seed). Needs
            ``subreaper=True``.
        preload: Modules the fork server imports before it forks anyone, so a child
            finds them imported (``typing``, ``trio``, a framework the plugins share):
            found on the interpreter's own path, never on ``entry_paths`` (the server
            runs no plugin code). Entering the execution fails if one cannot be
            imported.
        cgroup_root: Where the cgroup hierarchies are mounted; None uses none (see
            ``_cgroups``). Entering the execution finds which it may write, makes its
            own parent in each, removes the empty cgroups a previous run on the same
            state directory left, and logs what the children's trees are limited by.
        isolation: "users": each child runs as a user of its own (see ``_isolation``: a
            uid from ``isolation_users``, no new privileges, a private working
            directory and ``TMPDIR`` under ``STATE/children``, and a view of the file
            system in which the state directory is not visible); the runner must be
            root, and the entry paths readable by others. "namespace": each child makes
            a user and mount namespace in which the state directory is hidden but for
            its private directory, and drops every capability, but keeps the runner's
            uid. "auto" (the default): "users" as root, else "namespace"; entering the
            execution fails where neither can be had. "none": children run as the
            runner's user, in its state directory, as before.
        isolation_users: The uids children get, one per running child, returned as its
            session stops. Nothing else may use them; runners on one machine need
            ranges of their own.
        network: "host" (the default), or "none": each child gets a network namespace
            with loopback alone (it reaches nothing, the runner's port included).
            Needs isolation.

    Raises:
        ValueError: ``containment`` is none of those, a ``preload`` entry is not a
            module name, ``fork_server`` or ``containment="namespace"`` is asked for
            without ``subreaper``, ``isolation``, ``isolation_users`` or ``network`` is
            not valid, or ``network="none"`` is asked for without isolation.
    """

    # A child's own dead-man switch fires LEASE_SLACK past its lease, and its kill takes
    # a moment more: a fleet waits this much past a lease before a takeover (F7).
    switch_slack: ClassVar[float] = LEASE_SLACK + 1.0

    def __init__(
        self,
        state_directory: str | os.PathLike[str],
        *,
        entry_paths: Sequence[str | os.PathLike[str]] = (),
        commands: Mapping[str, Sequence[str]] | None = None,
        environment: Mapping[str, str] | None = None,
        python: str = sys.executable,
        subreaper: bool = True,
        standby: bool = False,
        containment: Containment = "auto",
        fork_server: bool = False,
        preload: Sequence[str] = (),
        cgroup_root: str | os.PathLike[str] | None = CGROUP_ROOT,
        isolation: Isolation = "auto",
        isolation_users: range = DEFAULT_CHILD_USERS,
        network: Network = "host",
    ) -> None:
        self.options = Options(
            state_directory=state_directory,
            entry_paths=entry_paths,
            commands=commands,
            environment=environment,
            python=python,
            subreaper=subreaper,
            standby=standby,
            containment=containment,
            fork_server=fork_server,
            preload=preload,
            cgroup_root=cgroup_root,
            isolation=isolation,
            isolation_users=isolation_users,
            network=network,
        )
        # Until entered: nothing of the host's (see _bringup).
        self._host = Host()
        self._boot_id = boot_id()
        self._logs = Logs(self.state_directory)
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._standby = Standby(self._start_standby)
        # The tree limits of the last load that resolved under them: from then on each
        # standby waits in a cgroup of its own, in the hierarchies they need.
        self._expected: Limits | None = None
        # The emptied cgroups kept for the next children (none until entered).
        self._pool = Pool(self._host.cgroups)
        # One process creation at a time: see _start.
        self._creating = trio.CapacityLimiter(1)
        # Interpreters booting at once (started, not yet resolved): see spawn.
        self._booting = trio.CapacityLimiter(BOOTING)

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("this SubprocessExecution is already running")
        (self.state_directory / "logs").mkdir(parents=True, exist_ok=True)
        stack = contextlib.AsyncExitStack()
        self._nursery = await stack.enter_async_context(open_background_nursery())
        self._stack = stack
        self._nursery.start_soon(self._logs.remove_evicted, name="evicted records' logs")
        self._standby = Standby(self._start_standby)  # afresh: this run may start them
        try:
            await self._host.bring_up(self.options, stack)
        except BaseException as error:
            await self.__aexit__(type(error), error, error.__traceback__)
            raise
        self._pool = Pool(self.cgroups)
        if self.standby:
            # Once the containment is known: the standby's T is made for it.
            self._nursery.start_soon(self._standby.run, name="standby interpreter")
        logger.info(
            "subprocess children are contained by %s",
            self.mechanism.describe(),
            extra={"containment": self.mechanism.kind},
        )
        logger.info(
            "subprocess children's trees are limited by %s",
            self.cgroups.describe(),
            extra={"cgroups": "v2" if self.cgroups.v2 else "v1" if self.cgroups.used else "none"},
        )
        logger.info(
            "subprocess children are isolated by %s",
            self.isolated.describe(),
            extra={"isolation": self.isolated.kind},
        )
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack = self._stack
        nursery = self._nursery
        assert stack is not None
        assert nursery is not None
        self._stack = None
        self._nursery = None
        self._standby.closing()
        # The output copiers end with their children; any still running are cut off.
        nursery.cancel_scope.cancel()
        try:
            # The cgroups kept for children to come go first, in a worker thread (a
            # removal may wait on the kernel); one given back from now on is removed.
            with trio.CancelScope(shield=True), outside_the_run():
                await trio.to_thread.run_sync(self._pool.drain)
            return await stack.__aexit__(*exc_info)
        finally:
            # Every background task has ended, a standby being started included.
            self._logs.flush()
            await self._standby.close()
            # Its cgroup went with it: the parents are empty only now.
            self._host.let_go()

    # -- the options, as given (read-only), and the host as bring-up left it -----------

    @property
    def state_directory(self) -> Path:
        """Where the logs, and the children's private directories, are (absolute)."""
        return self.options.state_directory

    @property
    def entry_paths(self) -> tuple[str, ...]:
        """Where entry points are found (resolved)."""
        return self.options.entry_paths

    @property
    def commands(self) -> dict[str, tuple[str, ...]]:
        """The named commands, ``name -> argv``."""
        return self.options.commands

    @property
    def environment(self) -> dict[str, str]:
        """The extra environment of every child."""
        return self.options.environment

    @property
    def python(self) -> str:
        """The interpreter that runs the bootstrap."""
        return self.options.python

    @property
    def subreaper(self) -> bool:
        """Whether this process is a child subreaper while the execution runs."""
        return self.options.subreaper

    @property
    def standby(self) -> bool:
        """Whether one bootstrap interpreter is kept started ahead of the next load."""
        return self.options.standby

    @property
    def containment(self) -> Containment:
        """The containment asked for (:attr:`mechanism` is the one chosen)."""
        return self.options.containment

    @property
    def fork_server(self) -> bool:
        """Whether children are forked by a fork server."""
        return self.options.fork_server

    @property
    def preload(self) -> tuple[str, ...]:
        """What the fork server imports before it forks anyone."""
        return self.options.preload

    @property
    def cgroup_root(self) -> Path | None:
        """Where the cgroup hierarchies are mounted (None: no cgroups)."""
        return self.options.cgroup_root

    @property
    def isolation(self) -> Isolation:
        """The isolation asked for (:attr:`isolated` is the one prepared)."""
        return self.options.isolation

    @property
    def isolation_users(self) -> range:
        """The uids isolated children get."""
        return self.options.isolation_users

    @property
    def network(self) -> Network:
        """The children's network: "host", or "none"."""
        return self.options.network

    @property
    def cgroups(self) -> Hierarchies:
        """The cgroup hierarchies that hold children's trees (none until entered)."""
        return self._host.cgroups

    @property
    def isolated(self) -> Isolated:
        """How children are isolated (not at all until entered)."""
        return self._host.isolated

    @property
    def mechanism(self) -> Mechanism:
        """How a child's tree is held (the sweep until entered)."""
        return self._host.mechanism

    @mechanism.setter
    def mechanism(self, mechanism: Mechanism) -> None:
        """Another containment, for the children started from now on."""
        self._host.mechanism = mechanism

    @property
    def fork_server_pid(self) -> int | None:
        """The fork server's pid while it runs, else None."""
        server = self._host.server
        return server.pid if server is not None else None

    @property
    def fork_server_forks(self) -> int:
        """How many children the fork server has made since the execution started."""
        server = self._host.server
        return server.forks if server is not None else 0

    # -- logs -------------------------------------------------------------------------

    def log_path(self, handle: Handle) -> Path:
        """The log file of a session's child."""
        return self._logs.path(handle)

    def logs(self, handle: Handle, *, tail: int | None = None) -> str:
        """What a session's child wrote (stdout and stderr), or its last ``tail`` bytes;
        "" once its record was evicted (its log goes with it: ``_logs``)."""
        return self._logs.read(handle, tail=tail)

    def evicted(self, handles: Sequence[Handle]) -> None:
        """Retention evicted these sessions' records: their logs go (in the background)."""
        self._logs.evicted(handles)
        if self._nursery is None:  # not running: nothing removes them later
            self._logs.flush()

    async def retained(self, handles: Collection[Handle]) -> None:
        """Recovery is over: remove every log but those of these sessions (an earlier
        run's whose records are gone).

        Raises:
            ExecutionError: The logs' directory cannot be read.
        """
        try:
            with outside_the_run():
                removed = await trio.to_thread.run_sync(self._logs.keep_only, list(handles))
        except OSError as error:
            message = f"cannot look at the logs in {self._logs.directory}: {error}"
            raise ExecutionError(message) from error
        if removed:
            logger.info("removed %d logs of sessions whose records are not retained", removed)

    # -- spawn and recover ------------------------------------------------------------

    def _kind(self, load: Load) -> Literal["command", "python"]:
        """What ``load`` names: a named command, or an entry point on the entry paths.

        Raises:
            PackageError: Neither, or an entry point where no entry path is configured.
        """
        specifier = load.specifier
        if specifier in self.commands:
            return "command"
        if ENTRY_POINT.match(specifier):
            if not self.entry_paths:
                raise PackageError(
                    f"no entry paths are configured, so {specifier!r} cannot be loaded"
                )
            return "python"
        commands = ", ".join(sorted(self.commands)) or "none"
        hint = (
            f" (did you mean {specifier}:main, a function main in the module {specifier}?)"
            if ":" not in specifier and specifier.replace(".", "").replace("_", "").isalnum()
            else ""
        )
        raise PackageError(
            f"{specifier!r} is neither a configured command (configured: {commands}) "
            "nor a package.module:function entry point whose function is a public name"
            f"{hint}"
        )

    def _spec(self, handle: Handle, load: Load, limits: Limits) -> SpawnCommand:
        """The spawn message for ``load`` (see ``_bootstrap.py``)."""
        limits = self.cgroups.rlimits(limits)  # what a cgroup holds is not setrlimit's
        spec: SpawnCommand = {
            "command": "spawn",
            "kind": self._kind(load),
            "specifier": load.specifier,
            "limits": {
                "memory_bytes": limits.memory_bytes,
                "cpu_seconds": limits.cpu_seconds,
                "open_files": limits.open_files,
                "file_size_bytes": limits.file_size_bytes,
            },
            "context": {
                "identity": handle.key.identity,
                "instance": handle.key.instance,
                "generation": handle.generation,
                "config": thaw(load.config),
            },
        }
        if spec["kind"] == "command":
            spec["argv"] = list(self.commands[load.specifier])
        else:
            spec["paths"] = list(self.entry_paths)
        return spec

    def _environment(self, handle: Handle) -> dict[str, str]:
        environment = self.options.base_environment()
        environment["TRIO_SUPERVISOR_IDENTITY"] = handle.key.identity
        environment["TRIO_SUPERVISOR_INSTANCE"] = handle.key.instance
        environment["TRIO_SUPERVISOR_GENERATION"] = str(handle.generation)
        return environment

    async def _start(
        self, environment: Mapping[str, str], output: int, *, tree: Limits | None = None
    ) -> Interpreter:
        """An interpreter, forked by the fork server or started; with ``tree`` (tree
        limits), one started is moved into a cgroup of its own while it boots."""
        server = self._host.server
        if server is not None and self._nursery is not None:
            if server.running:
                try:
                    return await server.fork(environment, output)
                except Broken as error:
                    logger.warning("%s; this load starts its own interpreter", error)
            server.restart_soon(self._nursery)
        return await self._start_cold(environment, output, tree=tree)

    async def _start_cold(
        self, environment: Mapping[str, str], output: int, *, tree: Limits | None = None
    ) -> Interpreter:
        # Created one at a time (``creating``): trio starts each process in a thread,
        # and a burst of loads would run that many fork+exec threads at once, which
        # starve the event loop of the GIL for hundreds of milliseconds. Serialized, a
        # burst costs the same total time and the loop goes on serving other sessions
        # between creations.
        return await start_interpreter(
            self.python,
            self._host.bootstrap,
            environment=environment,
            output=output,
            directory=self.state_directory,
            containment=self.mechanism.spec,
            strict=self.mechanism.required,
            creating=self._creating,
            keep=self._host.keep,
            # The limits are written as it resolves, not before it boots: one that it
            # cannot boot under fails the load as the request's fault (PackageError).
            join=None if tree is None else functools.partial(self._prepared, limits=tree),
        )

    def _prepared(self, pid: int, limits: Limits) -> TreeCgroup | None:
        """(In a worker thread.) A cgroup made for ``pid`` with it inside (see
        :meth:`Hierarchies.prepared`; one the pool kept where it has one), or None where
        that fails: T then joins one as it resolves, as it would unprepared."""
        try:
            kept = self._pool.take(self.cgroups.controllers(limits))
            if kept is not None:
                kept.prepare(pid)
                return kept
            return self.cgroups.prepared(pid, limits)
        except OSError as error:
            logger.debug("no cgroup prepared for the interpreter %d: %s", pid, error)
            return None

    async def _start_standby(self) -> Interpreter:
        # Output goes nowhere until the spawn message names the session's log.
        if self._host.server is None or not self._host.server.running:
            interpreter = await self._start_cold(
                self.options.base_environment(), subprocess.DEVNULL
            )
        else:
            nowhere = os.open(os.devnull, os.O_WRONLY)
            try:
                interpreter = await self._start(self.options.base_environment(), nowhere)
            finally:
                os.close(nowhere)
        if self.python == sys.executable:  # our bootstrap, as root (see _join_ahead)
            if self._expected is not None:
                self._join_ahead(interpreter, self._expected)
            if self.isolated.ahead:
                self._isolate_ahead(interpreter)
        return interpreter

    def _isolate_ahead(self, interpreter: Interpreter) -> None:
        """Grant the standby's child its uid and private directory now, and have the
        standby fork its plugin while it waits, in namespaces of its own: the fork, the
        copy of the view and its mounts (most of what isolating a child costs) are then
        not the load's (see ``_bootstrap.Ahead``). Where no uid is free now, the load
        claims one (looking at the claims again), or says why it cannot.

        Never waits: the standby's start keeps what it started even as the execution
        exits (``Standby.fill``). A standby discarded gives its grant back.
        """
        if self._nursery is None:
            return  # the execution exits, and discards it
        try:
            grant = self.isolated.claim_now()
        except OSError as error:
            logger.debug("no uid granted ahead to the standby: %s", error)
            return
        if grant is None:
            return
        try:
            interpreter.isolate_ahead(grant, self.isolated.spec(grant), self.isolated.release)
        except OSError as error:  # it is gone: discarded, it gives the grant back
            logger.debug("no namespaces prepared for the standby: %s", error)

    def _join_ahead(self, interpreter: Interpreter, expected: Limits) -> None:
        """Have the standby make its cgroup, in the hierarchies the last load's limits
        needed, and join it while it waits: the mkdirs and the move (which waits for the
        kernel, see _cgroups) are its own, not the runner's; the load that takes it
        writes its limits. Where that fails (or the load took it first), the load makes
        what is missing before its spawn message, and the standby joins as it reads
        that, as it would unprepared."""
        pid = interpreter.process.pid
        started = interpreter.start_time()
        if started is None:
            return  # it is gone: the load that takes it finds so
        controllers = self.cgroups.controllers(expected)
        cgroup = self._pool.take(controllers)
        if cgroup is None:
            cgroup = self.cgroups.child(f"{pid}-{started}", Limits())
            cgroup.controllers = controllers
        try:
            interpreter.join_ahead(cgroup)
        except OSError as error:  # it is gone, and made nothing
            logger.debug("no cgroup prepared for the standby %d: %s", pid, error)
            if cgroup.reused:
                self._pool.put_back(cgroup)  # as it was: nothing joined it

    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> Unit:
        """Start the bootstrap for ``load``; return once it resolved the code.

        Raises:
            PackageError: The specifier is not allowed, or its code cannot be found.
            ExecutionError: The process could not be started or prepared.
        """
        nursery = self._nursery
        if nursery is None:
            await trio.lowlevel.checkpoint()
            raise ExecutionError(
                "SubprocessExecution is not running: enter it with `async with` first"
            )
        # A burst of loads boots that many interpreters at once, and on a small machine
        # they take every core from the event loop. Booted a few at a time, the burst
        # takes the same total time and the loop keeps serving everyone else.
        # The bootstrap's time is not the run's: a virtual clock waits for it (realtime.py).
        with outside_the_run():
            try:
                # Free: taking it is no schedule point (the spawn's wait for its child
                # is one).
                self._booting.acquire_nowait()
            except trio.WouldBlock:
                await self._booting.acquire()
            try:
                return await self._spawn(nursery, handle, load, limits)
            finally:
                self._booting.release()

    async def _spawn(
        self, nursery: trio.Nursery, handle: Handle, load: Load, limits: Limits
    ) -> ProcessUnit:
        self.cgroups.refuse(limits)
        tree = limits if self.cgroups.wanted(limits) else None
        spec = self._spec(handle, load, limits)
        log = self.log_path(handle)
        # Capped output is copied through a pipe made here, so only an uncapped load
        # can take the interpreter started ahead.
        standby = self._standby.take(nursery) if limits.output_bytes is None else None
        if standby is not None:
            # Started ahead: it learns where its output goes and its environment now.
            warm: SpawnCommand = {
                **spec,
                "log": str(log),
                "environment": self._environment(handle),
            }
            unit = await self._prepare(nursery, load, standby, warm, None, log, limits)
            if unit is not None:
                return unit
            # It died before it answered: nothing of the caller's ran; start afresh.
        if limits.output_bytes is None:
            # No cap: the child writes into its log file itself, and nothing is copied.
            reader, writer = -1, os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        else:
            reader, writer = os.pipe()
        try:
            interpreter = await self._start(self._environment(handle), writer, tree=tree)
        except BaseException as error:
            if reader >= 0:
                os.close(reader)
            if isinstance(error, OSError):
                raise ExecutionError(
                    f"cannot start the child for {load.specifier!r}: {error}"
                ) from error
            raise
        finally:
            os.close(writer)
        copied = reader if reader >= 0 else None
        unit = await self._prepare(nursery, load, interpreter, spec, copied, log, limits)
        if unit is None:
            # It died before it reported: under limits, it could not run under them
            # (too little memory, say), which is the request's fault.
            raise failure({"event": "eof"}, load.specifier, _rlimits_text(limits))
        return unit

    async def _prepare(
        self,
        nursery: trio.Nursery,
        load: Load,
        interpreter: Interpreter,
        spec: SpawnCommand,
        reader: int | None,
        log: Path,
        limits: Limits,
    ) -> ProcessUnit | None:
        """Send the spawn message; the resolved unit, or None if the child died first.

        ``reader`` is the pipe of capped output (copied into ``log``), or None when
        the child writes its log itself.
        """
        process = interpreter.process
        started = interpreter.start_time()
        cgroup = interpreter.cgroup
        joined = False
        if cgroup is not None:
            # Prepared (the standby's, or the one its maker was moved into as it booted):
            # the unit writes only the limits as it resolves (none for a load that asks
            # for none: the cgroup then holds the tree without limiting it), and makes
            # the hierarchies it needs that it lacks. A standby
            # joined it itself (and joins what was added); a started T is in it unless
            # its maker forked it before the move.
            wider = cgroup.cover(limits)
            cgroup.limits = limits
            joined = (
                not wider
                and cgroup.prepared_for is not None
                and (cgroup.prepared_for == process.pid or cgroup.holds(process.pid))
            )
        elif self.cgroups.wanted(limits):
            # Made by the unit as it resolves, unless one kept is given to it.
            cgroup = self._pool.take(self.cgroups.controllers(limits))
            if cgroup is None:
                cgroup = self.cgroups.child(f"{process.pid}-{started}", limits)
            cgroup.limits = limits
        if cgroup is not None:
            if joined:
                spec = {**spec, "joined": cgroup.procs}  # for T to remove it, orphaned
            elif self.python == sys.executable:
                # T joins before it forks P (unless it joined these while it waited).
                spec = {**spec, "cgroups": cgroup.procs}
            else:
                # Another interpreter may run as another user (a wrapper that drops
                # privileges): we move T in ourselves as the unit resolves.
                cgroup.member = process.pid
        grant = None
        if self.isolated.used:
            # Claimed ahead for a standby, which made its plugin's namespaces for it;
            # the same spec tells it to use them.
            grant = interpreter.take_grant()
            if grant is None:
                try:
                    grant = await self.isolated.claim()
                except BaseException:
                    await interpreter.discard()
                    raise
            spec = {**spec, "isolation": self.isolated.spec(grant)}
        identity = ChildIdentity(
            adapter=ADAPTER,
            ref=f"{process.pid}:{started}",
            pid=process.pid,
            pgid=process.pid,
            start_time=started,
            boot_id=self._boot_id,
            cgroup=None if cgroup is None else cgroup.path,
            uid=None if grant is None else grant.uid,
        )
        if cgroup is not None and cgroup.reused:
            self._pool.given(cgroup, identity.ref)  # see recover
        unit = ProcessUnit(
            process,
            identity,
            interpreter.control,
            load,
            marker=interpreter.marker,
            containment=self.mechanism.kind,
            limits=_rlimits_text(limits),
            cgroup=cgroup,
            gone=functools.partial(self._release, grant),
        )
        if reader is None:
            unit.output_done.set()
        else:
            nursery.start_soon(
                copy_output,
                reader,
                log,
                limits.output_bytes,
                unit.output_done,
                name=f"output of {load.specifier}",
            )
        if not await unit.resolve(spec):
            return None
        if self.cgroups.wanted(limits):
            self._expected = limits  # the hierarchies the next standby makes
        return unit

    def _release(self, grant: Grant | None, cgroup: TreeCgroup | None) -> None:
        """A child is gone: its empty cgroup is kept for another child or removed, its
        private directory goes and its uid is free again, in the background (see
        :meth:`_let_go`)."""
        if self._nursery is None:
            return  # the execution has exited: its next start removes what is left
        if cgroup is not None or grant is not None:
            self._nursery.start_soon(self._let_go, cgroup, grant, name="a gone child's leftovers")

    async def _let_go(self, cgroup: TreeCgroup | None, grant: Grant | None) -> None:
        """Take back what a gone child left once the loop is idle: after its termination
        is reported, and never between the steps of a request someone waits for. What
        waits on the kernel runs in a worker thread (see TreeCgroup.remove_blocking): the
        cgroup is reset for the pool, or removed (Pool.keep). An execution that exits
        waits for that (a bounded wait); what a crash leaves, its next start removes."""
        with trio.CancelScope(shield=True):  # given back even if cancelled
            await when_idle()
            try:
                if grant is not None:
                    # First: what the files of its private directory hold of memory is
                    # charged to the cgroup until they go (Pool.keep looks at that).
                    await self.isolated.release(grant)
            finally:
                if cgroup is not None:
                    await self._keep(cgroup)

    async def _keep(self, cgroup: TreeCgroup) -> None:
        with outside_the_run():  # the kernel's time, not the run's (realtime.py)
            try:
                await trio.to_thread.run_sync(self._pool.keep, cgroup)
            except OSError as error:
                logger.warning("cannot remove the cgroup %s: %s", cgroup.path, error)

    async def recover(self, child: ChildIdentity) -> Termination:
        """Make sure a child left by an earlier run is gone; never touch anyone else.

        A different boot id, or a pid whose start time differs from the record, means the
        child is gone and nothing is sent. A live child is killed through a pidfd, with
        its whole tree (its namespace, or every process below it). A child that is gone
        but left processes in its group or session has those killed too: only its
        descendants can hold its process group or session id.

        Where the child had a cgroup, whatever is still in it is killed then, and it is
        removed; unless this execution emptied it of that child and keeps it, or gave it to
        another since (a runner that heals itself recovers its own records: see
        ``_cgroups``, Pool.held_from).

        Raises:
            ExecutionError: ``child`` was not made by this execution.
        """
        if child.adapter != ADAPTER or child.pid is None or child.pgid is None:
            raise ExecutionError(f"{child} was not made by the subprocess execution")
        termination = await self._recover_tree(child, child.pid, child.pgid)
        if child.uid is not None and child.boot_id == self._boot_id:
            await self.isolated.recovered(child.uid)
        if child.cgroup is None or child.boot_id != self._boot_id or not self.cgroups.used:
            return termination  # after a reboot, no cgroup of that run is left
        try:
            cgroup = self.cgroups.recorded(child.cgroup)
        except ValueError as error:
            logger.warning("recovery leaves a cgroup alone: %s", error)
            return termination
        if self._pool.held_from(child.cgroup, child.ref):
            logger.info(
                "recovery leaves the cgroup %s alone: its child's stop emptied it, and it "
                "is kept for another child, or holds one",
                child.cgroup,
            )
            return termination
        # The tree is killed by now: what is still in the cgroup escaped every other hold.
        left = await cgroup.emptied()
        await cgroup.remove()
        if not left:
            return termination
        status = termination.exit
        killed = attrs.evolve(status, descendants_killed=status.descendants_killed + left)
        return Termination(kind="killed", exit=killed)

    async def _recover_tree(self, child: ChildIdentity, pid: int, pgid: int) -> Termination:
        gone = Termination(kind="exited", exit=ExitStatus(code=None, signal=None))
        if child.boot_id != self._boot_id:
            await trio.lowlevel.checkpoint()
            return gone
        stat = read_stat(pid)
        if stat is not None and stat.running:
            if stat.start_time == child.start_time:
                status = await kill_recorded(pid, pgid, child.start_time)
                if status is None:  # it exited, or its pid went to a stranger, meanwhile
                    return Termination(kind="exited", exit=ExitStatus())
                _log_orphans(pid, pgid, leader=True, descendants=status.descendants_killed)
                return Termination(kind="killed", exit=status)
            # The pid was reused, so nothing holds its number as a group or session id.
            await trio.lowlevel.checkpoint()
            return gone
        left = {
            member: found
            for member, found in process_table().items()
            if found.running and pgid in (found.pgid, found.session)
        }
        if left:
            # The child is dead, its group or session is not: only its descendants can
            # hold those ids. Frozen and killed with everything below them.
            tree = Tree()
            for member, found in left.items():
                tree.pin(member, found.start_time)
            tree.freeze(list(left))
            tree.kill()
            await tree.gone()
            await group_gone(pgid)
            _log_orphans(pid, pgid, leader=False, descendants=len(left))
            return Termination(kind="killed", exit=ExitStatus(descendants_killed=len(left)))
        reap_group(pgid)
        await trio.lowlevel.checkpoint()
        return gone


def _log_orphans(pid: int, pgid: int, *, leader: bool, descendants: int) -> None:
    """Say what recovery killed of a child an earlier run left; no key is known here."""
    logger.warning(
        "recovery found the child %d of an earlier run %s, and killed %d processes of its group %d",
        pid,
        "alive" if leader else "gone",
        descendants + 1 if leader else descendants,
        pgid,
        extra={"pid": pid, "pgid": pgid, "descendants_killed": descendants},
    )


def _rlimits_text(limits: Limits) -> str:
    """The rlimits a child runs under, as ``name=value, ...`` (empty: none)."""
    return ", ".join(
        f"{name}={value}"
        for name, value in attrs.asdict(limits).items()
        if value is not None and name != "output_bytes"
    )
