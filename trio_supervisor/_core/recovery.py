"""Recovery: what a supervisor does on entry with what an earlier run left (V1-V5).

Theory of operation
-------------------
A run that crashed leaves records that are not Stopped, and perhaps their children.
Before the new supervisor is usable:

1. every stored record and high-water mark is read (V1, V5): the index takes in the
   marks and the Stopped records;
2. each record that is not Stopped is settled: with a child identity, the execution's
   ``recover`` makes sure that child is gone (killing it if it still runs, never
   touching anything else) within ``confirmation_timeout``; without one, there is
   nothing to end (V2). Orphans are confirmed concurrently, a bounded number at once;
3. every settled record is written back as Stopped with reason Recovery, ``previous``
   its active snapshot (V3), in one batch where the store can, and the index takes it
   in once the store acknowledged it.

An orphan that cannot be confirmed gone stops the start-up with
``TerminationUnconfirmedError``: a supervisor that started anyway could open its key
again while the old child still ran. Its record stays as it was, so the next start
tries again. Old leases are never resumed (V4): a recovered session is Stopped.
"""

from __future__ import annotations

import logging

import trio

from ..abc import Execution
from ..errors import ExecutionError, TerminationUnconfirmedError
from ..model import (
    ChildIdentity,
    LoadedRecord,
    LoadingRecord,
    SessionRecord,
    StoppedRecord,
    StoppingRecord,
    Termination,
    log_fields,
    recovered,
)
from ..realtime import bounded
from .records import Records
from .termination import NO_CHILD

__all__ = ["recover"]

# The public name, not the private module's.
logger = logging.getLogger("trio_supervisor.recovery")

# How many orphans recovery confirms at once.
CONCURRENCY = 64


async def recover(records: Records, execution: Execution, *, confirmation: float) -> None:
    """Read every record and stop what an earlier run left behind (V1-V5).

    Raises:
        StateStorageError: The store could not be read or written.
        TerminationUnconfirmedError: An orphan could not be confirmed gone.
    """
    pending = await records.read()
    # By position in pending; None while (or if) an orphan is not confirmed gone.
    terminations: list[Termination | None] = []
    failures: list[Exception] = []
    limiter = trio.CapacityLimiter(CONCURRENCY)

    async def confirm(position: int, record: SessionRecord, child: ChildIdentity) -> None:
        async with limiter:
            with bounded(confirmation) as scope:
                try:
                    termination = await execution.recover(child)
                    if not isinstance(termination, Termination):
                        raise ExecutionError(f"recover returned {termination!r}, not a Termination")
                except Exception as error:
                    failures.append(error)
                else:
                    terminations[position] = termination
                    if termination.kind == "killed":
                        key = record.handle.key
                        logger.warning(
                            "killed the orphan of %s/%s generation %d (pid %s) left by an "
                            "earlier run",
                            key.identity,
                            key.instance,
                            record.handle.generation,
                            child.pid,
                            extra=log_fields(key, record.handle.generation),
                        )
            if scope.cancelled_caught:
                failures.append(
                    ExecutionError(f"recovering {child} took longer than the confirmation timeout")
                )

    async with trio.open_nursery() as nursery:
        for position, record in enumerate(pending):
            child = _child_of(record)
            if child is None:
                terminations.append(NO_CHILD)
            else:
                terminations.append(None)
                nursery.start_soon(confirm, position, record, child)

    stopped = [
        recovered(record, termination)
        for record, termination in zip(pending, terminations, strict=True)
        if termination is not None
    ]
    if stopped:
        await records.save_all(stopped)
        logger.info("recovered %d sessions left over from an earlier run", len(stopped))
    if failures:
        raise TerminationUnconfirmedError(
            f"{len(failures)} orphaned children could not be confirmed gone; "
            "the supervisor does not start",
            causes=tuple(failures),
        ) from failures[0]


def _child_of(record: SessionRecord) -> ChildIdentity | None:
    active = record.previous if isinstance(record, StoppingRecord | StoppedRecord) else record
    if isinstance(active, LoadingRecord | LoadedRecord):
        return active.child
    return None
