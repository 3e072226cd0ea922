"""Where a child's bootstrap interpreter comes from: the fork server, a cold start, or
the standby, prepared while it waits.

Theory of operation: every load needs an :class:`~._standby.Interpreter` that has run
nothing yet. :meth:`Interpreters.start` asks the fork server for one where it runs (a
fork, no Python start-up), and starts one otherwise (:meth:`Interpreters.start_cold`);
a load with tree limits has its cold-started interpreter moved into a cgroup of its
own while Python boots (``limits._tree_cgroup``). :meth:`Interpreters.for_standby` is
the standby's starter (``_standby.Standby``): the interpreter kept ahead of the next
load joins its cgroup and, isolated, has its plugin fork into namespaces of its own
while it waits, so that the load that takes it does neither.

Rules that never bend:

* One process creation at a time: trio starts each process in a thread, and a burst
  of loads would run that many fork+exec threads at once, which starve the event loop
  of the GIL for hundreds of milliseconds. Serialized, a burst costs the same total
  time and the loop goes on serving other sessions between creations.
* Preparing the standby never waits: a failure leaves the work to the load that takes
  it (which makes what is missing), and a grant or cgroup it could not use goes back.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from collections.abc import Mapping

import trio

from ...model import Limits
from ..limits._pool import Pool
from ..limits._tree_cgroup import TreeCgroup
from ._bringup import Host
from ._forkserver import Broken
from ._options import Options
from ._standby import Interpreter, start_interpreter

__all__ = ["Interpreters"]

# What happens to the children is said in the subprocess execution's own name (its
# face's logger): one logger for an operator to configure.
logger = logging.getLogger("trio_supervisor.executions.subprocess")


class Interpreters:
    """The bootstrap interpreters of one subprocess execution's children.

    Args:
        options: The execution's options.
        host: The host as bring-up leaves it (the fork server, the containment, the
            cgroups, the isolation).
        pool: The emptied cgroups kept for the next children.

    Attributes:
        pool: The emptied cgroups kept for the next children (the run's: each run of
            the execution has its own).
        nursery: The run's background tasks; None while the execution does not run
            (or is on its way out), when nothing is started in the background.
        expected: The tree limits of the last load that resolved under them: from then
            on each standby waits in a cgroup of its own, in the hierarchies they need.
    """

    def __init__(self, options: Options, host: Host, pool: Pool) -> None:
        self.options = options
        self.host = host
        self.pool = pool
        self.nursery: trio.Nursery | None = None
        self.expected: Limits | None = None
        self._creating = trio.CapacityLimiter(1)

    async def start(
        self, environment: Mapping[str, str], output: int, *, tree: Limits | None = None
    ) -> Interpreter:
        """An interpreter, forked by the fork server or started; with ``tree`` (tree
        limits), one started is moved into a cgroup of its own while it boots."""
        server = self.host.server
        if server is not None and self.nursery is not None:
            if server.running:
                try:
                    return await server.fork(environment, output)
                except Broken as error:
                    logger.warning("%s; this load starts its own interpreter", error)
            server.restart_soon(self.nursery)
        return await self.start_cold(environment, output, tree=tree)

    async def start_cold(
        self, environment: Mapping[str, str], output: int, *, tree: Limits | None = None
    ) -> Interpreter:
        """An interpreter started (one creation at a time: see the module's docs)."""
        mechanism = self.host.mechanism
        return await start_interpreter(
            self.options.python,
            self.host.bootstrap,
            environment=environment,
            output=output,
            directory=self.options.state_directory,
            containment=mechanism.spec,
            strict=mechanism.required,
            creating=self._creating,
            keep=self.host.keep,
            # The limits are written as it resolves, not before it boots: one that it
            # cannot boot under fails the load as the request's fault (PackageError).
            join=None if tree is None else functools.partial(self._prepared, limits=tree),
        )

    def _prepared(self, pid: int, limits: Limits) -> TreeCgroup | None:
        """(In a worker thread.) A cgroup made for ``pid`` with it inside (see
        ``Hierarchies.prepared``; one the pool kept where it has one), or None where
        that fails: T then joins one as it resolves, as it would unprepared."""
        cgroups = self.host.cgroups
        try:
            kept = self.pool.take(cgroups.controllers(limits))
            if kept is not None:
                kept.prepare(pid)
                return kept
            return cgroups.prepared(pid, limits)
        except OSError as error:
            logger.debug("no cgroup prepared for the interpreter %d: %s", pid, error)
            return None

    async def for_standby(self) -> Interpreter:
        """The next standby: output going nowhere until the spawn message names the
        session's log, prepared ahead for the load that will take it."""
        server = self.host.server
        environment = self.options.base_environment()
        if server is None or not server.running:
            interpreter = await self.start_cold(environment, subprocess.DEVNULL)
        else:
            nowhere = os.open(os.devnull, os.O_WRONLY)
            try:
                interpreter = await self.start(environment, nowhere)
            finally:
                os.close(nowhere)
        if self.options.python == sys.executable:  # our bootstrap, as root (see _join_ahead)
            if self.expected is not None:
                self._join_ahead(interpreter, self.expected)
            if self.host.isolated.ahead:
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
        if self.nursery is None:
            return  # the execution exits, and discards it
        isolated = self.host.isolated
        try:
            grant = isolated.claim_now()
        except OSError as error:
            logger.debug("no uid granted ahead to the standby: %s", error)
            return
        if grant is None:
            return
        try:
            interpreter.isolate_ahead(grant, isolated.spec(grant), isolated.release)
        except OSError as error:  # it is gone: discarded, it gives the grant back
            logger.debug("no namespaces prepared for the standby: %s", error)

    def _join_ahead(self, interpreter: Interpreter, expected: Limits) -> None:
        """Have the standby make its cgroup, in the hierarchies the last load's limits
        needed, and join it while it waits: the mkdirs and the move (which waits for the
        kernel, see ``limits._tree_cgroup``) are its own, not the runner's; the load that
        takes it writes its limits. Where that fails (or the load took it first), the
        load makes what is missing before its spawn message, and the standby joins as it
        reads that, as it would unprepared."""
        pid = interpreter.process.pid
        started = interpreter.start_time()
        if started is None:
            return  # it is gone: the load that takes it finds so
        cgroups = self.host.cgroups
        controllers = cgroups.controllers(expected)
        cgroup = self.pool.take(controllers)
        if cgroup is None:
            cgroup = cgroups.child(f"{pid}-{started}", Limits())
            cgroup.controllers = controllers
        try:
            interpreter.join_ahead(cgroup)
        except OSError as error:  # it is gone, and made nothing
            logger.debug("no cgroup prepared for the standby %d: %s", pid, error)
            if cgroup.reused:
                self.pool.put_back(cgroup)  # as it was: nothing joined it
