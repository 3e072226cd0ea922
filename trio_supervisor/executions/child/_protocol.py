"""The messages between the runner and a child's bootstrap, typed once for both sides.

The bootstrap (``_bootstrap.py``) runs in the child, standard library only: it imports
this module under ``if TYPE_CHECKING:`` alone, so the types cost it nothing at run
time, and mypy checks what the runner builds (``subprocess``, ``_isolation``,
``_standby``, ``_unit``, ``_forkserver``) and what the bootstrap reads against the one
definition here. On the wire each is a ``marshal``'d dict (see ``_bootstrap.py`` for
the order they come in, and for the framing).

* Control socket, runner to child: :class:`JoinCommand` and :class:`IsolateCommand` (to
  a standby, while it waits), :class:`SpawnCommand` (once), :class:`RenewCommand` (any
  number of times), :class:`StartCommand` (once).
* Control socket, child to runner: :class:`TrackedEvent` (first), then
  :class:`ResolvedEvent` or :class:`FailedEvent`, then :class:`StartedEvent` or
  :class:`FailedEvent`, and :class:`ExitedEvent` as T ends.
* Fork server socket: :class:`ForkRequest` to the server; :class:`ServerReply` back.
* The view's maker reads :class:`ViewSpec` on its stdin.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict, final

__all__ = [
    "Code",
    "Command",
    "EntryContext",
    "EofReply",
    "Event",
    "ExitedEvent",
    "FailedEvent",
    "ForkRequest",
    "IsolateCommand",
    "IsolationSpec",
    "JoinCommand",
    "NamespaceIsolationSpec",
    "OwnMounts",
    "RLimits",
    "RenewCommand",
    "Reply",
    "ResolvedEvent",
    "ServerReply",
    "SpawnCommand",
    "StartCommand",
    "StartedEvent",
    "TrackedEvent",
    "UserIsolationSpec",
    "ViewSpec",
]

# -- runner to child ------------------------------------------------------------------


class JoinCommand(TypedDict):
    """To a standby, while it waits: make its cgroup and join it."""

    command: Literal["join"]
    make: list[str]  # the cgroup's directory in each hierarchy
    cgroups: list[str]  # the cgroup.procs files T joins


class RLimits(TypedDict):
    """The rlimits T applies before it forks the plugin (None: not limited)."""

    memory_bytes: int | None
    cpu_seconds: int | None
    open_files: int | None
    file_size_bytes: int | None


class EntryContext(TypedDict):
    """What an entry point is told (``_bootstrap.Context``)."""

    identity: str
    instance: str
    generation: int
    config: Any


class OwnMounts(TypedDict):
    """What an isolated child mounts in a mount namespace of its own
    (``_bootstrap.own_mounts``)."""

    private: list[str]  # a fresh tmpfs over each
    keep: list[tuple[str, bool]]  # mounted back below one: (real path, writable)
    proc: bool  # a /proc of its PID namespace's own


@final  # so that ``"hide" in spec`` tells the two apart
class UserIsolationSpec(OwnMounts):
    """A child as a uid of its own, in the children's view (``_bootstrap.isolate``)."""

    uid: int
    home: str
    tmp: str
    network: Literal["host", "none"]
    view: int  # the view's descriptor, inherited


@final
class NamespaceIsolationSpec(OwnMounts):
    """A child with the runner's uid, in namespaces of its own that hide the state
    directory but for its private directory (``_bootstrap.hide_state``)."""

    hide: str  # the state directory
    cover: bool  # cover it with an empty tmpfs (else it lies below a fresh one)
    home: str
    tmp: str
    network: Literal["host", "none"]


IsolationSpec = UserIsolationSpec | NamespaceIsolationSpec


class IsolateCommand(TypedDict):
    """To a standby, while it waits: fork its plugin ahead, in namespaces of its own
    (``_bootstrap.Ahead``), for the child its spawn message will name with the same
    ``isolation``."""

    command: Literal["isolate"]
    isolation: IsolationSpec


class SpawnCommand(TypedDict):
    """What to run, under which limits, with which context (once, before "start")."""

    command: Literal["spawn"]
    # A named command's argv, or an entry point to find on the entry paths.
    kind: Literal["command", "python"]
    argv: NotRequired[list[str]]  # "command"
    paths: NotRequired[list[str]]  # "python"
    specifier: str
    limits: RLimits
    context: EntryContext
    # To a standby started ahead: its session's log and environment.
    log: NotRequired[str]
    environment: NotRequired[dict[str, str]]
    # With a cgroup: the cgroup.procs files T joins, or those of the one it was born in.
    cgroups: NotRequired[list[str]]
    joined: NotRequired[list[str]]
    isolation: NotRequired[IsolationSpec]
    # Never sent: the executable T resolved, for the plugin to exec.
    executable: NotRequired[str]


class RenewCommand(TypedDict):
    command: Literal["renew"]
    lease: float


class StartCommand(TypedDict):
    command: Literal["start"]


Command = JoinCommand | IsolateCommand | SpawnCommand | RenewCommand | StartCommand

# -- child to runner ------------------------------------------------------------------


class TrackedEvent(TypedDict):
    """Which process is T (first, before the spawn message)."""

    event: Literal["tracked"]
    pid: int


class Code(TypedDict):
    """The code T resolved: its file or executable, digest and distribution version."""

    origin: str
    digest: str
    version: str | None


class ResolvedEvent(TypedDict):
    """The code T found; sent with the writing end of P's "go" pipe (SCM_RIGHTS)."""

    event: Literal["resolved"]
    code: Code
    containment: Literal["namespace", "sweep"]  # what this child really uses


class FailedEvent(TypedDict):
    """The child cannot run: the request's fault (PackageError) or the host's."""

    event: Literal["failed"]
    kind: Literal["PackageError", "ExecutionError"]
    message: str


class StartedEvent(TypedDict):
    event: Literal["started"]


class ExitedEvent(TypedDict):
    """As T ends: how the plugin ended (a wait status), and how many processes it left
    that had to be killed."""

    event: Literal["exited"]
    status: int
    killed: int


Event = TrackedEvent | ResolvedEvent | FailedEvent | StartedEvent | ExitedEvent


class EofReply(TypedDict):
    """Never sent: what the runner reads where the child is gone before it answered."""

    event: Literal["eof"]


Reply = Event | EofReply

# -- the fork server, and the view's maker ----------------------------------------------


class ForkRequest(TypedDict):
    """A fresh T, please (its control socket, marker pipe and output go as SCM_RIGHTS)."""

    environment: dict[str, str]


class ServerReady(TypedDict):
    event: Literal["ready"]


class ServerFailed(TypedDict):
    event: Literal["failed"]
    message: str


class Forked(TypedDict):
    pid: int  # T, re-parented to the runner


ServerReply = ServerReady | ServerFailed | Forked


class ViewSpec(TypedDict):
    """What the children's view covers, what it mounts back, and where the private
    directories' tmpfs goes (``_bootstrap.make_view``)."""

    covers: list[str]
    binds: list[str]
    homes: str
