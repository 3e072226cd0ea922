"""Bootstrap interpreters, and the one kept started ahead of the next load (the standby).

Theory of operation: every child starts as an :class:`Interpreter`, a ``python -I``
running ``_bootstrap.py`` in a session and process group of its own, which waits on
its socket for the spawn message and has run nothing yet. Python's start-up is most
of a minimal child's load time, so a :class:`Standby` may keep one interpreter started
ahead: a load takes it (:meth:`Standby.take`), tells it its session's log file and
environment with the spawn message, and a new one is started in the background.

Rules that never bend:

* An interpreter runs none of the caller's code until it is told to, so discarding
  one is a plain SIGKILL and a reap: it is alone in its group.
* There is at most one standby, and none is started once the execution is closing.
* A standby is never handed out dead: one that died while it waited is dropped, and
  the load starts an interpreter of its own.

Races this guards against:

* The execution closes while a standby is being started: :meth:`Standby.fill` keeps
  what it started even then, and the execution's exit discards it once every
  background task has ended (:meth:`Standby.close`), so none is left behind.
* The standby is killed from outside and already reaped: ``poll`` then says so, and
  its pid, no longer ours, is never signalled.
"""

from __future__ import annotations

import hashlib
import os
import py_compile
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Protocol

import attrs
import trio

__all__ = [
    "BOOTSTRAP",
    "ChildProcess",
    "Interpreter",
    "Standby",
    "compile_bootstrap",
    "start_interpreter",
]

BOOTSTRAP = Path(__file__).with_name("_bootstrap.py")
# How long a discarded interpreter, killed, may take to be reaped.
DISCARD_CONFIRMATION = 5.0


def compile_bootstrap(directory: Path) -> Path:
    """The bootstrap compiled once into ``directory``, or its source if that fails.

    Python compiles a script it is given as source on every start (only imported modules
    are cached), which costs each child a few milliseconds; given the compiled file, it
    runs that directly. The name carries the interpreter's cache tag and the source's
    digest, so a changed bootstrap or interpreter never runs a stale copy.
    """
    try:
        source = BOOTSTRAP.read_bytes()
        digest = hashlib.sha256(source).hexdigest()[:16]
        target = directory / f".bootstrap-{sys.implementation.cache_tag}-{digest}.pyc"
        if not target.exists():
            py_compile.compile(str(BOOTSTRAP), cfile=str(target), doraise=True)
    except (OSError, py_compile.PyCompileError):
        return BOOTSTRAP
    return target


class ChildProcess(Protocol):
    """What a bootstrap interpreter's process offers, started or forked."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    async def wait(self) -> int: ...


@attrs.define(eq=False)
class Interpreter:
    """A started bootstrap that has not been told what to run yet.

    Attributes:
        process: The bootstrap's process (a ``trio.Process``, or forked by the fork
            server).
        control: Our end of its socket pair.
        marker: The reading end of a pipe whose writing end it inherited, and passes on
            to whatever it starts: how its leftovers are known once it is gone (see
            ``_trees.strays``).
    """

    process: ChildProcess
    control: socket.socket
    marker: int

    async def discard(self) -> None:
        """End it and reap it. It ran nothing and is alone in its process group."""
        self.control.close()
        os.close(self.marker)
        if self.process.poll() is None:  # not reaped, so its pid is still ours
            self.process.kill()
        with trio.move_on_after(DISCARD_CONFIRMATION):
            await self.process.wait()


async def start_interpreter(
    python: str,
    bootstrap: Path,
    *,
    environment: Mapping[str, str],
    output: int,
    directory: Path,
) -> Interpreter:
    """A bootstrap process, waiting for its spawn message on the returned socket.

    Args:
        python: The interpreter to run.
        bootstrap: The bootstrap, compiled or as source.
        environment: The process's whole environment.
        output: The file descriptor its stdout and stderr go to.
        directory: Its working directory.
    """
    ours, theirs = socket.socketpair()
    marker, marked = os.pipe()
    try:
        process = await trio.lowlevel.open_process(
            [python, "-I", str(bootstrap), str(theirs.fileno())],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            pass_fds=(theirs.fileno(), marked),
            start_new_session=True,
            env=dict(environment),
            cwd=directory,
        )
    except BaseException:
        ours.close()
        os.close(marker)
        raise
    finally:
        theirs.close()
        os.close(marked)
    return Interpreter(process, ours, marker)


class Standby:
    """At most one interpreter started ahead of the next load.

    Args:
        start: Starts an interpreter with output going nowhere (the spawn message
            names the session's log file later).
    """

    def __init__(self, start: Callable[[], Awaitable[Interpreter]]) -> None:
        self._start = start
        self.ready: Interpreter | None = None
        self._filling = False
        self._closing = False

    async def fill(self) -> None:
        """Start the next standby interpreter, unless one is there or on its way."""
        if self.ready is not None or self._filling or self._closing:
            await trio.lowlevel.checkpoint()
            return
        self._filling = True
        try:
            interpreter = await self._start()
        except OSError:
            return  # the next load starts its own interpreter, and reports the error
        finally:
            self._filling = False
        # Kept even if the execution is closing: close() discards it once this task
        # has ended.
        self.ready = interpreter

    def take(self, nursery: trio.Nursery) -> Interpreter | None:
        """The interpreter started ahead, if there is a live one; the next one starts."""
        standby = self.ready
        if standby is None:
            return None
        self.ready = None
        nursery.start_soon(self.fill, name="standby interpreter")
        if standby.process.poll() is not None:
            standby.control.close()  # it died while it waited (reaped by poll)
            os.close(standby.marker)
            return None
        return standby

    def closing(self) -> None:
        """Start no more interpreters (the execution is on its way out)."""
        self._closing = True

    async def close(self) -> None:
        """Discard the interpreter that waits, if any; call once no fill() runs."""
        self._closing = True
        ready, self.ready = self.ready, None
        if ready is not None:
            # Shielded: this runs as the execution exits, often cancelled, and an
            # interpreter left here would outlive it. Bounded: discard waits at most
            # DISCARD_CONFIRMATION for the reap; this is the ceiling on it.
            with trio.move_on_after(DISCARD_CONFIRMATION, shield=True):
                await ready.discard()
