"""Process groups, as the kernel shows them (Linux).

Theory of operation: every child of the subprocess execution leads a process group of
its own (its pgid is its pid), and whatever it starts stays in that group unless it
leaves on purpose. So the group, not the pid, is what we signal, count and wait for.
What we know of a process comes from ``/proc/PID/stat``, read by :func:`read_stat`
and nowhere else in the package (the child-side ``_bootstrap.py``, which may import
nothing of the package, keeps a reading of its own).

Rules that never bend:

* A child is gone only when its group is: :func:`group_gone` returns once no process,
  not even a zombie, holds the group id.
* A pid alone names nobody. Only a pid together with the boot id and the start time
  it had when we recorded it names our child: the kernel reuses pids, but a reused pid
  has a later start time, and after a reboot no pid is ours.
* Signals are requests. :func:`signal_group` ignores a group that is already gone
  (``ESRCH``) or never was ours (``EPERM``); only an observed exit confirms anything.

Races this guards against:

* The leader exits while its grandchildren run on: the group outlives its leader, and
  is signalled and waited for by its recorded id, which no one else can take while any
  member lives.
* A grandchild is re-parented to us (we are a child subreaper) and exits: it stays a
  zombie in the group until reaped, so waiting for the group reaps as it polls, or the
  wait would never end.
* A process exits between listing ``/proc`` and reading its ``stat``: it is skipped,
  as if the listing had been taken a moment later.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from pathlib import Path

import attrs

from ... import realtime
from ...errors import ExecutionError
from ...model import ExitStatus

__all__ = [
    "ProcessStat",
    "become_subreaper",
    "boot_id",
    "exit_status",
    "group_exists",
    "group_gone",
    "live_members",
    "read_stat",
    "reap",
    "reap_group",
    "signal_group",
    "start_time",
]

GROUP_POLL = 0.005  # seconds between checks that a group is empty
_PR_SET_CHILD_SUBREAPER = 36


@attrs.frozen(kw_only=True)
class ProcessStat:
    """What ``/proc/PID/stat`` says of one process (the fields we use).

    Attributes:
        name: The command name (field 2), without its parentheses.
        state: The state letter (field 3); ``"Z"`` for a zombie.
        ppid: The parent's pid (field 4).
        pgid: The process group id (field 5).
        session: The session id (field 6).
        start_time: Clock ticks after boot when the process started (field 22).
    """

    name: str
    state: str
    ppid: int
    pgid: int
    session: int
    start_time: int

    @property
    def running(self) -> bool:
        """Whether the process still runs: it exists and is not a zombie."""
        return self.state != "Z"


def read_stat(pid: int) -> ProcessStat | None:
    """The ``/proc/PID/stat`` of ``pid``, or None when there is no such process."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            raw = os.read(fd, 4096)  # the whole file: its name is at most 64 bytes
        finally:
            os.close(fd)
        # The command name may hold spaces and parentheses: the fields follow the last ")".
        close = raw.rindex(b")")
        fields = raw[close + 2 :].decode().split()
        return ProcessStat(
            name=raw[raw.index(b"(") + 1 : close].decode(errors="replace"),
            state=fields[0],
            ppid=int(fields[1]),
            pgid=int(fields[2]),
            session=int(fields[3]),
            start_time=int(fields[19]),
        )
    except (OSError, ValueError, IndexError):
        return None  # gone, or gone while we read it


def boot_id() -> str:
    """This boot of the kernel; after a reboot no recorded pid is ours."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def start_time(pid: int) -> int | None:
    """Clock ticks after boot when ``pid`` started, or None when there is no such pid."""
    stat = read_stat(pid)
    return None if stat is None else stat.start_time


def live_members(pgid: int) -> list[int]:
    """The processes of a group that still run (zombies are not counted)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = read_stat(int(entry))
            if stat is not None and stat.pgid == pgid and stat.running:
                members.append(int(entry))
    return members


def group_exists(pgid: int) -> bool:
    """Whether any process (a zombie included) is in the group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def become_subreaper() -> None:
    """Make this process the reaper of its orphaned descendants (``PR_SET_CHILD_SUBREAPER``).

    Raises:
        ExecutionError: The kernel refused.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise ExecutionError(f"cannot become a child subreaper: {os.strerror(ctypes.get_errno())}")


def signal_group(pgid: int, signum: int) -> None:
    """Send ``signum`` to the group; a group that is gone (or not ours) is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def reap_group(pgid: int) -> None:
    """Reap members of the group that are our children (zombies of a subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


async def group_gone(pgid: int) -> None:
    """Return once no process is left in the group.

    Members that were re-parented to us (when this process is a child subreaper) are
    reaped here, or they would stay in the group as zombies. Not a checkpoint when the
    group is gone already: callers wait for the leader first.
    """
    while True:
        reap_group(pgid)
        if not group_exists(pgid):
            return  # the caller's wait for the leader was the checkpoint
        await realtime.sleep(GROUP_POLL)  # a poll of the process table: real time


def reap(pid: int) -> ExitStatus:
    """The exit status of a child of ours that exited, or 'signal 9' if not ours."""
    try:
        _, raw = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return ExitStatus(code=None, signal=signal.SIGKILL)
    if os.WIFSIGNALED(raw):
        return ExitStatus(code=None, signal=os.WTERMSIG(raw))
    if os.WIFEXITED(raw):
        return ExitStatus(code=os.WEXITSTATUS(raw))
    return ExitStatus(code=None, signal=signal.SIGKILL)


def exit_status(
    returncode: int, *, descendants_killed: int = 0, oom_limit: int | None = None
) -> ExitStatus:
    """A ``Popen``-style returncode (negative: killed by that signal) as an ExitStatus,
    with what else is known of the exit."""
    if returncode < 0:
        code, signum = None, -returncode
    else:
        code, signum = returncode, None
    return ExitStatus(
        code=code, signal=signum, descendants_killed=descendants_killed, oom_limit=oom_limit
    )
