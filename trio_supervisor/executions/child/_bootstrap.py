"""The child side of the subprocess execution. Standard library only, and lean.

Run as ``python -I _bootstrap.py FD HOW STRICT``, where FD is one end of a socket pair
whose other end the supervisor holds, HOW is how the child is contained ("pid" or
"user" for a PID namespace, "sweep" for none) and STRICT says whether a namespace is
required ("strict") or may fall back to the sweep ("lax"). The supervisor started this
process in a session and process group of its own. Messages are length-prefixed
``marshal`` values (4-byte big-endian length, then the payload), each typed once for
both sides in ``_protocol`` (imported for the type checker alone):

    child -> supervisor   {"event": "tracked", "pid": 1234}   first: which process is T
    supervisor -> child   {"command": "join", "make": [...], "cgroups": [...]}   to a
                          standby, while it waits: the cgroup it makes (its directory
                          in each hierarchy) and the cgroup.procs files it joins
    supervisor -> child   {"command": "isolate", "isolation": {...}}   to a standby, while
                          it waits: T forks P ahead, in namespaces of its own, for a
                          spawn message with the same "isolation" (:class:`Ahead`)
    supervisor -> child   {"command": "spawn", ...}     what to run, limits, context
                          (to a standby started ahead, also "log" and "environment";
                          with a cgroup, "cgroups": the cgroup.procs files T joins
                          (unless it joined them ahead), or "joined": those of the
                          cgroup T was born in;
                          isolated, "isolation": the uid, home, TMPDIR, network and
                          view P takes before it runs anything, see :func:`isolate`)
    child -> supervisor   {"event": "resolved", "code": {...}, "containment": "namespace"}
                          (or "sweep": what this child really uses), with the writing
                          end of P's "go" pipe (SCM_RIGHTS): at "start" the supervisor
                          lets P go itself  or  {"event": "failed", ...}
    supervisor -> child   {"command": "renew", "lease": 5.0}    any number of times
    supervisor -> child   {"command": "start"}
    child -> supervisor   {"event": "started"}  or  {"event": "failed", ...}
    child -> supervisor   {"event": "exited", "status": 15, "killed": 2}  as T ends: how
                          the plugin ended (a wait status) and how many processes it
                          left that had to be killed

Theory of operation: two processes, each with one job.

* **T, the tracked process**, whose pid, start time and boot id the supervisor records.
  Before any of the caller's code runs it joins the child's cgroup, if it was given
  one (so the plugin's whole tree is in it from its first fork), resolves the
  specifier (finding the module file without importing it, or the executable of a
  named command), reports the code
  and its digest, and applies the limits with setrlimit. Then its one thread keeps the
  control protocol, the lease and the dead-man switch, and runs none of the caller's
  code. It holds the plugin's whole tree one of two ways:

  - **namespace**: T is PID 1 of a PID namespace made for this child alone (in a user
    namespace of its own where it is not privileged). Only a process forked after
    ``unshare(CLONE_NEWPID)`` can be that, so the process the supervisor started makes
    the namespace, forks T and exits (:func:`launch`; the fork server's intermediate
    process does the same), and T is re-parented to the supervisor, a child subreaper.
    Whatever the plugin starts is in the namespace, whatever it does (``setsid``, a
    double fork, a cleared environment); T reaps every orphan, and when T exits the
    kernel kills everything left in it.
  - **sweep**, where the kernel allows no namespace: T is the process the supervisor
    started (or one the fork server made), and a child subreaper, so every orphan of
    the plugin's is re-parented to it and stays in its tree; on every way out T
    freezes that tree (SIGSTOP, until a walk of ``/proc`` finds nothing running), kills
    it and reaps it.

* **P, the plugin**: the entry point, or the named command (by exec), T's child in a
  process group of its own, forked ahead and let go at "start". Where the runner
  isolates its children, P gives up root before it waits for "start" (:func:`isolate`):
  it enters the children's view of the file system, takes a uid and gid of its own,
  ``PR_SET_NO_NEW_PRIVS`` and its private directory, and, without a network, a network
  namespace of its own; in a mount namespace of its own it gets a fresh tmpfs over
  ``/tmp``, ``/var/tmp`` and ``/dev/shm``, and, in a PID namespace, that namespace's
  ``/proc`` (:func:`own_mounts`). A standby's T forks its P while it waits, and that P
  makes those namespaces then; at the load it takes its spawn message, the session's
  log, environment, limits and uid while T resolves the code (:class:`Ahead`). T stays
  root, runs none of the plugin's code, and cannot be signalled or traced by P.

Ways out, and what holds each:

* P ends by itself: T kills what P left (``kill(-1)`` from PID 1, or the sweep),
  reports how P ended, and ends the same way (a PID 1 cannot die by its own signal, so
  in a namespace it exits with 128 plus the signal's number; the report is what counts).
* interrupt: the supervisor's SIGTERM reaches T, which passes it to P's group, where the
  entry point gets it as a KeyboardInterrupt; from then on the lease no longer counts.
* EOF on the socket (the supervisor died) or an expired lease: T ends, and the
  namespace with it; a sweeping T sweeps its tree first.
* T killed: in a namespace the kernel kills the rest with its PID 1; swept, P dies by
  its parent-death signal, armed before any of the caller's code runs (P checks T is
  still there once it is armed, since T may have died just before), and the supervisor
  finds what P left by T's session and marker pipe.

Exit: the entry point's int result (or 0), 1 when it raised, and death by SIGTERM when
it was interrupted; a named command's own status or signal.

Run as ``python -I _bootstrap.py serve FD HOW STRICT [MODULE ...]``, it is the fork
server instead (see the section at the end of this file): it prepares once, then makes
a fresh T per load, which goes on exactly as a T the supervisor started.

Start-up time is part of every load, so this file imports only what is built into the
interpreter: ``_signal`` instead of ``signal`` (which pulls in ``enum`` and more),
``marshal`` instead of ``json`` (which pulls in ``re``), raw file descriptors instead of
``socket``, ``_ctypes`` instead of ``ctypes`` for ``unshare`` and ``prctl``. Anything
else is imported when it is needed. It is one file because it runs as a script that
may import nothing beside it.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # built in; see above
import gc
import marshal
import os
import select
import sys
import time

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs milliseconds
if TYPE_CHECKING:
    from typing import Any, Literal, NoReturn, TypeGuard

    # The messages, typed once for both sides (the runner's imports them at run time).
    from ._protocol import (
        Code,
        Command,
        Event,
        ForkRequest,
        IsolationSpec,
        NamespaceIsolationSpec,
        OwnMounts,
        RLimits,
        ServerReply,
        SpawnCommand,
        UserIsolationSpec,
        ViewSpec,
    )

# How long after its lease deadline the child kills itself when no renewal came. The
# supervisor stops an expired session itself at the deadline; this is for a supervisor
# that hangs without dying.
LEASE_SLACK = 1.0
SIGKILL = 9
SIGSTOP = 19
SIGTERM = _signal.SIGTERM
SIGINT = _signal.SIGINT
SIGCHLD = _signal.SIGCHLD
# Held while forking, so that each side installs its own handlers before it sees them.
FORK_HELD = {SIGTERM, SIGCHLD}
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
# An interrupt's SIGTERM can reach P just before its main thread blocks in a system
# call that does not look at signals first (``time.sleep`` does not), where it waits
# unhandled until the call returns. So T pokes P with POKE while it runs on, first after
# POKE_FIRST seconds, then at twice the interval before: the blocked call returns
# (EINTR), and Python runs the SIGTERM's handler it held. P handles POKE with a handler
# that does nothing (a plugin that execs another program leaves it ignored, its
# default). Entry points only: a named command gets nothing but its SIGTERM.
POKE = _signal.SIGWINCH
POKE_FIRST = 0.02
# How many walks of the tree a freeze may take before it kills what it found anyway (a
# process in uninterruptible sleep stops only when it leaves it).
FREEZE_PASSES = 200
# The most CPU seconds a limit may name (see apply_limits).
CPU_SECONDS_MAX = (2**63 - 1) // 10**9


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
    """The socket to the supervisor: T reads it, and T or P may report on it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def send(self, message: Event, fd: int = -1) -> None:
        """Send ``message``, with ``fd`` (as ``SCM_RIGHTS``) where one is given."""
        payload = marshal.dumps(dict(message))
        data = len(payload).to_bytes(4, "big") + payload
        try:
            if fd >= 0:
                import _socket  # socket's C part: no enum (see the top)

                carrier = _socket.socket(fileno=self.fd)
                try:
                    rights = [
                        (_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fd.to_bytes(4, sys.byteorder))
                    ]
                    data = data[carrier.sendmsg([data], rights) :]
                finally:
                    carrier.detach()  # the descriptor stays ours
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError:
            pass  # the supervisor is gone; T sees EOF and ends us

    def fill(self) -> bool:
        """Read what has arrived (the socket is readable); False at EOF."""
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:
            chunk = b""
        self.buffer += chunk
        return bool(chunk)

    def take(self) -> Any:
        """The next whole message already read, or None."""
        if len(self.buffer) < 4 or len(self.buffer) < 4 + int.from_bytes(self.buffer[:4], "big"):
            return None
        size = int.from_bytes(self.buffer[:4], "big")
        message = marshal.loads(self.buffer[4 : 4 + size])
        self.buffer = self.buffer[4 + size :]
        return message

    def read(self) -> Any:
        """One message, waiting for it; None on EOF."""
        while (message := self.take()) is None:
            if not self.fill():
                return None
        return message

    def close(self) -> None:
        """Let go of the socket (a process that has nothing more to say)."""
        quietly(os.close, self.fd)


# -- system calls the os module lacks on Python 3.11 ----------------------------------

_LIBC: dict[str, Any] = {}


def bind(*names: str) -> None:
    """Find the C library's ``names`` (a standby does it while it waits: it costs
    the load the import of ``_ctypes``)."""
    import _ctypes  # the C part of ctypes, without its Python layer (see above)

    class Int(_ctypes._SimpleCData):  # type: ignore[type-arg]  # what ctypes.c_int is
        _type_ = "i"

    class Function(_ctypes.CFuncPtr):  # what ctypes.CDLL makes of a symbol
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
        _restype_ = Int

    class Library:  # what CDLL(None) is to CFuncPtr: the program's own symbols
        _handle = _ctypes.dlopen(None)  # type: ignore[arg-type]  # NULL, as dlopen takes

    for name in names:
        _LIBC[name] = Function((name, Library))  # type: ignore[arg-type]
    _LIBC["errno"] = _ctypes.get_errno


def libc(name: str, *arguments: int | bytes) -> None:
    """Call the C library's ``name`` (``unshare``, ``prctl``); OSError when it fails."""
    if name not in _LIBC:
        bind(name)
    if _LIBC[name](*arguments) != 0:
        number = _LIBC["errno"]()
        raise OSError(number, f"{name}: {os.strerror(number)}")


def unshare(how: str) -> None:
    """Make a PID namespace for this process's children: the next one forked is its PID 1.

    Args:
        how: "pid" (``unshare(CLONE_NEWPID)``; needs CAP_SYS_ADMIN) or "user" (the same
            in a new user namespace, which an unprivileged process may make).

    Raises:
        OSError: The kernel refused.
    """
    if how == "pid":
        libc("unshare", CLONE_NEWPID)
        return
    user_namespace(CLONE_NEWPID)


def user_namespace(flags: int) -> None:
    """``unshare`` a user namespace (with the other namespaces of ``flags``) in which
    this process keeps its ids."""
    uid, gid = os.getuid(), os.getgid()
    libc("unshare", CLONE_NEWUSER | flags)
    # The same ids inside as outside (files, logs and messages show no "nobody");
    # setgroups must be denied before an unprivileged gid_map.
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        with open(f"/proc/self/{name}", "w") as file:
            file.write(text)


# Why T has no namespace although one was required; its spawn then fails with it.
REFUSED: list[str] = []


def make_tracked(how: str, strict: bool) -> int:
    """Make T: fork it into a namespace made for it, or as a sweeping child subreaper.

    Runs in the process that makes T (a started bootstrap, or the fork server's
    intermediate process), which must not live on as T's parent: T is re-parented to
    the supervisor, a child subreaper, once it has gone.

    Args:
        how: "pid" or "user" (see :func:`unshare`), or "sweep".
        strict: A namespace is required: where the kernel refuses one, T is made all
            the same, and refuses its spawn message with the reason (see ``REFUSED``).

    Returns:
        0 in T; T's pid in the caller once T leads a session of its own (-1 if T
        died before that).
    """
    refused = ""
    if how in ("pid", "user"):
        try:
            unshare(how)
        except OSError as error:
            refused = f"cannot make a PID namespace: {error}" if strict else ""
    settled, settling = os.pipe()
    tracked = os.fork()
    if tracked == 0:
        os.close(settled)
        os.setsid()
        if refused:
            REFUSED.append(refused)
        elif os.getpid() != 1:  # no namespace: the sweep holds the tree
            libc("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        os.write(settling, b"s")
        os.close(settling)
        return 0
    os.close(settling)
    led = os.read(settled, 1) == b"s"  # else T died before it got there
    os.close(settled)
    return tracked if led else -1


def launch(control: Control, how: str, strict: bool) -> None:
    """(a bootstrap the supervisor started) Become T, or make T and go; either way tell
    the supervisor T's pid (``{"event": "tracked", "pid": ...}``).

    Swept, this process is T. For a namespace, T must be its PID 1, which only a fork
    after ``unshare`` can be: this process makes T and exits, and T is re-parented to
    the supervisor.
    """
    if how == "sweep":
        libc("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        control.send({"event": "tracked", "pid": os.getpid()})
        return
    tracked = make_tracked(how, strict)
    if tracked == 0:
        return  # in T, which the supervisor learns of from us
    control.send({"event": "tracked", "pid": tracked})
    os._exit(0)


# -- process trees, read from /proc ---------------------------------------------------
# Our own reading of /proc/PID/stat, not the package's (``_groups.read_stat``): this file
# runs in the child and imports nothing of the package, which would pull in Trio and
# attrs and cost every load its start-up time.


def process_table() -> dict[int, tuple[int, bytes]]:
    """Every process's parent and state letter."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as file:
                    stat = file.read()
                fields = stat[stat.rindex(b")") + 2 :].split()
                table[int(entry)] = (int(fields[1]), fields[0])
            except (OSError, ValueError):
                continue  # it exited while we looked
    return table


def live_descendants(root: int, table: dict[int, tuple[int, bytes]]) -> list[int]:
    """The processes below ``root`` that have not exited (zombies are left out)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, frontier = [], [root]
    while frontier:
        for child in children.get(frontier.pop(), ()):
            frontier.append(child)
            if table[child][1] not in (b"Z", b"X"):
                found.append(child)
    return found


def has_children() -> bool:
    """Whether this process has (or had, unreaped) a child: one system call."""
    try:
        os.waitpid(-1, os.WNOHANG)  # reaps at most one exited child, which is ours
    except ChildProcessError:
        return False
    return True


def reap_all() -> None:
    """Wait until no child is left (every one killed, so each ends)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def quietly(function: Any, *arguments: Any) -> None:
    """Call ``function``; an OSError (a process or descriptor already gone) is no error.

    Not ``contextlib.suppress``: importing contextlib would cost every load its time.
    """
    try:  # noqa: SIM105  # see above
        function(*arguments)
    except OSError:
        pass


def sweep_descendants() -> int:
    """(T, sweep) Freeze every descendant, kill them all, reap them.

    This process is a child subreaper that reaps nothing while it sweeps, so every
    descendant is in its tree, and a pid in it is freed only by a parent that is not
    stopped yet, which would have to be reused within the pass to mislead it.

    Returns:
        How many were still running.
    """
    if not has_children():
        return 0  # a subreaper with no child has no descendant at all
    me = os.getpid()
    for _ in range(FREEZE_PASSES):
        table = process_table()
        live = live_descendants(me, table)
        running = [pid for pid in live if table[pid][1] not in (b"T", b"t")]
        if not running:
            break
        for pid in running:  # again, if SIGCONT woke it: the sender is stopped in turn
            quietly(os.kill, pid, SIGSTOP)
    # None of them can start a process now. Kill them, then whatever a walk still finds
    # (a process that was stuck in the kernel through every pass).
    killed: set[int] = set()
    while fresh := [pid for pid in live if pid not in killed]:
        for pid in fresh:
            quietly(os.kill, pid, SIGKILL)
        killed.update(fresh)
        live = live_descendants(me, process_table())
    reap_all()
    return len(killed)


def clear_namespace() -> int:
    """(T, PID 1) Kill every other process of the namespace, and reap them.

    Returns:
        How many were still running.
    """
    if not has_children():
        return 0  # orphans come to PID 1: with no child, the namespace is empty
    # /proc is the supervisor's, so it shows our pid outside the namespace.
    running = len(live_descendants(int(os.readlink("/proc/self")), process_table()))
    quietly(os.kill, -1, SIGKILL)  # from PID 1: everyone in the namespace but us
    reap_all()
    return running


def kill_group() -> None:
    os.killpg(os.getpgrp(), SIGKILL)


def fork_held() -> int:
    """fork() with SIGTERM and SIGCHLD held; each side releases them (``release``)."""
    _signal.pthread_sigmask(_signal.SIG_BLOCK, FORK_HELD)
    return os.fork()


def release() -> None:
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, FORK_HELD)


def close_all(*fds: int) -> None:
    for fd in fds:
        quietly(os.close, fd)


# -- T: the tracked process -----------------------------------------------------------


class Tracked:
    """T's one thread: the control protocol, the lease, the dead-man switch, its child.

    Args:
        control: The socket to the supervisor.
        containment: "namespace" (T is PID 1 of the plugin's namespace) or "sweep" (T
            is a child subreaper).
    """

    def __init__(self, control: Control, containment: str, ahead: Ahead | None = None) -> None:
        self.control = control
        self.containment = containment
        self.deadline: float | None = None
        self.interrupted = False
        self.pokes = False  # P is an entry point: poke it once interrupted (see POKE)
        self.poke_at: float | None = None
        self.poke_every = POKE_FIRST
        self.child = 0  # P, once forked (a standby's, forked ahead: see Ahead)
        self.cgroups: list[str] = []  # the cgroup.procs files T joined, if any
        self.status: int | None = None  # P's wait status, once reaped
        # P waits on ``go`` (forked before "start", it runs nothing until then). T holds
        # ``going``, and the supervisor a copy until "start" (sent with "resolved"): EOF
        # there means both are gone (P ends with T anyway: its namespace, or its
        # parent-death signal).
        if ahead is None:
            self.go, self.going = os.pipe()
        else:
            self.go, self.going = -1, ahead.going
            self.child = ahead.pid
        self.started = -1  # for a named command: the pipe its exec closes
        # SIGCHLD wakes the loop through this pipe (select() alone would not see it).
        self.wakeup, self.wakeup_writer = os.pipe()
        os.set_blocking(self.wakeup, False)
        os.set_blocking(self.wakeup_writer, False)
        _signal.set_wakeup_fd(self.wakeup_writer, warn_on_full_buffer=False)
        _signal.signal(SIGCHLD, lambda *_: None)
        # T wants no KeyboardInterrupt: the plugin (which may signal its parent, or its
        # PID 1) cannot break T's loop that way. P sets its own handler.
        _signal.signal(SIGINT, _signal.SIG_IGN)
        # Installed in either case: a PID 1 gets only the signals it has a handler for.
        _signal.signal(SIGTERM, self.interrupt)

    def interrupt(self, number: int, frame: object) -> None:
        """SIGTERM, the supervisor's interrupt: pass it on to P's group, where the entry
        point gets it as a KeyboardInterrupt; with no P yet, end as if killed by it.

        From now on only EOF counts: the lease cannot cut the graceful stop short.
        """
        self.interrupted = True
        if not self.child:
            self.end(SIGTERM)  # the wait status of a death by SIGTERM
        if self.status is None:
            quietly(os.killpg, self.child, SIGTERM)
            if self.pokes and self.poke_at is None:
                self.poke_at = time.monotonic() + self.poke_every

    def poke(self) -> None:
        """Poke P, once it is due, and set the next (see POKE)."""
        now = time.monotonic()
        if self.poke_at is None or self.status is not None or now < self.poke_at:
            return
        quietly(os.kill, self.child, POKE)
        self.poke_every *= 2
        self.poke_at = now + self.poke_every

    def renew(self, lease: float) -> None:
        self.deadline = time.monotonic() + float(lease) + LEASE_SLACK

    def switch(self, *, gone: bool = False) -> NoReturn:
        """The dead-man switch: end this child's whole tree, then this process.

        With the supervisor ``gone``, nobody else removes the child's cgroup (a runner
        of its fleet takes the session over, or none): T does, once its tree is."""
        if gone and self.cgroups:
            if self.containment == "namespace":
                clear_namespace()
            else:
                sweep_descendants()
            leave_cgroups(self.cgroups)
        if self.containment == "namespace":
            # The plugin is killed with the namespace as its PID 1 exits.
            self.end(SIGKILL)
        sweep_descendants()
        kill_group()  # T alone leads its group (P has its own)
        raise SystemExit(1)  # not reached: SIGKILL ends us

    def serve(self, *, until_start: bool) -> None:
        """Answer the supervisor until "start" or, after it, until the child has exited.

        EOF on the socket (the supervisor died) or an expired lease pulls the switch.
        After an interrupt only EOF counts, so the lease cannot cut a graceful stop short.
        """
        while True:
            message: Command | None = self.control.take()
            if message is not None:
                if message["command"] == "renew":
                    self.renew(message["lease"])
                elif message["command"] == "start" and until_start:
                    return
                continue
            if not until_start and self.reap():
                return
            timeout = None
            if self.deadline is not None and not self.interrupted:
                # Capped: select refuses a timeout past about 9.2e9 s (a lease that long
                # would kill this loop); the loop just looks again after an hour.
                timeout = min(max(self.deadline - time.monotonic(), 0.0), 3600.0)
            if self.poke_at is not None and self.status is None:
                self.poke()
                due = max(self.poke_at - time.monotonic(), 0.0)
                timeout = due if timeout is None else min(timeout, due)
            ready, _, _ = select.select([self.control.fd, self.wakeup], [], [], timeout)
            if self.wakeup in ready:
                while True:
                    try:
                        if not os.read(self.wakeup, 512):
                            break
                    except BlockingIOError:
                        break
            if self.control.fd in ready and not self.control.fill():
                self.switch(gone=True)  # the supervisor is gone: nobody may outlive it
            expired = self.deadline is not None and time.monotonic() >= self.deadline
            if not ready and expired and not self.interrupted:
                self.switch()  # the lease ran out and nobody renewed it

    def reap(self) -> bool:
        """Reap what has exited (orphans too: they come to a PID 1 or a subreaper);
        whether the child has."""
        while self.status is None:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == self.child:
                self.status = status
        return self.status is not None

    def fork_plugin(self, spec: SpawnCommand) -> int:
        """Fork P, which waits for :meth:`start`; return 0 in P once started, else its
        pid."""
        # Swept, P must not outlive T; in a namespace, T's exit ends it anyway.
        parent = os.getpid() if self.containment == "sweep" else None
        # What T has is P's too, and never garbage: frozen, the plugin's collections
        # leave it alone, so they neither walk it nor copy the pages it is on.
        gc.freeze()
        plugin, pipe = fork_plugin(spec)
        if plugin == 0:
            _signal.set_wakeup_fd(-1)  # none of T's handling
            close_all(self.wakeup, self.wakeup_writer, self.going)
            _signal.signal(SIGCHLD, _signal.SIG_DFL)
            _signal.signal(SIGTERM, _signal.SIG_DFL)
            become_plugin(
                spec,
                self.control,
                parent=parent,
                starter=pipe,
                go=self.go,
                own_pids=self.containment == "namespace",
            )
            return 0
        close_all(self.go)
        self.child = plugin
        self.started = pipe
        release()
        return plugin

    def start(self) -> None:
        """At "start": let P run (and, for a named command, report its exec)."""
        # An error: P died before it was let go; serve() reaps it, and we end as it did.
        quietly(os.write, self.going, b"g")
        close_all(self.going)
        announce(self.control, self.started)

    def finish(self) -> NoReturn:
        """Once P exited: kill what it left (the namespace's rest, or the swept tree),
        then end the way P did."""
        status = self.status
        assert status is not None
        killed = clear_namespace() if self.containment == "namespace" else sweep_descendants()
        self.end(status, killed)

    def end(self, status: int, killed: int = 0) -> NoReturn:
        """Tell the supervisor how P ended (a wait status) and how many processes it left
        that were killed, then end the same way.

        A PID 1 cannot die by a signal of its own, so in a namespace T exits with 128 plus
        the signal's number, and the report is what the supervisor goes by.
        """
        self.control.send({"event": "exited", "status": status, "killed": killed})
        if os.WIFSIGNALED(status):
            if self.containment == "sweep":
                die_by(os.WTERMSIG(status))
            code = 128 + os.WTERMSIG(status)
        else:
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# -- P: the plugin --------------------------------------------------------------------


def fork_plugin(spec: SpawnCommand) -> tuple[int, int]:
    """Fork P, with the signals held; ``(0, starter)`` in P, else ``(pid, started)``.

    For a named command, ``started`` and ``starter`` are the two ends of a pipe that
    tells the parent whether P's exec worked (see :func:`announce`); else both are -1.
    """
    command = spec["kind"] == "command"
    started, starter = os.pipe() if command else (-1, -1)  # close-on-exec, both
    plugin = fork_held()
    if plugin == 0:
        close_all(started)
        return 0, starter
    # P does it too: whoever is first, P leads its group (an error: it did, and may
    # have exec'd already).
    quietly(os.setpgid, plugin, plugin)
    close_all(starter)
    return plugin, started


def become_plugin(
    spec: SpawnCommand,
    control: Control,
    *,
    parent: int | None,
    starter: int,
    go: int,
    own_pids: bool,
) -> None:
    """In P: its own group, default signals, tied to its parent's life; then, once T
    says "go", runs a named command (an entry point runs once this returns).

    Args:
        parent: T's pid when P is swept (P must not outlive T); None in a namespace,
            which ends with T, its PID 1.
        starter: For a named command, the pipe that reports a failed exec.
        go: The pipe T writes to at "start" (EOF: T is gone).
        own_pids: P is in a PID namespace of its own (T is its PID 1).
    """
    os.setpgid(0, 0)
    _signal.signal(SIGTERM, _signal.SIG_DFL)
    _signal.signal(SIGCHLD, _signal.SIG_DFL)
    _signal.signal(SIGINT, _signal.default_int_handler)
    if parent is not None:
        libc("prctl", PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)  # T died before that was armed
    release()
    isolation = spec.get("isolation")
    if isolation is not None:
        # Before "start", while the supervisor makes the identity durable: nothing of
        # the caller's has run yet, and none of it runs as root.
        try:
            isolate(isolation, own_pids=own_pids)
        except (OSError, ValueError) as error:
            refuse(f"cannot isolate the child: {error}", control, starter)
    look_ahead(spec)
    # Forked ahead, so that the fork costs the load nothing: nothing of the caller's
    # runs before the supervisor's "start".
    if os.read(go, 1) != b"g":
        os._exit(1)  # T is gone
    os.close(go)
    if spec["kind"] == "command":
        run_command(spec, control, starter)


def refuse(message: str, control: Control, starter: int) -> NoReturn:
    """(P, before "start") Say why this child cannot run, and end: through ``starter``
    for a named command (T reports it), else on the control socket."""
    if starter >= 0:
        os.write(starter, message.encode())
    else:
        control.send({"event": "failed", "kind": "ExecutionError", "message": message})
    os._exit(1)


def isolate(isolation: IsolationSpec, *, own_pids: bool) -> None:
    """(P, still root) Become the isolated child the runner prepared.

    In order: a network namespace with loopback alone (``"network": "none"``); the
    children's view of the file system (``"view"``, a mount namespace's descriptor
    that the runner made: the state directory and what others may not read are
    covered there); a mount namespace of its own, a copy of the view, with its own
    ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``/proc`` (:func:`own_mounts`); the
    child's private directory as its working directory and ``TMPDIR``; no
    supplementary groups, the child's own gid and uid (which drops every capability);
    no new privileges (a set-user-id program gains nothing). Dumpable again, as an exec
    would make it, so that its own ``/proc`` files are its own.

    Without a uid (``"hide"`` names the state directory instead), the child keeps the
    runner's uid and hides the state directory in namespaces of its own:
    :func:`hide_state`.

    Args:
        isolation: The spawn message's ``isolation`` (``_isolation.Isolated.spec``).
        own_pids: P is in a PID namespace of its own, whose ``/proc`` it may mount.

    Raises:
        OSError: A step failed: the child must not run.
    """
    if "hide" in isolation:
        hide_state(isolation, own_pids=own_pids)
        return
    uid = isolation["uid"]
    if os.geteuid() != 0:
        raise OSError(
            f"its interpreter runs as uid {os.geteuid()}, not root, so it cannot become "
            f"uid {uid}; run the interpreter as root, or pass isolation='none'"
        )
    own_namespaces(isolation, own_pids=own_pids)
    take_identity(isolation)


def take_identity(isolation: UserIsolationSpec) -> None:
    """(P, root, in its own namespaces) The child's private directory, and its uid."""
    uid = isolation["uid"]
    os.chdir(isolation["home"])
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid):
        raise OSError(f"the uid is {os.getresuid()} after switching to {uid}")
    libc("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc("prctl", PR_SET_DUMPABLE, 1, 0, 0, 0)
    os.environ["TMPDIR"] = isolation["tmp"]


def own_namespaces(isolation: UserIsolationSpec, *, own_pids: bool) -> None:
    """(P, or a standby's P ahead of its load: :class:`Ahead`; root) Make its own
    namespaces and enter them: without a network, a network namespace with loopback
    alone; then the children's view, and a mount namespace of its own copied from it,
    with what is the child's alone mounted (:func:`own_mounts`)."""
    if isolation.get("network") == "none":
        libc("unshare", CLONE_NEWNET)
        loopback_up()
    view = isolation["view"]
    if view >= 0:
        libc("setns", view, CLONE_NEWNS)  # also sets the working directory to "/"
        os.close(view)
    # The view is every child's: what is this child's alone is mounted in a copy of it.
    # Nothing mounted there reaches the view or the host: the view has no shared mount
    # to copy (make_view made every mount a slave, and mounts made since are private).
    libc("unshare", CLONE_NEWNS)
    own_mounts(isolation, own_pids=own_pids)


class Ahead:
    """(a standby's T, while it waits) P, forked ahead of the load with its own
    namespaces made: the fork, the copy of the view and its mounts are most of what a
    child costs before its code runs, and are the same for any load. The runner asks for
    it with "isolate" (the uid and private directory claimed ahead), after "join" where
    the standby waits in a cgroup, so P is in that cgroup from its fork.

    P then waits for its spawn message, which T hands on at the load (:meth:`hand_on`)
    with the session's log. T discards it (:meth:`discard`) where the load asks for
    another isolation or cgroup than it was made for, or it died, and forks P then as
    without a standby. Once T is gone, P ends: in a namespace with its PID 1, swept by
    its parent-death signal; before its spawn message, by EOF on its channel.

    Args:
        pid: P's pid (0 in P).
        isolation: What it was made for.
        channel: T's end of the stream P reads its spawn message from (P's, in P).
        go: The pipe P waits on for "start" (T holds ``going``).
        started: For a named command, the pipe that reports a failed exec
            (:func:`announce`; P holds ``starter``).
    """

    def __init__(
        self,
        pid: int,
        isolation: UserIsolationSpec,
        channel: Any,
        go: int,
        going: int,
        started: int,
        starter: int,
        *,
        tracked: int,
    ) -> None:
        self.pid = pid
        self.tracked = tracked  # T's pid, as P sees it: 1 in a PID namespace
        self.isolation = isolation
        self.channel = channel
        self.go, self.going = go, going
        self.started, self.starter = started, starter

    @classmethod
    def fork(cls, isolation: IsolationSpec) -> Ahead | None:
        """Fork P for ``isolation``; None where it cannot be made ahead (another kind of
        isolation, no root, or a namespace refused: P says why, at the load)."""
        import _socket  # socket's C part: no enum (see the top)

        if "hide" in isolation or os.geteuid() != 0 or REFUSED:
            return None
        # As for any isolated child (see main): nobody but root may look into T, whose
        # root directory shows the state directory.
        libc("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        go, going = os.pipe()
        started, starter = os.pipe()  # close-on-exec, both
        gc.freeze()  # see Tracked.fork_plugin
        tracked = os.getpid()
        plugin = fork_held()
        if plugin == 0:
            ours.close()
            close_all(going, started)
            return cls(0, isolation, theirs, go, -1, -1, starter, tracked=tracked)
        quietly(os.setpgid, plugin, plugin)  # see fork_plugin
        theirs.close()
        close_all(go, starter)
        release()
        return cls(plugin, isolation, ours, -1, going, started, -1, tracked=tracked)

    def fits(self, spec: SpawnCommand, moved: bool) -> bool:
        """(T) Whether this P can be the load's: made for its isolation, in its cgroup
        (T ``moved`` to another as it resolved: P is not in that one), and alive."""
        if moved or spec.get("isolation") != self.isolation or "log" not in spec:
            return False
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def hand_on(self, spec: SpawnCommand) -> None:
        """(T) Send P its spawn message and the session's log (T's output: see
        take_over), once T reported the code."""
        import _socket

        fd = (1).to_bytes(4, sys.byteorder)
        quietly(self.channel.sendmsg, [b"s"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fd)])
        Control(self.channel.fileno()).send(spec)  # type: ignore[arg-type]
        self.channel.close()
        if spec["kind"] != "command":
            close_all(self.started)
            self.started = -1

    def discard(self) -> None:
        """(T) End P, which ran nothing, and reap it."""
        quietly(os.kill, self.pid, SIGKILL)
        quietly(os.waitpid, self.pid, 0)
        self.channel.close()
        close_all(self.going, self.started)

    def become(self, control: Control) -> int:
        """(P) Make its namespaces, wait for the spawn message, take the session's log,
        environment, limits and uid, then wait for "start" and run: P's exit status."""
        import _socket

        own_pids = self.tracked == 1
        # As fork_plugin's P: none of T's handling, a group of its own, and tied to T's
        # life where no namespace ends it with T.
        _signal.signal(SIGCHLD, _signal.SIG_DFL)
        _signal.signal(SIGTERM, _signal.SIG_DFL)
        os.setpgid(0, 0)
        _signal.signal(SIGINT, _signal.default_int_handler)
        if not own_pids:
            libc("prctl", PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
            if os.getppid() != self.tracked:
                os._exit(1)  # T died before that was armed
        release()
        failure = ""
        try:
            own_namespaces(self.isolation, own_pids=own_pids)
        except (OSError, ValueError) as error:
            failure = f"cannot isolate the child: {error}"
        try:
            _, ancillary, _, _ = self.channel.recvmsg(1, _socket.CMSG_SPACE(4))
        except OSError:
            ancillary = []
        log = [
            int.from_bytes(payload[:4], sys.byteorder)
            for level, kind, payload in ancillary
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS and len(payload) >= 4
        ]
        spec: SpawnCommand | None = Control(self.channel.fileno()).read() if log else None
        if spec is None:
            os._exit(1)  # T is gone (or discarded us) before the load
        self.channel.close()
        os.dup2(log[0], 1)
        os.dup2(log[0], 2)
        os.close(log[0])
        become_environment(spec["environment"])  # as T would have (take_over)
        command = spec["kind"] == "command"
        starter = self.starter if command else -1
        if not command:
            close_all(self.starter)
        if failure:
            refuse(failure, control, starter)
        try:
            apply_limits(spec["limits"])  # as T does, before it reports the code
        except (OSError, ValueError, Refused):
            os._exit(1)  # T, applying the same limits as root too, says why (PackageError)
        try:
            take_identity(self.isolation)
        except (OSError, ValueError) as error:
            refuse(f"cannot isolate the child: {error}", control, starter)
        look_ahead(spec)
        if os.read(self.go, 1) != b"g":
            os._exit(1)  # T is gone
        os.close(self.go)
        if command:
            run_command(spec, control, starter)
        return plugin_main(spec, control)


def hide_state(isolation: NamespaceIsolationSpec, *, own_pids: bool) -> None:
    """(P, with the runner's uid) Make a mount namespace (and a network namespace,
    without a network), with what is the child's alone in it (:func:`own_mounts`), cover
    the state directory with an empty tmpfs there and mount the private directory back;
    then drop every capability, and take no new privileges.

    In a PID namespace of its own, P holds what T holds over it (T made it, privileged
    or in a user namespace of its own), and makes the mount namespace there: only there
    may it mount the PID namespace's ``/proc`` (the capability must be held in the user
    namespace that owns the PID namespace, never one below it). Swept, it makes a user
    namespace of its own for the mount namespace."""
    home = isolation["home"]
    mount = bind_mount()
    flags = CLONE_NEWNS
    if isolation.get("network") == "none":
        flags |= CLONE_NEWNET
    libc("prctl", PR_SET_DUMPABLE, 1, 0, 0, 0)  # T's was off: its maps are its own to write
    if own_pids:
        libc("unshare", flags)
    else:
        user_namespace(flags)
    if flags & CLONE_NEWNET:
        loopback_up()
    mount(None, "/", None, MS_REC | MS_SLAVE, None)  # nothing goes back to the host
    pin = os.open(home, os.O_PATH)  # in this namespace, before anything covers it
    own_mounts(isolation, own_pids=own_pids)
    # Covered wherever it can be seen: below a fresh tmpfs too, where a path kept for the
    # child (the interpreter's prefix, an entry path, a checkout in /tmp) may hold it.
    if isolation["cover"] or os.path.isdir(isolation["hide"]):
        mount("tmpfs", isolation["hide"], "tmpfs", MS_NOSUID | MS_NODEV, "mode=0711")
        os.makedirs(home, 0o700)
        mount(f"/proc/self/fd/{pin}", home, None, MS_BIND, None)
        # The cover read-only, its own directory still writable under it.
        mount(None, isolation["hide"], None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    # (else the state directory is below a fresh tmpfs and out of sight, and own_mounts
    # kept the home)
    os.close(pin)
    os.chdir(home)
    # capset(2): version 3 header for this process, and two empty sets (no capability
    # effective, permitted or inheritable).
    libc("capset", (0x20080522).to_bytes(4, sys.byteorder) + bytes(4), bytes(24))
    libc("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.environ["TMPDIR"] = isolation["tmp"]


def own_mounts(isolation: OwnMounts, *, own_pids: bool) -> None:
    """(P, privileged in a mount namespace of its own, whose mounts propagate nowhere)
    Mount what is this child's alone.

    A fresh tmpfs (mode 1777, as the host's) over each of ``"private"`` (``/tmp``,
    ``/var/tmp``, ``/dev/shm``: where children could meet, or leave files behind), then
    mounted back from the real one what the child needs below one (``"keep"``: the
    interpreter, the entry paths, read-only; its private directory, writable). With
    ``"proc"``, the ``/proc`` of its PID namespace: its own tree alone is in it, and
    nothing of the runner's (its pid, command line or environment). They exist in this
    mount namespace alone, and go with the child's last process.

    Raises:
        OSError: A step failed (the message names it), or a ``/proc`` of its own was
            asked for and the child has no PID namespace (its T could not make one).
    """
    mount = bind_mount()
    kept = [(path, writable, os.open(path, os.O_PATH)) for path, writable in isolation["keep"]]
    for directory in isolation["private"]:
        mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    mask = os.umask(0o022)  # mount points any child may pass
    try:
        for path, writable, pin in kept:  # outermost first
            if os.path.isdir(f"/proc/self/fd/{pin}"):
                os.makedirs(path, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
            mount(f"/proc/self/fd/{pin}", path, None, MS_BIND | MS_REC, None)
            if not writable:
                mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID, None)
            os.close(pin)
    finally:
        os.umask(mask)
    if isolation["proc"]:
        if not own_pids:
            raise OSError(
                "it has no PID namespace of its own (the kernel refused it this one), "
                "so it cannot have a /proc of its own"
            )
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def loopback_up() -> None:
    """Bring up ``lo`` in a new network namespace (it starts down), without ``ip``."""
    import _socket
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    probe = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(probe.fileno(), siocgifflags, request))[1]
        request = struct.pack("16sH14s", b"lo", flags | iff_up, b"")
        fcntl.ioctl(probe.fileno(), siocsifflags, request)
    finally:
        probe.close()


def run_command(spec: SpawnCommand, control: Control, starter: int) -> NoReturn:
    """Become the named command (exec); on failure say why through ``starter``."""
    os.set_inheritable(control.fd, False)  # the command does not get the socket
    for number in (_signal.SIGPIPE, _signal.SIGXFSZ):
        # Python ignores them, and an exec keeps an ignored signal ignored.
        _signal.signal(number, _signal.SIG_DFL)
    try:
        os.execv(spec["executable"], spec["argv"])
    except OSError as error:
        os.write(starter, f"cannot run {spec['argv'][0]!r}: {error}".encode())
    os._exit(1)


def announce(control: Control, started: int) -> None:
    """For a named command: tell the supervisor whether its exec worked."""
    if started < 0:
        return  # an entry point reports for itself
    error = b""
    while chunk := os.read(started, 4096):  # EOF: the exec closed it
        error += chunk
    os.close(started)
    if error:
        control.send({"event": "failed", "kind": "ExecutionError", "message": error.decode()})
    else:
        control.send({"event": "started"})


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
    raise Refused(f"there is no module {module!r} on the runner's entry paths; check its name")


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


def resolve(spec: SpawnCommand) -> Code:
    """Find what to run; return its code identity. Runs none of the caller's code."""
    if spec["kind"] == "command":
        argv = spec["argv"]
        executable = which(argv[0])
        if not executable or not os.access(executable, os.X_OK):
            raise Refused(f"the command's executable {argv[0]!r} is not on this machine")
        return {"origin": executable, "digest": sha256_of(executable), "version": None}
    module = spec["specifier"].partition(":")[0]
    path = find_module(module, spec["paths"])
    return {
        "origin": path,
        "digest": sha256_of(path),
        "version": distribution_version(module, spec["paths"]),
    }


def take_over(log: str, environment: dict[str, str] | None) -> None:
    """Send output to the session's log and take its environment (a standby's start;
    ``environment`` None where its plugin, forked ahead, takes it alone)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if environment is not None:
        become_environment(environment)


def become_environment(environment: dict[str, str]) -> None:
    """Make ``os.environ`` exactly ``environment``, whatever it was, changing only what
    differs: each change is a ``putenv`` or ``unsetenv`` (tens of microseconds), and a
    standby's environment differs from its session's in a few variables."""
    for name in [name for name in os.environ if name not in environment]:
        del os.environ[name]
    for name, value in environment.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def join_cgroups(procs: list[str]) -> None:
    """Move this process (T) into the child's cgroup, in each hierarchy: "0" is the writer."""
    for path in procs:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def leave_cgroups(procs: list[str]) -> None:
    """Move this process (T) to the root of each hierarchy, and remove the child's
    cgroup, then the execution's parent if it was the last child (each a no-op where it
    cannot be done: the supervisor's next start removes what is left)."""
    for path in procs:
        child = os.path.dirname(path)
        parent = os.path.dirname(child)
        root = os.path.dirname(os.path.dirname(parent))  # above trio_supervisor/EXECUTION
        quietly(join_cgroups, [os.path.join(root, "cgroup.procs")])
        quietly(os.rmdir, child)
        quietly(os.rmdir, parent)


def apply_limits(limits: RLimits) -> None:
    if all(value is None for value in limits.values()):
        return
    import resource

    for name, number, value in (
        ("memory_bytes", resource.RLIMIT_AS, limits["memory_bytes"]),
        ("cpu_seconds", resource.RLIMIT_CPU, limits["cpu_seconds"]),
        ("open_files", resource.RLIMIT_NOFILE, limits["open_files"]),
        ("file_size_bytes", resource.RLIMIT_FSIZE, limits["file_size_bytes"]),
    ):
        if name == "cpu_seconds" and value is not None and value > CPU_SECONDS_MAX:
            # setrlimit takes it, but the kernel's CPU timer counts nanoseconds in 64
            # bits: the product wraps, and the child is killed within a tick or two.
            raise Refused(
                f"the limit cpu_seconds={value} cannot be applied: the kernel counts "
                f"CPU time in nanoseconds, up to {CPU_SECONDS_MAX} s"
            )
        if value is not None:
            try:
                resource.setrlimit(number, (value, value))
            except (OSError, ValueError, OverflowError) as error:
                # The host asked for a limit this system cannot set: its request's fault.
                raise Refused(f"the limit {name}={value} cannot be applied: {error}") from error


def print_traceback() -> None:
    import traceback

    traceback.print_exc()
    sys.stderr.flush()


def load_failure(specifier: str, error: BaseException, *, traceback_in_log: bool = False) -> str:
    """One sentence for a load that cannot run: the specifier, what is wrong, what to do."""
    if isinstance(error, Refused):
        return f"cannot load {specifier!r}: {error}"
    module = specifier.partition(":")[0]
    see = " (its traceback is in the session's log)" if traceback_in_log else ""
    if isinstance(error, ModuleNotFoundError) and error.name == module:
        return f"cannot load {specifier!r}: there is no module {module!r}; check its name"
    if isinstance(error, SyntaxError):
        where = f"{os.path.basename(error.filename or module)} line {error.lineno}"
        return f"cannot load {specifier!r}: {where}: {error.msg}{see}; fix the module"
    return (
        f"cannot load {specifier!r}: importing {module} raised "
        f"{type(error).__name__}: {error}{see}; fix the module"
    )


def _is_awaitable(value: object) -> bool:
    return hasattr(value, "__await__")


def entry_point(module: Any, attribute: str, specifier: str) -> Any:
    """The callable ``attribute`` of ``module``: a public name the plugin itself defines.

    A remote host chooses the specifier, so only what the plugin's author wrote may be
    reached: each part of the attribute must be public (no ``_private`` or ``__dunder__``
    name: ``plugin:__class__`` would call the module type), found in the module's (or
    its class's) own namespace, and the callable must be defined in that module, not
    imported into it (``plugin:system`` after ``from os import system``).

    Raises:
        Refused: It is none of that.
    """
    target = module
    for part in attribute.split("."):
        if not part or part.startswith("_"):
            raise Refused(f"{part!r} is not a public name; name a public function of the module")
        namespace = getattr(target, "__dict__", {})
        if part not in namespace:
            raise Refused(
                f"{module.__name__} defines no {attribute!r}; name a function that it defines"
            )
        target = getattr(target, part)
    if not callable(target):
        raise Refused(
            f"{attribute!r} names a {type(target).__name__}, not a function; name a function"
        )
    if getattr(target, "__module__", module.__name__) != module.__name__:
        raise Refused(
            f"{attribute!r} is {target.__module__}.{attribute}, imported by the plugin; "
            "only what the plugin defines may be loaded"
        )
    return target


def look_ahead(spec: SpawnCommand) -> None:
    """(P, before "start") Look the entry point's module up as its import will: the
    finders only read directories and files, and run nothing of the caller's (a dotted
    name is left alone: finding it would import its package). The import after "start"
    then finds the finders' caches filled, and the pages of the import system that it
    writes are P's own already (each is a copy-on-write fault in a fresh fork)."""
    if spec["kind"] == "command":
        return
    entry_paths(spec)
    module_name = spec["specifier"].partition(":")[0]
    if "." in module_name or module_name in sys.modules:
        return
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        try:
            if find_spec is not None and find_spec(module_name, None) is not None:
                return
        except Exception:  # the import says what is wrong, after "start"
            return


def entry_paths(spec: SpawnCommand) -> None:
    """Put the runner's entry paths first on ``sys.path`` (once)."""
    paths = spec["paths"]
    if sys.path[: len(paths)] != paths:
        sys.path[:0] = paths


def run_entry_point(spec: SpawnCommand, context: Context, control: Control) -> int | str:
    module_name, _, attribute = spec["specifier"].partition(":")
    entry_paths(spec)
    try:
        __import__(module_name)
        target = entry_point(sys.modules[module_name], attribute, spec["specifier"])
    except KeyboardInterrupt:
        raise  # interrupted while importing: plugin_main() ends P by SIGTERM
    except BaseException as error:  # any other failure to import is the package's
        # The traceback first: once the failure is sent, the runner may end the child
        # before anything written after it reached the log.
        if not isinstance(error, Refused):
            print_traceback()
        message = load_failure(spec["specifier"], error, traceback_in_log=True)
        control.send({"event": "failed", "kind": "PackageError", "message": message})
        return 1
    control.send({"event": "started"})
    control.close()  # the plugin does not hold the supervisor's socket
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


def poked(number: int, frame: object) -> None:
    """POKE's handler: nothing. Its arrival made a blocked call return, so that Python
    runs the handlers of the signals that came before it."""


def die_by(number: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    _signal.signal(number, _signal.SIG_DFL)
    os.kill(os.getpid(), number)
    time.sleep(60)  # the signal ends us


def plugin_main(spec: SpawnCommand, control: Control) -> int:
    """P, for an entry point: run it; its result is P's exit, an interrupt its SIGTERM."""
    # An interrupt becomes a KeyboardInterrupt in the entry point (sync code, or Trio's
    # own handling of SIGINT), so it can clean up.
    INTERRUPTS.install()
    _signal.signal(POKE, poked)
    context = spec["context"]
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
    if result == "interrupted":
        die_by(SIGTERM)
    return result if isinstance(result, int) else 1


def probe() -> int:
    """``_bootstrap.py probe``: can a child here have a PID namespace, and how? And may
    its plugin mount the namespace's own ``/proc``?

    Prints "pid" (privileged) or "user" (in a user namespace) and exits 0 once a process
    forked into one has run, or prints why not and exits 1. Where a process in that
    namespace, holding what a plugin holds there, may not mount its ``/proc`` (a
    container's ``/proc`` with paths masked, to an unprivileged process), a second line
    says why: "no /proc: ...".
    """
    reasons = []
    for how in ("pid", "user"):
        try:
            unshare(how)
        except OSError as error:
            reasons.append(f"{how}: {error.strerror}")
            continue
        said, saying = os.pipe()
        init = os.fork()
        if init == 0:
            if os.getpid() != 1:
                os._exit(1)
            try:  # as a plugin mounts it (see own_mounts)
                libc("unshare", CLONE_NEWNS)
                mount = bind_mount()
                mount(None, "/", None, MS_REC | MS_SLAVE, None)
                mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            except OSError as error:
                os.write(saying, str(error).encode())
            os._exit(0)
        os.close(saying)
        _, status = os.waitpid(init, 0)
        refused = os.read(said, 4096).decode(errors="replace")
        os.close(said)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            print(how)
            if refused:
                print(f"no /proc: {refused}")
            return 0
        reasons.append(f"{how}: the first process forked is not PID 1")
        break  # this process is in a namespace now, and may fork no more
    print("; ".join(reasons))
    return 1


# -- the children's view of the file system -------------------------------------------
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_SLAVE = 0x20, 0x1000, 0x4000, 0x80000


def bind_mount() -> Any:
    """``mount(2)`` from the C library, typed through ``_ctypes`` (see :func:`bind`); made
    once per process (a standby or the fork server makes it while it waits)."""
    if "mount()" in _LIBC:
        return _LIBC["mount()"]
    import _ctypes

    class Text(_ctypes._SimpleCData):  # type: ignore[type-arg]  # ctypes.c_char_p
        _type_ = "z"

    class Flags(_ctypes._SimpleCData):  # type: ignore[type-arg]  # ctypes.c_ulong
        _type_ = "L"

    bind("mount")
    function = _LIBC["mount"]
    function.argtypes = (Text, Text, Text, Flags, Text)

    def mount(
        source: str | None, target: str, kind: str | None, flags: int, data: str | None
    ) -> None:
        text = [None if part is None else part.encode() for part in (source, target, kind, data)]
        if function(text[0], text[1], text[2], flags, text[3]) != 0:
            number = _LIBC["errno"]()
            raise OSError(number, f"mount {target}: {os.strerror(number)}")

    _LIBC["mount()"] = mount
    return mount


def make_view() -> int:
    """``_bootstrap.py view``, run as root by the runner: make the children's view.

    Reads ``{"covers": [...], "binds": [...], "homes": path}``
    (marshal) on stdin: in a new mount namespace, an empty tmpfs (mode 0711: others may
    pass, not list) is mounted over each cover, outermost first, each bind under a cover
    is mounted back, read-only, from the real one, and a tmpfs of its
    own at ``homes``. Prints ``ready FD`` (FD: its descriptor of ``homes``) and holds
    the namespace until stdin closes; the runner keeps descriptors of both by then.
    """
    spec: ViewSpec = marshal.loads(sys.stdin.buffer.read(int(sys.stdin.buffer.readline())))
    mount = bind_mount()
    os.umask(0)
    libc("unshare", CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_SLAVE, None)  # nothing goes back to the host
    covers = sorted(spec["covers"], key=len)
    binds = sorted(spec["binds"], key=len)
    pins = {path: os.open(path, os.O_PATH) for path in binds}  # before covering

    def under(path: str, parents: list[str]) -> bool:
        return any(path.startswith(parent.rstrip("/") + "/") for parent in parents)

    for cover in covers:
        if under(cover, covers):
            os.makedirs(cover, 0o711, exist_ok=True)  # in an outer cover's tmpfs
        mount("tmpfs", cover, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0711")
    bound: list[str] = []
    for path in binds:
        if (not under(path, covers) and path not in covers) or under(path, bound):
            continue  # in plain view, or brought back with a bind above it
        if os.path.isdir(f"/proc/self/fd/{pins[path]}"):
            os.makedirs(path, 0o711, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), 0o711, exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        mount(f"/proc/self/fd/{pins[path]}", path, None, MS_BIND | MS_REC, None)
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID, None)
        bound.append(path)
    # The children's private directories: a tmpfs of the view's own, which the runner
    # reaches through a descriptor (it goes with the view).
    homes = spec["homes"]
    os.makedirs(homes, 0o711, exist_ok=True)
    mount("tmpfs", homes, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0711")
    print("ready", os.open(homes, os.O_RDONLY | os.O_DIRECTORY), flush=True)
    sys.stdin.buffer.read()  # until the runner holds the namespace
    return 0


def is_command(message: Any) -> TypeGuard[Command]:
    """Whether ``message``, as read, is one of the supervisor's commands."""
    return isinstance(message, dict) and "command" in message


def main() -> int:
    if sys.argv[1:] == ["probe"]:
        return probe()
    if sys.argv[1:] == ["view"]:
        return make_view()
    reset_signals()
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    control = Control(int(sys.argv[1]))
    bind("unshare", "prctl", "setns")  # before the spawn message: a standby's idle time
    bind_mount()
    if len(sys.argv) > 2:  # started by the supervisor (a forked T has the FD alone)
        launch(control, sys.argv[2], sys.argv[3] == "strict")
    command = control.read()
    joined: list[str] = []  # a standby's cgroup, joined while it waited
    ahead: Ahead | None = None  # a standby's P, forked while it waited
    while is_command(command) and command["command"] in ("join", "isolate"):
        if command["command"] == "isolate":
            if ahead is not None:
                ahead.discard()
            ahead = Ahead.fork(command["isolation"])  # else P is forked at the load
            if ahead is not None and ahead.pid == 0:
                return ahead.become(control)  # in P
            command = control.read()
            continue
        try:
            for directory in command["make"]:
                # Made already where a load took us before we read this: the same cgroup
                # (see _cgroups, TreeCgroup.create), which we join all the same.
                os.makedirs(directory, exist_ok=True)
            join_cgroups(command["cgroups"])
            joined = command["cgroups"]
        except OSError:
            joined = []  # the supervisor makes it, and it joins, as it resolves
        command = control.read()
    if not (is_command(command) and command["command"] == "spawn"):
        return 2  # P, if forked ahead, ends with us (see Ahead)
    spec = command
    if "isolation" in spec:
        # T stays root (or the runner's uid): nobody but root may trace it or read its
        # /proc files, its root directory included, through which the state directory
        # is in view. P is made dumpable again as it isolates itself.
        libc("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
    moved = spec.get("cgroups", joined) != joined
    if ahead is not None and not ahead.fits(spec, moved):
        ahead.discard()
        ahead = None
    try:
        if moved:
            join_cgroups(spec["cgroups"])
        if "log" in spec:
            # Started ahead as a standby: now it becomes the session's child (its
            # plugin forked ahead takes the environment itself).
            take_over(spec["log"], None if ahead is not None else spec["environment"])
        if ahead is not None and spec["kind"] != "command":
            # P takes its log, environment, limits and uid, and looks its module up,
            # while T resolves the code and the supervisor makes the identity durable (a
            # named command waits for its executable, below).
            ahead.hand_on(spec)
        code = resolve(spec)
        spec["executable"] = code["origin"]
        apply_limits(spec["limits"])
        if REFUSED:
            raise OSError(REFUSED[0])
    except Refused as error:
        message = load_failure(spec["specifier"], error)
        control.send({"event": "failed", "kind": "PackageError", "message": message})
        return 1
    except (OSError, ValueError) as error:
        message = f"cannot prepare the child: {error}"
        control.send({"event": "failed", "kind": "ExecutionError", "message": message})
        return 1
    containment: Literal["namespace", "sweep"] = "namespace" if os.getpid() == 1 else "sweep"
    tracked = Tracked(control, containment, ahead)
    tracked.cgroups = spec.get("cgroups") or spec.get("joined", [])
    tracked.pokes = spec["kind"] != "command"
    # With it goes the writing end of P's "go" pipe: the supervisor lets P go itself at
    # "start", one wake-up sooner than through T (T lets it go too, as it takes "start").
    control.send({"event": "resolved", "code": code, "containment": containment}, tracked.going)
    # A named command's P takes its spawn message, or P is forked, while the supervisor
    # makes the child's identity durable, before "start".
    if ahead is not None:
        if spec["kind"] == "command":
            ahead.hand_on(spec)
        tracked.started = ahead.started
    elif tracked.fork_plugin(spec) == 0:
        return plugin_main(spec, control)  # in P (a named command never gets here: it exec'd)
    tracked.serve(until_start=True)
    tracked.start()
    tracked.serve(until_start=False)
    return tracked.finish()


# -- the fork server ------------------------------------------------------------------
# Run as ``python -I _bootstrap.py serve FD HOW STRICT [MODULE ...]``: FD is a
# SOCK_SEQPACKET socket to the supervisor; HOW and STRICT say how each T is contained,
# as for a started bootstrap (see :func:`make_tracked`). The server imports what a
# child needs (and the MODULEs the owner asked to preload), says {"event": "ready"} (or
# {"event": "failed", "message": ...}), and then, for each request {"environment":
# {...}} that carries three descriptors (SCM_RIGHTS: the child's end of its control
# socket, its marker pipe, its output), makes a T through an intermediate process that
# exits at once, so that T is re-parented to the supervisor (a child subreaper), and
# answers {"pid": T} once that is so, or {"event": "failed", "message": ...}. It holds
# nothing of a session once it answered. EOF on FD (the supervisor is gone) ends it.

# What every child imports sooner or later: preloaded, no child pays for it.
PRELOADED = ("resource", "traceback", "_sha256", "_sha2")


def serve(fd: int, how: str, strict: bool, preload: list[str]) -> None:
    """The fork server's loop; returns only in a forked T, set up as a fresh bootstrap."""
    import _socket  # socket's C part: no enum

    reset_signals()
    bind("unshare", "prctl", "setns")
    bind_mount()
    # It runs none of the plugins' code, and a child of the runner's uid must not reach
    # the runner's files through its /proc/PID/root.
    libc("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
    server = _socket.socket(fileno=fd)

    def answer(reply: ServerReply) -> None:
        server.send(marshal.dumps(dict(reply)))

    # No parent-death signal: it fires when the *thread* that started us ends, and Trio
    # starts processes from worker threads that end when idle. EOF on FD is the signal.
    try:
        for name in PRELOADED:
            try:  # noqa: SIM105  # contextlib is not imported here (see the top)
                __import__(name)
            except ImportError:
                pass  # _sha2 or _sha256, by the version: sha256_of takes either
        for name in preload:
            __import__(name)
    except BaseException as error:  # a module the owner named cannot be imported
        answer({"event": "failed", "message": f"{error!r}"})
        os._exit(1)
    # Whatever is alive now is never collected in a child, so a collection there does
    # not copy the pages it shares with us.
    gc.collect()
    gc.freeze()
    answer({"event": "ready"})
    descriptors = _socket.CMSG_SPACE(3 * 4)
    while True:
        try:
            data, ancillary, flags, _ = server.recvmsg(1 << 20, descriptors)
        except InterruptedError:
            continue
        if not data:
            os._exit(0)  # the supervisor is gone
        fds: list[int] = []
        for level, kind, payload in ancillary:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                whole = len(payload) - len(payload) % 4
                for at in range(0, whole, 4):
                    fds.append(int.from_bytes(payload[at : at + 4], sys.byteorder))
        truncated = flags & (_socket.MSG_TRUNC | _socket.MSG_CTRUNC)
        if truncated or len(fds) != 3:
            close_all(*fds)
            answer({"event": "failed", "message": "a fork request needs 3 descriptors"})
            continue
        request = marshal.loads(data)
        pid = fork_tracked(server.fileno(), how, strict)
        if pid == 0:  # in T
            become_tracked(request, fds)
            return
        close_all(*fds)
        if pid < 0:
            answer({"event": "failed", "message": "the child did not start"})
        else:
            answer({"pid": pid})


def fork_tracked(server: int, how: str, strict: bool) -> int:
    """Make T (:func:`make_tracked`) in a process that exits at once: 0 in T, T's pid
    (re-parented to the supervisor, and leading its own session) in the server, -1 if
    that failed. The namespace is the intermediate process's to make: the server stays
    in ours."""
    reported, reporter = os.pipe()  # T's pid, from its parent
    try:
        middle = os.fork()
    except OSError:
        close_all(reported, reporter)
        return -1
    if middle == 0:  # the intermediate process: it never returns
        try:
            close_all(reported)
            tracked = make_tracked(how, strict)
        except BaseException:
            os._exit(1)
        if tracked == 0:
            close_all(reporter, server)
            return 0
        try:
            if tracked > 0:
                os.write(reporter, str(tracked).encode())
        finally:
            os._exit(0)
    close_all(reporter)
    os.waitpid(middle, 0)  # once it is gone, T is the supervisor's child
    text = os.read(reported, 32)
    close_all(reported)
    return int(text) if text else -1


def become_tracked(request: ForkRequest, fds: list[int]) -> None:
    """In a forked T: take the request's output, environment and descriptors."""
    control, marked, output = fds
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    for kept in (control, marked):
        os.set_inheritable(kept, True)  # as a spawned T inherits them
    become_environment(request["environment"])
    sys.argv[1:] = [str(control)]


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        # serve FD HOW STRICT [MODULE ...]; returns in each T it forks
        serve(int(sys.argv[2]), sys.argv[3], sys.argv[4] == "strict", sys.argv[5:])
    sys.exit(main())
