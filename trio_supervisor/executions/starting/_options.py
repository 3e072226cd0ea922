"""What a subprocess execution is told as it is made: its options, checked once.

An :class:`Options` is frozen, and checked as it is made, so an execution never holds
options it cannot run with: each error names the option at fault, and where two
options contradict each other, both and what to do. What follows from the options
alone (the children's base environment, the named commands' executables) is worked
out here too, so the execution's start-up (``_bringup``) and its spawns ask one place.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs

from ..limits._cgroups import ROOT as CGROUP_ROOT
from ..limits._isolation import (
    DEFAULT_CHILD_USERS,
    ISOLATIONS,
    NETWORKS,
    UID_MAX,
    Isolation,
    Network,
)
from ..trees._containment import CONTAINMENTS, Containment
from ._forkserver import check_preload

__all__ = ["ALLOWED_ENVIRONMENT", "Options"]

# What a child gets of the runner's own environment (the rest is the owner's).
ALLOWED_ENVIRONMENT = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")


def _absolute(path: str | os.PathLike[str]) -> Path:
    # Absolute: children run with the state directory as their working directory.
    return Path(path).absolute()


def _resolved(paths: Sequence[str | os.PathLike[str]]) -> tuple[str, ...]:
    return tuple(str(Path(path).resolve()) for path in paths)


def _commands(commands: Mapping[str, Sequence[str]] | None) -> dict[str, tuple[str, ...]]:
    """The named commands as ``name -> argv``, or ValueError/TypeError naming the bad one."""
    checked: dict[str, tuple[str, ...]] = {}
    for name, argv in (commands or {}).items():
        if not isinstance(name, str) or not name or not argv or isinstance(argv, str):
            raise ValueError(
                f"a named command needs a name and a non-empty argv list, got {name!r}: {argv!r}"
            )
        if not all(isinstance(part, str) for part in argv):
            raise TypeError(f"the argv of the command {name!r} must be strings")
        checked[name] = tuple(argv)
    return checked


def _environment(environment: Mapping[str, str] | None) -> dict[str, str]:
    return dict(environment or {})


def _optional_path(path: str | os.PathLike[str] | None) -> Path | None:
    return None if path is None else Path(path)


def _one_of(allowed: tuple[str, ...]) -> Callable[[Options, attrs.Attribute[str], str], None]:
    def check(options: Options, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in allowed:
            raise ValueError(f"{attribute.name} must be one of {allowed}, got {value!r}")

    return check


def _users(options: Options, attribute: attrs.Attribute[range], users: object) -> None:
    """``users`` must be a range of uids a child may get: ValueError naming the problem."""
    if not isinstance(users, range) or users.step != 1:
        raise ValueError(f"isolation_users must be a range of uids with step 1, got {users!r}")
    if len(users) == 0:
        raise ValueError(f"isolation_users is empty: {users!r}")
    if users.start < 1 or users.stop - 1 > UID_MAX:
        raise ValueError(
            f"isolation_users must lie within 1-{UID_MAX} (0 is root), got "
            f"{users.start}-{users.stop - 1}"
        )


@attrs.frozen(kw_only=True)
class Options:
    """A subprocess execution's options, as ``SubprocessExecution`` documents them, each
    converted to what the execution uses (absolute paths, tuples) and checked.

    Raises:
        ValueError: An option is none of its values, a ``preload`` entry is not a
            module name, a named command has no name or argv, ``fork_server`` or
            ``containment="namespace"`` is asked for without ``subreaper``,
            ``isolation_users`` is not a range of uids, or ``network="none"`` is asked
            for without isolation.
        TypeError: ``preload`` is one string, or a named command's argv holds other
            than strings.
    """

    state_directory: Path = attrs.field(converter=_absolute)
    entry_paths: tuple[str, ...] = attrs.field(default=(), converter=_resolved)
    commands: dict[str, tuple[str, ...]] = attrs.field(default=None, converter=_commands)
    environment: dict[str, str] = attrs.field(default=None, converter=_environment)
    python: str = sys.executable
    subreaper: bool = True
    standby: bool = False
    containment: Containment = attrs.field(default="auto", validator=_one_of(CONTAINMENTS))
    fork_server: bool = attrs.field(default=False)
    preload: tuple[str, ...] = attrs.field(default=(), converter=check_preload)
    cgroup_root: Path | None = attrs.field(default=CGROUP_ROOT, converter=_optional_path)
    isolation: Isolation = attrs.field(default="auto", validator=_one_of(ISOLATIONS))
    isolation_users: range = attrs.field(default=DEFAULT_CHILD_USERS, validator=_users)
    network: Network = attrs.field(default="host", validator=_one_of(NETWORKS))

    @containment.validator
    def _namespace_needs_a_subreaper(
        self, attribute: attrs.Attribute[Containment], containment: Containment
    ) -> None:
        if containment == "namespace" and not self.subreaper:
            raise ValueError(
                "containment='namespace' needs subreaper=True: each child's tracked "
                "process is the PID 1 of its namespace, re-parented to this process, "
                "which can wait for it only as a child subreaper"
            )

    @fork_server.validator
    def _fork_server_needs_a_subreaper(self, attribute: attrs.Attribute[bool], on: bool) -> None:
        if on and not self.subreaper:
            raise ValueError(
                "fork_server=True needs subreaper=True: a forked child is re-parented to "
                "this process, which can wait for it only as a child subreaper"
            )

    @network.validator
    def _no_network_needs_isolation(
        self, attribute: attrs.Attribute[Network], network: Network
    ) -> None:
        if network == "none" and self.isolation == "none":
            raise ValueError("network='none' needs isolation: the child would undo it as root")

    def base_environment(self) -> dict[str, str]:
        """Every child's environment but its session's variables: the allowlisted part
        of the runner's, then ``environment``, with unbuffered output."""
        environment = {name: os.environ[name] for name in ALLOWED_ENVIRONMENT if name in os.environ}
        environment.update(self.environment)
        environment["PYTHONUNBUFFERED"] = "1"
        return environment

    def executables(self) -> list[str]:
        """The named commands' executables, as a child finds them (for the view)."""
        path = self.base_environment().get("PATH", os.defpath)
        found = (shutil.which(argv[0], path=path) for argv in self.commands.values())
        return [os.path.realpath(executable) for executable in found if executable]
