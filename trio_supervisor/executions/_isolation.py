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

Which uids are free is this execution's to know: one whose private directory exists
is taken. A directory left by a run that was killed is removed at the next start, or,
while processes of its uid still run, by recovery once it has killed them (the uid is
recorded in the child's identity). Runners that share a machine need ranges of their
own: a uid of the range that some other process already runs as is left alone, and
the log says so.

Without root (or with ``isolation="none"``) none of this happens; "auto" then refuses
to start, naming what to do.
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

Isolation = Literal["auto", "none"]
ISOLATIONS: tuple[Isolation, ...] = ("auto", "none")
Network = Literal["host", "none"]
NETWORKS: tuple[Network, ...] = ("host", "none")
# 1024 uids from 2,000,000,000: far above the ranges distributions give to people and
# system users, and to the subordinate ranges of their containers.
DEFAULT_CHILD_USERS = range(2_000_000_000, 2_000_000_000 + 1024)
UID_MAX = 2**32 - 2  # (uid_t)-1 means "unchanged" to the kernel
VIEW_TIMEOUT = 10.0
CHILDREN = "children"

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
    """What one child was given: its uid (and gid), and its private directory."""

    uid: int
    home: Path

    @property
    def tmp(self) -> Path:
        return self.home / "tmp"


@attrs.define
class Isolated:
    """An execution's isolation, found and prepared once by :func:`prepare`.

    Attributes:
        users: The uids children get, or None when they are not isolated.
        network: "host", or "none" (a network namespace with loopback alone).
        view: The children's view (a mount namespace's descriptor), or -1.
        children: Where the private directories are (``STATE/children``).
        covered: What the view covers, for the log.
    """

    users: range | None
    network: Network = "host"
    view: int = -1
    children: Path | None = None
    covered: tuple[str, ...] = ()
    reason: str = ""
    _free: list[int] = attrs.field(factory=list)
    _held: set[int] = attrs.field(factory=set)

    @property
    def used(self) -> bool:
        return self.users is not None

    @property
    def free_uids(self) -> int:
        """How many uids a child may get now."""
        return len(self._free)

    def describe(self) -> str:
        """One line for the log."""
        if self.users is None:
            return f"nothing: they run as the runner's user ({self.reason})"
        last = self.users.stop - 1
        view = f"a view that covers {', '.join(self.covered)}" if self.covered else "no view"
        return (
            f"uids {self.users.start}-{last} of their own ({len(self._free)} free), "
            f"no new privileges, a private directory under {self.children}, {view}; "
            f"network {self.network}"
        )

    def spec(self, grant: Grant) -> dict[str, Any]:
        """The spawn message's ``isolation`` (see ``_bootstrap.isolate``)."""
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
        assert self.users is not None
        assert self.children is not None
        while self._free:
            uid = self._free.pop()
            home = self.children / str(uid)
            try:
                home.mkdir(mode=0o700)
            except FileExistsError:
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
        self._held.discard(grant.uid)
        if removed:
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
) -> Isolated:
    """Find what this runner can do, and prepare it: the private directories' parent,
    the free uids, the view.

    Raises:
        ExecutionError: Children cannot be isolated here (and ``isolation`` is "auto"),
            or something they need is readable by its owner alone.
    """
    if isolation == "none":
        await trio.lowlevel.checkpoint()
        return Isolated(users=None, reason="isolation='none' was asked for")
    if os.geteuid() != 0:
        await trio.lowlevel.checkpoint()
        raise ExecutionError(
            f"children cannot run as users of their own: the runner is not root (uid "
            f"{os.geteuid()}); run it as root, or pass isolation='none' (serve --isolation "
            "none) to run them as the runner's user"
        )
    needed = [*await _interpreter_paths(python), *entry_paths, *executables]
    for path in entry_paths:
        _check_readable(Path(path))
    children = state / CHILDREN
    free = await trio.to_thread.run_sync(_prepare_children, children, users)
    covers = _covers([*needed, str(children)], state)
    binds = [(path, False) for path in needed] + [(str(children), True)]
    with outside_the_run():
        view = await _make_view(bootstrap, covers, binds)
    return Isolated(
        users=users,
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


def _prepare_children(children: Path, users: range) -> list[int]:
    """Make ``STATE/children`` (root, 0711: others may pass, not list); remove the
    private directories earlier runs left whose uid runs nothing; return the free uids,
    highest first (claims pop the lowest)."""
    children.mkdir(exist_ok=True)
    os.chmod(children, 0o711)
    running: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                running.setdefault(os.stat(f"/proc/{entry}").st_uid, int(entry))
    taken: set[int] = set()
    for entry in os.listdir(children):
        if not entry.isdigit():
            continue
        uid = int(entry)
        if uid in running:
            taken.add(uid)  # recovery frees it once it has ended what runs
        elif not _remove_home(children / entry):
            taken.add(uid)
    strangers = sorted(uid for uid in users if uid in running and uid not in taken)
    if strangers:
        logger.warning(
            "processes the runner did not start run as uids of its children's range "
            "(%s, e.g. pid %d); those uids are left alone: give each runner of a machine "
            "a range of its own (isolation_users, serve --child-users)",
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
