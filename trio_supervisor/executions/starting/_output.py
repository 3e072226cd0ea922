"""A child's output, copied into its log file with a cap (``Limits.output_bytes``).

Theory of operation: without a cap the child writes into its log file itself and
nothing here runs. With one, the child's stdout and stderr are one pipe, and
:func:`copy_output` copies it into the log, keeping the **head**: the first ``cap``
bytes, then one line saying the rest was dropped.

Rules that never bend:

* The log never holds more than ``cap`` bytes of output plus that one line.
* Output beyond the cap is still read, and thrown away: a child is never blocked on a
  full pipe because it talks too much.
* ``done`` is set however the copy ends (the pipe's end, an error, cancellation), so
  whoever waits for the last of the output never waits for a copier that is gone.

Races this guards against: the child's grandchildren hold the pipe too, so it ends
when the whole group is gone, not when the leader exits. The unit therefore waits for
``done`` (bounded) only after the group is gone.
"""

from __future__ import annotations

from pathlib import Path

import trio

__all__ = ["copy_output"]

_CHUNK = 65536


async def copy_output(reader: int, path: Path, cap: int | None, done: trio.Event) -> None:
    """Copy the pipe ``reader`` into the log file ``path``, keeping the head when capped.

    Args:
        reader: The read end of the child's output pipe; closed when the copy ends.
        path: The session's log file, truncated first.
        cap: The most bytes of output kept, or None for all of it.
        done: Set when the copy is over, however it ended.
    """
    try:
        await _copy(reader, path, cap)
    finally:
        done.set()


async def _copy(reader: int, path: Path, cap: int | None) -> None:
    written = 0
    dropped = False
    stream = trio.lowlevel.FdStream(reader)
    # Unbuffered: what the child wrote is in the file as soon as we have it.
    async with stream, await trio.open_file(path, "wb", buffering=0) as log:
        while True:
            try:
                chunk = await stream.receive_some(_CHUNK)
            except trio.BrokenResourceError:
                chunk = b""
            if not chunk:
                break
            if cap is None:
                await log.write(chunk)
                continue
            room = cap - written
            if room > 0:
                await log.write(chunk[:room])
                written += min(room, len(chunk))
            if len(chunk) > max(room, 0) and not dropped:
                dropped = True
                await log.write(
                    f"\n[trio_supervisor: output beyond {cap} bytes dropped]\n".encode()
                )
