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

Where the parts live: this module is the face (construction, the run, the logs), and
composes the rooms beside it, each a folder that imports only the rooms below it:

* ``child/``: the child side, ``_bootstrap.py`` (one standard-library script), and
  ``_protocol``, the messages between it and the runner, typed once for both;
* ``trees/``: a child's process tree: ``_groups`` reads ``/proc`` and signals, reaps
  and waits for process groups, ``_trees`` finds, freezes and kills trees,
  ``_containment`` chooses how a tree is held (a PID namespace, or the sweep);
* ``limits/``: what a child may use and reach of the machine: ``_cgroups`` (the
  machine's hierarchies and this execution's parent in each), ``_tree_cgroup`` (one
  child's cgroup), ``_pool`` (emptied ones kept), ``_isolation`` (one class per kind)
  and ``_view`` (which kind, prepared once), ``_claims`` (what a runner holds of the
  machine, uids and cgroups, in its name, and takes back of runners that are gone);
* ``starting/``: from options to a resolved child: ``_options`` checks them,
  ``_bringup`` makes the host ready as the execution starts, ``_standby`` and
  ``_forkserver`` start interpreters (``_interpreters`` says which), ``_children``
  spawns a child and takes back what it leaves, ``_unit`` is a child and the control
  socket's protocol, ``_output`` copies capped output;

and, beside the face, ``_recovery`` (the children of an earlier run, ended) and
``_logs`` (the children's logs).

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

Hard limits for the whole tree (``limits/``): where a cgroup can be written, each child
asking for a tree limit (``memory_bytes``, ``processes``, ``cpu_percent``) has one, which
T is in before it forks the plugin: made and joined ahead where it can be (the standby
joins one while it waits, a cold start's interpreter is moved into one as Python boots),
so that the load writes only its limits. A child without a tree limit is contained as before, and
pays nothing for cgroups (but for a standby prepared once loads asked for them, whose
cgroup then holds its tree with no limit). ``memory_bytes`` is then the tree's
memory plus swap (no ``RLIMIT_AS``), ``processes`` its ``pids.max`` and
``cpu_percent`` its CPU quota; the kill adds ``cgroup.kill``, and ``wait`` returns only
once the cgroup is empty, which is then kept for a later child (reset, a few at most) or
removed (``limits._pool``). An OOM kill is reported in the exit status.
Where none can be written, ``memory_bytes`` is ``RLIMIT_AS`` (address space, not
resident memory) per process, and a load asking for ``processes`` or ``cpu_percent`` is
refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

import trio

from .._background import open_background_nursery
from ..abc import Unit
from ..errors import ExecutionError
from ..model import ChildIdentity, Handle, Limits, Load, Termination
from ..realtime import outside_the_run
from ._logs import Logs
from ._recovery import recover
from .child._bootstrap import LEASE_SLACK
from .limits._cgroups import ROOT as CGROUP_ROOT
from .limits._cgroups import Hierarchies
from .limits._isolation import DEFAULT_CHILD_USERS, Isolated, Isolation, Network
from .limits._pool import Pool
from .starting._bringup import Host
from .starting._children import Children
from .starting._interpreters import Interpreters
from .starting._options import Options
from .starting._standby import Standby
from .trees._containment import Containment, Mechanism
from .trees._groups import boot_id

__all__ = ["DEFAULT_CHILD_USERS", "SubprocessExecution"]

logger = logging.getLogger(__name__)


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
        # The run's parts, made afresh as it is entered: the emptied cgroups kept for
        # the next children (none until entered), and the standby.
        self._pool = Pool(self._host.cgroups)
        self._interpreters = Interpreters(self.options, self._host, self._pool)
        self._standby = Standby(self._interpreters.for_standby)
        self._children = Children(
            self.options, self._host, self._interpreters, self._standby, self._boot_id
        )

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("this SubprocessExecution is already running")
        (self.state_directory / "logs").mkdir(parents=True, exist_ok=True)
        stack = contextlib.AsyncExitStack()
        self._nursery = await stack.enter_async_context(open_background_nursery())
        self._stack = stack
        self._nursery.start_soon(self._logs.remove_evicted, name="evicted records' logs")
        # Afresh: this run may start them.
        self._standby = Standby(self._interpreters.for_standby)
        try:
            await self._host.bring_up(self.options, stack)
        except BaseException as error:
            await self.__aexit__(type(error), error, error.__traceback__)
            raise
        self._pool = Pool(self.cgroups)
        self._children.enter(self._nursery, self._pool, self._standby)
        if self.options.standby:
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
        self._children.leave()
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

    # -- the host as bring-up left it (the options are ``options``, as checked) ---------

    @property
    def state_directory(self) -> Path:
        """Where the logs, and the children's private directories, are (absolute)."""
        return self.options.state_directory

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
        """The log file of a session's child.

        Args:
            handle: The session's handle.

        Returns:
            The path of its log, which may not exist (yet, or any more).
        """
        return self._logs.path(handle)

    def logs(self, handle: Handle, *, tail: int | None = None) -> str:
        """What a session's child wrote (stdout and stderr), or its last ``tail`` bytes;
        "" once its record was evicted (its log goes with it: ``_logs``).

        Args:
            handle: The session's handle.
            tail: How many bytes from the end to read; None reads it all.

        Returns:
            The log's text (undecodable bytes replaced).
        """
        return self._logs.read(handle, tail=tail)

    def evicted(self, handles: Sequence[Handle]) -> None:
        """Retention evicted these sessions' records: their logs go (in the background).

        Implements :meth:`trio_supervisor.abc.Retaining.evicted` (O10).
        """
        self._logs.evicted(handles)
        if self._nursery is None:  # not running: nothing removes them later
            self._logs.flush()

    async def retained(self, handles: Collection[Handle]) -> None:
        """Recovery is over: remove every log but those of these sessions (an earlier
        run's whose records are gone).

        Implements :meth:`trio_supervisor.abc.Retaining.retained`.

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

    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> Unit:
        """Start the bootstrap for ``load``; return once it resolved the code.

        Implements :meth:`trio_supervisor.abc.Execution.spawn` (L4); the unit applies
        ``limits`` (docs/design.md, "limits").

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
        return await self._children.spawn(nursery, handle, load, limits, self.log_path(handle))

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
        ``_recovery``, and ``Pool.held_from``).

        Implements :meth:`trio_supervisor.abc.Execution.recover` (V2).

        Raises:
            ExecutionError: ``child`` was not made by this execution.
        """
        return await recover(
            child,
            boot_id=self._boot_id,
            cgroups=self.cgroups,
            isolated=self.isolated,
            pool=self._pool,
        )
