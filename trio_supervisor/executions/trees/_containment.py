"""How a child's whole process tree is held: a PID namespace, or the subreaper sweep.

Theory of operation: nothing a plugin starts may outlive its session, and a process
group cannot promise that (``setsid`` leaves it). Two mechanisms can, and the runner
picks one at start-up (see ``_bootstrap.py`` for how each works in the child):

* **namespace**: a PID namespace per child. Whatever the plugin starts is in it, and
  the kernel kills all of it when the namespace's PID 1, the child's tracked process,
  exits. Made with ``unshare(CLONE_NEWPID)`` where the bootstrap is privileged
  (``"pid"``), else in a user namespace of its own (``"user"``), where the kernel lets
  an unprivileged process; the process that makes it forks the tracked process into it
  and exits, so the runner must be a child subreaper to get it.
* **sweep**: the child's tracked process is a child subreaper, so every orphan of the
  plugin's comes to it; it freezes and kills its tree on every way out, and the
  runner does the same from outside when it kills a child.

Which one the kernel allows is probed once per interpreter and runner process (a
bootstrap run as ``_bootstrap.py probe``, which tries both and forks into the
namespace it made), so a container whose seccomp profile or sysctl forbids namespaces
gets the sweep. Each child still says which one it really uses, and a child whose
namespace fails is swept instead (unless the namespace was required; an isolated child
promised a ``/proc`` of its own fails its load instead, see below).

The process the probe forks into the namespace also mounts the namespace's own
``/proc``, as an isolated plugin does (``_bootstrap.own_mounts``): where the kernel
refuses that (a container's ``/proc`` with paths masked, to a runner that is not root),
isolated children keep the host's ``/proc``, and the log's isolation line says why.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Literal

import attrs
import trio

from ...errors import ExecutionError
from ...realtime import bounded, outside_the_run

__all__ = ["CONTAINMENTS", "Containment", "Mechanism", "choose"]

Containment = Literal["auto", "namespace", "sweep"]
CONTAINMENTS: tuple[Containment, ...] = ("auto", "namespace", "sweep")
# How long the probe may take; one that does not answer counts as "not allowed".
PROBE_TIMEOUT = 10.0

# Probed once per interpreter and bootstrap (its compiled copies, one per state
# directory, are named after its digest): whether it worked, and what it printed.
_PROBED: dict[tuple[str, str], tuple[bool, str]] = {}


@attrs.frozen(kw_only=True)
class Mechanism:
    """The containment a runner gives its children.

    Attributes:
        kind: "namespace" or "sweep".
        unshare: For a namespace, how the child makes it: "pid" (privileged) or "user"
            (in a user namespace of its own); None for the sweep.
        required: The caller asked for this one: a child that cannot have it fails.
        reason: Why this one, for the log.
        proc: For a namespace, why a plugin there may not mount its ``/proc`` ("" when
            it may).
    """

    kind: Literal["namespace", "sweep"]
    unshare: Literal["pid", "user"] | None
    required: bool
    reason: str
    proc: str = ""

    @property
    def proc_refused(self) -> str:
        """Why an isolated child cannot have a ``/proc`` of its own ("" when it can)."""
        if self.kind == "sweep":
            return f"no PID namespace: {self.reason}"
        return self.proc

    @property
    def spec(self) -> str:
        """What the spawn message asks of the bootstrap ("pid", "user" or "sweep")."""
        return self.unshare or "sweep"

    def describe(self) -> str:
        """One line for the log."""
        if self.unshare == "pid":
            return "a PID namespace per child (privileged unshare)"
        if self.unshare == "user":
            return "a PID namespace per child, in an unprivileged user namespace"
        return f"the subreaper sweep ({self.reason})"


async def _probe(python: str, bootstrap: Path) -> tuple[bool, str]:
    key = (python, bootstrap.name)
    if key not in _PROBED:
        try:
            done = None
            with bounded(PROBE_TIMEOUT), outside_the_run():
                done = await trio.run_process(
                    [python, "-I", str(bootstrap), "probe"],
                    stdin=subprocess.DEVNULL,
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
            if done is None:
                return False, f"the probe did not answer within {PROBE_TIMEOUT:g} s"
            said = (done.stdout or done.stderr).decode(errors="replace").strip()
            _PROBED[key] = (done.returncode == 0, said or f"probe exited {done.returncode}")
        except OSError as error:
            return False, f"the probe failed: {error!r}"
    return _PROBED[key]


async def choose(requested: Containment, python: str, bootstrap: Path) -> Mechanism:
    """The mechanism for ``requested``, given what this kernel allows.

    Raises:
        ExecutionError: A namespace was required, and the kernel allows none.
    """
    if requested == "sweep":
        await trio.lowlevel.checkpoint()
        return Mechanism(kind="sweep", unshare=None, required=True, reason="asked for")
    allowed, said = await _probe(python, bootstrap)
    how, _, proc = said.partition("\n")
    if allowed and how in ("pid", "user"):
        return Mechanism(
            kind="namespace",
            unshare="pid" if how == "pid" else "user",
            required=requested == "namespace",
            reason="the kernel allows it",
            proc=proc.removeprefix("no /proc: "),
        )
    if requested == "namespace":
        raise ExecutionError(f"PID namespaces are required, but not allowed here: {said}")
    return Mechanism(
        kind="sweep",
        unshare=None,
        required=False,
        reason=f"PID namespaces are not allowed here: {said}",
    )
