"""Children as OS processes that cannot escape (Linux).

Each child is ``python -I`` running ``_bootstrap.py`` (compiled once into the state
directory), started in a session and process group of its own, talking to us over a
socket pair (see ``_bootstrap.py`` for the protocol). What a
remote host may run is decided here, by the runner's owner:

* **entry points** ``package.module:function``, found only on the ``entry_paths`` the
  owner configured: a sync function, or an async one run under ``trio.run``, called with
  a context (``identity``, ``instance``, ``generation``, ``config``);
* **named commands**: a table ``name -> argv``, so a host picks a name, never an argv.
  No shell is ever involved.

Guarantees, and how:

* The child's identity (pid, process group, start time, boot id) is known and returned
  by ``spawn`` before any of the caller's code runs: the bootstrap resolves, reports and
  applies the limits, then waits for ``start``.
* ``interrupt`` is SIGTERM and ``kill`` SIGKILL to the whole process group, by its
  recorded pgid, so a grandchild is signalled even after the leader exited.
* ``wait`` returns once the leader exited (Trio watches it through a pidfd) *and* no
  process is left in its group: a grandchild that ignores SIGTERM keeps the child
  "running" until the kill.
* Dead-man switch: if the supervisor dies, the socket reaches EOF and the bootstrap
  kills its group; if it hangs, the bootstrap kills its group one second after the lease
  it was last given.
* ``recover`` never signals a process that is not the recorded child: a different boot
  id, or a different start time for the pid, means the child is gone.
* Output: stdout and stderr go to one log file per session under the state directory.
  Without ``Limits.output_bytes`` the child writes into that file itself. With it, we
  copy the output and keep the **head**: the first bytes, then a line saying the rest
  was dropped.

Known limits: a process that leaves its process group (``setsid``, ``setpgid``) escapes
the group signals; only cgroups could hold it, and this execution does not use them.
``memory_bytes`` is ``RLIMIT_AS`` (address space, not resident memory).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import marshal
import math
import os
import py_compile
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import attrs
import trio

from ..background import open_background_nursery
from ..errors import ExecutionError, PackageError
from ..model import ChildIdentity, CodeIdentity, ExitStatus, Handle, Limits, Load, Termination

__all__ = ["SubprocessExecution", "boot_id", "start_time"]

ADAPTER = "subprocess"
BOOTSTRAP = Path(__file__).with_name("_bootstrap.py")
ENTRY_POINT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
ALLOWED_ENVIRONMENT = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
GROUP_POLL = 0.005  # seconds between checks that a group is empty


def boot_id() -> str:
    """This boot of the kernel; after a reboot no recorded pid is ours."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _stat(pid: int) -> list[str] | None:
    """Fields 3... of ``/proc/PID/stat`` (state first), or None when there is no such pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].decode().split()


def start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/PID/stat``: clock ticks after boot when the process started."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def _live_members(pgid: int) -> list[int]:
    """The processes of a group that still run (zombies are not counted)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def _group_exists(pgid: int) -> bool:
    """Whether any process (a zombie included) is in the group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise ExecutionError(f"cannot become a child subreaper: {os.strerror(ctypes.get_errno())}")


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _reap_group(pgid: int) -> None:
    """Reap members of the group that are our children (zombies of a subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


async def _group_gone(pgid: int) -> None:
    """Return once no process is left in the group.

    Members that were re-parented to us (when this process is a child subreaper) are
    reaped here, or they would stay in the group as zombies. Not a checkpoint when the
    group is gone already: callers wait for the leader first.
    """
    while True:
        _reap_group(pgid)
        if not _group_exists(pgid):
            return  # the caller's wait for the leader was the checkpoint
        await trio.sleep(GROUP_POLL)


def _status(returncode: int) -> ExitStatus:
    return (
        ExitStatus(code=None, signal=-returncode) if returncode < 0 else ExitStatus(code=returncode)
    )


def _compile_bootstrap(directory: Path) -> Path:
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


class SubprocessExecution:
    """An execution whose units are OS processes; use it as ``async with``.

    Args:
        state_directory: Where the per-session log files go (``logs/``).
        entry_paths: Directories searched for ``package.module:function`` specifiers.
            Empty: no entry point may be loaded.
        commands: Named commands, ``name -> argv``.
        environment: Extra environment variables for every child, on top of a minimal
            allowlist (``PATH``, ``LANG``, ...) and ``TRIO_SUPERVISOR_IDENTITY``,
            ``TRIO_SUPERVISOR_INSTANCE``, ``TRIO_SUPERVISOR_GENERATION``.
        python: The interpreter that runs the bootstrap.
        subreaper: Make this process a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``)
            while the execution runs, so a grandchild whose parent died is re-parented
            to us, not to PID 1 (which in a container may never reap it), and is reaped
            when its group is waited for. Orphans of *other* children of this process
            then come to it as well; turn this off if something else reaps them.
        standby: Keep one bootstrap interpreter started ahead of the next load, so a
            load does not wait for Python to start (most of a minimal child's load
            time). The standby runs none of the caller's code: it waits for its spawn
            message, then takes the session's environment and log file like a child
            started for it. It costs one idle interpreter while the execution runs, and
            serves loads without ``Limits.output_bytes`` (capped output is copied
            through a pipe made at spawn). If the supervisor dies, the standby sees its
            socket close and exits.
    """

    def __init__(
        self,
        state_directory: str | os.PathLike[str],
        *,
        entry_paths: Sequence[str | os.PathLike[str]] = (),
        commands: Mapping[str, Sequence[str]] | None = None,
        environment: Mapping[str, str] | None = None,
        python: str = sys.executable,
        subreaper: bool = True,
        standby: bool = False,
    ) -> None:
        # Absolute: children run with the state directory as their working directory.
        self.state_directory = Path(state_directory).absolute()
        self.entry_paths = tuple(str(Path(path).resolve()) for path in entry_paths)
        self.commands: dict[str, tuple[str, ...]] = {}
        for name, argv in (commands or {}).items():
            if not isinstance(name, str) or not name or not argv or isinstance(argv, str):
                raise ValueError(
                    "a named command needs a name and a non-empty argv list, "
                    f"got {name!r}: {argv!r}"
                )
            if not all(isinstance(part, str) for part in argv):
                raise TypeError(f"the argv of the command {name!r} must be strings")
            self.commands[name] = tuple(argv)
        self.environment = dict(environment or {})
        self.python = python
        self.subreaper = subreaper
        self._boot_id = boot_id()
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._logs: dict[tuple[str, str, int], Path] = {}
        self._bootstrap = BOOTSTRAP
        self.standby = standby
        self._ready: _Interpreter | None = None
        self._filling = False

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("this SubprocessExecution is already running")
        (self.state_directory / "logs").mkdir(parents=True, exist_ok=True)
        if self.subreaper:
            _become_subreaper()
        stack = contextlib.AsyncExitStack()
        self._nursery = await stack.enter_async_context(open_background_nursery())
        self._stack = stack
        if self.python == sys.executable:
            self._bootstrap = await trio.to_thread.run_sync(
                _compile_bootstrap, self.state_directory
            )
        if self.standby:
            self._nursery.start_soon(self._fill_standby, name="standby interpreter")
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack = self._stack
        nursery = self._nursery
        assert stack is not None
        assert nursery is not None
        self._stack = None
        self._nursery = None
        # The output copiers end with their children; any still running are cut off.
        nursery.cancel_scope.cancel()
        try:
            return await stack.__aexit__(*exc_info)
        finally:
            ready, self._ready = self._ready, None
            if ready is not None:
                with trio.CancelScope(shield=True):
                    await ready.discard()

    # -- logs -------------------------------------------------------------------------

    def log_path(self, handle: Handle) -> Path:
        """The log file of a session's child."""
        name = hashlib.sha256(f"{handle.key.identity}\0{handle.key.instance}".encode()).hexdigest()[
            :16
        ]
        return self.state_directory / "logs" / f"{name}-{handle.generation}.log"

    def logs(self, handle: Handle, *, tail: int | None = None) -> str:
        """What a session's child wrote (stdout and stderr), or its last ``tail`` bytes."""
        try:
            data = self.log_path(handle).read_bytes()
        except FileNotFoundError:
            return ""
        return data[-tail:].decode(errors="replace") if tail else data.decode(errors="replace")

    # -- spawn and recover ------------------------------------------------------------

    def _plan(self, load: Load) -> dict[str, Any]:
        specifier = load.specifier
        if specifier in self.commands:
            return {"kind": "command", "argv": list(self.commands[specifier])}
        if ENTRY_POINT.match(specifier):
            if not self.entry_paths:
                raise PackageError(
                    f"no entry paths are configured, so {specifier!r} cannot be loaded"
                )
            return {"kind": "python", "paths": list(self.entry_paths)}
        raise PackageError(
            f"{specifier!r} is neither a configured command "
            "nor a package.module:function entry point"
        )

    def _base_environment(self) -> dict[str, str]:
        environment = {name: os.environ[name] for name in ALLOWED_ENVIRONMENT if name in os.environ}
        environment.update(self.environment)
        environment["PYTHONUNBUFFERED"] = "1"
        return environment

    def _environment(self, handle: Handle) -> dict[str, str]:
        environment = self._base_environment()
        environment["TRIO_SUPERVISOR_IDENTITY"] = handle.key.identity
        environment["TRIO_SUPERVISOR_INSTANCE"] = handle.key.instance
        environment["TRIO_SUPERVISOR_GENERATION"] = str(handle.generation)
        return environment

    async def _start_interpreter(self, environment: Mapping[str, str], output: int) -> _Interpreter:
        """A bootstrap process, waiting for its spawn message on the returned socket."""
        ours, theirs = socket.socketpair()
        try:
            process = await trio.lowlevel.open_process(
                [self.python, "-I", str(self._bootstrap), str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=output,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                env=dict(environment),
                cwd=self.state_directory,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return _Interpreter(process, ours)

    async def _fill_standby(self) -> None:
        """Start the next standby interpreter, unless one is there or on its way."""
        if self._ready is not None or self._filling or self._nursery is None:
            await trio.lowlevel.checkpoint()
            return
        self._filling = True
        try:
            # Output goes nowhere until the spawn message names the session's log.
            interpreter = await self._start_interpreter(
                self._base_environment(), subprocess.DEVNULL
            )
        except OSError:
            return  # the next load starts its own interpreter, and reports the error
        finally:
            self._filling = False
        # Kept even if the execution is closing: its exit discards the standby once
        # this task has ended.
        self._ready = interpreter

    def _take_standby(self, limits: Limits) -> _Interpreter | None:
        standby = self._ready
        if standby is None or limits.output_bytes is not None:
            return None
        self._ready = None
        if self._nursery is not None:
            self._nursery.start_soon(self._fill_standby, name="standby interpreter")
        if standby.process.poll() is not None:
            standby.control.close()  # it died while it waited (reaped by poll)
            return None
        return standby

    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> _ProcessUnit:
        """Start the bootstrap for ``load``; return once it resolved the code.

        Raises:
            PackageError: The specifier is not allowed, or its code cannot be found.
            ExecutionError: The process could not be started or prepared.
        """
        nursery = self._nursery
        if nursery is None:
            await trio.lowlevel.checkpoint()
            raise ExecutionError(
                "SubprocessExecution is not running: enter it with `async with` first"
            )
        plan = self._plan(load)
        log = self.log_path(handle)
        spec: dict[str, Any] = {
            "command": "spawn",
            "specifier": load.specifier,
            "limits": {
                "memory_bytes": limits.memory_bytes,
                "cpu_seconds": limits.cpu_seconds,
                "open_files": limits.open_files,
                "file_size_bytes": limits.file_size_bytes,
            },
            "context": {
                "identity": handle.key.identity,
                "instance": handle.key.instance,
                "generation": handle.generation,
                "config": _thaw(load.config),
            },
            **plan,
        }
        standby = self._take_standby(limits)
        if standby is not None:
            # Started ahead: it learns where its output goes and its environment now.
            warm = {**spec, "log": str(log), "environment": self._environment(handle)}
            unit = await self._prepare(nursery, handle, load, standby, warm, None, log, limits)
            if unit is not None:
                return unit
            # It died before it answered: nothing of the caller's ran; start afresh.
        if limits.output_bytes is None:
            # No cap: the child writes into its log file itself, and nothing is copied.
            reader, writer = -1, os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        else:
            reader, writer = os.pipe()
        try:
            interpreter = await self._start_interpreter(self._environment(handle), writer)
        except BaseException as error:
            if reader >= 0:
                os.close(reader)
            if isinstance(error, OSError):
                raise ExecutionError(
                    f"cannot start the child for {load.specifier!r}: {error}"
                ) from error
            raise
        finally:
            os.close(writer)
        copied = reader if reader >= 0 else None
        unit = await self._prepare(nursery, handle, load, interpreter, spec, copied, log, limits)
        if unit is None:
            raise ExecutionError(f"the child for {load.specifier!r} exited before it reported")
        return unit

    async def _prepare(
        self,
        nursery: trio.Nursery,
        handle: Handle,
        load: Load,
        interpreter: _Interpreter,
        spec: Mapping[str, Any],
        reader: int | None,
        log: Path,
        limits: Limits,
    ) -> _ProcessUnit | None:
        """Send the spawn message; the resolved unit, or None if the child died first.

        ``reader`` is the pipe of capped output (copied into ``log``), or None when
        the child writes its log itself.
        """
        process = interpreter.process
        identity = ChildIdentity(
            adapter=ADAPTER,
            ref=f"{process.pid}:{start_time(process.pid)}",
            pid=process.pid,
            pgid=process.pid,
            start_time=start_time(process.pid),
            boot_id=self._boot_id,
        )
        unit = _ProcessUnit(self, process, identity, interpreter.control, load)
        if reader is None:
            unit.output_done.set()
        else:
            nursery.start_soon(
                _copy_output,
                reader,
                log,
                limits.output_bytes,
                unit.output_done,
                name=f"output of {load.specifier}",
            )
        try:
            try:
                await unit._send(spec)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                reply: dict[str, Any] = {"event": "eof"}
            else:
                reply = await unit._receive()
            if reply.get("event") == "eof":
                with trio.CancelScope(shield=True):
                    await unit._destroy()
                return None
            if reply.get("event") != "resolved":
                raise _failure(reply, load.specifier)
            code = reply["code"]
            unit.code = CodeIdentity(
                specifier=load.specifier,
                origin=code["origin"],
                digest=code["digest"],
                version=code["version"],
            )
        except BaseException:
            # Nothing of the caller's ran yet; the half-made child goes.
            with trio.CancelScope(shield=True):
                await unit._destroy()
            raise
        return unit

    async def recover(self, child: ChildIdentity) -> Termination:
        """Make sure a child left by an earlier run is gone; never touch anyone else.

        A different boot id, or a pid whose start time differs from the record, means the
        child is gone and nothing is sent. A live child is killed through a pidfd, with
        its whole group. A group whose leader is gone but whose members remain is killed
        too: only our child's descendants can hold its process group id.
        """
        if child.adapter != ADAPTER or child.pid is None or child.pgid is None:
            raise ExecutionError(f"{child} was not made by the subprocess execution")
        gone = Termination(kind="exited", exit=ExitStatus(code=None, signal=None))
        if child.boot_id != self._boot_id:
            await trio.lowlevel.checkpoint()
            return gone
        pid, pgid = child.pid, child.pgid
        fields = _stat(pid)
        if fields is not None and fields[0] != "Z":
            if int(fields[19]) == child.start_time:
                return await self._kill_recorded(pid, pgid, child.start_time)
            if int(fields[2]) == pgid:
                # The pid was reused by a process that leads a group of that id: theirs.
                await trio.lowlevel.checkpoint()
                return gone
        left = _live_members(pgid)
        if left:
            # The leader is dead, its group is not: only its descendants can hold the id.
            _signal_group(pgid, signal.SIGKILL)
            await trio.lowlevel.checkpoint()
            await _group_gone(pgid)
            return Termination(kind="killed", exit=ExitStatus(descendants_killed=len(left)))
        _reap_group(pgid)
        await trio.lowlevel.checkpoint()
        return gone

    async def _kill_recorded(self, pid: int, pgid: int, recorded: int | None) -> Termination:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            await trio.lowlevel.checkpoint()
            return Termination(kind="exited", exit=ExitStatus())
        try:
            # The pidfd pins the process: if its start time still matches, it is ours.
            if start_time(pid) != recorded:
                await trio.lowlevel.checkpoint()
                return Termination(kind="exited", exit=ExitStatus())
            descendants = sum(1 for member in _live_members(pgid) if member != pid)
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            _signal_group(pgid, signal.SIGKILL)
            await trio.lowlevel.wait_readable(pidfd)  # readable once the process exited
            status = _reap(pid)
            await _group_gone(pgid)
            return Termination(
                kind="killed", exit=attrs.evolve(status, descendants_killed=descendants)
            )
        finally:
            os.close(pidfd)


def _reap(pid: int) -> ExitStatus:
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


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {name: _thaw(item) for name, item in value.items()}
    if isinstance(value, tuple | list):
        return [_thaw(item) for item in value]
    return value


def _failure(reply: Mapping[str, Any], specifier: str) -> Exception:
    if reply.get("event") == "eof":
        return ExecutionError(f"the child for {specifier!r} exited before it reported")
    message = str(reply.get("message", reply))
    if reply.get("kind") == "PackageError":
        return PackageError(message)
    return ExecutionError(message)


async def _copy_output(reader: int, path: Path, cap: int | None, done: trio.Event) -> None:
    """Copy the child's output into its log file, keeping the head when capped."""
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
                chunk = await stream.receive_some(65536)
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


@attrs.define(eq=False)
class _Interpreter:
    """A started bootstrap that has not been told what to run yet."""

    process: trio.Process
    control: socket.socket

    async def discard(self) -> None:
        """End it and reap it. It ran nothing and is alone in its process group."""
        self.control.close()
        if self.process.poll() is None:  # not reaped, so its pid is still ours
            self.process.kill()
        with trio.move_on_after(5.0):
            await self.process.wait()


class _ProcessUnit:
    """One child process and the control socket to its bootstrap."""

    def __init__(
        self,
        execution: SubprocessExecution,
        process: trio.Process,
        identity: ChildIdentity,
        control: socket.socket,
        load: Load,
    ) -> None:
        self._execution = execution
        self._process = process
        self._identity = identity
        self.code = CodeIdentity(specifier=load.specifier)
        self._specifier = load.specifier
        self._socket = control  # the same socket, for reading what is left at exit
        self._control = trio.SocketStream(trio.socket.from_stdlib_socket(control))
        self._buffer = b""
        # Processes the child left in its group that had to be killed: counted by the
        # bootstrap as it exits ("swept"), and by our own kill of the group.
        self._descendants_killed = 0
        self._status: ExitStatus | None = None
        self._wait_lock = trio.Lock()
        self._send_lock = trio.StrictFIFOLock()
        self._started = False
        self._closed = False
        self.output_done = trio.Event()

    @property
    def identity(self) -> ChildIdentity:
        return self._identity

    async def _send(self, message: Mapping[str, Any]) -> None:
        # Length-prefixed marshal: the bootstrap reads it without importing json.
        payload = marshal.dumps(dict(message))
        async with self._send_lock:
            await self._control.send_all(len(payload).to_bytes(4, "big") + payload)

    async def _receive(self) -> dict[str, Any]:
        while len(self._buffer) < 4 or len(self._buffer) < 4 + int.from_bytes(
            self._buffer[:4], "big"
        ):
            try:
                chunk = await self._control.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                return {"event": "eof"}
            self._buffer += chunk
        size = int.from_bytes(self._buffer[:4], "big")
        message: dict[str, Any] = marshal.loads(self._buffer[4 : 4 + size])
        self._buffer = self._buffer[4 + size :]
        return message

    async def start(self) -> None:
        if self._started:
            await trio.lowlevel.checkpoint()
            raise ExecutionError("this unit was started already")
        self._started = True
        try:
            await self._send({"command": "start"})
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            raise ExecutionError(
                f"the child for {self._specifier!r} is gone before it started"
            ) from error
        reply = await self._receive()
        if reply.get("event") != "started":
            raise _failure(reply, self._specifier)

    async def renew(self, lease: float) -> None:
        if not math.isfinite(lease):
            await trio.lowlevel.checkpoint()
            return
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._send({"command": "renew", "lease": lease})

    async def interrupt(self) -> None:
        # The signal first: the child starts on its way out while the message that
        # disarms its lease watchdog (so the lease cannot cut the graceful stop short)
        # follows. The watchdog cannot fire in between: it waits for the lease plus a
        # second of slack, and the session was live, so its lease had not run out.
        _signal_group(self._identity.pgid or self._process.pid, signal.SIGTERM)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._send({"command": "interrupt"})

    async def kill(self) -> None:
        await trio.lowlevel.checkpoint()
        pgid = self._identity.pgid or self._process.pid
        # Whatever of the group is not the leader is something the child left behind.
        self._descendants_killed += sum(
            1 for pid in _live_members(pgid) if pid != self._process.pid
        )
        _signal_group(pgid, signal.SIGKILL)

    async def wait(self) -> ExitStatus:
        async with self._wait_lock:  # one waiter works it out; the others read it
            if self._status is None:
                returncode = await self._process.wait()
                # The leader is gone; the child is gone when its whole group is.
                await _group_gone(self._identity.pgid or self._process.pid)
                self._read_leftovers()
                self._status = attrs.evolve(
                    _status(returncode), descendants_killed=self._descendants_killed
                )
            return self._status

    def _read_leftovers(self) -> None:
        """Take in what the bootstrap said as it exited (how many it swept).

        Everything it sent is in the socket already: it has exited. So this reads
        without waiting, and stops at the first empty read.
        """
        while True:
            try:
                chunk = self._socket.recv(65536, socket.MSG_DONTWAIT)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self._buffer += chunk
        while len(self._buffer) >= 4:
            size = int.from_bytes(self._buffer[:4], "big")
            if len(self._buffer) < 4 + size:
                break
            message = marshal.loads(self._buffer[4 : 4 + size])
            self._buffer = self._buffer[4 + size :]
            if isinstance(message, dict) and message.get("event") == "swept":
                self._descendants_killed += int(message.get("killed", 0))

    async def _destroy(self) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        if self._process.returncode is None and not self._started:
            # Never started: nothing of the caller's ran; it simply goes, and is reaped.
            _signal_group(self._identity.pgid or self._process.pid, signal.SIGKILL)
            with trio.move_on_after(5.0):
                await self.wait()
        # Closing the socket is the child's dead-man switch if anything still runs.
        await self._control.aclose()
        # Once the group is gone its output ends; let the last of it reach the log.
        if not self.output_done.is_set():  # it is when the child wrote the log itself
            with trio.move_on_after(1.0):
                await self.output_done.wait()
