"""The execution protocols (docs/design.md, "Adapters")."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..model import ChildIdentity, CodeIdentity, ExitStatus, Handle, Limits, Load, Termination

__all__ = ["Execution", "Unit"]


@runtime_checkable
class Unit(Protocol):
    """The child of one session: an OS process, a Trio task, ...

    A unit is spawned not yet running; the supervisor persists its identity, then calls
    :meth:`start`. :meth:`interrupt` and :meth:`kill` are requests that return at once;
    only :meth:`wait` confirms an exit. Errors are reported as ``ExecutionError`` (or
    ``PackageError`` when the code itself is at fault).
    """

    @property
    def identity(self) -> ChildIdentity:
        """What finds the child again after a crash of the supervisor."""
        ...

    @property
    def code(self) -> CodeIdentity:
        """What code the child runs."""
        ...

    async def start(self) -> None:
        """Start the code; return once it began."""
        ...

    async def renew(self, lease: float) -> None:
        """Tell the child its lease now ends ``lease`` seconds from now."""
        ...

    async def interrupt(self) -> None:
        """Ask the child to stop (SIGTERM, or a cancellation it may handle)."""
        ...

    async def kill(self) -> None:
        """Stop the child outright (SIGKILL, or an outright cancellation)."""
        ...

    async def wait(self) -> ExitStatus:
        """Wait for the child to exit and return how; any number of tasks may wait."""
        ...

    async def aclose(self) -> None:
        """Release the unit's resources; called once, when its session ends."""
        ...


@runtime_checkable
class Execution(Protocol):
    """The adapter that spawns units, and finds them again after a crash."""

    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> Unit:
        """Make the unit that will run ``load`` for the session ``handle``, not yet started.

        Raises:
            PackageError: The load's code cannot be resolved.
            ExecutionError: The unit could not be made.
        """
        ...

    async def recover(self, child: ChildIdentity) -> Termination:
        """Make sure a child left over from an earlier run is gone, and say how it ended.

        Never signals anything that is not the recorded child.

        Raises:
            ExecutionError: The child's end could not be confirmed.
        """
        ...
