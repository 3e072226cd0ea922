"""The end of a child's log, as ``GET /v1/logs`` answers it: its last lines, or its last
bytes, read from the end of the file.

A log may be large and only its end is asked for, so the file is read backwards in
blocks until enough lines are found, never whole: the cost is what is answered. A last
line without a newline (a child still writing it) is a line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

__all__ = ["read_log"]

_BLOCK: Final = 64 * 1024  # bytes read at a time, backwards


def read_log(path: Path, *, lines: int | None = None, size: int | None = None) -> str:
    """A log's text: its last ``lines`` lines, or its last ``size`` bytes, or all of it
    when neither is given ("" where the file is gone). Blocking: call it in a thread.

    Bytes that are not UTF-8 (or a character cut by ``size``) read as U+FFFD.
    """
    assert lines is None or size is None, "lines or bytes, not both"
    try:
        with open(path, "rb") as log:
            end = os.fstat(log.fileno()).st_size
            if lines is not None:
                start = _start_of_last_lines(log.fileno(), end, lines)
            elif size is not None:
                start = max(0, end - size)
            else:
                start = 0
            log.seek(start)
            data = log.read(end - start)
    except FileNotFoundError:
        return ""
    return data.decode(errors="replace")


def _start_of_last_lines(fd: int, end: int, lines: int) -> int:
    """Where the last ``lines`` lines of the file's first ``end`` bytes begin."""
    if lines <= 0:
        return end
    # The newline that ends the last line ends no line after it: it is not counted.
    if end and os.pread(fd, 1, end - 1) == b"\n":
        end -= 1
    found = 0
    position = end
    while position > 0:
        begin = max(0, position - _BLOCK)
        block = os.pread(fd, position - begin, begin)
        at = len(block)
        while True:
            at = block.rfind(b"\n", 0, at)
            if at < 0:
                break
            found += 1
            if found == lines:
                return begin + at + 1
        position = begin
    return 0
