"""Bring-up: the host made ready for a subprocess execution's children, once, as it starts.

Theory of operation: before the first load, the runner finds out what this machine
lets its children have, and prepares it, in a fixed order, each step on what the one
before found:

1. The runner becomes a child subreaper (if asked), and compiles the bootstrap into
   the state directory (for its own interpreter).
2. The cgroup hierarchies it may write (``_cgroups.detect``), its parent in each
   claimed machine-wide (``_claims``); the empty cgroups a run on the same state
   directory left are removed, and what runners that are gone left is reclaimed.
3. The children's isolation (``_isolation.prepare``): their uids, view and private
   directories, or their namespaces.
4. The containment (``_containment.choose``): a PID namespace per child, or the sweep;
   what it allows decides whether an isolated child has a ``/proc`` of its own.
5. The fork server (if asked), started once the containment is known, with the view.

What it made is undone by the execution's exit stack, latest first; what it holds until
the children it served are gone (the cgroups' parents, the uids' claims) it lets go of
at :meth:`Host.let_go`, after the execution's last child. A step that fails leaves what
the steps before it made in the :class:`Host`, so the exit undoes just that.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import attrs
import trio

from ...errors import ExecutionError
from ..limits._cgroups import Hierarchies, detect
from ..limits._claims import CGROUPS, Claims, claims_root
from ..limits._isolation import Isolated, NoIsolation
from ..limits._view import prepare
from ..trees._containment import Mechanism, choose
from ..trees._groups import become_subreaper
from ._forkserver import ForkServer
from ._options import Options
from ._standby import BOOTSTRAP, compile_bootstrap

__all__ = ["Host"]

logger = logging.getLogger(__name__)


@attrs.define(kw_only=True)
class Host:
    """What the children of one execution find on this host: until :meth:`bring_up`,
    nothing (no cgroups, no isolation, the sweep, which every kernel allows).

    Attributes:
        bootstrap: The bootstrap children run: compiled into the state directory for
            the runner's own interpreter, else the source.
        cgroups: The cgroup hierarchies that hold children's trees.
        isolated: How children are kept from the runner and each other.
        mechanism: How a child's whole tree is held.
        server: The fork server, if the execution has one.
    """

    bootstrap: Path = BOOTSTRAP
    cgroups: Hierarchies = attrs.field(
        factory=lambda: Hierarchies(parent="", reason="not entered yet")
    )
    isolated: Isolated = attrs.field(factory=lambda: NoIsolation(reason="not entered yet"))
    mechanism: Mechanism = attrs.field(
        factory=lambda: Mechanism(kind="sweep", unshare=None, required=False, reason="")
    )
    server: ForkServer | None = None

    @property
    def keep(self) -> tuple[int, ...]:
        """Descriptors every bootstrap inherits: the children's view, if there is one."""
        return (self.isolated.view,) if self.isolated.view >= 0 else ()

    async def bring_up(self, options: Options, stack: contextlib.AsyncExitStack) -> None:
        """Make the host ready, in the order of the module's steps; what each made goes
        on ``stack`` to be undone.

        Raises:
            ExecutionError: Children cannot be isolated or contained as asked, or the
                fork server could not start.
        """
        if options.subreaper:
            become_subreaper()
        own = options.python == sys.executable
        if own:
            self.bootstrap = await trio.to_thread.run_sync(
                compile_bootstrap, options.state_directory
            )
        claims = await trio.to_thread.run_sync(claims_root)
        self.cgroups = await trio.to_thread.run_sync(_hierarchies, options, claims)
        stack.callback(self.cgroups.close)
        # First, as it ends: what children ended by their dead-man switch left.
        stack.callback(self.cgroups.remove_empty_leftovers)
        # Populated ones are left to recovery, which finds them by their records; and
        # what runners that are gone left on other state directories goes too.
        await trio.to_thread.run_sync(self.cgroups.remove_empty_leftovers)
        await trio.to_thread.run_sync(self.cgroups.reclaim)
        self.isolated = await prepare(
            options.isolation,
            options.isolation_users,
            options.network,
            state=options.state_directory,
            python=options.python,
            # The runner's own interpreter makes the view: compiled for it, or not.
            bootstrap=self.bootstrap if own else BOOTSTRAP,
            entry_paths=options.entry_paths,
            executables=options.executables(),
            claims=claims,
        )
        stack.callback(self.isolated.close)
        if options.subreaper:
            self.mechanism = await choose(options.containment, options.python, self.bootstrap)
        else:
            self.mechanism = Mechanism(
                kind="sweep",
                unshare=None,
                required=options.containment == "sweep",
                reason="subreaper=False, and a namespace's PID 1 is re-parented to us",
            )
        self.isolated.proc_refused = self.mechanism.proc_refused
        if options.fork_server:
            self.server = ForkServer(
                options.python,
                self.bootstrap,
                directory=options.state_directory,
                environment=options.base_environment(),
                preload=options.preload,
                containment=self.mechanism.spec,
                strict=self.mechanism.required,
                keep=self.keep,
            )
            stack.push_async_callback(self.server.aclose)
            await self.server.start()

    def let_go(self) -> None:
        """The execution's last child is gone: remove the cgroups' parents, and let go
        of what is claimed in the runner's name."""
        self.cgroups.close()
        self.cgroups.let_go()
        self.isolated.let_go()


def _hierarchies(options: Options, claims: Path) -> Hierarchies:
    """The cgroups children may get, this execution's parent claimed in ``claims``
    (the machine's claims; none claimed where the runner is not root, as only root
    may write them). Blocking."""
    owned = None
    if options.cgroup_root is not None and os.geteuid() == 0:
        try:
            owned = Claims.of(CGROUPS, claims)
        except (OSError, ExecutionError) as error:
            logger.warning("this execution's cgroups cannot be claimed: %s", error)
    return detect(options.cgroup_root, options.state_directory, owned)
