"""Hard limits for a child's whole tree: one cgroup per child (Linux).

Theory of operation. When the execution starts, :func:`detect` finds which cgroup
hierarchies this process may write, by making its own parent in each:
``trio_supervisor/<execution>`` (``<execution>`` is a digest of the state directory, so a
restarted runner finds what its previous run left). Two layouts are used:

* **v2**, where the cgroup2 hierarchy has the memory, pids and cpu controllers and they
  can be enabled down to our parent: every limit, and the kill, in one directory.
* **v1**, where they are bound to v1 hierarchies (``memory``, ``pids``, ``cpu``, and
  ``cpuacct`` for accounting): the limits there, and the kill and "is it empty" in a
  v2 cgroup of the same name where a cgroup2 hierarchy offers ``cgroup.kill`` (a
  process may be in a v1 and a v2 cgroup at once).

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

Reuse (:class:`Pool`). A cgroup is made and removed at a price beyond the ``mkdir`` and
``rmdir`` themselves: the kernel sets up a v1 memory cgroup's accounting as it is made,
and tears it down in its own workers after the ``rmdir``, on the same two cores as the
loads. So a child's cgroup, once its stop confirmed it empty, is kept for the next
child that needs the same hierarchies (up to ``POOL`` of them), where nothing of the
child it held is left to mislead: in a worker thread, once the loop is idle, it is
confirmed empty in every hierarchy with no task left counting toward ``pids.max``, the
memory still charged to it (the page cache of the files its child wrote) is reclaimed
where it is more than ``RESIDUE``, and it is given up where it stays more; every limit
it may hold is then written back to the kernel's default (none, ``oom_kill_disable``
off), the counters that can be reset are, and the one the OOM kill is told by, which
cannot, is read as its baseline (:meth:`TreeCgroup.reset`). The next child takes it as
one that is made already: the standby joins it while it waits (with no ``mkdir`` of its
own), a cold start's interpreter is moved into it as Python boots, and the load writes
its own limits as into a new one. Its control files stay open with it (``_Files``), as
opening one costs twenty to forty times what a write through it does: the load's limits,
the OOM count read as its child ends and the next reset are a write or a read each. The
kernel's wait for a move stays: a process must still be moved.
What the pool holds is removed as the execution ends; what a killed runner's pool held
is empty, and goes as the next start's or another runner's reclaim finds it.

A record names the cgroup its child used, which a later child may use again. A cgroup
this execution holds (kept, or given to another since) was emptied of every child
that used it before, so a recovery by this same execution (a runner that heals
itself) of a record naming it leaves it alone (:meth:`Pool.held_from`). One that a dead
incarnation held, kept or in use, is recovered as any of its cgroups: the empty ones
go as the execution starts, and what is still in one is that incarnation's, ended by
the recovery of whichever record names it first (and counted in its termination).

Whose they are. The parents are machine-wide, and a runner killed with ``kill -9``
may leave one behind, with empty cgroups in it, for good where no runner starts on its
state directory again. So each execution claims its parent's name (``_claims``:
``cgroups/<execution>``, naming the runner and the state directory) before it makes it,
and lets go of the claim once it removed the parent as it ended. Any runner, as it
starts, reclaims the parents of runners that are gone (:meth:`Hierarchies.reclaim`):
the empty cgroups in them, then each parent once it is empty, then the claim once
nothing of its parent is left (a cgroup that still holds a process stays, and its
parent and claim with it: the tree ends by its dead-man switch, or by recovery on its
state directory, and a later start takes what is left). A parent that no claim names
(made by an earlier version, or by a runner that may not write the claims) is left
alone, and the log says so.

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
* A cgroup is kept for another child only once it is empty (as it is removed), and it
  is given out with no limit of the child before it.
* Nothing outside ``trio_supervisor/`` is ever touched: a recorded path that leads
  elsewhere is refused.
* Another runner's parent is touched only once its claim says its runner is gone.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Final

import attrs
import trio

from ..errors import PackageError
from ..model import Limits
from ._claims import ClaimError, Claims
from ._groups import start_time

__all__ = ["PARENT", "POOL", "ROOT", "Hierarchies", "Pool", "TreeCgroup", "detect"]

logger = logging.getLogger(__name__)

ROOT: Final = Path("/sys/fs/cgroup")
PARENT: Final = "trio_supervisor"
V1_CONTROLLERS: Final = ("memory", "pids", "cpu", "cpuacct")
V2_CONTROLLERS: Final = ("memory", "pids", "cpu")
CFS_PERIOD_US: Final = 100_000
# How often a cgroup is read while it empties, and how long rmdir is retried for once it
# is empty (the kernel may take a moment to let go of the last exited task).
POLL: Final = 0.005
REMOVE_TRIES: Final = 200
# An execution's parent: a digest of its state directory (execution_name).
EXECUTION: Final = re.compile(r"[0-9a-f]{16}")
# How many emptied cgroups an execution keeps for its next children (Pool), and the memory
# still charged to one (the page cache of what its child wrote: 0.1-0.5 MiB after a
# minimal child here) above which it is reclaimed first, and given up if that fails.
POOL: Final = 4
RESIDUE: Final = 4 * 1024 * 1024


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


def _read(path: Path | str) -> str:
    """A small control file of the kernel's, read with one open and a read or two (the
    text file object's layers cost more than the read, on every stop)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


class _Files:
    """The control files of one cgroup, each kept open once opened: the pool's (a cgroup
    kept, and the child it is given to next). Opening a control file is most of what a
    write or a read of it costs (a walk of its path, the kernel's open of a cgroup file:
    20-40 us here, against 1 us for the write); a file kept open is read again from its
    start. Not ``cgroup.procs``: an open one lists the cgroup's processes only once.

    Used by the event loop as a child starts and ends, by a worker thread as the cgroup
    is kept, and closed by the one that removes it, or by the pool's end: each use holds
    a lock, so that no descriptor is closed while it is used (and then, perhaps, the
    number of another file's).
    """

    def __init__(self) -> None:
        self._open: dict[tuple[Path, int], int] = {}
        self._lock = threading.Lock()
        self.closed = False

    def _fd(self, path: Path, flags: int) -> int:
        if self.closed:
            raise FileNotFoundError(errno.ENOENT, "its cgroup is removed", str(path))
        fd = self._open.get((path, flags))
        if fd is None:
            fd = self._open[path, flags] = os.open(path, flags | os.O_CLOEXEC)
        return fd

    def read(self, path: Path) -> str:
        with self._lock:
            return os.pread(self._fd(path, os.O_RDONLY), 65536, 0).decode()

    def write(self, path: Path, value: str) -> None:
        with self._lock:
            os.write(self._fd(path, os.O_WRONLY), value.encode())

    def close(self) -> None:
        """Close them all (again: nothing more)."""
        with self._lock:
            self.closed = True
            open_files, self._open = self._open, {}
            for fd in open_files.values():
                os.close(fd)


@attrs.frozen(kw_only=True)
class Hierarchies:
    """The cgroup hierarchies this execution writes, found once by :func:`detect`.

    Attributes:
        parent: This execution's parent cgroup, relative to each hierarchy's root.
        v2: True when the limits are cgroup2's (``memory.max``, ``pids.max``, ...).
        limits: Controller name -> the directory of the hierarchy that holds it, for
            each controller a limit or accounting may use.
        kill: A cgroup2 hierarchy with ``cgroup.kill``, or None.
        memsw: v1 only: whether swap is accounted (``memory.memsw.limit_in_bytes``).
        reason: Why a part is missing, for the log; empty when nothing is.
        claims: The machine's claims of parents, where this execution holds the claim
            of its own (None: it holds none, and reclaims nothing).
    """

    parent: str
    v2: bool = False
    limits: dict[str, Path] = attrs.field(factory=dict)
    kill: Path | None = None
    memsw: bool = False
    reason: str = ""
    claims: Claims | None = None

    @property
    def name(self) -> str:
        """This execution's name: its parent's, below ``trio_supervisor``."""
        return self.parent.rpartition("/")[2]

    @property
    def used(self) -> bool:
        return bool(self.limits) or self.kill is not None

    def roots(self, controllers: Collection[str] | None = None) -> list[Path]:
        """Each hierarchy used (holding one of ``controllers``, if given, or the kill), once."""
        found = [
            root for name, root in self.limits.items() if controllers is None or name in controllers
        ]
        found += [self.kill] if self.kill is not None else []
        return list(dict.fromkeys(found))

    def controllers(self, limits: Limits) -> frozenset[str]:
        """The controllers a child's cgroup needs for ``limits``.

        Only those: a cgroup of a v1 hierarchy costs its making, its removal and (cpu)
        a scheduling group of the kernel's, so a child limited in memory and processes
        alone has none in ``cpu`` and ``cpuacct`` (its accounting).
        """
        needed = set()
        if limits.memory_bytes is not None:
            needed.add("memory")
        if limits.processes is not None:
            needed.add("pids")
        if limits.cpu_percent is not None:
            needed |= {"cpu", "cpuacct"}
        return frozenset(name for name in needed if name in self.limits)

    def describe(self) -> str:
        """One line for the log: what limits a child's tree, and what kills it."""
        if not self.used:
            return (
                f"no cgroup ({self.reason}): memory_bytes is RLIMIT_AS per process, and "
                "loads asking for processes or cpu_percent are refused"
            )
        enforced = [
            name
            for name, controller in (
                ("memory_bytes", "memory"),
                ("processes", "pids"),
                ("cpu_percent", "cpu"),
            )
            if controller in self.limits
        ]
        version = "v2" if self.v2 else "v1"
        text = f"a cgroup per child ({version}: {', '.join(enforced) or 'no limits'}"
        if "memory" in self.limits and not self.v2:
            text += ", memory plus swap" if self.memsw else ", memory without swap accounting"
        text += ")"
        if self.kill is not None:
            text += ", killed by cgroup.kill"
        else:
            text += ", killed process by process"
        if POOL:
            text += f", up to {POOL} emptied ones kept for the next children"
        if self.reason:
            text += f"; {self.reason}"
        return text

    def wanted(self, limits: Limits) -> bool:
        """Whether a child with ``limits`` gets a cgroup: only for a tree limit.

        A cgroup costs a child's start about 1 ms, and a cold start's move into the v1
        memory cgroup 5-18 ms more on some kernels; a child without a tree limit is
        contained as before (its PID namespace or its sweep) and pays none of it.
        """
        if not self.used:
            return False
        return (
            (limits.memory_bytes is not None and "memory" in self.limits)
            or limits.processes is not None
            or limits.cpu_percent is not None
        )

    def refuse(self, limits: Limits) -> None:
        """Raise PackageError for a limit asked for that no cgroup here can enforce."""
        for name, controller in (("processes", "pids"), ("cpu_percent", "cpu")):
            value = getattr(limits, name)
            if value is not None and controller not in self.limits:
                raise PackageError(
                    f"the limit {name}={value} cannot be enforced here: no writable cgroup "
                    f"has the {controller} controller"
                )

    def rlimits(self, limits: Limits) -> Limits:
        """The limits left to setrlimit: memory goes to the cgroup where there is one."""
        if self.wanted(limits) and "memory" in self.limits:
            return attrs.evolve(limits, memory_bytes=None)
        return limits

    def child(self, name: str, limits: Limits) -> TreeCgroup:
        """The cgroup of a new child, not made yet (see :meth:`TreeCgroup.create`), in
        the hierarchies its limits need."""
        return TreeCgroup(self, f"{self.parent}/{name}", limits, self.controllers(limits))

    def prepared(self, pid: int, limits: Limits) -> TreeCgroup:
        """A cgroup made for the process ``pid`` and holding it, in the hierarchies
        ``limits`` need, with none of them written yet.

        Blocks while the kernel moves it (see the module's docs): call it in a worker
        thread, while the process boots, before its load's limits are written.

        Raises:
            OSError: It cannot be made, or ``pid`` moved (ProcessLookupError: it is gone).
        """
        started = start_time(pid)
        if started is None:
            raise ProcessLookupError(errno.ESRCH, f"no process {pid}")
        cgroup = self.child(f"{pid}-{started}", Limits())
        cgroup.controllers = self.controllers(limits)
        cgroup.prepare(pid)
        return cgroup

    def recorded(self, path: str) -> TreeCgroup:
        """The cgroup a record names, left by an earlier run.

        Raises:
            ValueError: ``path`` is not one of ours.
        """
        parts = path.split("/")
        if parts[0] != PARENT or len(parts) < 3 or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"{path!r} is not a cgroup of this project")
        return TreeCgroup(self, path, Limits())

    def leftovers(self) -> Iterator[Path]:
        """Each child cgroup of this execution's parent, in every hierarchy."""
        for root in self.roots():
            base = root / self.parent
            try:
                entries = list(os.scandir(base))
            except OSError:
                continue
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    yield Path(entry.path)

    def remove_empty_leftovers(self) -> int:
        """Remove what an earlier run left that holds nothing; return how many."""
        removed = 0
        for path in self.leftovers():
            try:
                os.rmdir(path)
            except OSError:
                continue  # populated: recovery's, by its record
            removed += 1
        return removed

    def reclaim(self) -> list[str]:
        """Remove what the executions of runners that are gone left, in every hierarchy
        used: their empty cgroups, their parents once empty, their claims once nothing
        of their parent is left (see the module's docs). Blocking: call it in a worker
        thread. Returns the cgroups removed, and logs them.
        """
        if self.claims is None:
            return []
        claims = self.claims
        removed: list[str] = []
        unclaimed: list[str] = []
        with claims.reclaiming():
            names = set(claims.names())
            for root in self.roots():
                with contextlib.suppress(OSError):
                    names.update(
                        entry.name
                        for entry in os.scandir(root / PARENT)
                        if entry.is_dir(follow_symlinks=False)
                    )
            names.discard(self.name)
            for name in sorted(names):
                if not EXECUTION.fullmatch(name):
                    continue  # no execution's: nothing of ours
                try:
                    claim = claims.read(name)
                except ClaimError as error:
                    logger.warning("%s; the cgroups of %s/%s are left alone", error, PARENT, name)
                    continue
                if claim is None:
                    unclaimed.append(name)
                    continue
                if not claims.gone(claim, claims.owner.boot_id):
                    continue
                left = False
                for root in self.roots():
                    found, gone = _remove_empty(root / PARENT / name)
                    removed += gone
                    left = left or found
                if not left:
                    claims.remove(name, claim)
        if removed:
            logger.info(
                "removed %d cgroups that runners which are gone left: %s",
                len(removed),
                ", ".join(removed[:10]),
            )
        if unclaimed:
            logger.info(
                "cgroups of %s that no runner claims are left alone (made by an earlier "
                "version, or by a runner that may not write the claims): %s",
                PARENT,
                ", ".join(unclaimed[:10]),
            )
        return removed

    def let_go(self) -> None:
        """Drop this execution's claim of its parent, once its parent is gone from every
        hierarchy (else a reclaim takes it once its runner is gone)."""
        if self.claims is None:
            return
        if not any((root / self.parent).exists() for root in self.roots()):
            self.claims.drop(self.name)

    def close(self) -> None:
        """Remove this execution's parents, if they are empty (best effort), and the
        shared ``trio_supervisor`` above them where the last execution left it empty. A
        cgroup2 one with controllers enabled in it stays: a child's cgroup made below a
        parent made anew would have none."""
        for root in self.roots():
            with contextlib.suppress(OSError):
                os.rmdir(root / self.parent)
                if not self.v2:
                    os.rmdir(root / PARENT)


def _remove_empty(parent: Path) -> tuple[bool, list[str]]:
    """Remove the empty cgroups below ``parent``, then ``parent`` if it is empty: whether
    anything of it is left, and what was removed."""
    removed: list[str] = []
    left = False
    try:
        entries = [
            entry.path for entry in os.scandir(parent) if entry.is_dir(follow_symlinks=False)
        ]
    except FileNotFoundError:
        return False, removed
    except OSError:
        return True, removed
    for path in [*entries, str(parent)]:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            continue
        except OSError:
            left = True  # it still holds a process (or, the parent, such a cgroup)
            continue
        removed.append(path)
    return left, removed


def execution_name(state_directory: Path) -> str:
    return hashlib.sha256(str(state_directory).encode()).hexdigest()[:16]


def detect(root: Path | None, state_directory: Path, claims: Claims | None = None) -> Hierarchies:
    """Find and prepare what this process may write below ``root``; None: no cgroups.

    With ``claims`` (the machine's claims of parents), claims this execution's parent
    first (taking it from a runner on the same state directory that is gone).

    Makes this execution's parent in each hierarchy to learn whether it may (v2 keeps
    it, with its controllers enabled; v1 removes it again, a child's cgroup making it
    anew). Never raises: what cannot be used is left out, and said in ``reason``.
    """
    parent = f"{PARENT}/{execution_name(state_directory)}"
    if root is None:
        return Hierarchies(parent=parent, reason="turned off")
    claims = _claim(claims, execution_name(state_directory), state_directory)
    found = _detect(root, parent)
    if not found.used and claims is not None:
        claims.drop(found.name)  # nothing to hold
        claims = None
    return attrs.evolve(found, claims=claims)


def _claim(claims: Claims | None, name: str, state_directory: Path) -> Claims | None:
    """``claims``, once this execution's parent is claimed in it; None where it cannot be."""
    if claims is None:
        return None
    try:
        holder = claims.take(name, state_directory)
    except (ClaimError, OSError) as error:
        logger.warning("the cgroups of %s cannot be claimed: %s", state_directory, error)
        return None
    if holder is not None:
        logger.warning(
            "the cgroups of %s are claimed by a runner that still runs, %s: two runners "
            "on one state directory?",
            state_directory,
            holder.describe(),
        )
        return None
    return claims


def _detect(root: Path, parent: str) -> Hierarchies:
    reasons: list[str] = []
    v2_root: Path | None = root if (root / "cgroup.controllers").exists() else root / "unified"
    if v2_root is not None and not (v2_root / "cgroup.controllers").exists():
        v2_root = None
    if v2_root is not None:
        hierarchies = _v2(v2_root, parent, reasons)
        if hierarchies is not None:
            return hierarchies
    limits: dict[str, Path] = {}
    for name in V1_CONTROLLERS:
        hierarchy = root / name
        if not (hierarchy / "cgroup.procs").exists() or (hierarchy / "cgroup.controllers").exists():
            continue
        if _made(hierarchy, parent, reasons):
            limits[name] = hierarchy
    kill = None
    if v2_root is not None and _made(v2_root, parent, reasons):
        # In every cgroup but the root, where the kernel has it.
        if (v2_root / parent / "cgroup.kill").exists():
            kill = v2_root
        else:
            reasons.append(f"cgroup2 at {v2_root} has no cgroup.kill")
    memsw = "memory" in limits and (limits["memory"] / "memory.memsw.limit_in_bytes").exists()
    if not limits and kill is None and not reasons:
        reasons.append(f"no cgroup hierarchy under {root}")
    found = Hierarchies(
        parent=parent, limits=limits, kill=kill, memsw=memsw, reason="; ".join(reasons)
    )
    # The parents were made to find what is writable. In v1 a child's cgroup makes its
    # parent again as it is made (TreeCgroup.create), so they go now: a runner whose
    # children ask for no tree limit, killed before it could remove them, leaves none.
    found.close()
    return found


def _made(hierarchy: Path, parent: str, reasons: list[str]) -> bool:
    try:
        (hierarchy / parent).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reasons.append(f"{hierarchy} is not writable ({error.strerror})")
        return False
    return True


def _v2(hierarchy: Path, parent: str, reasons: list[str]) -> Hierarchies | None:
    """cgroup2 with the controllers enabled down to ``parent``, or None."""
    available = (hierarchy / "cgroup.controllers").read_text().split()
    missing = [name for name in V2_CONTROLLERS if name not in available]
    if missing:
        reasons.append(f"cgroup2 at {hierarchy} lacks {', '.join(missing)}")
        return None
    if not _made(hierarchy, parent, reasons):
        return None
    # Each level above the children must enable the controllers for the one below it.
    enable = " ".join(f"+{name}" for name in V2_CONTROLLERS)
    level = hierarchy
    try:
        for part in ["", *parent.split("/")]:
            level = level / part if part else level
            enabled = (level / "cgroup.subtree_control").read_text().split()
            if any(name not in enabled for name in V2_CONTROLLERS):
                _write(level / "cgroup.subtree_control", enable)
    except OSError as error:
        reasons.append(f"cgroup2 controllers cannot be enabled in {level} ({error.strerror})")
        return None
    limits = dict.fromkeys(V2_CONTROLLERS, hierarchy)
    return Hierarchies(parent=parent, v2=True, limits=limits, kill=hierarchy)


class TreeCgroup:
    """One child's cgroup, in every hierarchy used.

    Args:
        hierarchies: What :func:`detect` found.
        path: The cgroup, relative to each hierarchy's root.
        limits: What it enforces once made.
        controllers: Those whose hierarchies it is in (and the kill's); None: every one
            (a cgroup an earlier run recorded, whichever it was in).
    """

    def __init__(
        self,
        hierarchies: Hierarchies,
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
        # Its control files kept open, while the pool has it (see _Files); None: each is
        # opened as it is written or read.
        self.files: _Files | None = None
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
                if text not in _read(procs).split():
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
            _write(path, value)
        else:
            self.files.write(path, value)

    def _get(self, path: Path) -> str:
        """Read a control file of it (not ``cgroup.procs``), through :attr:`files` if kept."""
        return _read(path) if self.files is None else self.files.read(path)

    def _close_files(self) -> None:
        if self.files is not None:
            self.files.close()

    def _move(self, pid: int) -> None:
        for procs in self.procs:
            _write(Path(procs), str(pid))

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
                found.update(int(pid) for pid in _read(procs).split())
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
                _write(self.hierarchies.kill / self.path / "cgroup.kill", "1")
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
            if any(_read(procs).strip() for procs in self.procs if procs != skip):
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
            _write(reclaim, amount)  # rarely: not kept open
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


@attrs.frozen
class _Kept:
    """A cgroup the pool keeps: where it is, its OOM kills' baseline, its files."""

    path: str
    oom_baseline: int
    files: _Files


@attrs.define
class _Lent:
    """A cgroup the pool gave out: its files, and the ref of the child it holds (None
    until one does: a standby waits in it, or a cold start's interpreter boots)."""

    files: _Files
    child: str | None = None


class Pool:
    """The emptied cgroups an execution keeps for its next children, by the hierarchies
    they are in (see the module's docs), each with its control files kept open.

    Thread-safe: a cold start takes one in the worker thread that moves its interpreter
    in, while a gone child's is kept in another.

    Args:
        hierarchies: What :func:`detect` found.
        size: How many it keeps at most: ``POOL`` by default, none where no cgroup is
            used.
    """

    def __init__(self, hierarchies: Hierarchies, size: int | None = None) -> None:
        self.hierarchies = hierarchies
        self.size = (POOL if size is None else size) if hierarchies.used else 0
        self._lock = threading.Lock()
        self._kept: dict[frozenset[str], list[_Kept]] = {}
        # Each cgroup given out, by path, until it comes back (see held_from).
        self._lent: dict[str, _Lent] = {}
        self._closed = False
        self.taken = 0  # how many times one of its cgroups was given out

    def __len__(self) -> int:
        with self._lock:
            return self._count()

    def _count(self) -> int:
        return sum(len(kept) for kept in self._kept.values())

    def paths(self) -> list[str]:
        """The cgroups it keeps now."""
        with self._lock:
            return [kept.path for entries in self._kept.values() for kept in entries]

    def take(self, controllers: frozenset[str]) -> TreeCgroup | None:
        """A cgroup it keeps, in exactly the hierarchies ``controllers`` need (and the
        kill's), made, with no limit written; None where it keeps none."""
        with self._lock:
            kept = self._kept.get(controllers)
            if not kept:
                return None
            found = kept.pop()
            self._lent[found.path] = _Lent(found.files)
            self.taken += 1
        cgroup = TreeCgroup(self.hierarchies, found.path, Limits(), controllers)
        cgroup.made = True
        cgroup.reused = True
        cgroup.oom_baseline = found.oom_baseline
        cgroup.files = found.files
        return cgroup

    def put_back(self, cgroup: TreeCgroup) -> None:
        """Keep again ``cgroup``, just taken, which nothing joined (unless the pool is
        closed or full meanwhile: it is left then to the execution's end)."""
        assert cgroup.controllers is not None  # taken from the pool
        assert cgroup.files is not None
        with self._lock:
            self._lent.pop(cgroup.path, None)
            if not self._closed and self._count() < self.size:
                kept = _Kept(cgroup.path, cgroup.oom_baseline, cgroup.files)
                self._kept.setdefault(cgroup.controllers, []).append(kept)
                return
        cgroup.files.close()

    def given(self, cgroup: TreeCgroup, child: str) -> None:
        """``cgroup``, if it was taken from the pool, holds the child whose identity's ref
        is ``child`` now."""
        with self._lock:
            lent = self._lent.get(cgroup.path)
            if lent is not None:
                lent.child = child

    def held_from(self, path: str, child: str) -> bool:
        """Whether the cgroup ``path`` is one this pool keeps, or gave to another than the
        child whose identity's ref is ``child``. Then that child is not in it: it was
        confirmed empty of every child before it was kept, so a record that names it for
        ``child`` (of an incarnation that ended with the pool's execution still running)
        is settled without touching it."""
        with self._lock:
            if any(kept.path == path for entries in self._kept.values() for kept in entries):
                return True
            lent = self._lent.get(path)
            return lent is not None and lent.child != child

    def keep(self, cgroup: TreeCgroup) -> bool:
        """(In a worker thread.) Keep ``cgroup``, which its child's stop confirmed empty,
        for another child (fit again by :meth:`TreeCgroup.reset`); or remove it where it
        is unfit, or the pool is full or closed. Whether it was kept.

        Raises:
            OSError: It cannot be removed.
        """
        with self._lock:
            self._lent.pop(cgroup.path, None)
            room = not self._closed and self._count() < self.size
        if room:
            if cgroup.files is None:
                cgroup.files = _Files()  # opened as the reset uses them, kept from now on
            if cgroup.reset():
                assert cgroup.controllers is not None  # reset refuses a recorded one
                with self._lock:
                    if not self._closed and self._count() < self.size:
                        kept = _Kept(cgroup.path, cgroup.oom_baseline, cgroup.files)
                        self._kept.setdefault(cgroup.controllers, []).append(kept)
                        return True
        cgroup.remove_blocking()  # and its files closed
        return False

    def close(self) -> None:
        """Keep nothing more: each cgroup given back from now on is removed."""
        with self._lock:
            self._closed = True

    def drain(self) -> None:
        """(In a worker thread.) :meth:`close` it, and remove every cgroup it keeps (one
        that cannot be is logged, and left to the next start's removal of leftovers);
        the files of those it gave out are closed (what held them has ended)."""
        with self._lock:
            self._closed = True
            kept = []
            for controllers, entries in self._kept.items():
                for entry in entries:
                    cgroup = TreeCgroup(self.hierarchies, entry.path, Limits(), controllers)
                    cgroup.files = entry.files
                    kept.append(cgroup)
            self._kept.clear()
            lent, self._lent = self._lent, {}
        for given in lent.values():
            given.files.close()
        for cgroup in kept:
            try:
                cgroup.remove_blocking()
            except OSError as error:
                logger.warning("cannot remove the cgroup %s: %s", cgroup.path, error)
