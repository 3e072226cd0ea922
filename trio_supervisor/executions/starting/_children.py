"""A subprocess execution's children: each from its load to a resolved unit, and what
it leaves as it goes.

Theory of operation: :meth:`Children.spawn` turns a load into a spawn message (what
the owner allows: a named command, or an entry point on the entry paths), takes an
interpreter (the standby's, where the load's output is not capped, else one of
``_interpreters``), gives it the child's cgroup (prepared, kept by the pool, or made
as it resolves) and isolation grant, records the child's identity in a
:class:`~._unit.ProcessUnit`, and returns once the bootstrap resolved the code. Once a
child is gone, its cgroup is kept for another child or removed, and its grant given
back, in the background (:meth:`Children.release`).

Rules that never bend:

* A host picks a command by name, never an argv; an entry point is found only on the
  entry paths the owner configured.
* The child's identity (pid, start time, boot id, cgroup, uid) is in the unit before
  the spawn message is sent: nothing of the caller's runs before it is known.
* What a gone child leaves is taken back once the loop is idle, never between the steps
  of a request someone waits for; what waits on the kernel runs in a worker thread.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from pathlib import Path
from typing import Literal

import attrs
import trio

from ..._background import when_idle
from ...errors import ExecutionError, PackageError
from ...model import ChildIdentity, Handle, Limits, Load, thaw
from ...realtime import outside_the_run
from ..child._protocol import SpawnCommand
from ..limits._isolation import Grant
from ..limits._pool import Pool
from ..limits._tree_cgroup import TreeCgroup
from ._bringup import Host
from ._interpreters import Interpreters
from ._options import Options
from ._output import copy_output
from ._standby import Interpreter, Standby
from ._unit import ProcessUnit, failure

__all__ = ["ADAPTER", "BOOTING", "Children"]

# What happens to the children is said in the subprocess execution's own name (its
# face's logger): one logger for an operator to configure.
logger = logging.getLogger("trio_supervisor.executions.subprocess")

# What the subprocess execution's identities name as their adapter.
ADAPTER = "subprocess"
# package.module:function, the function's parts public names (see _bootstrap.entry_point).
ENTRY_POINT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z]\w*(\.[A-Za-z]\w*)*$")
# Interpreters that may boot at once: one per core the runner may use.
BOOTING = max(len(os.sched_getaffinity(0)), 1)


class Children:
    """How one subprocess execution spawns its children, and takes back what each leaves.

    Args:
        options: The execution's options.
        host: The host as bring-up leaves it.
        interpreters: Where their interpreters come from (and the pool of cgroups).
        standby: The interpreter kept ahead of the next load.
        boot_id: This machine's boot id, recorded in each identity.

    Attributes:
        nursery: The run's background tasks; None while the execution does not run.
    """

    def __init__(
        self,
        options: Options,
        host: Host,
        interpreters: Interpreters,
        standby: Standby,
        boot_id: str,
    ) -> None:
        self.options = options
        self.host = host
        self.interpreters = interpreters
        self.standby = standby
        self.boot_id = boot_id
        self.nursery: trio.Nursery | None = None
        # Interpreters booting at once (started, not yet resolved): see spawn.
        self._booting = trio.CapacityLimiter(BOOTING)

    def enter(self, nursery: trio.Nursery, pool: Pool, standby: Standby) -> None:
        """The execution runs: its children use this run's parts."""
        self.nursery = self.interpreters.nursery = nursery
        self.interpreters.pool = pool
        self.standby = standby

    def leave(self) -> None:
        """The execution is on its way out: nothing more is started in the background."""
        self.nursery = self.interpreters.nursery = None

    # -- the spawn message -------------------------------------------------------------

    def kind(self, load: Load) -> Literal["command", "python"]:
        """What ``load`` names: a named command, or an entry point on the entry paths.

        Raises:
            PackageError: Neither, or an entry point where no entry path is configured.
        """
        specifier = load.specifier
        commands = self.options.commands
        if specifier in commands:
            return "command"
        if ENTRY_POINT.match(specifier):
            if not self.options.entry_paths:
                raise PackageError(
                    f"no entry paths are configured, so {specifier!r} cannot be loaded"
                )
            return "python"
        named = ", ".join(sorted(commands)) or "none"
        hint = (
            f" (did you mean {specifier}:main, a function main in the module {specifier}?)"
            if ":" not in specifier and specifier.replace(".", "").replace("_", "").isalnum()
            else ""
        )
        raise PackageError(
            f"{specifier!r} is neither a configured command (configured: {named}) "
            "nor a package.module:function entry point whose function is a public name"
            f"{hint}"
        )

    def spec(self, handle: Handle, load: Load, limits: Limits) -> SpawnCommand:
        """The spawn message for ``load`` (see ``_bootstrap.py``)."""
        limits = self.host.cgroups.rlimits(limits)  # what a cgroup holds is not setrlimit's
        spec: SpawnCommand = {
            "command": "spawn",
            "kind": self.kind(load),
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
            spec["argv"] = list(self.options.commands[load.specifier])
        else:
            spec["paths"] = list(self.options.entry_paths)
        return spec

    def environment(self, handle: Handle) -> dict[str, str]:
        """A session's child's environment: every child's, and its session's variables."""
        environment = self.options.base_environment()
        environment["TRIO_SUPERVISOR_IDENTITY"] = handle.key.identity
        environment["TRIO_SUPERVISOR_INSTANCE"] = handle.key.instance
        environment["TRIO_SUPERVISOR_GENERATION"] = str(handle.generation)
        return environment

    # -- spawn ---------------------------------------------------------------------------

    async def spawn(
        self, nursery: trio.Nursery, handle: Handle, load: Load, limits: Limits, log: Path
    ) -> ProcessUnit:
        """A unit for ``load``, resolved (see ``SubprocessExecution.spawn``), whose output
        goes to ``log``.

        Raises:
            PackageError: The specifier is not allowed, or its code cannot be found.
            ExecutionError: The process could not be started or prepared.
        """
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
                return await self._spawn(nursery, handle, load, limits, log)
            finally:
                self._booting.release()

    async def _spawn(
        self, nursery: trio.Nursery, handle: Handle, load: Load, limits: Limits, log: Path
    ) -> ProcessUnit:
        cgroups = self.host.cgroups
        cgroups.refuse(limits)
        tree = limits if cgroups.wanted(limits) else None
        spec = self.spec(handle, load, limits)
        # Capped output is copied through a pipe made here, so only an uncapped load
        # can take the interpreter started ahead.
        standby = self.standby.take(nursery) if limits.output_bytes is None else None
        if standby is not None:
            # Started ahead: it learns where its output goes and its environment now.
            warm: SpawnCommand = {
                **spec,
                "log": str(log),
                "environment": self.environment(handle),
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
            interpreter = await self.interpreters.start(self.environment(handle), writer, tree=tree)
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
        cgroups = self.host.cgroups
        isolated = self.host.isolated
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
        elif cgroups.wanted(limits):
            # Made by the unit as it resolves, unless one kept is given to it.
            cgroup = self.interpreters.pool.take(cgroups.controllers(limits))
            if cgroup is None:
                cgroup = cgroups.child(f"{process.pid}-{started}", limits)
            cgroup.limits = limits
        if cgroup is not None:
            if joined:
                spec = {**spec, "joined": cgroup.procs}  # for T to remove it, orphaned
            elif self.options.python == sys.executable:
                # T joins before it forks P (unless it joined these while it waited).
                spec = {**spec, "cgroups": cgroup.procs}
            else:
                # Another interpreter may run as another user (a wrapper that drops
                # privileges): we move T in ourselves as the unit resolves.
                cgroup.member = process.pid
        grant = None
        if isolated.used:
            # Claimed ahead for a standby, which made its plugin's namespaces for it;
            # the same spec tells it to use them.
            grant = interpreter.take_grant()
            if grant is None:
                try:
                    grant = await isolated.claim()
                except BaseException:
                    await interpreter.discard()
                    raise
            spec = {**spec, "isolation": isolated.spec(grant)}
        identity = ChildIdentity(
            adapter=ADAPTER,
            ref=f"{process.pid}:{started}",
            pid=process.pid,
            pgid=process.pid,
            start_time=started,
            boot_id=self.boot_id,
            cgroup=None if cgroup is None else cgroup.path,
            uid=None if grant is None else grant.uid,
        )
        if cgroup is not None and cgroup.reused:
            self.interpreters.pool.given(cgroup, identity.ref)  # see _recovery
        unit = ProcessUnit(
            process,
            identity,
            interpreter.control,
            load,
            marker=interpreter.marker,
            containment=self.host.mechanism.kind,
            limits=_rlimits_text(limits),
            cgroup=cgroup,
            gone=functools.partial(self.release, grant),
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
        if cgroups.wanted(limits):
            self.interpreters.expected = limits  # the hierarchies the next standby makes
        return unit

    # -- what a gone child leaves ------------------------------------------------------

    def release(self, grant: Grant | None, cgroup: TreeCgroup | None) -> None:
        """A child is gone: its empty cgroup is kept for another child or removed, its
        private directory goes and its uid is free again, in the background (see
        :meth:`_let_go`)."""
        if self.nursery is None:
            return  # the execution has exited: its next start removes what is left
        if cgroup is not None or grant is not None:
            self.nursery.start_soon(self._let_go, cgroup, grant, name="a gone child's leftovers")

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
                    await self.host.isolated.release(grant)
            finally:
                if cgroup is not None:
                    await self._keep(cgroup)

    async def _keep(self, cgroup: TreeCgroup) -> None:
        with outside_the_run():  # the kernel's time, not the run's (realtime.py)
            try:
                await trio.to_thread.run_sync(self.interpreters.pool.keep, cgroup)
            except OSError as error:
                logger.warning("cannot remove the cgroup %s: %s", cgroup.path, error)


def _rlimits_text(limits: Limits) -> str:
    """The rlimits a child runs under, as ``name=value, ...`` (empty: none)."""
    return ", ".join(
        f"{name}={value}"
        for name, value in attrs.asdict(limits).items()
        if value is not None and name != "output_bytes"
    )
