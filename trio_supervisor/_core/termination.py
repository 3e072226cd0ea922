"""Terminating a session's child (P3) and releasing its unit (P4).

A signal is a request; only an observed exit confirms that a child stopped. Every wait
here is bounded: ``grace`` for a cooperative exit after the interrupt, then
``confirmation`` for the exit after the kill. The caller runs this shielded, so these
bounds are what keeps a shutdown finite.
"""

from __future__ import annotations

import trio

from ..abc import Unit
from ..errors import ExecutionError, TerminationUnconfirmedError
from ..model import ExitStatus, Fault, Termination
from ..realtime import bounded

__all__ = ["NO_CHILD", "faults", "release", "terminate"]

# The end of a session whose code never ran: it had no load, or its load failed before
# the code started (P3, V2). Immutable, so one serves all.
NO_CHILD = Termination(kind="none", exit=ExitStatus())


def faults(problems: list[Exception]) -> tuple[Fault, ...]:
    """Problems as they are persisted in a termination's cause."""
    return tuple(Fault.of(problem) for problem in problems)


async def terminate(
    unit: Unit | None,
    exit: ExitStatus | None,
    *,
    grace: float,
    confirmation: float,
    problems: list[Exception],
    graces: set[trio.CancelScope] | None = None,
) -> Termination:
    """Stop ``unit`` and return how it ended.

    Args:
        unit: The registered child, or None when the session never had one.
        exit: The child's exit status when it already exited by itself.
        grace: How long to wait for an exit after interrupting.
        confirmation: How long to wait for an exit after killing.
        problems: Where the exceptions met on the way are appended.
        graces: Where the grace's scope is kept while it runs, so that it can be cut
            short (an operator's second signal: see ``Supervisor.skip_grace``).

    Returns:
        ``exited`` with code 0 when there is no child; ``exited`` with the child's status
        when it exited by itself or on interrupt; ``killed`` when it had to be killed.

    Raises:
        TerminationUnconfirmedError: Even the kill was not followed by an observed exit.
    """
    # No schedule point when there is nothing to signal: the caller's store writes are.
    if exit is not None:
        return Termination(kind="exited", exit=exit)
    if unit is None:
        return NO_CHILD
    with bounded(grace) as grace_scope:
        if graces is not None:
            graces.add(grace_scope)
        try:
            await unit.interrupt()
            status = await unit.wait()
        except Exception as error:
            problems.append(error)
        else:
            return Termination(kind="exited", exit=status, cause=faults(problems))
        finally:
            if graces is not None:
                graces.discard(grace_scope)
    with bounded(confirmation):
        try:
            await unit.kill()
        except Exception as error:
            problems.append(error)
        try:
            status = await unit.wait()
        except Exception as error:
            problems.append(error)
        else:
            return Termination(kind="killed", exit=status, cause=faults(problems))
    raise TerminationUnconfirmedError(
        "the child was interrupted and killed, and its exit was still not observed",
        causes=tuple(problems),
    )


async def release(unit: Unit | None, *, confirmation: float, problems: list[Exception]) -> None:
    """Release a unit's resources once (P4); problems are appended to ``problems``."""
    if unit is None:
        return
    with bounded(confirmation) as scope:
        try:
            await unit.aclose()
        except Exception as error:
            problems.append(error)
    if scope.cancelled_caught:
        problems.append(
            ExecutionError("releasing the unit took longer than the confirmation timeout")
        )
