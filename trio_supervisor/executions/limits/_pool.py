"""Emptied cgroups an execution keeps for its next children (Linux).

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

Rules that never bend:

* A cgroup is kept for another child only once it is empty (as it is removed), and it
  is given out with no limit of the child before it.
"""

from __future__ import annotations

import logging
import threading
from typing import Final

import attrs

from ... import _defaults as defaults
from ...model import Limits
from ._control_files import ControlFiles
from ._tree_cgroup import Layout, TreeCgroup

__all__ = ["POOL", "Pool"]

logger = logging.getLogger(__name__)

# How many emptied cgroups an execution keeps for its next children.
POOL: Final = defaults.CGROUP_POOL


@attrs.frozen
class _Kept:
    """A cgroup the pool keeps: where it is, its OOM kills' baseline, its files."""

    path: str
    oom_baseline: int
    files: ControlFiles


@attrs.define
class _Lent:
    """A cgroup the pool gave out: its files, and the ref of the child it holds (None
    until one does: a standby waits in it, or a cold start's interpreter boots)."""

    files: ControlFiles
    child: str | None = None


class Pool:
    """The emptied cgroups an execution keeps for its next children, by the hierarchies
    they are in (see the module's docs), each with its control files kept open.

    Thread-safe: a cold start takes one in the worker thread that moves its interpreter
    in, while a gone child's is kept in another.

    Args:
        hierarchies: What ``_cgroups.detect`` found.
        size: How many it keeps at most: ``POOL`` by default, none where no cgroup is
            used.
    """

    def __init__(self, hierarchies: Layout, size: int | None = None) -> None:
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
                cgroup.files = ControlFiles()  # opened as the reset uses them, kept from now on
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
