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
others may not enter, so the children see the file system through a **view**, a mount
namespace made once per execution, in which the state directory is out of sight
(``_view``, which also prepares the kind of isolation as the execution starts).

The view is every child's; what is one child's alone is mounted in a copy of it, a
mount namespace the child makes as it enters the view (``_bootstrap.own_mounts``): a
fresh tmpfs over each of ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (so no two children
meet there and none leaves a file behind: each goes with its child's last process),
with what children need below one mounted back (:func:`_private_directories`), and,
where the child has a PID namespace of its own (``_containment``), that namespace's
``/proc``: the child's own tree is all it lists, and the runner's pid, command line and
environment are not in it. Where the kernel refuses a PID namespace, or its ``/proc``,
children keep the host's ``/proc``, and the log says so.

A standby (an interpreter kept ahead of the next load, ``_standby``) is granted its
child's uid and private directory while it waits, and forks its plugin then, which
makes its mount namespace (and, without a network, its network namespace) at once
(``_bootstrap.Ahead``): the load that takes it sends the same isolation, and the plugin
only takes its uid (the fork, the copy of the view and its mounts are most of what
isolating a child costs, 0.5 ms of the plugin's 0.8 ms here). The record is the same as
for any child: the uid in its identity is the one it runs as. A standby discarded
unused gives its grant back, as a child that is gone does.

Runners of one machine may share a range: a uid is claimed machine-wide, atomically,
by a claim ``uids/<uid>`` that names the runner (its pid, start time and boot id) and
the child's private directory, and given back once its child is gone (``_claims``).
A killed runner's claims are reclaimed by any runner: as it starts, and again when it
runs short of uids, before it refuses a load for want of one; a uid that a process
still runs as stays taken meanwhile (a killed runner's tree ends by its dead-man
switch, or by recovery, which frees the uid it recorded in the child's identity). A
uid of the range that some other process runs as is never given, and the log says so.

A runner that is not root cannot give uids away. Its children get the next best thing
(``"namespace"``, which "auto" picks there): each makes a user namespace and a mount
namespace of its own before it runs anything (the mount namespace alone where its
PID namespace's user namespace gives it what it needs), in which it mounts its own
``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``/proc`` as above, and an empty tmpfs covers
the state directory and only its private directory is mounted back; it then drops every
capability and takes ``PR_SET_NO_NEW_PRIVS``. It still runs as the runner's uid, so it
may read what the runner's user may read outside the state directory; the log says so.
Where the kernel allows no user namespace, "auto" refuses to start, naming what to do.

Each kind is a class of its own behind one interface, :class:`Isolated`:
:class:`UserIsolation` ("users"), :class:`NamespaceIsolation` ("namespace") and
:class:`NoIsolation` ("none"), chosen once by ``_view.prepare``. The execution asks the
one it has to claim, describe, spell out and release what a child is given, never
which kind it is.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar, Literal

import attrs
import trio

from ...errors import ExecutionError
from ...realtime import outside_the_run
from ..child._protocol import (
    IsolationSpec,
    NamespaceIsolationSpec,
    OwnMounts,
    UserIsolationSpec,
)
from ._claims import ClaimError, Claims, survey_uids

__all__ = [
    "DEFAULT_CHILD_USERS",
    "ISOLATIONS",
    "NETWORKS",
    "Grant",
    "Isolated",
    "Isolation",
    "NamespaceIsolation",
    "NoIsolation",
    "UserIsolation",
    "remove_home",
]

logger = logging.getLogger(__name__)

Isolation = Literal["auto", "users", "namespace", "none"]
ISOLATIONS: tuple[Isolation, ...] = ("auto", "users", "namespace", "none")
Network = Literal["host", "none"]
NETWORKS: tuple[Network, ...] = ("host", "none")
#: The uids isolated children run as by default, one each: 1024 uids from
#: 2,000,000,000, far above the ranges distributions give to people and system users,
#: and to the subordinate ranges of their containers.
DEFAULT_CHILD_USERS = range(2_000_000_000, 2_000_000_000 + 1024)
UID_MAX = 2**32 - 2  # (uid_t)-1 means "unchanged" to the kernel


@attrs.frozen
class Grant:
    """What one child was given: its uid (and gid; None in a namespace), and its
    private directory, as the child sees it."""

    uid: int | None
    home: Path

    @property
    def tmp(self) -> Path:
        """Its ``TMPDIR``: its working directory too."""
        return self.home


@attrs.define(kw_only=True)
class Isolated:
    """An execution's isolation, found and prepared once by ``_view.prepare``: the one
    interface of every kind, each a class of its own (:class:`NoIsolation`,
    :class:`NamespaceIsolation`, :class:`UserIsolation`), so the execution never asks
    which kind it has. What this class does is what a kind that gives children nothing
    of their own does; what only a kind that isolates can do (:meth:`claim`,
    :meth:`spec`, :meth:`release`) it refuses.

    Attributes:
        reason: Why this kind, for the log.
        network: "host", or "none" (a network namespace with loopback alone).
        children: Where the private directories are, as children see it
            (``STATE/children``).
        private: The directories of ``PRIVATE`` a child gets a fresh tmpfs over (those
            that are directories here, as their real paths).
        keep: What children need below one of them (the interpreter, the entry paths,
            the commands), mounted back read-only over the fresh tmpfs (real paths).
        homes_kept: Where the private directories are (their real path), if that is
            below one of them: each child's own is mounted back there, writable.
        proc_refused: Why children cannot have a ``/proc`` of their own (their PID
            namespace's), or "" where each has one. Told by the runner once it knows
            the containment.
    """

    kind: ClassVar[Literal["users", "namespace", "none"]]
    used: ClassVar[bool] = True
    # Whether a standby may be given a child's grant before its load, and fork its
    # plugin in namespaces of its own while it waits (``_bootstrap.Ahead``).
    ahead: ClassVar[bool] = False

    reason: str = ""
    network: Network = "host"
    children: Path | None = None
    private: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    homes_kept: Path | None = None
    proc_refused: str = "the containment is not known yet"

    @property
    def view(self) -> int:
        """The children's view (a mount namespace's descriptor every bootstrap
        inherits), or -1."""
        return -1

    @property
    def homes(self) -> int:
        """The private directories' parent as the runner reaches it (a directory's
        descriptor), or -1."""
        return -1

    @property
    def free_uids(self) -> int:
        """How many uids a child may get now."""
        return 0

    def is_free(self, uid: int) -> bool:
        """Whether a child may get ``uid`` now (this runner knows it free)."""
        return False

    def describe(self) -> str:
        """One line for the log."""
        raise NotImplementedError

    def _own(self) -> str:
        """What each child has of its own beside, for the log."""
        private = f"a fresh tmpfs each over {', '.join(self.private)}" if self.private else ""
        if self.proc_refused:
            proc = f"the host's /proc, with every process in it ({self.proc_refused})"
        else:
            proc = "a /proc of their own PID namespace"
        return "; ".join(part for part in (private, proc) if part)

    def _own_mounts(self, grant: Grant) -> OwnMounts:
        """What of the spawn message's ``isolation`` is mounted in the child's own mount
        namespace (see ``_bootstrap.own_mounts``)."""
        keep = [(path, False) for path in self.keep]
        if self.homes_kept is not None:  # after what it may lie in
            keep.append((str(self.homes_kept / grant.home.name), True))
        return {"private": list(self.private), "keep": keep, "proc": not self.proc_refused}

    def spec(self, grant: Grant) -> IsolationSpec:
        """The spawn message's ``isolation`` (see ``_bootstrap.isolate``)."""
        raise NotImplementedError(f"children isolated by {self.kind} are granted nothing")

    def home_of(self, uid: int) -> Path:
        """The private directory of the child running as ``uid``, as the runner reaches it."""
        raise NotImplementedError(f"children isolated by {self.kind} have no uid of their own")

    async def claim(self) -> Grant:
        """What the next child is given, claimed, with its private directory made (owned
        by it, mode 0700).

        Raises:
            ExecutionError: Nothing is left to give.
        """
        raise NotImplementedError(f"children isolated by {self.kind} are granted nothing")

    def claim_now(self) -> Grant | None:
        """What the next child is given, as :meth:`claim`, if something is free now
        (without looking at the claims again, and without waiting); else None."""
        return None

    async def release(self, grant: Grant) -> None:
        """Remove a gone child's private directory, and give back what it was granted."""
        raise NotImplementedError(f"children isolated by {self.kind} are granted nothing")

    async def recovered(self, uid: int) -> None:
        """Free the uid of a child an earlier run on this state directory left, now that
        recovery ended it."""
        await trio.lowlevel.checkpoint()

    def let_go(self) -> None:
        """The execution ends: let go of what it still holds for children whose end it
        was never shown."""

    def close(self) -> None:
        """Close what the runner holds of the children's file system."""


@attrs.define(kw_only=True)
class NoIsolation(Isolated):
    """``"none"``: children run as the runner's user, in its state directory."""

    kind: ClassVar[Literal["none"]] = "none"
    used: ClassVar[bool] = False

    def describe(self) -> str:
        return f"nothing: they run as the runner's user ({self.reason})"


@attrs.define(kw_only=True)
class NamespaceIsolation(Isolated):
    """``"namespace"``: each child makes a user and mount namespace of its own, in which
    the state directory is hidden but for its private directory (made on the host, as
    ``STATE/children/n<number>``)."""

    kind: ClassVar[Literal["namespace"]] = "namespace"
    _made: Iterator[int] = attrs.field(factory=lambda: itertools.count(1))

    def describe(self) -> str:
        return (
            "a user and mount namespace each, in which the state directory is hidden "
            f"but for its private directory under {self.children}, with no capabilities "
            "and no new privileges; they run as the runner's uid, and may read what "
            f"it may outside the state directory ({self.reason}; the runner is not "
            f"dumpable, so it leaves no core dump); {self._own()}; network {self.network}"
        )

    def spec(self, grant: Grant) -> NamespaceIsolationSpec:
        assert self.children is not None
        return {
            "hide": str(self.children.parent),
            # Below a fresh tmpfs, the state directory is out of sight already.
            "cover": self.homes_kept is None,
            "home": str(grant.home),
            "tmp": str(grant.tmp),
            "network": self.network,
            **self._own_mounts(grant),
        }

    async def claim(self) -> Grant:
        assert self.children is not None
        await trio.lowlevel.checkpoint()
        home = self.children / f"n{next(self._made)}"
        home.mkdir(mode=0o700)
        return Grant(None, home)

    async def release(self, grant: Grant) -> None:
        # On the host's file system: not on the event loop.
        with outside_the_run():
            await trio.to_thread.run_sync(remove_home, grant.home)


@attrs.define(kw_only=True)
class UserIsolation(Isolated):
    """``"users"``: each child runs as a uid of its own, in the children's view.

    Attributes:
        users: The uids children get.
        claims: Where uids are claimed machine-wide (``_claims``), by this runner.
        view: The children's view (a mount namespace's descriptor).
        homes: The private directories' parent, a tmpfs that exists in the view alone (a
            directory's descriptor). Making and removing a directory there costs
            microseconds, where a journaling file system takes a millisecond, and
            whatever a child left goes with the view.
        covered: What the view covers, for the log.
    """

    kind: ClassVar[Literal["users"]] = "users"
    ahead: ClassVar[bool] = True

    users: range
    claims: Claims
    view: int = -1
    homes: int = -1
    covered: tuple[str, ...] = ()
    _free: list[int] = attrs.field(factory=list)
    _held: set[int] = attrs.field(factory=set)
    # One survey of the claims at a time: loads that run short together share one.
    _surveying: trio.Lock = attrs.field(factory=trio.Lock)
    _looked: int = 0

    @property
    def free_uids(self) -> int:
        return len(self._free)

    def is_free(self, uid: int) -> bool:
        return uid in self._free

    def describe(self) -> str:
        last = self.users.stop - 1
        return (
            f"uids {self.users.start}-{last} of their own ({len(self._free)} free), "
            f"no new privileges, a private directory in a tmpfs at {self.children}, and a "
            f"view of the file system that covers {', '.join(self.covered)}; "
            f"{self._own()}; network {self.network}"
        )

    def spec(self, grant: Grant) -> UserIsolationSpec:
        assert grant.uid is not None
        return {
            "uid": grant.uid,
            "home": str(grant.home),
            "tmp": str(grant.tmp),
            "network": self.network,
            "view": self.view,
            **self._own_mounts(grant),
        }

    def home_of(self, uid: int) -> Path:
        """(Through the descriptor of the view's tmpfs.)"""
        return Path(f"/proc/self/fd/{self.homes}/{uid}")

    async def claim(self) -> Grant:
        """A free uid, claimed, with its private directory made (owned by it, mode 0700).

        Where none is left, the claims are looked at again first: those of runners that
        are gone since are reclaimed (``_claims``).

        Raises:
            ExecutionError: Every uid of the range is taken.
        """
        grant = self._take()
        if grant is not None:
            await trio.lowlevel.checkpoint()
            return grant
        await self.reclaim()
        grant = self._take()
        if grant is not None:
            return grant
        raise ExecutionError(
            f"every uid of {self.users.start}-{self.users.stop - 1} is in use by a "
            "running child: widen isolation_users (serve --child-users)"
        )

    def claim_now(self) -> Grant | None:
        if self.homes < 0:  # closed: the execution is on its way out
            return None
        return self._take()

    def _take(self) -> Grant | None:
        """The next free uid, claimed, or None where none is left."""
        assert self.children is not None
        while self._free:
            uid = self._free.pop()
            name = str(uid)
            if not self.claims.make(name, self.children / name):
                continue  # another runner's child has it now
            try:
                os.mkdir(name, 0o700, dir_fd=self.homes)
            except FileExistsError:  # a child of this run that has not gone yet
                self.claims.drop(name)
                continue
            except BaseException:
                self.claims.drop(name)  # claimed for nobody
                self._free.append(uid)
                raise
            os.chown(name, uid, uid, dir_fd=self.homes, follow_symlinks=False)
            self._held.add(uid)
            return Grant(uid, self.children / name)
        return None

    async def reclaim(self) -> None:
        """Look at the claims again: reclaim those of runners that are gone, and take
        every uid of the range that is free now (in a worker thread; one look at a time,
        which loads short of a uid together share)."""
        assert self.children is not None
        looked = self._looked
        async with self._surveying:
            if self._looked != looked:
                return  # looked at while this waited
            with outside_the_run():
                survey = await trio.to_thread.run_sync(
                    survey_uids, self.claims, self.users, self.children
                )
            self._looked += 1
        survey.log(quiet=True)
        free = set(self._free)
        # Highest first, as claims pop the lowest; those of this run's children that
        # are still going are its own to give back.
        found = [uid for uid in survey.free if uid not in free and uid not in self._held]
        self._free = sorted([*self._free, *found], reverse=True)

    async def release(self, grant: Grant) -> None:
        """Remove a gone child's private directory, and make its uid free again (its
        claim let go of even where this is cancelled: the execution ends, say)."""
        assert grant.uid is not None
        if self.homes < 0:  # closed: the view's tmpfs went with it (a standby's, discarded)
            self._give_back(grant.uid)
            await trio.lowlevel.checkpoint()
            return
        try:
            os.rmdir(str(grant.uid), dir_fd=self.homes)  # most children leave it empty
        except FileNotFoundError:
            pass
        except OSError:
            with outside_the_run():
                await trio.to_thread.run_sync(remove_home, self.home_of(grant.uid))
        finally:
            self._give_back(grant.uid)
        await trio.lowlevel.checkpoint()

    def _give_back(self, uid: int) -> None:
        self._held.discard(uid)
        self.claims.drop(str(uid))
        self._free.append(uid)

    async def recovered(self, uid: int) -> None:
        """Free the uid of a child an earlier run on this state directory left, now that
        recovery ended it (its private directory went with that run's view): its claim,
        of that run's dead runner, is reclaimed, unless another runner reclaimed it and
        claimed the uid since."""
        assert self.children is not None
        if uid not in self.users or uid in self._held or uid in self._free:  # ours already
            await trio.lowlevel.checkpoint()
            return
        with outside_the_run():
            free = await trio.to_thread.run_sync(
                _reclaim_recovered, self.claims, uid, self.children / str(uid)
            )
        if free and uid not in self._held and uid not in self._free:
            self._free.append(uid)

    def let_go(self) -> None:
        """The execution ends: let go of the claims of children whose end it was never
        shown (a child killed by :meth:`recover` while its unit of this run was dropped
        unwaited, say). A uid some process still runs as is never claimed again (the
        survey's rule), so this frees nothing in use."""
        for uid in sorted(self._held):
            logger.info("uid %d: let go of as the execution ends (its child's end unseen)", uid)
            self._give_back(uid)

    def close(self) -> None:
        for fd in (self.view, self.homes):
            if fd >= 0:
                os.close(fd)
        self.view = self.homes = -1


def _reclaim_recovered(claims: Claims, uid: int, home: Path) -> bool:
    """Reclaim the claim of ``uid`` that a dead run left for ``home`` (recovery ended its
    child); whether the uid is free of claims now."""
    with claims.reclaiming():
        try:
            claim = claims.read(str(uid))
        except ClaimError as error:
            logger.warning("%s; the uid %d stays taken", error, uid)
            return False
        if claim is None:
            return True
        if claim.holds != str(home) or not (
            claim.owner is None or claims.gone(claim, claims.owner.boot_id)
        ):
            return False  # claimed again since, by a runner that lives
        return claims.remove(str(uid), claim)


def remove_home(home: Path) -> bool:
    """Remove a private directory (its owner's symlinks cannot redirect it: shutil's
    removal works through descriptors); whether it is gone."""
    if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover  # not Linux
        raise ExecutionError("cannot remove children's directories safely on this system")
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(home)
    return not home.exists()
