"""The child side of the subprocess execution. Standard library only.

Run as ``python -I _bootstrap.py FD``, where FD is one end of a socket pair whose other
end the supervisor holds. The supervisor started this process in a session and process
group of its own. The protocol is JSON lines:

    supervisor -> child   {"command": "spawn", ...}     what to run, limits, context
    child -> supervisor   {"event": "resolved", "code": {...}}  or  {"event": "failed", ...}
    supervisor -> child   {"command": "renew", "lease": 5.0}    any number of times
    supervisor -> child   {"command": "start"}
    child -> supervisor   {"event": "started"}  or  {"event": "failed", ...}
    supervisor -> child   {"command": "interrupt"}  just before it sends SIGTERM

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
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# How long after its lease deadline the child kills itself when no renewal came. The
# supervisor stops an expired session itself at the deadline; this is for a supervisor
# that hangs without dying.
LEASE_SLACK = 1.0

_LIMITS = {
    "memory_bytes": resource.RLIMIT_AS,
    "cpu_seconds": resource.RLIMIT_CPU,
    "open_files": resource.RLIMIT_NOFILE,
    "file_size_bytes": resource.RLIMIT_FSIZE,
}


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
        self.socket = socket.socket(fileno=fd)
        self.socket.setblocking(True)
        self.lock = threading.Lock()
        self.buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\n"
        # OSError: the supervisor is gone; the watchdog sees EOF and ends us.
        with self.lock, contextlib.suppress(OSError):
            self.socket.sendall(data)

    def read(self, timeout: float | None = None) -> Any:
        """One message, None on EOF, or "timeout"."""
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.socket], [], [], timeout)
            if not ready:
                return "timeout"
            try:
                chunk = self.socket.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def kill_group() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def kill_the_rest_of_the_group() -> None:
    """SIGKILL every other process of this group (what the entry point left behind)."""
    group, me = os.getpgrp(), os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                stat = file.read()
            fields = stat[stat.rindex(b")") + 2 :].split()
            if int(fields[2]) == group:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError):
            continue
    # Reap those that are our children, so none lingers as a zombie of this group.
    while True:
        try:
            pid, _ = os.waitpid(-group, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class Watchdog(threading.Thread):
    """Reads the supervisor's commands; kills the group on EOF or an expired lease."""

    def __init__(self, control: Control) -> None:
        super().__init__(name="trio_supervisor watchdog", daemon=True)
        self.control = control
        self.start_requested = threading.Event()
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
                if (
                    self.deadline is not None
                    and time.monotonic() >= self.deadline
                    and not self.interrupted
                ):
                    kill_group()  # the lease ran out and nobody renewed it
                continue
            command = message.get("command")
            if command == "renew":
                self.renew(message["lease"])
            elif command == "start":
                self.start_requested.set()
            elif command == "interrupt":
                self.interrupted = True


def digest(path: str | Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 16), b""):
            sha.update(block)
    return "sha256:" + sha.hexdigest()


def find_module(module: str, paths: list[str]) -> Path:
    """The file of ``module`` on ``paths``, found without importing anything."""
    parts = module.split(".")
    for base in paths:
        where = Path(base).joinpath(*parts)
        for candidate in (where.with_suffix(".py"), where / "__init__.py"):
            if candidate.is_file():
                return candidate
    raise Refused(f"no module {module!r} on the entry paths {list(paths)!r}")


def distribution_version(module: str, paths: list[str]) -> str | None:
    import importlib.metadata

    top = module.split(".")[0]
    for distribution in importlib.metadata.distributions(path=list(paths)):
        names = (distribution.read_text("top_level.txt") or "").split()
        if top in names or (distribution.metadata["Name"] or "").replace("-", "_") == top:
            return distribution.version
    return None


def resolve(spec: dict[str, Any]) -> dict[str, str | None]:
    """Find what to run; return its code identity. Runs none of the caller's code."""
    if spec["kind"] == "command":
        argv = spec["argv"]
        executable = argv[0]
        if os.sep not in executable:
            import shutil

            executable = shutil.which(executable, path=os.environ.get("PATH", os.defpath))
        if not executable or not os.access(executable, os.X_OK):
            raise Refused(f"the command {spec['specifier']!r} has no executable {argv[0]!r}")
        return {"origin": executable, "digest": digest(executable), "version": None}
    module = spec["specifier"].partition(":")[0]
    path = find_module(module, spec["paths"])
    return {
        "origin": str(path),
        "digest": digest(path),
        "version": distribution_version(module, spec["paths"]),
    }


def apply_limits(limits: dict[str, int | None]) -> None:
    for name, which in _LIMITS.items():
        value = limits.get(name)
        if value is not None:
            resource.setrlimit(which, (value, value))


def run_entry_point(spec: dict[str, Any], context: Context, control: Control) -> int | str:
    module_name, _, attribute = spec["specifier"].partition(":")
    sys.path[:0] = spec["paths"]
    try:
        import importlib

        target = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
        if not callable(target):
            raise TypeError(f"{spec['specifier']!r} is not callable")
    except BaseException as error:  # any failure to import is the package's
        control.send(
            {
                "event": "failed",
                "kind": "PackageError",
                "message": f"cannot import {spec['specifier']!r}: {error!r}",
            }
        )
        traceback.print_exc()
        return 1
    control.send({"event": "started"})
    try:
        if inspect.iscoroutinefunction(target):
            import trio

            result = trio.run(target, context)
        else:
            result = target(context)
    except KeyboardInterrupt:
        return "interrupted"
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def run_command(spec: dict[str, Any], control: Control) -> int:
    # SIGTERM reaches the command too (the whole group is signalled); this process
    # waits for the command and ends the way it did. (Set before the command exists: a
    # handler is reset to the default in the command by exec.)
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        command = subprocess.Popen(spec["argv"])
    except OSError as error:
        control.send(
            {
                "event": "failed",
                "kind": "ExecutionError",
                "message": f"cannot run {spec['argv'][0]!r}: {error}",
            }
        )
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
    for number in (signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main() -> int:
    reset_signals()
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    control = Control(int(sys.argv[1]))
    spec = control.read()
    if not isinstance(spec, dict) or spec.get("command") != "spawn":
        return 2
    try:
        code = resolve(spec)
        apply_limits(spec["limits"])
    except Refused as error:
        control.send({"event": "failed", "kind": "PackageError", "message": str(error)})
        return 1
    except (OSError, ValueError) as error:
        control.send(
            {
                "event": "failed",
                "kind": "ExecutionError",
                "message": f"cannot prepare the child: {error}",
            }
        )
        return 1
    watchdog = Watchdog(control)
    watchdog.start()
    control.send({"event": "resolved", "code": code})
    watchdog.start_requested.wait()
    # An interrupt becomes a KeyboardInterrupt in the entry point (sync code, or Trio's
    # own handling of SIGINT), so it can clean up.
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    context = spec["context"]
    if spec["kind"] == "command":
        status = run_command(spec, control)
        kill_the_rest_of_the_group()
        if status < 0:
            signal.signal(-status, signal.SIG_DFL)
            os.kill(os.getpid(), -status)
        return status
    result = run_entry_point(
        spec,
        Context(context["identity"], context["instance"], context["generation"], context["config"]),
        control,
    )
    kill_the_rest_of_the_group()
    if result == "interrupted":
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # the signal ends us
    return result if isinstance(result, int) else 1


if __name__ == "__main__":
    sys.exit(main())
