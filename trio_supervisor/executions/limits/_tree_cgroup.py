"""One child's cgroup, in every hierarchy used: the hard limits of its whole tree (Linux).

Each child gets ``<parent>/<pid>-<start time>`` (the pid and start time of the first
of its processes to be in it, unique within a boot) in the hierarchies its limits need
(:meth:`Hierarchies.controllers`: ``cpu`` and ``cpuacct`` only for ``cpu_percent``)
and the kill's, and its tracked process T is in it before it forks the plugin, so the
whole tree is in the cgroup before any of the caller's code runs; T counts toward
``pids.max`` (set to ``processes + 1``) and toward the memory, as machinery. The limits
are written before the spawn message is sent.

Moving a process into a cgroup waits for the kernel: the first move after a quiet
moment waits for an RCU grace period (``synchronize_rcu``, as the attach takes the
cgroups' thread-group lock for writing: about 11 ms on a 2-core VM, holding every
other ``mkdir`` and ``rmdir`` of cgroups meanwhile; moves less than a grace period
apart do not wait), while making a cgroup and writing a limit do not. An operator can
remove that wait for the whole machine (``favordynmods``, a cgroup2 mount option, or
``cgroup_favordynmods=true`` on the kernel's command line, Linux 6.7+), at the price of
slower forks and exits. So the move is kept off a load's path wherever the process is known
before the load is (:meth:`Hierarchies.prepared`; the load then writes only its
limits, :meth:`TreeCgroup.create`):

* **the standby** (started or forked ahead) makes its cgroup and joins it by itself
  while it waits (told to by a "join" message before any spawn message: the work and
  the kernel's wait are its own, not the runner's), once a load of this execution has
  resolved under a tree limit, in the hierarchies that load's limits needed. The load
  that takes the standby makes, before its spawn message is sent, whatever of the
  cgroup is not there yet: the hierarchies it needs that the last one did not, and
  what the standby has not made (a load may take it before it has read its "join":
  both then make the same directories, and each takes the other's for its own), and
  writes its limits; T joins what it is not in as it reads the spawn message. A load
  that takes the standby before it has joined waits only for the rest of the move;
* **a cold start** moves the started interpreter in while Python boots, and its limits
  are written as T resolves (one that it cannot boot under fails the load as the
  request's fault). T, forked by the started interpreter once it has booted, is born in
  the cgroup (a fork inherits its parent's cgroups and waits for nothing); should it
  have been forked before the move, it joins by itself. The started interpreter, in
  the cgroup too, is reaped before the spawn message: a zombie counts toward
  ``pids.max``.
* otherwise (a child forked for its load by the fork server without a standby, or a
  standby that was not prepared), T writes "0" (itself) into each ``cgroup.procs`` as
  it resolves, and the load waits for the move.

A prepared cgroup that no load takes is removed with its process: a standby discarded
(as the execution exits, or found dead by a load), a cold start that failed. What a
killed runner's prepared cgroups held ends with it (a standby sees its socket close),
and the next start on the same state directory removes them empty.

Rules that never bend:

* A spawn message names only cgroups that are made: T writes itself into their
  ``cgroup.procs`` as soon as it reads it, and a cgroup made after the message was sent
  may be made too late (the runner's thread preempted between the two, on a busy
  machine), which fails the load.
* A cgroup is removed only once its ``cgroup.procs`` is empty: a zombie has left it
  (and ``rmdir`` succeeds), but ``pids.current`` still counts it, so that is never
  what is waited on.
* The kill is ``cgroup.kill`` where there is one; else every pid in ``cgroup.procs`` is
  sent SIGKILL, again and again until none is left (a fork between the read and the
  kill is found on the next pass).
* An OOM kill is told apart from any other SIGKILL by the cgroup's own counter
  (``oom_kill`` in v1 ``memory.oom_control`` or v2 ``memory.events``): a kill by us or
  by anyone else does not raise it. In a cgroup used before, only what the counter
  rose by since its baseline counts: what an earlier child met is never the next one's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Collection
from pathlib import Path
from typing import Final, Protocol

import trio

from ...errors import PackageError
from ...model import Limits
from ._control_files import ControlFiles, read_control, write_control

__all__ = ["Layout", "TreeCgroup"]

CFS_PERIOD_US: Final = 100_000
# How often a cgroup is read while it empties, and how long rmdir is retried for once it
# is empty (the kernel may take a moment to let go of the last exited task).
POLL: Final = 0.005
REMOVE_TRIES: Final = 200
# The memory still charged to an emptied cgroup (the page cache of what its child wrote:
# 0.1-0.5 MiB after a minimal child here) above which it is reclaimed before it is
# kept for another child, and given up if that fails (see TreeCgroup.reset).
RESIDUE: Final = 4 * 1024 * 1024


class Layout(Protocol):
    """What a child's cgroup needs to know of the hierarchies it is in (what
    ``_cgroups.detect`` found: :class:`_cgroups.Hierarchies`)."""

    @property
    def v2(self) -> bool: ...

    @property
    def limits(self) -> dict[str, Path]: ...

    @property
    def kill(self) -> Path | None: ...

    @property
    def memsw(self) -> bool: ...

    @property
    def used(self) -> bool: ...

    def roots(self, controllers: Collection[str] | None = None) -> list[Path]: ...

    def controllers(self, limits: Limits) -> frozenset[str]: ...


def _removed(directory: Path) -> bool:
    """Remove an empty cgroup directory; False while the last task is still leaving it
    (EBUSY). Gone already is removed."""
    try:
        directory.rmdir()
    except FileNotFoundError:
        return True
    except OSError as error:
        if error.errno != errno.EBUSY:
            raise
        return False
    return True


class TreeCgroup:
    """One child's cgroup, in every hierarchy used.

    Args:
        hierarchies: What ``_cgroups.detect`` found.
        path: The cgroup, relative to each hierarchy's root.
        limits: What it enforces once made.
        controllers: Those whose hierarchies it is in (and the kill's); None: every one
            (a cgroup an earlier run recorded, whichever it was in).
    """

    def __init__(
        self,
        hierarchies: Layout,
        path: str,
        limits: Limits,
        controllers: Collection[str] | None = None,
    ) -> None:
        self.hierarchies = hierarchies
        self.path = path
        self.limits = limits
        self.controllers = None if controllers is None else frozenset(controllers)
        self.made = False
        self._wider = False  # made, and in more hierarchies since (see cover)
        # Made by the process it is for (a standby, as it reads "join"), which may not
        # have got to it yet: create makes what is missing (see made_by_member).
        self._by_member = False
        self.removed = False
        # A process :meth:`create` moves in, for a T that cannot join by itself.
        self.member: int | None = None
        # The process :meth:`prepare` moved in ahead of the load.
        self.prepared_for: int | None = None
        # Used before, and taken from the pool (see Pool.take): made already, with the
        # OOM kills counted until then as the baseline of oom_kills.
        self.reused = False
        self.oom_baseline = 0
        # Its control files kept open, while the pool has it (see ControlFiles); None: each is
        # opened as it is written or read.
        self.files: ControlFiles | None = None
        # directories() and procs, for the controllers they were made for.
        self._paths: tuple[frozenset[str] | None, list[Path], list[str]] | None = None

    def _laid_out(self) -> tuple[list[Path], list[str]]:
        paths = self._paths
        if paths is None or paths[0] is not self.controllers:
            directories = [root / self.path for root in self.hierarchies.roots(self.controllers)]
            procs = [os.path.join(directory, "cgroup.procs") for directory in directories]
            paths = self._paths = (self.controllers, directories, procs)
        return paths[1], paths[2]

    def directories(self) -> list[Path]:
        return list(self._laid_out()[0])

    @property
    def procs(self) -> list[str]:
        """The files T writes itself into."""
        return list(self._laid_out()[1])

    def _in(self, controller: str) -> Path | None:
        root = self.hierarchies.limits.get(controller)
        if root is None or (self.controllers is not None and controller not in self.controllers):
            return None
        return root / self.path

    def cover(self, limits: Limits) -> bool:
        """Be in the hierarchies ``limits`` need too (made by :meth:`create`); whether
        that adds one, which a process in it already is not in then."""
        if self.controllers is None:
            return False
        before = self.directories()
        self.controllers |= self.hierarchies.controllers(limits)
        self._wider = self._wider or self.directories() != before
        return self._wider

    def create(self, *, limits: bool = True) -> None:
        """Make it (unless :meth:`prepare` did), with its limits written (unless
        ``limits`` is False: :meth:`configure` writes them then), and move :attr:`member`
        in, if set.

        Raises:
            PackageError: The kernel refused a limit's value.
            OSError: It cannot be made.
        """
        if self.made:
            # Prepared: only the limits are left to write (and the member to move in),
            # and what is not made yet to make: the hierarchies :meth:`cover` added, and
            # whatever a standby has not made of it (it makes it as it reads "join", which
            # a load that takes it at once may come before; T joins every hierarchy as
            # it reads its spawn message, so each must be there before that is sent). A
            # failure leaves it to the unit, which removes it once its processes are gone.
            if self._wider or self._by_member:
                self._make(missing=True)
            if limits:
                self.configure()
            self._move_member()
            return
        self._make()
        try:
            if limits:
                self._configure()
            self._move_member()
        except BaseException:
            self.unmake()
            raise

    def configure(self) -> None:
        """Write its limits (:meth:`create` made it, every hierarchy of it).

        Raises:
            PackageError: The kernel refused a limit's value.
            OSError: It cannot be written.
        """
        self._configure()

    def prepare(self, pid: int) -> None:
        """Make it with no limits (unless it is :attr:`reused`), and move ``pid`` in (see
        :meth:`Hierarchies.prepared`).

        Raises:
            OSError: It cannot be made, or ``pid`` moved; nothing is left then.
        """
        if not self.made:
            self._make()
        try:
            self._move(pid)
        except BaseException:
            self.unmake()
            raise
        self.prepared_for = pid

    def holds(self, pid: int) -> bool:
        """Whether ``pid`` is in it in every hierarchy."""
        text = str(pid)
        for procs in self.procs:
            try:
                if text not in read_control(procs).split():
                    return False
            except FileNotFoundError:
                return False
        return True

    def _make(self, *, missing: bool = False) -> None:
        made: list[Path] = []
        try:
            for directory in self.directories():
                # The parent too, should the last child of a run it had lost (by a
                # closed socket) have removed it as it left (see _bootstrap.leave_cgroups).
                try:
                    directory.mkdir(parents=True)
                except FileExistsError:
                    if not missing:
                        raise
                    # Made by the standby it was prepared for, which makes its own as
                    # it reads "join" (and joins it, or leaves it to T to join).
                    continue
                made.append(directory)
        except BaseException:
            for directory in reversed(made):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            raise
        self.made = True

    def unmake(self) -> None:
        """Remove it again, made and holding nothing (best effort)."""
        self._close_files()
        for directory in reversed(self.directories()):
            with contextlib.suppress(OSError):
                directory.rmdir()
        self.made = False

    def _put(self, path: Path, value: str) -> None:
        """Write a control file of it (not ``cgroup.procs``), through :attr:`files` if kept."""
        if self.files is None:
            write_control(path, value)
        else:
            self.files.write(path, value)

    def _get(self, path: Path) -> str:
        """Read a control file of it (not ``cgroup.procs``), through :attr:`files` if kept."""
        return read_control(path) if self.files is None else self.files.read(path)

    def _close_files(self) -> None:
        if self.files is not None:
            self.files.close()

    def _move(self, pid: int) -> None:
        for procs in self.procs:
            write_control(Path(procs), str(pid))

    def _move_member(self) -> None:
        if self.member is not None:
            self._move(self.member)

    def made_by_member(self) -> list[str]:
        """Its directories, for the process that makes it and joins it (a standby, as
        it waits: see ``_bootstrap``'s "join"). From now on it counts as made, with no
        limit written: :meth:`create` writes them, and makes first what the process has
        not made (yet, or at all: it may read "join" only after the load took it). One
        :attr:`reused` is made already: none for the process to make (nothing removes
        one the pool has, but the execution)."""
        if self.reused:
            return []
        self.made = True
        self._by_member = True
        return [str(directory) for directory in self.directories()]

    def _configure(self) -> None:
        v2 = self.hierarchies.v2
        writes: list[tuple[str, Path, str]] = []
        memory, pids, cpu = (self._in(name) for name in ("memory", "pids", "cpu"))
        value = self.limits.memory_bytes
        if value is not None and memory is not None:
            if v2:
                writes += [("memory_bytes", memory / "memory.max", str(value))]
                writes += [("memory_bytes", memory / "memory.swap.max", "0")]
            else:
                # memsw may never be below the memory limit: the memory limit first.
                writes += [("memory_bytes", memory / "memory.limit_in_bytes", str(value))]
                if self.hierarchies.memsw:
                    writes += [("memory_bytes", memory / "memory.memsw.limit_in_bytes", str(value))]
        value = self.limits.processes
        if value is not None and pids is not None:
            writes += [("processes", pids / "pids.max", str(value + 1))]  # T, machinery
        value = self.limits.cpu_percent
        if value is not None and cpu is not None:
            quota = value * CFS_PERIOD_US // 100
            if v2:
                writes += [("cpu_percent", cpu / "cpu.max", f"{quota} {CFS_PERIOD_US}")]
            else:
                writes += [("cpu_percent", cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))]
                writes += [("cpu_percent", cpu / "cpu.cfs_quota_us", str(quota))]
        for name, path, text in writes:
            try:
                self._put(path, text)
            except OSError as error:
                # EBUSY: a v1 memory limit below what the cgroup holds already (T, in it
                # since it was prepared), which the kernel could not reclaim.
                if error.errno not in (errno.EINVAL, errno.EBUSY):
                    raise
                # The host asked for a value this kernel cannot take: its request's fault.
                raise PackageError(
                    f"the limit {name}={getattr(self.limits, name)} cannot be applied: "
                    f"{error.strerror}"
                ) from error

    def members(self, *, everywhere: bool = True) -> set[int]:
        """Every process in it, in any hierarchy (zombies are in none); with
        ``everywhere`` False, in one: T joins them all before it forks, so each holds
        the whole tree, and one read is the cheaper."""
        found: set[int] = set()
        # The last first: the kill's hierarchy, where there is one. Another may be
        # missing (a recorded cgroup is looked for in every hierarchy).
        for procs in reversed(self.procs):
            try:
                found.update(int(pid) for pid in read_control(procs).split())
            except FileNotFoundError:
                continue
            if not everywhere:
                break
        return found

    def kill(self) -> None:
        """Kill everything in it: ``cgroup.kill``, else SIGKILL to each member."""
        if self.hierarchies.kill is not None:
            # Not there: never made, or removed already.
            with contextlib.suppress(FileNotFoundError):
                write_control(self.hierarchies.kill / self.path / "cgroup.kill", "1")
            return
        for pid in self.members():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def emptied(self) -> int:
        """Kill what is still in it, until nothing is; return how many were found.

        Called once the child's tracked process has exited, when nothing of its tree
        may run any more: what is found here escaped every other way of holding it. Not
        a checkpoint when it is empty: the caller's wait for that exit was one.
        """
        found = self.members(everywhere=False)
        if not found:
            return 0
        seen = set(found)
        while found:
            self.kill()
            await trio.sleep(POLL)
            found = self.members()
            seen |= found
        return len(seen)

    def oom_kills(self) -> int:
        """How many of its processes the kernel killed for going over its memory limit,
        since it was given to this child (see :meth:`reset`)."""
        return max(self._oom_counter() - self.oom_baseline, 0)

    def _oom_counter(self) -> int:
        """The kernel's count of OOM kills in it, since it was made (0 where none is kept)."""
        memory = self._in("memory")
        if memory is None:
            return 0
        name = "memory.events" if self.hierarchies.v2 else "memory.oom_control"
        try:
            text = self._get(memory / name)
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def reset(self) -> bool:
        """(In a worker thread.) Make it fit for another child, as a new one would be:
        whether it is (see the module's docs, and :class:`Pool`).

        Once its child is gone: it must hold nothing in any hierarchy and count no task
        toward ``pids.max`` (a zombie not yet released would count toward the next
        child's); the memory charged to it is reclaimed where it is more than
        ``RESIDUE``, and it is unfit where it stays more (what is left counts toward the
        next child's limit: it is reclaimable page cache only when it is small). Then
        every limit it may hold is written back to none, the counters that can be are
        reset, and the OOM kills counted so far become the baseline of :meth:`oom_kills`.
        """
        if self.controllers is None:
            return False  # a recorded one: whichever hierarchies it was in
        try:
            # pids.current counts every task, zombies included: where there is one, the
            # cgroup.procs of the other hierarchies are read, else every one.
            pids = self._in("pids")
            if pids is not None and int(self._get(pids / "pids.current")) != 0:
                return False
            skip = None if pids is None else os.path.join(pids, "cgroup.procs")
            if any(read_control(procs).strip() for procs in self.procs if procs != skip):
                return False
            memory = self._in("memory")
            if memory is not None and not self._reclaimed(memory):
                return False
            for path, text in self._defaults():
                self._put(path, text)
            for path in self._counters():
                with contextlib.suppress(FileNotFoundError):  # not on every kernel
                    self._put(path, "0")
        except (OSError, ValueError):
            return False  # gone meanwhile, or refused: it is removed instead
        self.oom_baseline = self._oom_counter()
        return True

    def _reclaimed(self, memory: Path) -> bool:
        """Whether at most ``RESIDUE`` is charged to it, reclaiming it first where more is
        (v1 ``memory.force_empty``, v2 ``memory.reclaim`` where the kernel has it)."""
        usage = memory / ("memory.current" if self.hierarchies.v2 else "memory.usage_in_bytes")
        charged = int(self._get(usage))
        if charged <= RESIDUE:
            return True
        if self.hierarchies.v2:
            reclaim, amount = memory / "memory.reclaim", str(charged)
        else:
            reclaim, amount = memory / "memory.force_empty", "0"
        # EAGAIN (v2): not all of it could be; ENOENT: this kernel has no such file.
        with contextlib.suppress(OSError):
            write_control(reclaim, amount)  # rarely: not kept open
        return int(self._get(usage)) <= RESIDUE

    def _defaults(self) -> list[tuple[Path, str]]:
        """What its limits read in a new cgroup, in an order the kernel takes (v1: the
        memory plus swap limit may never be below the memory limit)."""
        memory, pids, cpu = (self._in(name) for name in ("memory", "pids", "cpu"))
        writes: list[tuple[Path, str]] = []
        if memory is not None:
            if self.hierarchies.v2:
                writes += [(memory / "memory.max", "max"), (memory / "memory.swap.max", "max")]
            else:
                if self.hierarchies.memsw:
                    writes += [(memory / "memory.memsw.limit_in_bytes", "-1")]
                writes += [(memory / "memory.limit_in_bytes", "-1")]
                writes += [(memory / "memory.oom_control", "0")]  # the OOM killer on
        if pids is not None:
            writes += [(pids / "pids.max", "max")]
        if cpu is not None:
            if self.hierarchies.v2:
                writes += [(cpu / "cpu.max", f"max {CFS_PERIOD_US}")]
            else:
                writes += [(cpu / "cpu.cfs_quota_us", "-1")]
                writes += [(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))]
        return writes

    def _counters(self) -> list[Path]:
        """The counters of its use that a write of 0 resets: v1's peaks and failures of
        memory, and its CPU time. The others count its whole life: ``pids.peak`` and
        ``pids.events``, cgroup2's ``memory.peak`` (reset only for the file descriptor
        that writes it) and ``memory.events`` (whose ``oom_kill`` has a baseline)."""
        if self.hierarchies.v2:
            return []
        found: list[Path] = []
        memory, cpuacct = self._in("memory"), self._in("cpuacct")
        if memory is not None:
            kinds = ["memory", "memory.memsw"] if self.hierarchies.memsw else ["memory"]
            found += [
                memory / f"{kind}.{name}"
                for kind in kinds
                for name in ("max_usage_in_bytes", "failcnt")
            ]
        if cpuacct is not None:
            found += [cpuacct / "cpuacct.usage"]
        return found

    async def remove(self) -> None:
        """Remove it in every hierarchy; it must be empty (see :meth:`emptied`)."""
        self._close_files()
        for directory in self.directories():
            for _ in range(REMOVE_TRIES):
                if _removed(directory):
                    break
                await trio.sleep(POLL)  # the last task is still leaving it
        self.removed = True

    def remove_blocking(self) -> None:
        """(In a worker thread.) :meth:`remove`, for a cgroup the unit handed over once
        it was empty: a removal waits for the kernel's cgroup lock, which a process
        moving into another cgroup holds for an RCU grace period (milliseconds), so it
        is not the event loop's to wait for."""
        self._close_files()
        for directory in self.directories():
            for _ in range(REMOVE_TRIES):
                if _removed(directory):
                    break
                time.sleep(POLL)
        self.removed = True
