"""One child process, and the control socket to its bootstrap.

Theory of operation: a :class:`ProcessUnit` is made around a bootstrap interpreter that
is running but has been told nothing yet. :meth:`ProcessUnit.resolve` sends it the
spawn message and reads back what code it found; only then does the supervisor make
the child's identity durable and call :meth:`ProcessUnit.start`. The socket carries
length-prefixed ``marshal`` values (a 4-byte big-endian length, then the payload; see
``_bootstrap.py`` for every message), because the bootstrap must not import ``json``.

Rules that never bend:

* The interrupt is SIGTERM to the child's process group by its recorded pgid, which
  holds the tracked process T alone; T passes it on to the plugin's group and stops
  counting the lease (see ``_bootstrap.py`` for T and the plugin P).
* The kill ends the whole tree. In a namespace, SIGKILL to T is enough: T is its PID 1,
  and the kernel kills everything in the namespace with it. Swept, the tree below T is
  frozen and killed process by process (``_trees``), T first.
* :meth:`ProcessUnit.wait` returns only once T exited (in a namespace, the namespace is
  empty by then), its group is empty, and whatever the kill froze has exited too; with
  a cgroup, once that is empty as well (what is still in it is killed); the empty
  cgroup is then removed, by the unit or, handed over with ``gone``, by the execution
  in a worker thread. It is the only thing that confirms an exit. ``interrupt`` and
  ``kill`` are requests.
* Closing the socket is the child's dead-man switch: T ends its whole tree.
* A unit that was never started ran none of the caller's code, so abandoning it is a
  kill and a reap.

Races this guards against:

* The child exits while a message is on its way: a broken socket is the same as EOF,
  and EOF before an answer is "the child died first", not a protocol error.
* T reports how the plugin ended and what was killed of what it left
  (``{"event": "exited"}``) just before it exits, when nobody reads the socket any
  more: :meth:`ProcessUnit.wait` takes those last messages in without waiting, since
  everything the child sent is in the socket once it has exited. The report, not T's
  own status, says how the plugin ended: a PID 1 cannot die by its own signal.
* A swept T killed by someone else (the OOM killer, an operator) could not sweep: what
  it left was re-parented to us, and :meth:`ProcessUnit.wait` finds it by T's session
  and by the marker pipe it inherited (``_trees.strays``), and kills it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any

import trio

from ...errors import ExecutionError, PackageError
from ...model import ChildIdentity, CodeIdentity, ExitStatus, Load, signal_name
from ...realtime import bounded, outside_the_run
from ..child._protocol import Command, EofReply, Reply, SpawnCommand, StartCommand
from ..limits._tree_cgroup import TreeCgroup
from ..trees._groups import exit_status, group_gone, signal_group
from ..trees._trees import Tree, left_behind, process_table, strays
from ._standby import ChildProcess, ForkedProcess, frame, take_message

__all__ = ["ProcessUnit", "failure"]

_CHUNK = 65536
# Room for the one descriptor a reply may carry ("resolved": the plugin's "go" pipe).
_RIGHTS = socket.CMSG_SPACE(4)
_EOF: EofReply = {"event": "eof"}
# How long an abandoned child, killed, may take to be reaped; how long the last of its
# copied output may take to reach the log once its group is gone.
KILL_CONFIRMATION = 5.0
OUTPUT_DRAIN = 1.0


def failure(reply: Reply, specifier: str, limits: str = "") -> Exception:
    """The error a reply other than the expected one stands for.

    ``limits`` names the rlimits the child runs under, if any: a child under limits
    that dies before it reports could not run under them, which is the request's fault.
    """
    if reply["event"] == "eof":
        if limits:
            return PackageError(
                f"the child for {specifier!r} could not run under the limits asked for ({limits})"
            )
        return ExecutionError(f"the child for {specifier!r} exited before it reported")
    if reply["event"] == "exited":  # see ExitedEvent
        # The plugin ended before it said it started: its module ended it as it was
        # imported (os._exit, a crash in an extension), or it was killed.
        returncode = os.waitstatus_to_exitcode(int(reply["status"]))
        if returncode >= 0:
            return PackageError(
                f"cannot load {specifier!r}: the child exited with code {returncode} "
                "while its module was imported, before it started; fix the module"
            )
        name = signal_name(-returncode)
        if limits:
            return PackageError(
                f"cannot load {specifier!r}: the child was killed by {name} before it "
                f"started, under the limits asked for ({limits})"
            )
        return ExecutionError(f"the child for {specifier!r} was killed by {name} before it started")
    if reply["event"] != "failed":  # out of step with us
        return ExecutionError(str(reply))
    if reply["kind"] == "PackageError":
        return PackageError(reply["message"])
    return ExecutionError(reply["message"])


class ProcessUnit:
    """One child process and the control socket to its bootstrap.

    Args:
        process: The bootstrap interpreter, which leads its own process group.
        identity: The child identity the supervisor records.
        control: Our end of the socket pair; the unit owns it from now on.
        load: What the child is to run.
        marker: The reading end of the child's marker pipe (see ``_standby``); the unit
            owns it from now on.
        containment: "namespace" or "sweep", as asked; the bootstrap says which it
            really uses when it resolves (:attr:`containment`).
        limits: The rlimits it runs under, as text (see :func:`failure`).
        cgroup: The cgroup that holds its tree, made as it resolves, or None.
        gone: Called once the child and its whole tree are gone, with its cgroup, if
            it had one, empty (its uid and private directory may be given to another
            child then, and the cgroup is the caller's to remove), or None: the unit
            then removes the cgroup itself before :meth:`wait` returns.
    """

    def __init__(
        self,
        process: ChildProcess,
        identity: ChildIdentity,
        control: socket.socket,
        load: Load,
        *,
        marker: int | None = None,
        containment: str = "sweep",
        limits: str = "",
        cgroup: TreeCgroup | None = None,
        gone: Callable[[TreeCgroup | None], None] | None = None,
    ) -> None:
        self._cgroup = cgroup
        self._gone = gone
        self.limits = limits  # the rlimits it runs under, as text (see failure())
        self._process = process
        self._identity = identity
        self._pgid = identity.pgid or process.pid
        self.code = CodeIdentity(specifier=load.specifier)
        self._specifier = load.specifier
        # When the lease ends (on the run's clock), as renewed before "start": it goes to
        # T with "start" (see renew).
        self._lease_until: float | None = None
        # Read (recvmsg) and written without waiting; waited on through Trio.
        self._socket = control
        control.setblocking(False)
        self._buffer = b""
        # The writing end of P's "go" pipe, sent with "resolved": "start" lets P go
        # through it at once, as well as through T.
        self._go: int | None = None
        # Processes the child left that had to be killed: counted by T as it exits
        # ("exited"), and by our own kill.
        self._descendants_killed = 0
        self._reported: int | None = None  # how P ended, as T reported it (a returncode)
        self._status: ExitStatus | None = None
        self._wait_lock = trio.Lock()
        self._send_lock = trio.StrictFIFOLock()
        self._started = False
        # Set once start() has its answer (or gave up): until then the exit is not
        # told (see wait), so a plugin that failed to load and ended is a failed load.
        self._start_answered = trio.Event()
        self._signalled = False  # interrupted or killed: its exit is near
        self._closed = False
        self._marker = marker
        # What a kill froze (swept), to be confirmed gone by wait().
        self._frozen: list[Tree] = []
        self.containment = containment
        self.output_done = trio.Event()

    @property
    def identity(self) -> ChildIdentity:
        return self._identity

    async def _send(self, *messages: Command, answered: bool = False) -> None:
        """Send ``messages`` to T, in one write.

        ``answered``: the caller reads T's answer next, and that read is the schedule
        point (it waits for the answer, or checkpoints when it is there already), so a
        send that goes at once adds none (see :meth:`_ask`).
        """
        data = b"".join(frame(message) for message in messages)
        if self._send_lock.locked():  # a send is waiting for room: queue behind it
            async with self._send_lock:
                await self._send_rest(data)
            return
        # A message is small, and T reads while it waits: it goes at once, whole, with
        # one schedule point (not the lock's and the stream's).
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            sent = self._socket.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as error:  # closed by us, or T is gone
            raise trio.BrokenResourceError(f"the child's socket: {error}") from error
        if sent == len(data):
            if not answered:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return
        self._send_lock.acquire_nowait()  # free still: no schedule point since the check
        try:
            await self._send_rest(data[sent:])
        finally:
            self._send_lock.release()

    async def _send_rest(self, data: bytes) -> None:
        """Send ``data`` as the socket has room for it (a message T has not read yet)."""
        while data:
            if self._socket.fileno() < 0:
                raise trio.ClosedResourceError("the child's socket is closed")
            await trio.lowlevel.wait_writable(self._socket)
            try:
                sent = self._socket.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError as error:  # closed by us, or T is gone
                raise trio.BrokenResourceError(f"the child's socket: {error}") from error
            data = data[sent:]

    async def _ask(self, *messages: Command) -> Reply:
        """Send ``messages`` and read T's answer, with one schedule point: the read's."""
        await self._send(*messages, answered=True)
        if self._buffer:  # something read before: the answer may need no read below
            await trio.lowlevel.cancel_shielded_checkpoint()
        return await self._receive()

    async def _receive(self) -> Reply:
        while (taken := take_message(self._buffer)) is None:
            chunk = await self._read()
            if not chunk:
                return _EOF
            self._buffer += chunk
        message: Reply
        message, self._buffer = taken
        if message["event"] == "exited":  # P ended first: T's last word (see wait)
            self._exited(message)
        return message

    async def _read(self) -> bytes:
        """What the child sent next, and any descriptor with it; empty at EOF."""
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            try:
                chunk, ancillary, _, _ = self._socket.recvmsg(_CHUNK, _RIGHTS)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(self._socket)
                except trio.ClosedResourceError:
                    return b""
                waited = True
                continue
            except OSError:
                chunk, ancillary = b"", []
            break
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                whole = len(payload) - len(payload) % 4
                for at in range(0, whole, 4):
                    fd = int.from_bytes(payload[at : at + 4], sys.byteorder)
                    if self._go is None and not self._started:
                        self._go = fd
                    else:
                        os.close(fd)  # none other is asked for
        if not waited:  # else the wait was the schedule point
            await trio.lowlevel.cancel_shielded_checkpoint()
        return chunk

    def _let_go(self) -> None:
        """Close our end of P's "go" pipe (once it was used, or will never be)."""
        go, self._go = self._go, None
        if go is not None:
            os.close(go)

    async def resolve(self, spec: SpawnCommand) -> bool:
        """Send the spawn message and take in the code the bootstrap resolved.

        Returns:
            True once the code is known (:attr:`code`); False when the child died before
            it answered, and has been reaped.

        Raises:
            PackageError: The bootstrap refused the specifier (the child is reaped).
            ExecutionError: It could not prepare the child (the child is reaped).
        """
        try:
            cgroup = self._cgroup
            # T joins by itself, or is in it already: its limits are written while T
            # resolves (nothing of the caller's runs before "start").
            joins = cgroup is not None and cgroup.member is None
            if cgroup is not None:
                try:
                    if joins:
                        # A few mkdirs: what a standby made ahead is there already.
                        cgroup.create(limits=False)
                    else:
                        # Moving another process waits for the kernel (an RCU grace
                        # period, milliseconds): not on the event loop.
                        await trio.to_thread.run_sync(cgroup.create)
                except OSError as error:
                    raise ExecutionError(
                        f"cannot make the cgroup of the child for {self._specifier!r}: {error}"
                    ) from error
            try:
                await self._send(spec, answered=True)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                reply: Reply = _EOF
            else:
                if joins:
                    assert cgroup is not None
                    try:
                        cgroup.configure()
                    except OSError as error:
                        raise ExecutionError(
                            f"cannot limit the cgroup of the child for {self._specifier!r}: {error}"
                        ) from error
                # The read is the schedule point (the spawn message went at once).
                reply = await self._receive()
            if reply["event"] == "resolved":
                code = reply["code"]
                self.containment = reply["containment"]
                self.code = CodeIdentity(
                    specifier=self._specifier,
                    origin=code["origin"],
                    digest=code["digest"],
                    version=code["version"],
                )
                return True
            if reply["event"] != "eof":
                raise failure(reply, self._specifier)
        except BaseException:
            await self._abandon()
            raise
        await self._abandon()
        return False

    async def _abandon(self) -> None:
        """Release a child that will never start; nothing of the caller's ran in it."""
        # Shielded: this runs as spawn fails or is cancelled, and a child left here
        # would be one nobody recorded. Bounded: aclose waits at most KILL_CONFIRMATION
        # for the reap and OUTPUT_DRAIN for the output; this is the ceiling on both.
        with bounded(KILL_CONFIRMATION + OUTPUT_DRAIN, shield=True), outside_the_run():
            await self.aclose()

    async def start(self) -> None:
        if self._started:
            await trio.lowlevel.checkpoint()
            raise ExecutionError("this unit was started already")
        self._started = True
        try:
            await self._start()
        finally:
            self._start_answered.set()

    async def _start(self) -> None:
        if self._go is not None:
            # P goes now; T, told next, lets it go too (and reports a command's exec).
            with contextlib.suppress(OSError):  # P is gone: T reports how it ended
                os.write(self._go, b"g")
            self._let_go()
        start: StartCommand = {"command": "start"}
        until, self._lease_until = self._lease_until, None
        with outside_the_run():  # the child's time is not the run's (realtime.py)
            try:
                if until is None:
                    reply = await self._ask(start)
                else:
                    # The lease renewed before "start", as what is left of it now.
                    left = max(until - trio.current_time(), 0.0)
                    reply = await self._ask({"command": "renew", "lease": left}, start)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
                raise ExecutionError(
                    f"the child for {self._specifier!r} is gone before it started"
                ) from error
        if reply["event"] != "started":
            raise failure(reply, self._specifier, self.limits)

    async def renew(self, lease: float) -> None:
        if not math.isfinite(lease):
            await trio.lowlevel.checkpoint()
            return
        if not self._started:
            # Nothing of the caller's runs before "start", and T needs no lease to wait
            # for it (the closed socket is its switch): the lease goes with "start", as
            # what is left of it then. One message and one wake-up of T fewer a load,
            # and no schedule point (the loader saves the child's identity next).
            await trio.lowlevel.checkpoint_if_cancelled()
            self._lease_until = trio.current_time() + lease
            return
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._send({"command": "renew", "lease": lease})

    async def interrupt(self) -> None:
        # A request that returns at once, with no schedule point: the wait for the exit
        # that follows it is one.
        await trio.lowlevel.checkpoint_if_cancelled()
        self._signalled = True
        # T takes it as the end of its lease watchdog too, so the lease cannot cut the
        # graceful stop short.
        signal_group(self._pgid, signal.SIGTERM)

    async def kill(self) -> None:
        self._signalled = True
        await trio.lowlevel.checkpoint()
        tracked = self._process.pid
        if self._process.returncode is None:  # not reaped: the pid is still T's
            self._descendants_killed += left_behind(tracked, process_table())
            if self.containment != "namespace":
                tree = Tree()
                if tree.pin(tracked, self._identity.start_time):
                    tree.freeze([tracked])
                    tree.kill()
                self._frozen.append(tree)
        # In a namespace, the kernel ends everything else with T, its PID 1.
        signal_group(self._pgid, signal.SIGKILL)
        if self._cgroup is not None:
            self._cgroup.kill()

    async def wait(self) -> ExitStatus:
        # Once signalled, the child's exit is near and bounded in real time: a virtual
        # clock waits for it (realtime.py). Before, the wait is the child's whole life.
        with outside_the_run() if self._signalled else contextlib.nullcontext():
            return await self._wait()

    async def _wait(self) -> ExitStatus:
        # One waiter works it out; the others read it. Taking the lock free is no
        # schedule point: the wait for the exit is one.
        lock = self._wait_lock
        waited = lock.locked()
        if waited:
            await lock.acquire()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
            lock.acquire_nowait()
        try:
            if self._status is not None:
                if not waited:  # else waiting for the lock was the schedule point
                    await trio.lowlevel.cancel_shielded_checkpoint()
            else:
                returncode = await self._process.wait()
                if self._started and not self._start_answered.is_set():
                    # A plugin that failed to load says so and ends: its answer is
                    # start()'s to read first (a failed load, L5), before what T said as
                    # it exited is read here, and only then is its exit told.
                    await self._start_answered.wait()
                # T is gone (and its namespace with it); the child is gone when its
                # whole group is, and all that the kill froze.
                await group_gone(self._pgid)
                while self._frozen:
                    await self._frozen[0].gone(skip={self._process.pid})
                    del self._frozen[0]
                if self.containment == "sweep" and returncode == -signal.SIGKILL:
                    await self._kill_strays()
                reported = self._read_leftovers()
                if reported is not None:
                    returncode = reported
                elif self.containment == "namespace" and returncode > 128:
                    # Unreported (its socket was closed first): a PID 1 cannot die by
                    # its own signal, so T exits with 128 plus the signal's number.
                    returncode = 128 - returncode
                oom_limit = None
                cgroup = self._cgroup
                if cgroup is not None and not cgroup.removed:
                    # Whatever escaped every other hold (it left the session and closed
                    # its marker) is still in the cgroup.
                    self._descendants_killed += await cgroup.emptied()
                    if cgroup.oom_kills():
                        oom_limit = cgroup.limits.memory_bytes
                    if self._gone is None:
                        await cgroup.remove()
                    else:
                        # Empty: nothing of the child is left to hold or kill. Its
                        # removal may wait on the kernel's cgroup lock (see
                        # TreeCgroup.remove_blocking), and the exit is confirmed.
                        self._cgroup = None
                self._status = exit_status(
                    returncode,
                    descendants_killed=self._descendants_killed,
                    oom_limit=oom_limit,
                )
                if self._gone is not None:
                    self._gone(cgroup)
            return self._status
        finally:
            lock.release()

    async def _kill_strays(self) -> None:
        """Kill and reap what a swept T, killed before it could sweep, left to us."""
        found = strays(self._process.pid, self._marker)
        if not found:
            return
        tree = Tree()
        self._frozen.append(tree)  # closed by aclose() if this is cancelled
        for pid, stat in found.items():
            tree.pin(pid, stat.start_time)
        tree.freeze(list(found))  # pins what runs below them too
        dead = sum(1 for pid, stat in found.items() if not stat.running and pid in tree.pidfds)
        self._descendants_killed += len(tree.pidfds) - dead
        tree.kill()
        await tree.gone()
        self._frozen.remove(tree)

    def _read_leftovers(self) -> int | None:
        """Take in what T said as it exited: how many processes it killed, and how the
        plugin ended (a returncode, negative for a signal), or None if it said nothing
        (T itself was killed).

        Everything it sent is in the socket already: it has exited. So this reads
        without waiting, and stops at the first empty read.
        """
        while True:
            try:
                chunk = self._socket.recv(_CHUNK, socket.MSG_DONTWAIT)
            except OSError:  # BlockingIOError included: nothing more to read
                break
            if not chunk:
                break
            self._buffer += chunk
        while (taken := take_message(self._buffer)) is not None:
            message, self._buffer = taken
            if isinstance(message, dict) and message.get("event") == "exited":
                self._exited(message)
        return self._reported

    def _exited(self, message: Mapping[str, Any]) -> None:
        """Take in T's report of how the plugin ended (read here, or by start())."""
        self._descendants_killed += int(message.get("killed", 0))
        self._reported = os.waitstatus_to_exitcode(int(message["status"]))

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        if self._process.returncode is None and not self._started:
            # Never started: nothing of the caller's ran; it simply goes, and is reaped.
            await self.kill()
            with bounded(KILL_CONFIRMATION), outside_the_run():
                await self.wait()
        # Closing the socket is the child's dead-man switch if anything still runs. No
        # schedule point of its own: the release that follows an exit waited for has
        # nothing to wait for.
        self._let_go()
        trio.lowlevel.notify_closing(self._socket)
        self._socket.close()
        if self._marker is not None:
            os.close(self._marker)
            self._marker = None
        for tree in self._frozen:  # left by a wait that was cancelled
            tree.close()
        cgroup = self._cgroup
        if cgroup is not None and not cgroup.removed and not cgroup.members():
            # Left by a wait that was cancelled; one still populated is left to the
            # execution's exit, or to its next start on the same state directory.
            with contextlib.suppress(OSError):
                await cgroup.remove()
        if isinstance(self._process, ForkedProcess) and self._process.has_maker:
            # Its maker, if nothing waited for T (a recovery ended it): it exited as
            # soon as T existed.
            with bounded(KILL_CONFIRMATION), outside_the_run():
                await self._process.reap_maker()
        # Once the group is gone its output ends; let the last of it reach the log.
        if not self.output_done.is_set():  # it is when the child wrote the log itself
            with bounded(OUTPUT_DRAIN), outside_the_run():
                await self.output_done.wait()
