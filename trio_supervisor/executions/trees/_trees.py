"""Process trees: everything a child started, found by parentage, frozen and killed.

Theory of operation: a process group holds only what stays in it (``setsid`` and
``setpgid`` leave it), so what a child started is found by parentage instead: the tree
below the child's tracked process, by the parent pid of ``/proc/PID/stat``. While the
tracked process lives, nothing the plugin starts can leave that tree: in a PID
namespace the tracked process is its PID 1, so every orphan goes to it; in a sweep the
tracked process is a child subreaper, so every orphan goes to it too (see
``_bootstrap.py`` for the tracked process T and the plugin P).

Rules that never bend:

* A process is signalled only through a pidfd, taken after a walk found it and checked
  against the start time that walk read: a pid that was freed and reused meanwhile is
  never signalled.
* A tree is frozen before it is killed: SIGSTOP, walk after walk, until a walk finds
  nothing of it running. A stopped process cannot fork, so what is killed is all there
  is.
* Gone means exited (each pidfd readable), and reaped when it became our child: a
  killed process whose parent died is re-parented to us, a subreaper.

Races this guards against:

* A process exits between the walk and its pidfd: it is skipped, as if the walk had
  come a moment later.
* A process not stopped yet sends SIGCONT to one that is: the next walk finds it
  running and stops it again, and the sender too.
* A killed process's zombie is re-parented to us only once its parent has exited, so
  the reap waits until every pinned process has.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Collection, Iterable

import attrs
import trio

from ...model import ExitStatus
from ._groups import ProcessStat, group_gone, read_stat, reap, signal_group, start_time

__all__ = [
    "Tree",
    "descendants",
    "has_namespace",
    "kill_recorded",
    "left_behind",
    "process_table",
    "strays",
]

# Walks of a tree a freeze may take before it kills what it found anyway (a process in
# uninterruptible sleep stops only when it leaves it).
FREEZE_PASSES = 200


def process_table() -> dict[int, ProcessStat]:
    """Every process ``/proc`` shows, by pid."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = read_stat(int(entry))
            if stat is not None:
                table[int(entry)] = stat
    return table


def descendants(roots: Iterable[int], table: dict[int, ProcessStat]) -> list[int]:
    """Every process below ``roots`` (zombies included), parents before their children."""
    children: dict[int, list[int]] = {}
    for pid, stat in table.items():
        children.setdefault(stat.ppid, []).append(pid)
    found: list[int] = []
    frontier = list(roots)
    while frontier:
        for child in children.get(frontier.pop(0), ()):
            found.append(child)
            frontier.append(child)
    return found


def _oldest_child(parent: int, table: dict[int, ProcessStat]) -> int | None:
    children = [pid for pid, stat in table.items() if stat.ppid == parent]
    return min(children, key=lambda pid: (table[pid].start_time, pid), default=None)


def has_namespace(pid: int) -> bool:
    """Whether ``pid`` holds its children in a PID namespace of their own: it is the PID 1
    of one (a tracked process), or made one for them (a tracked process of an earlier
    version, which a record may still name)."""
    try:
        own = os.readlink(f"/proc/{pid}/ns/pid")
        children = os.readlink(f"/proc/{pid}/ns/pid_for_children")
        ours = os.readlink("/proc/self/ns/pid")
    except OSError:
        return False
    return own != ours or children != own


def left_behind(tracked: int, table: dict[int, ProcessStat]) -> int:
    """How many processes below the tracked process the plugin started (running ones).

    The machinery is not counted: the tracked process and the plugin's own process, its
    first child: no process of the plugin's exists before it, so none is older.
    """
    machinery = {tracked, _oldest_child(tracked, table)}
    return sum(
        1 for pid in descendants([tracked], table) if pid not in machinery and table[pid].running
    )


def strays(tracked: int, marker: int | None) -> dict[int, ProcessStat]:
    """What a tracked process that is gone may have left to us: its session's members
    (zombies too), and our children that hold its marker (the pipe whose reading end is
    ``marker``).

    Both survive a cleared environment, and neither is a name. A process that left the
    session and closed the inherited marker is beyond this (see subprocess.py).
    """
    table = process_table()
    if tracked in table:
        return {}  # its pid is someone else's now, and so may its session id be
    found = {pid: stat for pid, stat in table.items() if stat.session == tracked}
    if marker is not None and not select.select([marker], [], [], 0)[0]:
        # Readable would mean that no process holds the other end any more.
        inode = f"pipe:[{os.fstat(marker).st_ino}]"
        me = os.getpid()
        for pid, stat in table.items():
            if stat.ppid == me and stat.running and pid not in found and _holds(pid, inode):
                found[pid] = stat
    return found


def _holds(pid: int, inode: str) -> bool:
    try:
        return any(
            os.readlink(f"/proc/{pid}/fd/{fd}") == inode for fd in os.listdir(f"/proc/{pid}/fd")
        )
    except OSError:
        return False


@attrs.define(eq=False)
class Tree:
    """Processes pinned by pidfds, to be frozen and killed as one.

    Attributes:
        pidfds: The pinned processes, by pid.
    """

    pidfds: dict[int, int] = attrs.field(factory=dict)

    def pin(self, pid: int, started: int | None) -> bool:
        """Pin ``pid`` if it is still the process that started at ``started``."""
        if pid in self.pidfds:
            return True
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return False  # gone
        if start_time(pid) != started:  # pinned, so this reads the pinned process
            os.close(pidfd)
            return False
        self.pidfds[pid] = pidfd
        return True

    def _send(self, pid: int, number: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfds[pid], number)

    def freeze(self, roots: Collection[int]) -> None:
        """Stop ``roots`` (those pinned) and everything below them until none runs,
        pinning each process found."""
        roots = [pid for pid in roots if pid in self.pidfds]
        for _ in range(FREEZE_PASSES):
            table = process_table()
            running = False
            for pid in [*roots, *descendants(roots, table)]:
                stat = table.get(pid)
                if stat is None or not stat.running or not self.pin(pid, stat.start_time):
                    continue
                if stat.state not in ("T", "t"):
                    running = True
                    self._send(pid, signal.SIGSTOP)
            if not running:
                return

    def kill(self) -> None:
        """SIGKILL every pinned process (a frozen one dies as a running one does)."""
        for pid in self.pidfds:
            self._send(pid, signal.SIGKILL)

    async def gone(self, *, skip: Collection[int] = ()) -> None:
        """Return once every pinned process has exited; reap those that are our
        children, except ``skip`` (reaped by whoever started them); unpin them all."""
        for pidfd in self.pidfds.values():
            await trio.lowlevel.wait_readable(pidfd)  # readable once it exited
        for pid, pidfd in self.pidfds.items():
            if pid not in skip:
                # By its pidfd: exactly the pinned process, and only if it is ours.
                with contextlib.suppress(ChildProcessError):
                    os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222
        self.close()

    def close(self) -> None:
        for pidfd in self.pidfds.values():
            os.close(pidfd)
        self.pidfds.clear()


async def kill_recorded(pid: int, pgid: int, recorded: int | None) -> ExitStatus | None:
    """SIGKILL ``pid`` and its whole tree, if ``pid`` is still the process that started
    at ``recorded``; wait until all of it is gone.

    The pid is pinned by a pidfd before its start time is checked, so it cannot exit
    and pass to a stranger between the check and the signal. In a namespace, killing
    the tracked process, its PID 1, is enough: the kernel ends the namespace with it. A
    swept tree is frozen and killed process by process.

    Returns:
        How it ended (``descendants_killed`` counts what the plugin left running), or
        None when there is no such process, or it is not the one recorded.
    """
    tree = Tree()
    if not tree.pin(pid, recorded):
        await trio.lowlevel.checkpoint()
        return None
    try:
        namespace = has_namespace(pid)
        left = left_behind(pid, process_table())
        if not namespace:
            tree.freeze([pid])
        tree.kill()
        signal_group(pgid, signal.SIGKILL)
        await trio.lowlevel.wait_readable(tree.pidfds[pid])  # readable once it exited
        status = reap(pid)
        await tree.gone(skip={pid})
        await group_gone(pgid)
        return attrs.evolve(status, descendants_killed=left)
    finally:
        tree.close()
