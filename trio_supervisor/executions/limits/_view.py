"""How a runner finds the isolation it can give its children, and prepares it, once.

:func:`prepare` runs as the execution starts (``_bringup``): it checks what children
need, makes the private directories' parent, surveys the free uids (the claims of
runners that are gone reclaimed) and makes the view, and gives the kind of isolation
the runner can have (``_isolation``: users, namespaces, or none).

A uid alone is not enough where the interpreter or the plugins lie below a directory
others may not enter (``/root``, mode 0700, is a common home of pyenv), so the children
see the file system through a **view**: a mount namespace made once per execution
(``_bootstrap.make_view``), in which an empty tmpfs covers each such directory and the
state directory, and only what children need is mounted back: the interpreter's
prefixes and path, the entry paths and the named commands' executables (all
read-only). ``STATE/children`` there is a tmpfs of the view's own, which holds the
private directories (the runner reaches it through a descriptor; making and removing
a directory costs microseconds there, against a millisecond of a journaling file
system, and it goes with the view). Each child enters the view with ``setns``. So the
state directory, its store and token files and every session's log stay out of sight,
whatever their modes, and a child's output still reaches its log through the
descriptor the runner opened.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import stat
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import trio

from ...errors import ExecutionError
from ...realtime import bounded, outside_the_run
from ..child._protocol import ViewSpec
from ._claims import UIDS, Claims, survey_uids
from ._isolation import (
    Isolated,
    Isolation,
    NamespaceIsolation,
    Network,
    NoIsolation,
    UserIsolation,
    remove_home,
)

__all__ = ["CHILDREN", "PRIVATE", "prepare"]

VIEW_TIMEOUT = 10.0
CHILDREN = "children"
# Where any process may write: each isolated child gets a fresh tmpfs over each (as
# systemd's PrivateTmp), so no two children meet there and none leaves files behind.
PRIVATE = ("/tmp", "/var/tmp", "/dev/shm")

# What each interpreter puts on a child's path, asked once per interpreter.
_PATHS: dict[str, list[str]] = {}
_ASK = (
    "import sys, os, marshal; sys.stdout.buffer.write(marshal.dumps("
    "[sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, "
    "os.path.realpath(sys.executable), *sys.path]))"
)


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
    claims: Path | None = None,
) -> Isolated:
    """Find what this runner can do, and prepare it: the private directories' parent,
    the free uids (the claims of runners that are gone reclaimed), the view.

    ``claims`` is where the machine's claims are (``_claims.claims_root()`` by default).

    Raises:
        ExecutionError: Children cannot be isolated here (and ``isolation`` is "auto"),
            or something they need is readable by its owner alone.
    """
    if isolation == "none":
        await trio.lowlevel.checkpoint()
        return NoIsolation(reason="isolation='none' was asked for")
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
        needed = [*await _interpreter_paths(python), *entry_paths, *executables]
        private, keep = await trio.to_thread.run_sync(_private_directories, needed, ())
        homes_kept = await trio.to_thread.run_sync(_kept, children, private)
        await trio.to_thread.run_sync(_private_parent, children)
        # A child of the runner's uid could otherwise read the state directory through
        # /proc/<runner>/root: only root may look into a process that is not dumpable.
        _not_dumpable()
        why = "asked for" if isolation == "namespace" else f"the runner is uid {os.geteuid()}"
        return NamespaceIsolation(
            network=network,
            children=children,
            reason=why,
            private=private,
            keep=keep,
            homes_kept=homes_kept,
        )
    if os.geteuid() != 0:
        await trio.lowlevel.checkpoint()
        raise ExecutionError(
            f"children cannot run as users of their own: the runner is not root (uid "
            f"{os.geteuid()}); run it as root, or pass isolation='auto' or 'none'"
        )
    needed = [*await _interpreter_paths(python), *entry_paths, *executables]
    for path in entry_paths:
        _check_readable(Path(path))
    uids = await trio.to_thread.run_sync(Claims.of, UIDS, claims)
    with outside_the_run():
        survey = await trio.to_thread.run_sync(survey_uids, uids, users, children)
    survey.log()
    covers = _covers([*needed, str(children)], state)
    private, keep = await trio.to_thread.run_sync(_private_directories, needed, covers)
    homes_kept = await trio.to_thread.run_sync(_kept, children, private)
    with outside_the_run():
        view, homes = await _make_view(bootstrap, covers, needed, children)
    return UserIsolation(
        users=users,
        claims=uids,
        network=network,
        view=view,
        homes=homes,
        children=children,
        covered=tuple(covers),
        free=survey.free,
        private=private,
        keep=keep,
        homes_kept=homes_kept,
    )


def _under(path: str, parents: Iterable[str]) -> bool:
    """Whether ``path`` lies below one of ``parents``."""
    return any(path.startswith(parent.rstrip("/") + "/") for parent in parents)


def _private_directories(
    needed: Iterable[str], covers: Sequence[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The directories of ``PRIVATE`` each child gets a fresh tmpfs over (as real paths:
    ``/var/tmp`` may be a link to ``/tmp``; none the view ``covers``, where children see
    nothing of the host's), and what of ``needed`` lies below one, to be mounted back
    (outermost first, none below another).

    Raises:
        ExecutionError: A needed path is one of them: children could not find it.
    """
    private = tuple(
        dict.fromkeys(
            real
            for real in map(os.path.realpath, PRIVATE)
            if os.path.isdir(real) and real not in covers and not _under(real, covers)
        )
    )
    keep: list[str] = []
    for path in sorted(dict.fromkeys(map(os.path.realpath, needed)), key=len):
        if path in private:
            raise ExecutionError(
                f"children need {path}, but each gets an empty {path} of its own: move "
                "what they need elsewhere, or pass isolation='none' (serve --isolation none)"
            )
        if _under(path, private) and not _under(path, keep):
            keep.append(path)
    return private, tuple(keep)


def _kept(children: Path, private: Sequence[str]) -> Path | None:
    """The real path of ``children`` if it lies below one of ``private``, else None."""
    real = os.path.realpath(children)
    return Path(real) if _under(real, private) else None


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


def _private_parent(children: Path) -> None:
    """``STATE/children`` on the host, for children in namespaces of their own, without
    the private directories an earlier run on it left (its children died with it)."""
    children.mkdir(exist_ok=True)
    os.chmod(children, 0o711)
    for entry in os.listdir(children):
        if entry.startswith("n") and entry[1:].isdigit():
            remove_home(children / entry)


async def _make_view(
    source: Path, covers: list[str], binds: list[str], homes: Path
) -> tuple[int, int]:
    """Make the children's view (see ``_bootstrap.make_view``): its descriptor, and that
    of the tmpfs at ``homes`` in it."""
    spec: ViewSpec = {"covers": covers, "binds": binds, "homes": str(homes)}
    payload = marshal.dumps(dict(spec))

    def make() -> tuple[int, int]:
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
            said = maker.stdout.readline().split()
            if len(said) != 2 or said[0] != b"ready":
                maker.stdin.close()
                error = maker.stderr.read().decode(errors="replace") if maker.stderr else ""
                last = error.strip().splitlines()[-1:] or ["it said nothing"]
                raise ExecutionError(f"cannot make the children's view: {last[0]}")
            view = os.open(f"/proc/{maker.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
            return view, os.open(f"/proc/{maker.pid}/fd/{int(said[1])}", flags)
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
