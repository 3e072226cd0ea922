"""A runner's capacity and the ceilings every child gets out of the box (docs/service.md D).

The runner (``runner.py``) finds its capacity (:func:`capacity_of`) before anything
starts, then asks :func:`runner_admission` for its admission. The allocatable memory is
the machine's (or the runner's own cgroup's limit, where lower) less the reserve; every
child gets a memory and a process ceiling unless the owner's ``[limits]`` say otherwise,
field by field; what was found is logged, including what is weaker where the execution
can make no cgroup.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import attrs

from .. import _defaults as defaults
from ..errors import PackageError
from ..executions.subprocess import SubprocessExecution
from ..model import Limits
from .admission import Admission, Capacity
from .served import ServedSupervisor
from .tenants import Ceilings

__all__ = [
    "Found",
    "capacity_of",
    "machine_memory",
    "out_of_the_box",
    "runner_admission",
]

logger = logging.getLogger(__name__)


def machine_memory() -> tuple[int, str]:
    """The bytes of memory this runner's children may share, and where that was read:
    the machine's physical memory, or the runner's own cgroup's limit where lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    found = (total, "the machine's memory")
    for limit_file in _own_memory_limits():
        with contextlib.suppress(OSError, ValueError):
            text = limit_file.read_text().strip()
            if text != "max" and 0 < int(text) < found[0]:
                found = (int(text), f"the runner's cgroup limit ({limit_file})")
    return found


def _own_memory_limits() -> list[Path]:
    """The memory limit files of this process's cgroups (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), where they can be found."""
    files = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            relative = path.lstrip("/")
            if controllers == "":
                files.append(Path("/sys/fs/cgroup", relative, "memory.max"))
            elif "memory" in controllers.split(","):
                files.append(Path("/sys/fs/cgroup/memory", relative, "memory.limit_in_bytes"))
    return files


def out_of_the_box(allocatable: int) -> Ceilings:
    """The ceilings every child of ``serve`` gets when nobody set others (docs/service.md
    D): a memory ceiling of 1 GiB by default and the allocatable memory at most, and
    4096 processes."""
    return Ceilings(
        default=Limits(
            memory_bytes=min(defaults.CHILD_MEMORY, allocatable),
            processes=defaults.CHILD_PROCESSES,
        ),
        max=Limits(memory_bytes=allocatable, processes=defaults.CHILD_PROCESSES),
    )


@attrs.frozen
class Found:
    """The runner's capacity, and where its memory was read."""

    capacity: Capacity
    memory: int  # the machine's (or the runner's cgroup's), before the reserve
    source: str
    reserve: int


def capacity_of(max_children: int | None, reserve_memory: int) -> Found:
    """The runner's capacity: ``max_children`` (None: ``_defaults.CHILDREN_PER_CORE``
    per core), and the memory :func:`machine_memory` finds less ``reserve_memory``.

    Raises:
        ValueError: The reserve leaves the children no memory.
    """
    memory, source = machine_memory()
    allocatable = memory - reserve_memory
    if allocatable <= 0:
        raise ValueError(
            f"--reserve-memory {reserve_memory:,} leaves the children no memory: "
            f"{source} is {memory:,} bytes"
        )
    most = max_children or defaults.CHILDREN_PER_CORE * (os.cpu_count() or 1)
    return Found(
        Capacity(max_children=most, allocatable=allocatable), memory, source, reserve_memory
    )


def runner_admission(
    supervisor: ServedSupervisor,
    execution: SubprocessExecution,
    found: Found,
    limits: Ceilings | None,
) -> Admission:
    """The runner's admission, with its ceilings and capacity, logged: what every child
    gets, and how many children with how much memory the runner takes.

    Args:
        supervisor: The runner's supervisor.
        execution: Its execution: which cgroups it may make says which ceilings hold.
        found: Its capacity (:func:`capacity_of`).
        limits: The owner's ceilings (``[limits]``), over :func:`out_of_the_box`'s.
    """
    capacity = found.capacity
    allocatable = capacity.allocatable
    ceilings = out_of_the_box(allocatable)
    try:
        execution.cgroups.refuse(ceilings.max)
    except PackageError as error:
        # Every load would be refused for a ceiling nobody asked for: leave it out.
        logger.warning("no process ceiling out of the box: %s", error.detail)
        ceilings = Ceilings(
            default=attrs.evolve(ceilings.default, processes=None),
            max=attrs.evolve(ceilings.max, processes=None),
        )
    if limits is not None:
        ceilings = limits.over(ceilings)
    logger.info(
        "every child gets ceilings: %s; capacity %d children and %s bytes of memory "
        "ceilings (%s, %s bytes, less --reserve-memory %s)",
        ceilings.described(),
        capacity.max_children,
        f"{allocatable:,}",
        found.source,
        f"{found.memory:,}",
        f"{found.reserve:,}",
    )
    if not execution.cgroups.used:
        logger.warning(
            "no cgroup can be made here (%s): a child's memory ceiling holds per process "
            "(RLIMIT_AS) only, so a child's tree of processes may take more than its "
            "ceiling, and the runner's capacity is not a guarantee",
            execution.cgroups.describe(),
        )
    return Admission(supervisor, ceilings=ceilings, capacity=capacity)
