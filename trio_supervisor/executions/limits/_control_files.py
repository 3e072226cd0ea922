"""A cgroup's control files, as the kernel offers them: read, written, kept open.

Each is a small file of the kernel's whose read or write is one system call; what it
costs is its opening (see :class:`ControlFiles`), so the cgroups that are used again
(``_pool``) keep theirs open.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

__all__ = ["ControlFiles", "read_control", "write_control"]


def read_control(path: Path | str) -> str:
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


def write_control(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


class ControlFiles:
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
