"""Recovery: the children an earlier run of a subprocess execution left, found and ended.

A runner that crashed leaves its children to their dead-man switch, and their records
to the next start, which asks the execution to make sure each is gone (V2): that is
:func:`recover`. What it may touch is decided by the record alone: the child's boot id,
pid, start time, process group, uid and cgroup.

Rules that never bend:

* Nothing is signalled that is not the recorded child or its descendant: a different
  boot id, or a pid whose start time differs from the record, means the child is gone.
  A live child is pinned by a pidfd before its start time is checked again, and killed
  with its whole tree (its namespace, or every process below it: ``trees._trees``).
* A child that is gone but left processes in its process group or session has those
  killed: only its descendants can hold those ids.
* A cgroup is touched only in the boot that made it, and not while this execution
  holds it (``limits._pool``: a runner that heals itself recovers its own records).

Races this guards against: the recorded pid reused by a stranger (its start time
differs, so it is left alone), and the pid exiting and passing to a stranger between
the check and the signal (the pidfd pins it).
"""

from __future__ import annotations

import logging

import attrs
import trio

from ..errors import ExecutionError
from ..model import ChildIdentity, ExitStatus, Termination
from .limits._cgroups import Hierarchies
from .limits._isolation import Isolated
from .limits._pool import Pool
from .starting._children import ADAPTER
from .trees._groups import group_gone, read_stat, reap_group
from .trees._trees import Tree, kill_recorded, process_table

__all__ = ["recover"]

# What recovery finds is said in the subprocess execution's own name (its
# face's logger): one logger for an operator to configure.
logger = logging.getLogger("trio_supervisor.executions.subprocess")


async def recover(
    child: ChildIdentity,
    *,
    boot_id: str,
    cgroups: Hierarchies,
    isolated: Isolated,
    pool: Pool,
) -> Termination:
    """Make sure ``child``, left by an earlier run, is gone; never touch anyone else.

    Args:
        child: The identity a record names.
        boot_id: This machine's boot id now.
        cgroups: The hierarchies of this execution (where the child's cgroup may be).
        isolated: This execution's isolation (which frees the uid the child had).
        pool: The cgroups this execution keeps or gave out (left alone).

    Raises:
        ExecutionError: ``child`` was not made by the subprocess execution.
    """
    if child.adapter != ADAPTER or child.pid is None or child.pgid is None:
        raise ExecutionError(f"{child} was not made by the subprocess execution")
    termination = await _recover_tree(child, child.pid, child.pgid, boot_id)
    if child.uid is not None and child.boot_id == boot_id:
        await isolated.recovered(child.uid)
    if child.cgroup is None or child.boot_id != boot_id or not cgroups.used:
        return termination  # after a reboot, no cgroup of that run is left
    try:
        cgroup = cgroups.recorded(child.cgroup)
    except ValueError as error:
        logger.warning("recovery leaves a cgroup alone: %s", error)
        return termination
    if pool.held_from(child.cgroup, child.ref):
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


async def _recover_tree(child: ChildIdentity, pid: int, pgid: int, boot_id: str) -> Termination:
    gone = Termination(kind="exited", exit=ExitStatus(code=None, signal=None))
    if child.boot_id != boot_id:
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
