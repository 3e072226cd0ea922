"""What the conformance machine needs to drive an execution adapter.

An adapter author wraps their execution in a :class:`Harness`: which specifiers load,
which one fails to resolve, how to make a child exit by itself, and what exit status its
children report for each way they end (the model predicts every termination whole, so it
must know that a process reports ``SIGTERM`` where a Trio task reports that it was
cancelled). Three harnesses ship here: for the fake execution (every behaviour
scriptable), the in-process one and the subprocess one.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, Self, runtime_checkable

import trio

from ..abc import Execution
from ..errors import ExecutionError, PackageError
from ..executions.inprocess import InProcessExecution, PluginContext
from ..executions.subprocess import SubprocessExecution
from ..executions.trees._groups import group_exists, read_stat
from ..model import ChildIdentity, ExitStatus, Handle
from .fakes import FakeExecution
from .reference import Ending

__all__ = ["FakeHarness", "Harness", "InProcessHarness", "SubprocessHarness"]


@runtime_checkable
class Harness(Protocol):
    """An execution adapter, as the conformance machine drives it.

    Attributes:
        execution: The adapter under test. One harness serves one example, across
            the machine's restarts: a child left by a crashed supervisor must still be
            found by ``execution.recover``.
        specifiers: Two specifiers whose children run until they are stopped.
        missing: A specifier whose spawn raises ``PackageError``.
        broken: A specifier whose start raises ``ExecutionError``, or None.
        scripted: Whether :meth:`ignore` works (children that ignore signals).
    """

    @property
    def execution(self) -> Execution:
        """The adapter under test, the same across the machine's restarts."""
        ...

    @property
    def specifiers(self) -> Sequence[str]:
        """Two specifiers whose children run until they are stopped."""
        ...

    @property
    def missing(self) -> str:
        """A specifier whose spawn raises ``PackageError``."""
        ...

    @property
    def broken(self) -> str | None:
        """A specifier whose start raises ``ExecutionError``, or None."""
        ...

    @property
    def scripted(self) -> bool:
        """Whether :meth:`ignore` works (children that ignore signals)."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc_info: object) -> bool | None: ...

    def exit(self, handle: Handle, child: ChildIdentity, code: int) -> None:
        """Make a running child exit by itself with ``code`` (X1).

        Args:
            handle: The child's session.
            child: The child's identity.
            code: The exit code it exits with.
        """
        ...

    def ignore(self, child: ChildIdentity, *, interrupt: bool, kill: bool) -> None:
        """Make a child ignore its interrupt, or its kill too (``scripted`` only; P3).

        Args:
            child: The child's identity.
            interrupt: Ignore the interrupt.
            kill: Ignore the kill too: its termination is then unconfirmed.

        Raises:
            NotImplementedError: The harness is not ``scripted``.
        """
        ...

    def heal(self, child: ChildIdentity) -> None:
        """Make a child heed its signals again, as an operator would end it.

        Args:
            child: The child's identity.

        Raises:
            NotImplementedError: The harness is not ``scripted``.
        """
        ...

    def alive(self, child: ChildIdentity) -> bool:
        """Whether the child still runs.

        Args:
            child: The child's identity.

        Returns:
            True while it runs.
        """
        ...

    def exit_status(self, ending: Ending, code: int = 0) -> ExitStatus:
        """The exit status the adapter reports for a child of ``specifiers`` ending so.

        Args:
            ending: ``"exit"``: ``unit.wait()`` of a child that exited by itself with
                ``code`` (see :meth:`exit`); ``"interrupt"``: of a child that ended on
                ``unit.interrupt()``; ``"kill"``: of one that ended on ``unit.kill()``;
                ``"recover"``: the status in the termination ``execution.recover``
                returns for a child it killed; ``"gone"``: the same for a child it
                found already gone.
            code: The child's own exit code, for ``"exit"``.

        Returns:
            The status, as the conformance machine expects to read it.
        """
        ...


class FakeHarness:
    """The scriptable fake: every behaviour of the machine is available."""

    specifiers = ("plugin:main", "plugin:other")
    missing = "missing:main"
    broken = "broken:main"
    scripted = True

    def __init__(self) -> None:
        self.fake = FakeExecution()
        self.fake.behave(self.missing, spawn_error=PackageError(f"no module for {self.missing!r}"))
        self.fake.behave(self.broken, start_error=ExecutionError("the child failed to start"))
        self.execution: Execution = self.fake

    async def __aenter__(self) -> Self:
        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await trio.lowlevel.checkpoint()

    def exit(self, handle: Handle, child: ChildIdentity, code: int) -> None:
        """Implements :meth:`trio_supervisor.testing.Harness.exit`."""
        self.fake.unit_by_ref(child.ref).exit(code=code)

    def ignore(self, child: ChildIdentity, *, interrupt: bool, kill: bool) -> None:
        """Implements :meth:`trio_supervisor.testing.Harness.ignore`."""
        behaviour = self.fake.unit_by_ref(child.ref).behaviour
        behaviour.ignore_interrupt = behaviour.ignore_interrupt or interrupt
        behaviour.ignore_kill = behaviour.ignore_kill or kill

    def heal(self, child: ChildIdentity) -> None:
        """Implements :meth:`trio_supervisor.testing.Harness.heal`."""
        behaviour = self.fake.unit_by_ref(child.ref).behaviour
        behaviour.ignore_interrupt = behaviour.ignore_kill = False

    def alive(self, child: ChildIdentity) -> bool:
        """Implements :meth:`trio_supervisor.testing.Harness.alive`."""
        return not self.fake.unit_by_ref(child.ref).exited

    def exit_status(self, ending: Ending, code: int = 0) -> ExitStatus:
        """The signals a process would report.

        Implements :meth:`trio_supervisor.testing.Harness.exit_status`.
        """
        # The fake reports the signals a process would; recovery kills a live unit.
        interrupted = self.fake.default.interrupt_code
        statuses = {
            "exit": ExitStatus(code=code),
            "interrupt": ExitStatus(signal=signal.SIGTERM)
            if interrupted is None
            else ExitStatus(code=interrupted),
            "kill": ExitStatus(signal=signal.SIGKILL),
            "recover": ExitStatus(signal=signal.SIGKILL),
            "gone": ExitStatus(),
        }
        return statuses[ending]


class InProcessHarness:
    """The in-process execution, with plugins that exit when told to.

    Trio cannot stop a task that shields itself, so children that ignore signals are
    not scripted here.
    """

    specifiers = ("wait:main", "wait:other")
    missing = "missing:main"
    broken = None
    scripted = False

    def __init__(self) -> None:
        self._exits: dict[tuple[object, int], tuple[trio.Event, list[int]]] = {}
        plugins = dict.fromkeys(self.specifiers, self._plugin)
        self.inprocess = InProcessExecution(plugins)
        self.execution: Execution = self.inprocess
        self._stack = contextlib.AsyncExitStack()

    def _control(self, key: object, generation: int) -> tuple[trio.Event, list[int]]:
        return self._exits.setdefault((key, generation), (trio.Event(), [0]))

    async def _plugin(self, context: PluginContext) -> int:
        event, code = self._control(context.key, context.generation)
        await event.wait()
        return code[0]

    async def __aenter__(self) -> Self:
        await self._stack.enter_async_context(self.inprocess)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._stack.__aexit__(*exc_info)

    def exit(self, handle: Handle, child: ChildIdentity, code: int) -> None:
        """Implements :meth:`trio_supervisor.testing.Harness.exit`."""
        event, slot = self._control(handle.key, handle.generation)
        slot[0] = code
        event.set()

    def ignore(self, child: ChildIdentity, *, interrupt: bool, kill: bool) -> None:
        """Not scripted here: raises ``NotImplementedError``.

        Implements :meth:`trio_supervisor.testing.Harness.ignore`.
        """
        raise NotImplementedError("in-process children cannot ignore their signals")

    def heal(self, child: ChildIdentity) -> None:
        """Not scripted here: raises ``NotImplementedError``.

        Implements :meth:`trio_supervisor.testing.Harness.heal`.
        """
        raise NotImplementedError("in-process children cannot ignore their signals")

    def alive(self, child: ChildIdentity) -> bool:
        """Implements :meth:`trio_supervisor.testing.Harness.alive`."""
        return self.inprocess.runs(child)

    def exit_status(self, ending: Ending, code: int = 0) -> ExitStatus:
        """A stopped task is ``cancelled``.

        Implements :meth:`trio_supervisor.testing.Harness.exit_status`.
        """
        # A task has no signals (deviation (j)): interrupt, kill and recovery cancel it.
        statuses = {
            "exit": ExitStatus(code=code),
            "interrupt": ExitStatus(cancelled=True),
            "kill": ExitStatus(cancelled=True),
            "recover": ExitStatus(cancelled=True),
            "gone": ExitStatus(),
        }
        return statuses[ending]


class SubprocessHarness:
    """The subprocess execution, with a plugin that exits when told to (through a file).

    Args:
        state_directory: Where the execution keeps its logs, and the plugin its mailbox.
        standby: Passed to ``SubprocessExecution``: loads run in interpreters started
            ahead of them.
    """

    specifiers = ("conformance_waiter:main", "conformance_waiter:asynchronous")
    missing = "conformance_missing:main"
    broken = None
    scripted = False

    def __init__(self, state_directory: str | os.PathLike[str], *, standby: bool = False) -> None:
        self.mailbox = Path(state_directory) / "mailbox"
        self.mailbox.mkdir(parents=True, exist_ok=True)
        self.subprocess = SubprocessExecution(
            state_directory,
            entry_paths=[Path(__file__).with_name("plugins")],
            environment={"WAITER_MAILBOX": str(self.mailbox)},
            standby=standby,
        )
        self.execution: Execution = self.subprocess

    async def __aenter__(self) -> Self:
        await self.subprocess.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self.subprocess.__aexit__(*exc_info)

    def exit(self, handle: Handle, child: ChildIdentity, code: int) -> None:
        """Writes the code into the plugin's mailbox.

        Implements :meth:`trio_supervisor.testing.Harness.exit`.
        """
        name = f"{handle.key.instance}-{handle.generation}"
        if child.uid is not None:  # isolated: it reads its own directory alone
            folder = self.subprocess.isolated.home_of(child.uid)
        else:
            folder = self.mailbox
        # Written aside, then renamed: the plugin polls for the name, and a file it
        # found before its code was written in would read as code 0.
        aside = folder / f".{name}.writing"
        aside.write_text(str(code))
        aside.rename(folder / name)

    def ignore(self, child: ChildIdentity, *, interrupt: bool, kill: bool) -> None:
        """Not scripted here: raises ``NotImplementedError``.

        Implements :meth:`trio_supervisor.testing.Harness.ignore`.
        """
        raise NotImplementedError("use the fake execution to script ignored signals")

    def heal(self, child: ChildIdentity) -> None:
        """Not scripted here: raises ``NotImplementedError``.

        Implements :meth:`trio_supervisor.testing.Harness.heal`.
        """
        raise NotImplementedError("use the fake execution to script ignored signals")

    def exit_status(self, ending: Ending, code: int = 0) -> ExitStatus:
        """``SIGTERM`` on interrupt, ``SIGKILL`` on kill.

        Implements :meth:`trio_supervisor.testing.Harness.exit_status`.
        """
        # The bootstrap dies by SIGTERM when interrupted, and every kill is SIGKILL to
        # the group; the waiter plugin leaves no descendants behind.
        statuses = {
            "exit": ExitStatus(code=code),
            "interrupt": ExitStatus(signal=signal.SIGTERM),
            "kill": ExitStatus(signal=signal.SIGKILL),
            "recover": ExitStatus(signal=signal.SIGKILL),
            "gone": ExitStatus(),
        }
        return statuses[ending]

    def alive(self, child: ChildIdentity) -> bool:
        """While its leader or its process group lives.

        Implements :meth:`trio_supervisor.testing.Harness.alive`.
        """
        assert child.pid is not None
        assert child.pgid is not None
        stat = read_stat(child.pid)
        if stat is not None and stat.running and stat.start_time == child.start_time:
            return True
        # The leader is gone; the child lives on while anything (a zombie too) holds
        # its process group.
        return group_exists(child.pgid)
