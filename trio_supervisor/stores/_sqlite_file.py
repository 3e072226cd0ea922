"""The SQLite store's file: made private to its owner, and claimed by one store.

* :func:`claim` makes the file (mode 0600) if it does not exist, makes it and the
  companions an earlier run left private, and takes an ownership lock on it: a
  ``flock`` held for as long as the store is open. SQLite's own locks say that *some*
  connection uses the file, for a moment or for good; this one says that a store owns
  it, so a second store fails at once, naming the process that holds it, where SQLite
  would wait out its whole lock timeout first. A lock that no store holds (a checkpoint,
  a tool's brief transaction) is still SQLite's to wait for.
* ``flock`` and SQLite's POSIX locks do not meet on Linux or macOS. The descriptor is
  kept open until the store's connection closed: closing a descriptor of the file
  drops every POSIX lock the process holds on it, SQLite's included.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from typing import Final

from ..errors import StateStorageError

__all__ = ["COMPANIONS", "PRIVATE", "claim", "holder"]

PRIVATE: Final = 0o600  # the database's mode, and so its companions' (SQLite copies it)
# What SQLite keeps beside the database: the write-ahead log, its index (none in
# EXCLUSIVE locking mode), and the rollback journal of the switch to WAL.
COMPANIONS: Final = ("-wal", "-shm", "-journal")
# Where Linux lists the locks held on files, with the process that took each.
_LOCKS: Final = "/proc/locks"


def claim(path: str) -> int:
    """Make the file private and take its ownership lock; the descriptor that holds it.

    SQLite makes the write-ahead log and the journals with the database's own mode, so
    the companions it makes later are private too. A file that is private already is
    left as it is, whoever owns it. Close the descriptor once the store's connection
    closed (see the module docs).

    Raises:
        StateStorageError: The file cannot be made, or made private (it belongs to
            another user), or another store owns it: the message names the process,
            where the system says which.
    """
    try:
        # Read-only is enough to make the file, change its mode and lock it; SQLite
        # opens it for writing itself, and says so if it cannot.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, PRIVATE)
    except OSError as error:
        raise StateStorageError(f"{path}: cannot open: {error.strerror or error}") from error
    try:
        _make_private(path, fd)
        _own(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_private(path: str, fd: int) -> None:
    # SQLite names the companions after the file the path leads to.
    real = os.path.realpath(path)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) & ~PRIVATE:
            os.fchmod(fd, PRIVATE)
        for companion in (real + suffix for suffix in COMPANIONS):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_IMODE(os.stat(companion).st_mode) & ~PRIVATE:
                    os.chmod(companion, PRIVATE)
    except OSError as error:
        raise StateStorageError(
            f"{path}: cannot open: cannot make {error.filename or real} readable and "
            f"writable by its owner alone (mode 0600): {error.strerror or error}"
        ) from error


def _own(path: str, fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            # A file system without flock (some network ones): SQLite's own exclusive
            # lock still keeps a second store out, after its lock timeout.
            return
        # The words "is locked" are the ones callers look for (the runner, the examples).
        raise StateStorageError(
            f"{path}: cannot open: the file is locked by another store that owns it, in "
            f"{holder(fd) or 'a process the system does not name'}"
        ) from None


def holder(fd: int) -> str | None:
    """The process that holds the ownership lock of the file open as ``fd``, as
    ``process PID (COMMAND LINE)``; None where the system does not say (not Linux, or a
    process in another PID namespace)."""
    try:
        status = os.fstat(fd)
        # /proc/locks is ASCII only: no decoder or error handler is ever asked anything,
        # so mutants of how it is decoded are equivalent (mutmut leaves them out).
        # pragma: no mutate block
        with open(_LOCKS, encoding="ascii", errors="replace") as locks:
            listed = locks.read().splitlines()
    except OSError:
        return None
    # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2147796 0 EOF": the device's major and minor
    # numbers in hex, the inode in decimal; "->" marks a waiter, not a holder.
    device = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    for line in listed:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device:
            pid = int(fields[4]) if fields[4].isdigit() else 0
            if pid == os.getpid():
                return "this process"
            if pid > 0:
                return f"process {pid}{_command_of(pid)}"
    return None


def _command_of(pid: int) -> str:
    """`` (its command line)``, cut short; empty where it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            words = file.read().split(b"\0")
    except OSError:
        return ""
    command = " ".join(" ".join(word.decode(errors="replace").split()) for word in words if word)
    if not command:
        return ""
    return f" ({command if len(command) <= 120 else command[:117] + '...'})"
