"""Each child as a user of its own, unable to reach anything of the runner's.

Theory of operation. A runner that is root gives each running child a uid and gid of
its own from a range the owner configures (``isolation_users``), and nobody else uses
them: the child cannot signal, trace or read anything of the runner's or of another
child's, cannot gain privileges (``PR_SET_NO_NEW_PRIVS``, no capabilities once its uids
are not 0), and has a private working directory and ``TMPDIR``,
``STATE/children/<uid>``, which is made for it and removed once it is gone. The steps
are the plugin process's own, before it runs anything (``_bootstrap.isolate``); the
tracked process stays root and runs none of the plugin's code.

A uid alone is not enough where the interpreter or the plugins lie below a directory
others may not enter (``/root``, mode 0700, is a common home of pyenv), so the children
see the file system through a **view**: a mount namespace made once per execution
(``_bootstrap.make_view``), in which an empty tmpfs covers each such directory and the
state directory, and only what children need is mounted back: the interpreter's
prefixes and path, the entry paths, the named commands' executables (all read-only)
and ``STATE/children``. Each child enters it with ``setns``. So the state directory,
its store and token files and every session's log stay out of sight, whatever their
modes, and a child's output still reaches its log through the descriptor the runner
opened.

Runners of one machine may share a range: a uid is claimed machine-wide, atomically,
by a symbolic link ``/run/trio-supervisor/uids/<uid>`` to the child's private directory
(which names the runner's state directory), and given back once its child is gone. What
a run that was killed left (claims, private directories) is removed at the next start
on the same state directory, or, while processes of its uid still run, by recovery
once it has killed them (the uid is recorded in the child's identity). A uid of the
range that some other process already runs as is left alone, and the log says so.

A runner that is not root cannot give uids away. Its children get the next best thing
(``"namespace"``, which "auto" picks there): each makes a user namespace and a mount
namespace of its own before it runs anything, in which an empty tmpfs covers the state
directory and only its private directory is mounted back; it then drops every
capability and takes ``PR_SET_NO_NEW_PRIVS``. It still runs as the runner's uid, so it
may read what the runner's user may read outside the state directory; the log says so.
Where the kernel allows no user namespace, "auto" refuses to start, naming what to do.
"""

from __future__ import annotations

import contextlib
import logging
import marshal
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import trio

from ..errors import ExecutionError
from ..realtime import bounded, outside_the_run

__all__ = ["DEFAULT_CHILD_USERS", "ISOLATIONS", "NETWORKS", "Grant", "Isolated", "Isolation"]

logger = logging.getLogger(__name__)

Isolation = Literal["auto", "users", "namespace", "none"]
ISOLATIONS: tuple[Isolation, ...] = ("auto", "users", "namespace", "none")
Network = Literal["host", "none"]
NETWORKS: tuple[Network, ...] = ("host", "none")
# 1024 uids from 2,000,000,000: far above the ranges distributions give to people and
# system users, and to the subordinate ranges of their containers.
DEFAULT_CHILD_USERS = range(2_000_000_000, 2_000_000_000 + 1024)
UID_MAX = 2**32 - 2  # (uid_t)-1 means "unchanged" to the kernel
VIEW_TIMEOUT = 10.0
CHILDREN = "children"
# Which uid each running child of any runner of this machine holds: a symbolic link
# named after the uid, to the child's private directory (so it names its runner's
# state directory). Made atomically, or not at all: two runners sharing a range of uids
# never give one to two children.
CLAIMS = Path("/run/trio-supervisor/uids")

# What each interpreter puts on a child's path, asked once per interpreter.
_PATHS: dict[str, list[str]] = {}
_ASK = (
    "import sys, os, marshal; sys.stdout.buffer.write(marshal.dumps("
    "[sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, "
    "os.path.realpath(sys.executable), *sys.path]))"
)


def check_users(users: object) -> range:
    """``users`` as a range of uids a child may get, or ValueError naming the problem."""
    if not isinstance(users, range) or users.step != 1:
        raise ValueError(f"isolation_users must be a range of uids with step 1, got {users!r}")
    if len(users) == 0:
        raise ValueError(f"isolation_users is empty: {users!r}")
    if users.start < 1 or users.stop - 1 > UID_MAX:
        raise ValueError(
            f"isolation_users must lie within 1-{UID_MAX} (0 is root), got "
            f"{users.start}-{users.stop - 1}"
        )
    return users


@attrs.frozen
class Grant:
    """What one child was given: its uid (and gid; None in a namespace), and its
    private directory."""

    uid: int | None
    home: Path

    @property
    def tmp(self) -> Path:
        return self.home / "tmp"


@attrs.define
class Isolated:
    """An execution's isolation, found and prepared once by :func:`prepare`.

    Attributes:
        kind: "users" (a uid per child), "namespace" (a user and mount namespace per
            child), or "none".
        users: The uids children get, for "users".
        network: "host", or "none" (a network namespace with loopback alone).
        view: The children's view (a mount namespace's descriptor), or -1.
        children: Where the private directories are (``STATE/children``).
        covered: What the view covers, for the log.
    """

    kind: Literal["users", "namespace", "none"]
    users: range | None = None
    network: Network = "host"
    view: int = -1
    children: Path | None = None
    covered: tuple[str, ...] = ()
    claims: Path | None = None
    reason: str = ""
    _free: list[int] = attrs.field(factory=list)
    _held: set[int] = attrs.field(factory=set)
    _made: int = 0

    @property
    def used(self) -> bool:
        return self.kind != "none"

    @property
    def free_uids(self) -> int:
        """How many uids a child may get now."""
        return len(self._free)

    def describe(self) -> str:
        """One line for the log."""
        if self.kind == "none":
            return f"nothing: they run as the runner's user ({self.reason})"
        if self.kind == "namespace":
            return (
                "a user and mount namespace each, in which the state directory is hidden "
                f"but for its private directory under {self.children}, with no capabilities "
                "and no new privileges; they run as the runner's uid, and may read what "
                f"it may outside the state directory ({self.reason}; the runner is not "
                f"dumpable, so it leaves no core dump); network {self.network}"
            )
        assert self.users is not None
        last = self.users.stop - 1
        view = f"a view that covers {', '.join(self.covered)}" if self.covered else "no view"
        return (
            f"uids {self.users.start}-{last} of their own ({len(self._free)} free), "
            f"no new privileges, a private directory under {self.children}, {view}; "
            f"network {self.network}"
        )

    def spec(self, grant: Grant) -> dict[str, Any]:
        """The spawn message's ``isolation`` (see ``_bootstrap.isolate``)."""
        if grant.uid is None:
            assert self.children is not None
            return {
                "hide": str(self.children.parent),
                "home": str(grant.home),
                "tmp": str(grant.tmp),
                "network": self.network,
            }
        return {
            "uid": grant.uid,
            "home": str(grant.home),
            "tmp": str(grant.tmp),
            "network": self.network,
            "view": self.view,
        }

    def claim(self) -> Grant:
        """A free uid with its private directory made (owned by it, mode 0700).

        Raises:
            ExecutionError: Every uid of the range is taken.
        """
        assert self.children is not None
        if self.kind == "namespace":
            self._made += 1
            home = self.children / f"n{self._made}"
            home.mkdir(mode=0o700)
            (home / "tmp").mkdir(mode=0o700)
            return Grant(None, home)
        assert self.users is not None
        assert self.claims is not None
        while self._free:
            uid = self._free.pop()
            home = self.children / str(uid)
            claim = self.claims / str(uid)
            try:
                os.symlink(home, claim)
            except FileExistsError:
                continue  # another runner's child has it now
            try:
                home.mkdir(mode=0o700)
            except FileExistsError:
                claim.unlink()
                continue  # left by a child whose stop was cut short: not ours to give
            os.chown(home, uid, uid)
            tmp = home / "tmp"
            tmp.mkdir(mode=0o700)
            os.chown(tmp, uid, uid)
            self._held.add(uid)
            return Grant(uid, home)
        raise ExecutionError(
            f"every uid of {self.users.start}-{self.users.stop - 1} is in use by a "
            "running child: widen isolation_users (serve --child-users)"
        )

    async def release(self, grant: Grant) -> None:
        """Remove a gone child's private directory, and make its uid free again."""
        with outside_the_run():
            removed = await trio.to_thread.run_sync(_remove_home, grant.home)
        if grant.uid is None:
            return
        self._held.discard(grant.uid)
        if removed:
            assert self.claims is not None
            claim = self.claims / str(grant.uid)
            with contextlib.suppress(OSError):
                if Path(os.readlink(claim)) == grant.home:
                    claim.unlink()
            self._free.append(grant.uid)

    async def recovered(self, uid: int) -> None:
        """Free the uid of a child an earlier run left, now that recovery ended it."""
        if self.users is None or self.children is None or uid not in self.users:
            await trio.lowlevel.checkpoint()
            return
        if uid in self._held:  # given to a child of this run meanwhile: not ours
            await trio.lowlevel.checkpoint()
            return
        await self.release(Grant(uid, self.children / str(uid)))

    def close(self) -> None:
        if self.view >= 0:
            os.close(self.view)
            self.view = -1


def _remove_home(home: Path) -> bool:
    """Remove a private directory (its owner's symlinks cannot redirect it: shutil's
    removal works through descriptors); whether it is gone."""
    if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover  # not Linux
        raise ExecutionError("cannot remove children's directories safely on this system")
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(home)
    return not home.exists()


async def prepare(
    isolation: Isolation,
    users: range,
    network: Network,
    *,
    state: Path,
    python: str,
    bootstrap: Path,
    entry_paths: Sequence[str],
    executables: Iterable[str],
    claims: Path = CLAIMS,
) -> Isolated:
    """Find what this runner can do, and prepare it: the private directories' parent,
    the free uids, the view.

    Raises:
        ExecutionError: Children cannot be isolated here (and ``isolation`` is "auto"),
            or something they need is readable by its owner alone.
    """
    if isolation == "none":
        await trio.lowlevel.checkpoint()
        return Isolated("none", reason="isolation='none' was asked for")
    children = state / CHILDREN
    if isolation == "namespace" or (isolation == "auto" and os.geteuid() != 0):
        refused = _user_namespaces_refused()
        if refused:
            await trio.lowlevel.checkpoint()
            raise ExecutionError(
                f"children cannot be isolated: the runner is not root (uid {os.geteuid()}), "
                f"and {refused}; run it as root, allow user namespaces, or pass "
                "isolation='none' (serve --isolation none) to run them as the runner's user"
            )
        await trio.to_thread.run_sync(_prepare_children, children, range(0), None)
        # A child of the runner's uid could otherwise read the state directory through
        # /proc/<runner>/root: only root may look into a process that is not dumpable.
        _not_dumpable()
        why = "asked for" if isolation == "namespace" else f"the runner is uid {os.geteuid()}"
        return Isolated("namespace", network=network, children=children, reason=why)
    if os.geteuid() != 0:
        await trio.lowlevel.checkpoint()
        raise ExecutionError(
            f"children cannot run as users of their own: the runner is not root (uid "
            f"{os.geteuid()}); run it as root, or pass isolation='auto' or 'none'"
        )
    needed = [*await _interpreter_paths(python), *entry_paths, *executables]
    for path in entry_paths:
        _check_readable(Path(path))
    free = await trio.to_thread.run_sync(_prepare_children, children, users, claims)
    covers = _covers([*needed, str(children)], state)
    binds = [(path, False) for path in needed] + [(str(children), True)]
    with outside_the_run():
        view = await _make_view(bootstrap, covers, binds)
    return Isolated(
        "users",
        users=users,
        claims=claims,
        network=network,
        view=view,
        children=children,
        covered=tuple(covers),
        free=free,
    )


async def _interpreter_paths(python: str) -> list[str]:
    if python not in _PATHS:
        with bounded(VIEW_TIMEOUT), outside_the_run():
            done = await trio.run_process(
                [python, "-I", "-c", _ASK], capture_stdout=True, capture_stderr=True, check=False
            )
        if done is None or done.returncode != 0:
            said = "" if done is None else done.stderr.decode(errors="replace").strip()
            raise ExecutionError(f"cannot ask {python} for its path: {said or 'no answer'}")
        found = [path for path in dict.fromkeys(marshal.loads(done.stdout)) if path]
        _PATHS[python] = await trio.to_thread.run_sync(_existing, found)
    return _PATHS[python]


def _not_dumpable() -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        number = ctypes.get_errno()
        raise ExecutionError(f"cannot make the runner undumpable: {os.strerror(number)}")


def _user_namespaces_refused() -> str:
    """Why a child could not make a user namespace here, as far as sysctls tell ("" if
    nothing stands in the way; a seccomp filter may still refuse it, and the child then
    fails its load saying so)."""
    for sysctl, refusing in (
        ("/proc/sys/user/max_user_namespaces", "0"),
        ("/proc/sys/kernel/unprivileged_userns_clone", "0"),
    ):
        with contextlib.suppress(OSError):
            if Path(sysctl).read_text().strip() == refusing:
                return f"{sysctl} is {refusing}"
    return ""


def _existing(paths: list[str]) -> list[str]:
    return [path for path in paths if os.path.exists(path)]


def _others_may(path: Path, mode: int) -> bool:
    try:
        return (path.stat().st_mode & mode) == mode
    except OSError:
        return False


def _check_readable(path: Path) -> None:
    need = stat.S_IROTH | stat.S_IXOTH if path.is_dir() else stat.S_IROTH
    if not _others_may(path, need):
        raise ExecutionError(
            f"children run as users of their own and cannot read {path}: make it readable "
            f"to others (chmod o+rX), or pass isolation='none' (serve --isolation none)"
        )


def _covers(needed: Iterable[str], state: Path) -> list[str]:
    """The directories the view covers: the state directory, and the outermost
    directory above each needed path that others may not enter."""
    covers = {str(state)}
    for path in needed:
        for parent in reversed(Path(path).parents):
            if not _others_may(parent, stat.S_IXOTH):
                covers.add(str(parent))
                break
    # One inside another is covered with it (the view makes it again, empty).
    return sorted(covers, key=len)


def _prepare_children(children: Path, users: range, claims: Path | None) -> list[int]:
    """Make ``STATE/children`` (root, 0711: others may pass, not list) and the claims'
    directory; remove what earlier runs on this state directory left whose uid runs
    nothing (private directories and their claims), and claims of state directories that
    are gone; return the free uids, highest first (claims pop the lowest)."""
    children.mkdir(exist_ok=True)
    os.chmod(children, 0o711)
    running: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                running.setdefault(os.stat(f"/proc/{entry}").st_uid, int(entry))
    taken: set[int] = set()
    if claims is not None:
        claims.mkdir(mode=0o700, parents=True, exist_ok=True)
        for entry in os.listdir(claims):
            uid, claim = int(entry), claims / entry
            target = Path(os.readlink(claim))
            if uid in running:
                taken.add(uid)  # recovery frees it once it has ended what runs
            elif target.parent == children:  # this state directory's, from a dead run
                if _remove_home(target):
                    claim.unlink()
                else:
                    taken.add(uid)
            elif not target.parent.is_dir():  # a state directory that is gone
                claim.unlink()
            else:
                taken.add(uid)  # another runner's child, about to start
    for entry in os.listdir(children):
        namespaced = entry.startswith("n") and entry[1:].isdigit()  # its runner is gone
        unused = entry.isdigit() and int(entry) not in taken and int(entry) not in running
        if namespaced or unused:
            _remove_home(children / entry)
    strangers = sorted(uid for uid in users if uid in running and uid not in taken)
    if strangers:
        logger.warning(
            "processes that no runner claimed run as uids of the children's range "
            "(%s, e.g. pid %d); those uids are left alone",
            ", ".join(map(str, strangers[:5])),
            running[strangers[0]],
        )
    return sorted((uid for uid in users if uid not in taken and uid not in running), reverse=True)


async def _make_view(source: Path, covers: list[str], binds: list[tuple[str, bool]]) -> int:
    """Make the children's view (see ``_bootstrap.make_view``); its descriptor."""
    payload = marshal.dumps({"covers": covers, "binds": [list(bind) for bind in binds]})

    def make() -> int:
        maker = subprocess.Popen(
            [sys.executable, "-I", "-S", str(source), "view"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert maker.stdin is not None
        assert maker.stdout is not None
        try:
            maker.stdin.write(b"%d\n" % len(payload) + payload)
            maker.stdin.flush()
            said = maker.stdout.readline()
            if said.strip() != b"ready":
                maker.stdin.close()
                error = maker.stderr.read().decode(errors="replace") if maker.stderr else ""
                last = error.strip().splitlines()[-1:] or ["it said nothing"]
                raise ExecutionError(f"cannot make the children's view: {last[0]}")
            return os.open(f"/proc/{maker.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            if not maker.stdin.closed:
                maker.stdin.close()
            try:
                maker.wait(VIEW_TIMEOUT)
            except subprocess.TimeoutExpired:
                maker.kill()
                maker.wait()
            for stream in (maker.stdout, maker.stderr):
                if stream is not None:
                    stream.close()

    return await trio.to_thread.run_sync(make)
