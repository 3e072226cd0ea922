"""What a runner holds of the machine, written so that any runner can tell when to take it back.

Theory of operation. Runners of one machine share parts of it: the uids of the
children's range (``_isolation``) and the cgroups their executions make
(``_cgroups``). What one runner holds of them is written down as a **claim**: a
symbolic link in a directory only root may write (:func:`claims_root`:
``/run/trio-supervisor``, or ``/dev/shm/trio-supervisor`` where only that is in
memory), made atomically or not at all (``symlink`` fails where the name exists), whose
text names its **owner** and what it holds::

    uids/<uid>       -> "owner PID START BOOT STATE/children/<uid>"
    cgroups/<name>   -> "owner PID START BOOT STATE"

``PID START BOOT`` is the runner's pid, the start time the kernel gave that pid (clock
ticks after boot, field 22 of ``/proc/PID/stat``) and the boot id. A pid alone names
nobody, as the kernel reuses pids; a reused pid has a later start time, and after a
reboot no process is the one named. So a dead owner never looks alive, and a live one
never looks dead. (Runners that share a claims directory must see each other's
processes: one PID namespace, as they already need to see who runs as a uid.)

A claim goes when its owner lets go of what it holds, or, once its owner is dead, when
any runner **reclaims** it: as it starts, and, for uids, again when it runs short
(``_isolation``). A uid whose owner is dead stays taken while any process still runs as
it (a killed runner's trees end by their dead-man switch; a stopped one, by recovery);
a reclaim later takes it.

Rules that never bend:

* Only a reclaim removes another runner's claim, and every reclaim holds an exclusive
  ``flock`` on the claims' directory: two runners never both judge one claim, so a claim
  made anew after one reclaim removed the old one is never removed by the other. A
  claim whose owner lives is removed by nobody but that owner.
* A claim that cannot be read (not a symbolic link, text of no known format) never
  stops a runner: it is left alone, and the log names it.
* Claims of the format before owners were named (uids only: a bare path,
  ``STATE/children/<uid>``) are still read. Their owner is known dead where their state
  directory is gone, or is the reclaiming runner's own (a runner holds its state
  directory, so the run that made them is over); any other is left alone, and the log
  says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import attrs

from ...errors import ExecutionError
from ..trees._groups import boot_id, read_stat

__all__ = [
    "CGROUPS",
    "CLAIMS",
    "UIDS",
    "Claim",
    "ClaimError",
    "Claims",
    "Owner",
    "UidSurvey",
    "claims_root",
    "running_uids",
    "survey_uids",
]

logger = logging.getLogger(__name__)

# Where claims live: the first of these on a tmpfs, else the first (claims_root). In
# memory where one is found: a link made and removed per child on a journaling file
# system costs a load 0.6 ms.
CLAIMS: Final = (Path("/run/trio-supervisor"), Path("/dev/shm/trio-supervisor"))
UIDS: Final = "uids"
CGROUPS: Final = "cgroups"
# "owner PID START BOOT WHAT": what it holds is last, as a path may hold spaces.
_OWNED = re.compile(r"owner ([0-9]+) ([0-9]+) ([0-9a-f-]+) (/.*)", re.ASCII | re.DOTALL)


class ClaimError(ExecutionError):
    """A claim that cannot be read: it says which, and why."""


@attrs.frozen
class Owner:
    """A process of one boot: its pid, the start time the kernel gave it, the boot id."""

    pid: int
    start_time: int
    boot_id: str

    @classmethod
    def this_process(cls) -> Owner:
        stat = read_stat(os.getpid())
        assert stat is not None  # we run
        return cls(os.getpid(), stat.start_time, boot_id())

    def alive(self, boot: str) -> bool:
        """Whether it still runs, in the boot ``boot`` (a zombie holds nothing)."""
        if self.boot_id != boot:
            return False
        stat = read_stat(self.pid)
        return stat is not None and stat.running and stat.start_time == self.start_time

    def __str__(self) -> str:
        return f"pid {self.pid} (started at tick {self.start_time})"


@attrs.frozen
class Claim:
    """What a claim's text says.

    Attributes:
        owner: Who holds it; None for a claim of the format before owners were named.
        holds: What it holds, as a path: a child's private directory, a state directory.
    """

    owner: Owner | None
    holds: str

    @property
    def text(self) -> str:
        """The claim's text, the symbolic link's target."""
        if self.owner is None:
            return self.holds
        owner = self.owner
        return f"owner {owner.pid} {owner.start_time} {owner.boot_id} {self.holds}"

    @classmethod
    def parse(cls, text: str, where: Path) -> Claim:
        """The claim ``text`` says, found at ``where``.

        Raises:
            ClaimError: The text is of no format a runner writes.
        """
        if text.startswith("/"):
            return cls(None, text)
        found = _OWNED.fullmatch(text)
        if found is None:
            raise ClaimError(f"the claim {where} says {text!r}, which is no claim a runner makes")
        pid, started, boot, holds = found.groups()
        return cls(Owner(int(pid), int(started), boot), holds)

    def describe(self) -> str:
        """For the log: what it holds, and for whom."""
        if self.owner is None:
            return f"{self.holds} (a claim that names no runner)"
        return f"{self.holds} for {self.owner}"


def claims_root() -> Path:
    """Where this machine's runners keep their claims: the first of ``CLAIMS`` on a tmpfs,
    else the first (``/run`` is a tmpfs on most systems)."""
    mounts: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/mounts") as file:
        for line in file:
            fields = line.split()
            if len(fields) > 2:
                mounts[fields[1]] = fields[2]

    def kind(path: Path) -> str:
        for place in (path, *path.parents):
            if str(place) in mounts:
                return mounts[str(place)]
        return ""

    return next((path for path in CLAIMS if kind(path) == "tmpfs"), CLAIMS[0])


def _own_directory(path: Path) -> None:
    """Make ``path`` (and its parent) root's alone, or refuse one someone else made
    (``/dev/shm`` is anyone's to write)."""
    for directory in (path.parent, path):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
        found = directory.lstat()
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != 0 or found.st_mode & 0o077:
            raise ExecutionError(
                f"{directory} is not a directory that root alone may write "
                f"(mode {found.st_mode:o}, owner {found.st_uid}): remove it, so that "
                "the runner makes it anew"
            )


class Claims:
    """One directory of claims (``uids``, ``cgroups``), as one owner makes, lets go of,
    reads and reclaims them. Blocking calls all: the caller runs them in a worker thread
    where they may wait (:meth:`reclaiming` waits for other runners' reclaims).

    Args:
        directory: Where the claims are.
        owner: Whose the claims made here are: this process by default.
    """

    def __init__(self, directory: Path, owner: Owner | None = None) -> None:
        self.directory = directory
        self.owner = owner if owner is not None else Owner.this_process()

    @classmethod
    def of(cls, kind: str, root: Path | None = None) -> Claims:
        """The claims of ``kind`` (``UIDS``, ``CGROUPS``) under ``root`` (found by
        :func:`claims_root` by default), their directory made root's alone.

        Raises:
            ExecutionError: The directory is there, but others may write it.
            OSError: It cannot be made (the runner is not root).
        """
        claims = cls((root if root is not None else claims_root()) / kind)
        _own_directory(claims.directory)
        return claims

    def text(self, holds: Path | str) -> str:
        """The text of this owner's claim of ``holds``."""
        return Claim(self.owner, str(holds)).text

    def make(self, name: str, holds: Path | str) -> bool:
        """Claim ``name``, for ``holds``: whether it was free (it is this owner's now)."""
        try:
            os.symlink(self.text(holds), self.directory / name)
        except FileExistsError:
            return False
        return True

    def drop(self, name: str) -> None:
        """Let go of this owner's claim of ``name`` (nothing, where it is not this
        owner's: no runner removes another's claim while its owner lives)."""
        path = self.directory / name
        with contextlib.suppress(OSError, ClaimError):
            if Claim.parse(os.readlink(path), path).owner == self.owner:
                os.unlink(path)

    def names(self) -> list[str]:
        """The name of every claim, claimed by anyone."""
        return sorted(os.listdir(self.directory))

    def read(self, name: str) -> Claim | None:
        """The claim of ``name``, or None where there is none.

        Raises:
            ClaimError: It cannot be read: not a symbolic link, or of no known format.
        """
        path = self.directory / name
        try:
            text = os.readlink(path)
        except FileNotFoundError:
            return None
        except OSError as error:  # EINVAL: not a symbolic link
            raise ClaimError(f"the claim {path} cannot be read: {error.strerror}") from error
        return Claim.parse(text, path)

    def gone(self, claim: Claim, boot: str) -> bool:
        """Whether ``claim`` names an owner that is dead (False for one that names none)."""
        return claim.owner is not None and claim.owner != self.owner and not claim.owner.alive(boot)

    @contextlib.contextmanager
    def reclaiming(self) -> Iterator[None]:
        """Hold the reclaims' lock: no other runner reclaims meanwhile (it blocks)."""
        descriptor = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # and the lock with it

    def remove(self, name: str, claim: Claim) -> bool:
        """While :meth:`reclaiming`: remove the claim of ``name`` if it still says ``claim``;
        whether it did."""
        path = self.directory / name
        try:
            if os.readlink(path) != claim.text:
                return False
            os.unlink(path)
        except OSError:
            return False
        return True

    def take(self, name: str, holds: Path | str) -> Claim | None:
        """Claim ``name`` for ``holds``, taking it from a dead owner where one held it; the
        live owner's claim that stands in the way, or None where it is this owner's now.

        Raises:
            ClaimError: The claim in the way cannot be read (it is left alone).
        """
        with self.reclaiming():
            found = self.read(name)
            if found is not None and found.text == self.text(holds):
                return None
            if found is not None:
                if not self.gone(found, self.owner.boot_id):
                    return found
                self.remove(name, found)
            if self.make(name, holds):
                return None
            return self.read(name)  # pragma: no cover  # made meanwhile, outside a reclaim


def running_uids() -> dict[int, int]:
    """Every uid some process runs as (real, effective, saved or file system uid, as
    ``/proc/PID/status`` says: its owner in ``/proc`` may be root's where it is not
    dumpable), each with one such pid."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as file:
                for line in file:
                    if line.startswith(b"Uid:"):
                        for uid in line.split()[1:]:
                            found.setdefault(int(uid), int(entry))
                        break
        except (OSError, ValueError):
            continue  # gone meanwhile
    return found


@attrs.frozen
class UidSurvey:
    """What a look at the uid claims found (:func:`survey_uids`).

    Attributes:
        free: The uids of the range no one claims and no process runs as, highest first
            (a claim takes the lowest).
        reclaimed: The claims it removed, of owners that are gone, by uid.
        unreadable: Why each claim it could not read was left alone, by its name.
        unknown: The claims that name no runner, left alone as their state directory is
            there and not this runner's, by uid.
        strangers: The uids of the range that some process runs as with no claim, each
            with one such pid.
    """

    free: list[int]
    reclaimed: dict[int, Claim] = attrs.field(factory=dict)
    unreadable: dict[str, str] = attrs.field(factory=dict)
    unknown: dict[int, Claim] = attrs.field(factory=dict)
    strangers: dict[int, int] = attrs.field(factory=dict)

    def log(self, *, quiet: bool = False) -> None:
        """Say what it reclaimed, and (unless ``quiet``) what it left alone and why."""
        if self.reclaimed:
            logger.info(
                "reclaimed %d uids whose runners are gone: %s",
                len(self.reclaimed),
                "; ".join(f"{uid}, {claim.describe()}" for uid, claim in self.reclaimed.items()),
            )
        if quiet:
            return
        for name, why in self.unreadable.items():
            logger.warning("%s; the uid %s stays taken", why, name)
        if self.unknown:
            logger.warning(
                "claims that name no runner (made by an earlier version) hold uids %s: "
                "they are left alone while their state directories are there; remove "
                "them once no runner uses those (e.g. %s)",
                ", ".join(map(str, list(self.unknown)[:5])),
                next(iter(self.unknown.values())).holds,
            )
        if self.strangers:
            uids = ", ".join(map(str, list(self.strangers)[:5]))
            logger.warning(
                "processes that no runner claimed run as uids of the children's range "
                "(%s, e.g. pid %d); those uids are left alone",
                uids,
                next(iter(self.strangers.values())),
            )


def survey_uids(claims: Claims, users: range, children: Path) -> UidSurvey:
    """Reclaim the uid claims of owners that are gone (where no process runs as the uid
    any more), and find the free uids of ``users``. Blocking: call it in a worker thread.

    A claim of the format before owners is reclaimed where its private directory is in
    ``children`` (this runner's state directory: the run that made it is over) or its
    state directory is gone.
    """
    running = running_uids()
    boot = claims.owner.boot_id
    taken: set[int] = set()
    reclaimed: dict[int, Claim] = {}
    unreadable: dict[str, str] = {}
    unknown: dict[int, Claim] = {}
    with claims.reclaiming():
        for name in claims.names():
            if not (name.isascii() and name.isdigit()):
                unreadable[name] = f"the claim {claims.directory / name} is not named after a uid"
                continue
            uid = int(name)
            try:
                claim = claims.read(name)
            except ClaimError as error:
                unreadable[name] = str(error)
                taken.add(uid)
                continue
            if claim is None:
                continue  # let go of meanwhile
            if claim.owner is None:
                home = Path(claim.holds)
                over = home.parent == children or not home.parent.parent.is_dir()
                if not over:
                    unknown[uid] = claim
            else:
                over = claims.gone(claim, boot)
            if over and uid not in running and claims.remove(name, claim):
                reclaimed[uid] = claim
            else:
                taken.add(uid)
    strangers = {
        uid: pid for uid, pid in sorted(running.items()) if uid in users and uid not in taken
    }
    free = [uid for uid in reversed(users) if uid not in taken and uid not in running]
    return UidSurvey(free, reclaimed, unreadable, unknown, strangers)
