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

import contextlib
import hashlib
import marshal
import os
import py_compile
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import trio

from ..._background import when_idle
from ...errors import ExecutionError
from ...realtime import bounded, outside_the_run
from ..child import _bootstrap
from ..child._protocol import Command, IsolateCommand, IsolationSpec, JoinCommand
from ..limits._isolation import Grant
from ..limits._tree_cgroup import TreeCgroup
from ..trees._groups import start_time

__all__ = [
    "BOOTSTRAP",
    "ChildProcess",
    "ForkedProcess",
    "Interpreter",
    "Standby",
    "compile_bootstrap",
    "frame",
    "start_interpreter",
    "take_message",
]

# The child side: run by its path as a script, never imported in the child.
BOOTSTRAP = Path(_bootstrap.__file__)
# How long a discarded interpreter, killed, may take to be reaped; how long a started
# one may take to say which process is T (Python's start-up, on a loaded machine).
DISCARD_CONFIRMATION = 5.0
BOOT_TIMEOUT = 30.0


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
        process: T, the bootstrap's tracked process: the ``trio.Process`` started (swept),
            or a :class:`ForkedProcess` (made in its namespace by the process started,
            or forked by the fork server).
        control: Our end of its socket pair.
        marker: The reading end of a pipe whose writing end it inherited, and passes on
            to whatever it starts: how its leftovers are known once it is gone (see
            ``_trees.strays``).
        cgroup: The cgroup it joins ahead of its load (:meth:`join_ahead`, or made as
            it booted by ``start_interpreter``'s ``join``); whoever takes the
            interpreter owns it.
        grant: What its child was granted ahead of its load (:meth:`isolate_ahead`),
            given back if it is discarded; whoever takes the interpreter takes it.
    """

    process: ChildProcess
    control: socket.socket
    marker: int
    cgroup: TreeCgroup | None = None
    grant: Grant | None = None
    _give_back: Callable[[Grant], Awaitable[None]] | None = None
    _start_time: int | None = None

    def start_time(self) -> int | None:
        """When T started (clock ticks after boot), read once; None if it is gone."""
        if self._start_time is None:
            self._start_time = start_time(self.process.pid)
        return self._start_time

    def join_ahead(self, cgroup: TreeCgroup) -> None:
        """Have it make ``cgroup`` and join it while it waits.

        It does so before it reads its spawn message (``_bootstrap``'s "join"), so the
        work, and the kernel's wait for the move, are its own, not the runner's: a load
        that takes it sooner waits only for the rest. It owns :attr:`cgroup` from now on.

        Raises:
            OSError: It is gone (the message could not be sent).
        """
        message: JoinCommand = {
            "command": "join",
            "make": cgroup.made_by_member(),
            "cgroups": cgroup.procs,
        }
        self.control.sendall(frame(message))
        self.cgroup = cgroup

    def isolate_ahead(
        self,
        grant: Grant,
        isolation: IsolationSpec,
        give_back: Callable[[Grant], Awaitable[None]],
    ) -> None:
        """Have it fork its plugin while it waits, in namespaces of its own, for the
        child that ``grant`` (claimed ahead: a uid and its private directory) is for.

        It does so before it reads its spawn message (``_bootstrap``'s "isolate", after
        "join": the plugin is in the cgroup it joined), so the fork, the copy of the
        view and its mounts are not the load's: the load that takes it sends the same
        ``isolation`` and takes :attr:`grant` (:meth:`take_grant`); a discarded one
        gives it back with ``give_back``.

        Raises:
            OSError: It is gone (the message could not be sent); it holds the grant
                all the same, until it is discarded.
        """
        # Its own from now on, sent or not: a dead one is discarded, and gives it back.
        self.grant = grant
        self._give_back = give_back
        message: IsolateCommand = {"command": "isolate", "isolation": isolation}
        self.control.sendall(frame(message))

    def take_grant(self) -> Grant | None:
        """What it was granted ahead (:meth:`isolate_ahead`), if anything: the caller's
        from now on."""
        grant, self.grant = self.grant, None
        return grant

    async def discard(self) -> None:
        """End it and reap it, and remove its cgroup. It ran nothing and is alone in its
        process group; in its cgroup, the plugin it forked ahead (if any) ends with it
        (see ``_bootstrap.Ahead``), and the removal waits for that."""
        self.control.close()
        os.close(self.marker)
        if self.process.poll() is None:  # not reaped, so its pid is still ours
            self.process.kill()
        with bounded(DISCARD_CONFIRMATION), outside_the_run():
            await self.process.wait()
        await _remove(self.cgroup)
        grant = self.take_grant()
        if grant is not None and self._give_back is not None:
            await self._give_back(grant)  # nothing ran as its uid


async def _remove(cgroup: TreeCgroup | None) -> None:
    """Remove a prepared cgroup whose process is gone (one still there stays, for the
    execution's next start to remove)."""
    if cgroup is not None:
        with bounded(DISCARD_CONFIRMATION), contextlib.suppress(OSError):
            await cgroup.remove()


@contextlib.contextmanager
def interpreter_ends() -> Iterator[tuple[socket.socket, socket.socket, int, int]]:
    """The ends a new interpreter is started with: its socket pair and marker pipe.

    Yields our end of the socket pair, theirs, then the marker pipe's reading end (ours,
    see :class:`Interpreter`) and its writing end (theirs). Their ends are closed once
    the block has handed them over, whatever happened; ours only if it failed, since an
    interpreter started keeps them.
    """
    ours, theirs = socket.socketpair()
    marker, marked = os.pipe()
    try:
        yield ours, theirs, marker, marked
    except BaseException:
        ours.close()
        os.close(marker)
        raise
    finally:
        theirs.close()
        os.close(marked)


async def start_interpreter(
    python: str,
    bootstrap: Path,
    *,
    environment: Mapping[str, str],
    output: int,
    directory: Path,
    containment: str,
    strict: bool,
    creating: trio.CapacityLimiter,
    keep: Sequence[int] = (),
    join: Callable[[int], TreeCgroup | None] | None = None,
) -> Interpreter:
    """A bootstrap process, waiting for its spawn message on the returned socket.

    Args:
        python: The interpreter to run.
        bootstrap: The bootstrap, compiled or as source.
        environment: The process's whole environment.
        output: The file descriptor its stdout and stderr go to.
        directory: Its working directory.
        containment: How T holds the plugin's tree: "pid" or "user" (a namespace), or
            "sweep" (see ``_bootstrap.make_tracked``).
        strict: A namespace is required (T refuses its spawn message without one).
        creating: Held while the process is created (not while it boots).
        keep: More descriptors it inherits, by the same numbers (the children's view).
        join: Called in a worker thread with the started process's pid while its
            Python boots: the cgroup it moved the process into (T, forked once it has
            booted, is born in it), which the interpreter returned holds, or None.

    Raises:
        OSError: The process could not be started.
        ExecutionError: It exited, or did not say which process is T within
            ``BOOT_TIMEOUT``.
    """
    with interpreter_ends() as (ours, theirs, marker, marked):
        async with creating:
            process = await trio.lowlevel.open_process(
                [
                    python,
                    "-I",
                    str(bootstrap),
                    str(theirs.fileno()),
                    containment,
                    "strict" if strict else "lax",
                ],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=output,
                pass_fds=(theirs.fileno(), marked, *keep),
                start_new_session=True,
                env=dict(environment),
                cwd=directory,
            )
    joined: list[TreeCgroup | None] = [None]

    async def joining() -> None:
        assert join is not None
        joined[0] = await trio.to_thread.run_sync(join, process.pid)

    try:
        # Shielded: a bootstrap that made T and was then abandoned would leave a T
        # nobody knows of. Bounded: Python's start-up, at worst BOOT_TIMEOUT.
        with trio.CancelScope(shield=True), bounded(BOOT_TIMEOUT), outside_the_run():
            if join is None:
                tracked = await _tracked(process, ours)
            else:
                # The move waits for the kernel while Python boots, not after it.
                found: ChildProcess | ExecutionError
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(joining)
                    try:
                        found = await _tracked(process, ours)
                    except ExecutionError as error:
                        found = error  # raised as itself, not in the nursery's group
                if isinstance(found, ExecutionError):
                    raise found
                tracked = found
                if joined[0] is not None and isinstance(tracked, ForkedProcess):
                    # T's maker was in the cgroup, and exits as soon as T exists: reaped
                    # now, as its zombie counts toward pids.max until it is.
                    await tracked.reap_maker()
            return Interpreter(tracked, ours, marker, joined[0])
        raise ExecutionError(f"the child's bootstrap did not start within {BOOT_TIMEOUT:g} s")
    except BaseException:
        ours.close()
        os.close(marker)
        with bounded(DISCARD_CONFIRMATION, shield=True), outside_the_run():
            if process.poll() is None:
                process.kill()
            await process.wait()
            await _remove(joined[0])
        raise


async def _tracked(process: trio.Process, control: socket.socket) -> ChildProcess:
    """The process that is T, once the bootstrap has said which (``_bootstrap.launch``).

    Swept, it is the started process itself. For a namespace, that process made T and
    exits: once it is reaped, T is our child (we are its subreaper). Nobody waits for
    that here: T goes on while its maker ends.
    """
    buffer = b""
    while (taken := take_message(buffer)) is None:
        await trio.lowlevel.wait_readable(control)
        try:
            chunk = control.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
        except OSError:
            chunk = b""
        if not chunk:
            raise ExecutionError("the child's bootstrap exited before it started")
        buffer += chunk
    message, _ = taken  # nothing follows: T says nothing more before its spawn message
    pid = message.get("pid") if isinstance(message, dict) else None
    if not isinstance(pid, int) or pid <= 0:
        raise ExecutionError(f"the child's bootstrap could not start it: {message!r}")
    if pid == process.pid:
        return process
    return ForkedProcess(pid, maker=process)


def frame(message: Command) -> bytes:
    """One message of the control protocol: a 4-byte big-endian length, then marshal."""
    payload = marshal.dumps(dict(message))
    return len(payload).to_bytes(4, "big") + payload


def take_message(buffer: bytes) -> tuple[Any, bytes] | None:
    """The first whole message in ``buffer`` and what follows it, or None if incomplete."""
    if len(buffer) < 4:
        return None
    size = int.from_bytes(buffer[:4], "big")
    if len(buffer) < 4 + size:
        return None
    return marshal.loads(buffer[4 : 4 + size]), buffer[4 + size :]


class ForkedProcess:
    """A T made by a fork (the fork server's, or a started bootstrap's that made its
    namespace): our child, re-parented to us, watched through a pidfd like a
    trio.Process.

    Args:
        pid: T's pid. It must be our child already, or the child of ``maker``, which
            never reaps it: either way nobody else can reap it, so the pid stays T's.
        maker: The process of ours that made T and is on its way out. T is its child
            until it has exited, and ours once it is reaped, which :meth:`wait` does
            first; until then :meth:`poll` says T runs.
    """

    def __init__(self, pid: int, maker: ChildProcess | None = None) -> None:
        self._pid = pid
        self._maker = maker
        self._pidfd: int | None = os.pidfd_open(pid)
        self._returncode: int | None = None

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

    @property
    def has_maker(self) -> bool:
        """Whether the process that made T is still to be reaped (:meth:`reap_maker`)."""
        return self._maker is not None

    def poll(self) -> int | None:
        """Its returncode (Popen-style, negative for a signal) if it has exited."""
        if self._maker is not None:
            if self._maker.poll() is None:
                return None  # not ours yet, so not ours to reap
            self._maker = None
        if self._returncode is None:
            try:
                pid, status = os.waitpid(self._pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: gone, status unknown
                pid, status = self._pid, signal.SIGKILL
            if pid != 0:
                self._returncode = os.waitstatus_to_exitcode(status)
                self._close()
        return self._returncode

    def kill(self) -> None:
        if self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def wait(self) -> int:
        await self.reap_maker()
        waited = False
        while self.poll() is None:
            assert self._pidfd is not None
            await trio.lowlevel.wait_readable(self._pidfd)
            waited = True
        if not waited:  # else the wait was the schedule point
            await trio.lowlevel.checkpoint()
        assert self._returncode is not None
        return self._returncode

    async def reap_maker(self) -> None:
        """Reap the process that made T (it exits as soon as T exists), if not yet."""
        if self._maker is not None:
            await self._maker.wait()
            self._maker = None

    def _close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        self._close()


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
        # Where run() waits until the interpreter it started is taken.
        self._taken = trio.lowlevel.ParkingLot()

    async def run(self) -> None:
        """Keep one interpreter started ahead: one now, and the next each time a load
        takes it (:meth:`take`), until cancelled. One task for the execution's whole
        run, not one a load."""
        while True:
            await self.fill()
            await self._taken.park()

    async def fill(self) -> None:
        """Start the next standby interpreter, unless one is there or on its way."""
        if self.ready is not None or self._filling or self._closing:
            await trio.lowlevel.checkpoint()
            return
        self._filling = True
        try:
            await when_idle()
            interpreter = await self._start()
        except (OSError, ExecutionError):
            return  # the next load starts its own interpreter, and reports the error
        finally:
            self._filling = False
        try:
            if isinstance(interpreter.process, ForkedProcess) and interpreter.process.has_maker:
                # Its maker exits at once: reaped before the standby is offered, so that
                # whoever takes it finds T re-parented to us and no maker left. (Offered
                # first, a reader of the process table could see the maker as the
                # standby, and T not yet ours.) Shielded and bounded, as a discard is.
                with bounded(DISCARD_CONFIRMATION, shield=True), outside_the_run():
                    await interpreter.process.reap_maker()
        finally:
            # Kept even if the execution is closing: close() discards it once this task
            # has ended.
            self.ready = interpreter

    def take(self, nursery: trio.Nursery) -> Interpreter | None:
        """The interpreter started ahead, if there is a live one; the next one starts
        (:meth:`run`)."""
        standby = self.ready
        if standby is None:
            return None
        self.ready = None
        self._taken.unpark_all()
        if standby.process.poll() is not None:
            # It died while it waited (reaped by poll): its socket and cgroup go.
            nursery.start_soon(standby.discard, name="dead standby interpreter")
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
            with bounded(DISCARD_CONFIRMATION, shield=True), outside_the_run():
                await ready.discard()
