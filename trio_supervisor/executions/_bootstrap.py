"""The child side of the subprocess execution. Standard library only, and lean.

Run as ``python -I _bootstrap.py FD``, where FD is one end of a socket pair whose other
end the supervisor holds. The supervisor started this process in a session and process
group of its own. Messages are length-prefixed ``marshal`` values (4-byte big-endian
length, then the payload):

    supervisor -> child   {"command": "spawn", ...}     what to run, limits, context
                          (to a standby started ahead, also "log" and "environment")
    child -> supervisor   {"event": "resolved", "code": {...}}  or  {"event": "failed", ...}
    supervisor -> child   {"command": "renew", "lease": 5.0}    any number of times
    supervisor -> child   {"command": "start"}
    child -> supervisor   {"event": "started"}  or  {"event": "failed", ...}
    supervisor -> child   {"command": "interrupt"}  right after it sends SIGTERM
    child -> supervisor   {"event": "swept", "killed": 2}  as it exits, if it had to
                          kill what the entry point left in its group

Before any of the caller's code runs, this process resolves the specifier (finding the
module file on the configured paths without importing it, or the executable of a named
command), reports what it found and its digest, and applies the limits with setrlimit.

A watchdog thread enforces the lease and is the dead-man switch: when the socket reaches
EOF (the supervisor died) or the lease deadline passes without a renewal, it kills the
whole process group with SIGKILL. After an interrupt only EOF counts, so the lease
cannot cut a graceful stop short.

Exit: the entry point's int result (or 0), 1 when it raised, and death by SIGTERM when
it was interrupted. Whatever it left running in the group is killed first: the child's
exit ends its whole process tree. Named commands run as a child of this process, which
stays their parent under the same watchdog and exits the way the command did.

Start-up time is part of every load, so this file imports only what is built into the
interpreter: ``_signal`` and ``_thread`` instead of ``signal`` and ``threading`` (which
pull in ``enum`` and more), ``marshal`` instead of ``json`` (which pulls in ``re``), raw
file descriptors instead of ``socket``. Anything else is imported when it is needed.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # built in; see above
import _thread
import marshal
import os
import select
import sys
import time

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs milliseconds
if TYPE_CHECKING:
    from typing import Any

# How long after its lease deadline the child kills itself when no renewal came. The
# supervisor stops an expired session itself at the deadline; this is for a supervisor
# that hangs without dying.
LEASE_SLACK = 1.0
SIGKILL = 9
SIGTERM = _signal.SIGTERM
SIGINT = _signal.SIGINT


class Context:
    """What an entry point is told: its session's key and generation, and its config."""

    def __init__(self, identity: str, instance: str, generation: int, config: Any) -> None:
        self.identity = identity
        self.instance = instance
        self.generation = generation
        self.config = config

    def __repr__(self) -> str:
        return f"Context({self.identity!r}, {self.instance!r}, generation={self.generation})"


class Refused(Exception):
    """The specifier cannot be run: a PackageError on the supervisor's side."""


class Control:
    """The socket to the supervisor, shared by the main thread and the watchdog."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = _thread.allocate_lock()
        self.buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        payload = marshal.dumps(message)
        data = len(payload).to_bytes(4, "big") + payload
        with self.lock:
            try:
                while data:
                    data = data[os.write(self.fd, data) :]
            except OSError:
                pass  # the supervisor is gone; the watchdog sees EOF and ends us

    def read(self, timeout: float | None = None) -> Any:
        """One message, None on EOF, or "timeout"."""
        while len(self.buffer) < 4 or len(self.buffer) < 4 + int.from_bytes(self.buffer[:4], "big"):
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                return "timeout"
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                return None
            self.buffer += chunk
        size = int.from_bytes(self.buffer[:4], "big")
        message = marshal.loads(self.buffer[4 : 4 + size])
        self.buffer = self.buffer[4 + size :]
        return message


def kill_group() -> None:
    os.killpg(os.getpgrp(), SIGKILL)


def has_children() -> bool:
    """Whether this process has (or had, unreaped) a child: one system call."""
    try:
        os.waitpid(-1, os.WNOHANG)  # reaps at most one exited child, which is ours
    except ChildProcessError:
        return False
    return True


def sweep(control: Control) -> None:
    """Kill what the entry point left in the group; tell the supervisor how many."""
    killed = kill_the_rest_of_the_group()
    if killed:
        control.send({"event": "swept", "killed": killed})


def kill_the_rest_of_the_group() -> int:
    """SIGKILL every other process of this group (what the entry point left behind).

    Returns:
        How many processes were killed.
    """
    if not has_children():
        return 0  # nothing was started, so nothing can be left
    killed = 0
    group, me = os.getpgrp(), os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            # Our own reading of /proc/PID/stat, not the package's (``_groups.read_stat``):
            # this file runs in the child and imports nothing of the package, which would
            # pull in Trio and attrs and cost every load its start-up time.
            with open(f"/proc/{entry}/stat", "rb") as file:
                stat = file.read()
            fields = stat[stat.rindex(b")") + 2 :].split()
            if int(fields[2]) == group and fields[0] != b"Z":
                os.kill(int(entry), SIGKILL)
                killed += 1
        except (OSError, ValueError):
            continue
    # Reap those that are our children, so none lingers as a zombie of this group.
    while True:
        try:
            pid, _ = os.waitpid(-group, os.WNOHANG)
        except ChildProcessError:
            return killed
        if pid == 0:
            return killed


class Watchdog:
    """Reads the supervisor's commands; kills the group on EOF or an expired lease."""

    def __init__(self, control: Control) -> None:
        self.control = control
        self.start_requested = _thread.allocate_lock()
        self.start_requested.acquire()  # released by the start command
        self.deadline: float | None = None
        self.interrupted = False

    def renew(self, lease: float) -> None:
        self.deadline = time.monotonic() + float(lease) + LEASE_SLACK

    def run(self) -> None:
        while True:
            timeout = None
            if self.deadline is not None and not self.interrupted:
                timeout = max(self.deadline - time.monotonic(), 0.0)
            message = self.control.read(timeout)
            if message is None:
                kill_group()  # the supervisor is gone: nobody may outlive it
                return
            if message == "timeout":
                expired = self.deadline is not None and time.monotonic() >= self.deadline
                if expired and not self.interrupted:
                    kill_group()  # the lease ran out and nobody renewed it
                continue
            command = message.get("command")
            if command == "renew":
                self.renew(message["lease"])
            elif command == "start":
                if self.start_requested.locked():
                    self.start_requested.release()
            elif command == "interrupt":
                self.interrupted = True


def sha256_of(path: str) -> str:
    # The built-in implementation first: hashlib's OpenSSL binding takes longer to load.
    for name in ("_sha256", "_sha2", "hashlib"):
        try:
            sha256 = __import__(name).sha256
        except (ImportError, AttributeError):
            continue
        break
    digest = sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 16), b""):
            digest.update(block)
    return "sha256:" + str(digest.hexdigest())


def find_module(module: str, paths: list[str]) -> str:
    """The file of ``module`` on ``paths``, found without importing anything."""
    parts = module.split(".")
    for base in paths:
        where = os.path.join(base, *parts)
        for candidate in (where + ".py", os.path.join(where, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    raise Refused(f"no module {module!r} on the entry paths {list(paths)!r}")


def distribution_version(module: str, paths: list[str]) -> str | None:
    """The version of the installed distribution that holds ``module``, if any."""
    if not any(
        name.endswith((".dist-info", ".egg-info")) for base in paths for name in _listing(base)
    ):
        return None  # no distribution metadata at all: skip importlib.metadata's cost
    import importlib.metadata

    top = module.split(".")[0]
    for distribution in importlib.metadata.distributions(path=list(paths)):
        names = (distribution.read_text("top_level.txt") or "").split()
        if top in names or (distribution.metadata["Name"] or "").replace("-", "_") == top:
            return distribution.version
    return None


def _listing(base: str) -> list[str]:
    try:
        return os.listdir(base)
    except OSError:
        return []


def which(executable: str) -> str | None:
    if os.sep in executable:
        return executable
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        candidate = os.path.join(directory, executable)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def resolve(spec: dict[str, Any]) -> dict[str, str | None]:
    """Find what to run; return its code identity. Runs none of the caller's code."""
    if spec["kind"] == "command":
        argv = spec["argv"]
        executable = which(argv[0])
        if not executable or not os.access(executable, os.X_OK):
            raise Refused(f"the command {spec['specifier']!r} has no executable {argv[0]!r}")
        return {"origin": executable, "digest": sha256_of(executable), "version": None}
    module = spec["specifier"].partition(":")[0]
    path = find_module(module, spec["paths"])
    return {
        "origin": path,
        "digest": sha256_of(path),
        "version": distribution_version(module, spec["paths"]),
    }


def take_over(log: str, environment: dict[str, str]) -> None:
    """Send output to the session's log and take its environment (a standby's start)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()  # exactly the session's, whatever the standby started with
    os.environ.update(environment)


def apply_limits(limits: dict[str, int | None]) -> None:
    if all(value is None for value in limits.values()):
        return
    import resource

    which_limit = {
        "memory_bytes": resource.RLIMIT_AS,
        "cpu_seconds": resource.RLIMIT_CPU,
        "open_files": resource.RLIMIT_NOFILE,
        "file_size_bytes": resource.RLIMIT_FSIZE,
    }
    for name, number in which_limit.items():
        value = limits.get(name)
        if value is not None:
            resource.setrlimit(number, (value, value))


def print_traceback() -> None:
    import traceback

    traceback.print_exc()


def _is_awaitable(value: object) -> bool:
    return hasattr(value, "__await__")


def run_entry_point(spec: dict[str, Any], context: Context, control: Control) -> int | str:
    module_name, _, attribute = spec["specifier"].partition(":")
    sys.path[:0] = spec["paths"]
    try:
        __import__(module_name)
        target: Any = sys.modules[module_name]
        for part in attribute.split("."):
            target = getattr(target, part)
        if not callable(target):
            raise TypeError(f"{spec['specifier']!r} is not callable")
    except KeyboardInterrupt:
        raise  # interrupted while importing: main() ends the child by SIGTERM
    except BaseException as error:  # any other failure to import is the package's
        message = f"cannot import {spec['specifier']!r}: {error!r}"
        control.send({"event": "failed", "kind": "PackageError", "message": message})
        print_traceback()
        return 1
    control.send({"event": "started"})
    try:
        result = target(context)
        if _is_awaitable(result):
            # An async entry point: run the coroutine it returned under Trio.
            import trio

            async def run_it() -> Any:
                return await result

            result = trio.run(run_it)
    except KeyboardInterrupt:
        INTERRUPTS.over = True
        return "interrupted"
    except SystemExit as exit:
        INTERRUPTS.over = True
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:
        INTERRUPTS.over = True
        print_traceback()
        return 1
    INTERRUPTS.over = True
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def run_command(spec: dict[str, Any], control: Control) -> int:
    import subprocess

    # SIGTERM reaches the command too (the whole group is signalled); this process
    # waits for the command and ends the way it did. (Set before the command exists: a
    # handler is reset to the default in the command by exec.)
    _signal.signal(SIGTERM, lambda *_: None)
    try:
        command = subprocess.Popen(spec["argv"])
    except OSError as error:
        message = f"cannot run {spec['argv'][0]!r}: {error}"
        control.send({"event": "failed", "kind": "ExecutionError", "message": message})
        return 1
    control.send({"event": "started"})
    # Negative: killed by that signal (Popen's convention), which main() re-enacts.
    return command.wait()


def reset_signals() -> None:
    """Start from the default dispositions, whatever the supervisor inherited.

    A process started in the background by a shell ignores SIGINT and SIGQUIT, and an
    ignored signal stays ignored across exec: without this, the KeyboardInterrupt an
    interrupt is turned into would never be raised.
    """
    for number in (_signal.SIGHUP, _signal.SIGQUIT, SIGTERM, _signal.SIGUSR1, _signal.SIGUSR2):
        _signal.signal(number, _signal.SIG_DFL)
    _signal.signal(SIGINT, _signal.default_int_handler)


class Interrupts:
    """Turns SIGTERM into a KeyboardInterrupt until the entry point is over.

    The interrupt goes through SIGINT, so an entry point running under Trio gets it the
    way Trio delivers a Ctrl-C. Once the entry point has returned (``over``), a late
    SIGTERM changes nothing: the child is already on its way out, with its own status.
    """

    over = False

    def install(self) -> None:
        _signal.signal(SIGTERM, self.handle)

    def handle(self, number: int, frame: object) -> None:
        if not self.over:
            _signal.raise_signal(SIGINT)


INTERRUPTS = Interrupts()


def die_by(number: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    _signal.signal(number, _signal.SIG_DFL)
    os.kill(os.getpid(), number)
    time.sleep(60)  # the signal ends us


def main() -> int:
    reset_signals()
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    control = Control(int(sys.argv[1]))
    spec = control.read()
    if not isinstance(spec, dict) or spec.get("command") != "spawn":
        return 2
    try:
        if "log" in spec:
            # Started ahead as a standby: now it becomes the session's child.
            take_over(spec["log"], spec["environment"])
        code = resolve(spec)
        apply_limits(spec["limits"])
    except Refused as error:
        control.send({"event": "failed", "kind": "PackageError", "message": str(error)})
        return 1
    except (OSError, ValueError) as error:
        message = f"cannot prepare the child: {error}"
        control.send({"event": "failed", "kind": "ExecutionError", "message": message})
        return 1
    watchdog = Watchdog(control)
    _thread.start_new_thread(watchdog.run, ())
    control.send({"event": "resolved", "code": code})
    watchdog.start_requested.acquire()
    # An interrupt becomes a KeyboardInterrupt in the entry point (sync code, or Trio's
    # own handling of SIGINT), so it can clean up.
    INTERRUPTS.install()
    context = spec["context"]
    if spec["kind"] == "command":
        status = run_command(spec, control)
        sweep(control)
        if status < 0:
            die_by(-status)
        return status
    try:
        result = run_entry_point(
            spec,
            Context(
                context["identity"], context["instance"], context["generation"], context["config"]
            ),
            control,
        )
    except KeyboardInterrupt:
        # Interrupted outside the entry point's own try: just before it began (say, while
        # the "started" event was being sent) or just as it ended.
        result = "interrupted"
    INTERRUPTS.over = True
    sweep(control)
    if result == "interrupted":
        die_by(SIGTERM)
    return result if isinstance(result, int) else 1


if __name__ == "__main__":
    sys.exit(main())
