"""The cgroup hierarchies a runner may write, found once as it starts (Linux).

Hard limits for a child's whole tree are one cgroup per child (``_tree_cgroup``), in
this execution's parent of each hierarchy used; this module finds those hierarchies,
makes and claims the parents, and takes back what runners that are gone left in them.
The emptied children's cgroups kept for the next children are ``_pool``'s.

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
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Final

import attrs

from ...errors import PackageError
from ...model import Limits
from ..trees._groups import start_time
from ._claims import ClaimError, Claims
from ._control_files import write_control
from ._pool import POOL
from ._tree_cgroup import TreeCgroup

__all__ = ["PARENT", "ROOT", "Hierarchies", "detect", "execution_name"]

logger = logging.getLogger(__name__)

ROOT: Final = Path("/sys/fs/cgroup")
PARENT: Final = "trio_supervisor"
V1_CONTROLLERS: Final = ("memory", "pids", "cpu", "cpuacct")
V2_CONTROLLERS: Final = ("memory", "pids", "cpu")
EXECUTION: Final = re.compile(r"[0-9a-f]{16}")
# How many emptied cgroups an execution keeps for its next children (Pool), and the memory
# still charged to one (the page cache of what its child wrote: 0.1-0.5 MiB after a


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
                write_control(level / "cgroup.subtree_control", enable)
    except OSError as error:
        reasons.append(f"cgroup2 controllers cannot be enabled in {level} ({error.strerror})")
        return None
    limits = dict.fromkeys(V2_CONTROLLERS, hierarchy)
    return Hierarchies(parent=parent, v2=True, limits=limits, kill=hierarchy)
