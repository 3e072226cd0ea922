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
  by anyone else does not raise it.
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

__all__ = ["PARENT", "ROOT", "Hierarchies", "TreeCgroup", "detect"]

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
        """Make it with no limits, and move ``pid`` in (see :meth:`Hierarchies.prepared`).

        Raises:
            OSError: It cannot be made, or ``pid`` moved; nothing is left then.
        """
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
        for directory in reversed(self.directories()):
            with contextlib.suppress(OSError):
                directory.rmdir()
        self.made = False

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
        not made (yet, or at all: it may read "join" only after the load took it)."""
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
                _write(path, text)
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
        """How many of its processes the kernel killed for going over its memory limit."""
        memory = self._in("memory")
        if memory is None:
            return 0
        name = "memory.events" if self.hierarchies.v2 else "memory.oom_control"
        try:
            text = _read(memory / name)
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    async def remove(self) -> None:
        """Remove it in every hierarchy; it must be empty (see :meth:`emptied`)."""
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
        for directory in self.directories():
            for _ in range(REMOVE_TRIES):
                if _removed(directory):
                    break
                time.sleep(POLL)
        self.removed = True
