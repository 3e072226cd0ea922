"""The fork server: bootstrap interpreters made by ``fork`` instead of by starting Python.

Theory of operation: starting Python is most of a minimal child's load. The fork server
is one bootstrap interpreter (``_bootstrap.py serve``, standard library only) started
with the execution, which has imported what every child needs and the modules the
runner's owner asked to preload, and then forks a fresh tracked process T per load.
T is forked through an intermediate process that exits at once, so it is re-parented
to this process (a child subreaper), leads a session of its own, and from then on is
exactly what :func:`~._standby.start_interpreter` makes: a bootstrap that waits for its
spawn message and has run nothing. Its control socket, marker pipe and output go to
the server with the request (``SCM_RIGHTS``), with the session's environment; the
server closes its copies once it answered, so it holds nothing of any session.

Rules that never bend:

* The server runs none of a host's code: it forks before the spawn message exists,
  and every check and limit happens in T, as for a started one. The namespace, if any,
  is made by the intermediate process (T must be its PID 1), so the server itself stays
  in ours.
* Only a child subreaper can use it (a T re-parented elsewhere could not be waited
  for); the execution refuses the combination.
* A server that fails or dies is never waited on by a load: the load starts its
  interpreter the usual way, and the server is started again in the background (at
  most once a second).

Races this guards against:

* A request cancelled half-way would leave a reply in the socket that the next
  request would take for its own: a request is shielded, and bounded by
  ``REQUEST_TIMEOUT``, after which the server counts as broken.
* The execution closes while a request is under way (a standby's, started in the
  background): :meth:`ForkServer.aclose` closes the socket only once that request has
  its answer, and the execution discards the standby it made.
* T exits before we look at it: it is our child (the intermediate process was reaped
  before the server answered), so its pid stays its own until we reap it, and the
  pidfd opened on it is T's.

Known limits: a forked child shares what the server's interpreter fixed at start-up,
its hash seed among them (``str`` hashes are the same in every child of one server),
and its command line (``ps`` shows every forked T as ``... serve FD``).
If the server is killed between its fork and its answer, the T it made sees EOF on
its control socket and exits, but nobody reaps it until the runner exits.
"""

from __future__ import annotations

import array
import logging
import marshal
import re
import select
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from ...errors import ExecutionError
from ...realtime import bounded, outside_the_run
from ..child._protocol import ForkRequest
from ._standby import ForkedProcess, Interpreter, interpreter_ends

__all__ = ["Broken", "ForkServer", "check_preload"]

logger = logging.getLogger(__name__)

# How long one fork request may take before the server counts as broken; how long
# the server may take to start (its imports included); how often a broken one is
# started again.
REQUEST_TIMEOUT = 5.0
START_TIMEOUT = 30.0
RESTART_INTERVAL = 1.0
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def check_preload(preload: Sequence[str]) -> tuple[str, ...]:
    """``preload`` as module names, or ValueError naming the first that is none."""
    if isinstance(preload, str):
        raise TypeError("preload must be a sequence of module names, not one string")
    for name in preload:
        if not isinstance(name, str) or not _MODULE.match(name):
            raise ValueError(f"preload names a module as 'package.module', got {name!r}")
    return tuple(preload)


class Broken(Exception):
    """The fork server cannot serve this request (it is gone, or answered nonsense)."""


class ForkServer:
    """One fork server process and the socket to it.

    Args:
        python: The interpreter.
        bootstrap: The bootstrap, compiled or as source.
        directory: Its working directory (and so its children's).
        environment: Its environment (each child gets its session's with the request).
        preload: Modules it imports before it forks anyone.
        containment: How each T it makes holds its plugin's tree: "pid" or "user" (a
            namespace, made by the intermediate process), or "sweep".
        strict: A namespace is required.
    """

    def __init__(
        self,
        python: str,
        bootstrap: Path,
        *,
        directory: Path,
        environment: Mapping[str, str],
        preload: Sequence[str],
        containment: str,
        strict: bool,
        keep: Sequence[int] = (),
    ) -> None:
        self._keep = tuple(keep)  # inherited by the server and every T it forks
        self._command = [python, "-I", str(bootstrap), "serve"]
        # After the socket's FD: how each T is contained (see _bootstrap.make_tracked).
        self._containment = [containment, "strict" if strict else "lax"]
        self._directory = directory
        self._environment = dict(environment)
        self._preload = tuple(preload)
        self._process: trio.Process | None = None
        # Its socket (non-blocking); None while it is not running.
        self._socket: socket.socket | None = None
        self._lock = trio.Lock()
        self._restarting = False
        self._last_start = -float("inf")
        self._closed = False
        self.forks = 0  # children forked so far, for tests and the curious

    @property
    def running(self) -> bool:
        return self._socket is not None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        """Start the server and wait until it has imported everything.

        Raises:
            ExecutionError: It could not start, or a preloaded module failed to import.
        """
        self._last_start = trio.current_time()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = await trio.lowlevel.open_process(
                [*self._command, str(theirs.fileno()), *self._containment, *self._preload],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(), *self._keep),
                start_new_session=True,
                env=self._environment,
                cwd=self._directory,
            )
        except OSError as error:
            ours.close()
            raise ExecutionError(f"cannot start the fork server: {error}") from error
        finally:
            theirs.close()
        channel = ours
        channel.setblocking(False)
        try:
            reply: Any = None
            with bounded(START_TIMEOUT), outside_the_run():
                reply = _decode(await _receive(channel))
            if not isinstance(reply, dict) or reply.get("event") != "ready":
                why = reply.get("message") if isinstance(reply, dict) else "it did not answer"
                raise ExecutionError(f"the fork server did not start: {why}")
        except BaseException:
            channel.close()
            await _end(process)
            raise
        if self._closed:  # the execution closed while this one started
            channel.close()
            await _end(process)
            return
        self._process, self._socket = process, channel

    async def fork(self, environment: Mapping[str, str], output: int) -> Interpreter:
        """A fresh T, waiting for its spawn message, as ``start_interpreter`` makes one.

        Raises:
            Broken: The server cannot serve it; start the interpreter another way.
        """
        request: ForkRequest = {"environment": dict(environment)}
        with interpreter_ends() as (ours, theirs, marker, marked):
            pid = await self._request(
                marshal.dumps(dict(request)), [theirs.fileno(), marked, output]
            )
            return Interpreter(ForkedProcess(pid), ours, marker)

    async def _request(self, request: bytes, fds: list[int]) -> int:
        lock = self._lock
        if lock.locked():
            await lock.acquire()
        else:
            # Free: taking it is no schedule point, the wait for the reply is one.
            await trio.lowlevel.checkpoint_if_cancelled()
            lock.acquire_nowait()
        try:
            channel = self._socket
            if channel is None:
                await trio.lowlevel.cancel_shielded_checkpoint()
                raise Broken("the fork server is not running")
            # In a worker thread: the server's fork runs as the request goes out, and on
            # a busy machine it takes the core of whoever woke it. The thread, not the
            # event loop, waits that out. Shielded (a reply left unread would answer the
            # next request) and bounded in the thread (REQUEST_TIMEOUT, real time).
            with trio.CancelScope(shield=True), outside_the_run():
                reply = await trio.to_thread.run_sync(_exchange, channel, request, fds)
            if isinstance(reply, dict) and isinstance(reply.get("pid"), int):
                self.forks += 1
                return int(reply["pid"])
            why = reply.get("message") if isinstance(reply, dict) else "it did not answer"
            if not (isinstance(reply, dict) and reply.get("event") == "failed" and self._alive()):
                await self._stop()  # gone, or out of step with us
            raise Broken(f"the fork server could not fork: {why}")
        finally:
            lock.release()

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def restart_soon(self, nursery: trio.Nursery) -> None:
        """Start the server again in the background, unless it runs or is on its way."""
        if self._socket is not None or self._restarting or self._closed:
            return
        if trio.current_time() - self._last_start < RESTART_INTERVAL:
            return
        self._restarting = True
        nursery.start_soon(self._restart, name="fork server")

    async def _restart(self) -> None:
        try:
            await self._stop()
            await self.start()
            logger.info("the fork server was started again")
        except ExecutionError as error:
            logger.warning("%s; loads start their interpreters meanwhile", error)
        finally:
            self._restarting = False

    async def _stop(self) -> None:
        channel, self._socket = self._socket, None
        process, self._process = self._process, None
        if channel is not None:
            trio.lowlevel.notify_closing(channel)
            channel.close()
        if process is not None:
            if not self._closed:
                logger.warning("the fork server stopped; loads start their own interpreters")
            await _end(process)

    async def aclose(self) -> None:
        self._closed = True
        # Shielded, and after a request under way (a standby's, at the execution's exit)
        # has its answer: closing the socket under it would fail it with an error that
        # is nobody's. Bounded: a request takes at most REQUEST_TIMEOUT.
        with trio.CancelScope(shield=True):
            async with self._lock:
                await self._stop()


def _exchange(channel: socket.socket, request: bytes, fds: list[int]) -> Any:
    """(In a worker thread.) Send a request with ``fds`` and wait for the reply: the
    reply, decoded; None if none came within ``REQUEST_TIMEOUT``; a "failed" event if
    the socket failed."""
    try:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        channel.sendmsg([request], ancillary)  # one packet, one request under way
        answer = select.poll()
        answer.register(channel, select.POLLIN)
        if not answer.poll(REQUEST_TIMEOUT * 1000):
            return None
        return _decode(channel.recv(65536, socket.MSG_DONTWAIT))
    except OSError as error:
        return {"event": "failed", "message": str(error)}


async def _receive(channel: socket.socket) -> bytes:
    """The next packet the server sent (empty: it is gone), with one schedule point."""
    await trio.lowlevel.checkpoint_if_cancelled()
    waited = False
    while True:
        try:
            data = channel.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(channel)
            waited = True
        else:
            break
    if not waited:  # else the wait was the schedule point
        await trio.lowlevel.cancel_shielded_checkpoint()
    return data


def _decode(data: bytes) -> Any:
    if not data:
        return None
    try:
        return marshal.loads(data)
    except (EOFError, ValueError, TypeError):
        return None


async def _end(process: trio.Process) -> None:
    """Kill and reap the server (it holds nothing of anyone's)."""
    if process.poll() is None:
        process.kill()
    with bounded(REQUEST_TIMEOUT, shield=True), outside_the_run():
        await process.wait()
