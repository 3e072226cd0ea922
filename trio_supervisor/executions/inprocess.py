"""Children as Trio tasks in this process: for trusted code, tests and embedding.

A plugin is an async callable taking a :class:`PluginContext`. It runs in the
execution's own nursery, inside two cancel scopes::

    kill scope       kill() cancels it: the task is cancelled outright
      interrupt scope  interrupt() cancels it: the plugin sees Cancelled, and may
                       handle it (clean up, return) within the supervisor's grace

Trio cannot stop a task that shields itself from cancellation. Such a plugin outlives
the kill, and the supervisor reports ``TerminationUnconfirmedError`` after its
confirmation timeout; it is the one thing an in-process child can do that a process
cannot. Run untrusted code in the subprocess execution instead.

Exit statuses: a plugin that returns gives code 0 (or the int it returned), one that
raises gives code 1. A task has no signals: one ended by interrupt or kill is
``cancelled`` (the termination's kind says which: ``exited`` when it stopped within the
grace, ``killed`` when it had to be cancelled outright).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import inspect
import logging
import types
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Self

import attrs
import trio

from .._background import open_background_nursery
from ..abc import Unit
from ..errors import ExecutionError, PackageError
from ..model import (
    JSON,
    ChildIdentity,
    CodeIdentity,
    ExitStatus,
    Handle,
    Key,
    Limits,
    Load,
    Termination,
    log_fields,
)
from .child._bootstrap import Refused, entry_point, load_failure

__all__ = ["InProcessExecution", "Plugin", "PluginContext"]

logger = logging.getLogger(__name__)

ADAPTER = "inprocess"
_CANCELLED = ExitStatus(cancelled=True)


@attrs.frozen(kw_only=True)
class PluginContext:
    """What a plugin is told about the session it runs for.

    Attributes:
        key: The session's key.
        generation: The session's generation.
        config: The load's configuration (a read-only JSON object).
        limits: The session's negotiated limits; the in-process execution cannot
            enforce them, so a plugin that cares reads them here.
    """

    key: Key
    generation: int
    config: Mapping[str, JSON]
    limits: Limits


#: A plugin of the in-process execution: an async callable taking a
#: :class:`PluginContext` and returning an exit code (None counts as 0).
Plugin = Callable[[PluginContext], Awaitable[int | None]]


class InProcessExecution:
    """An execution whose units are Trio tasks; use it as ``async with``.

    Args:
        plugins: Specifier -> plugin. Looked up first.
        importable: Also resolve specifiers of the form ``package.module:function``
            by importing them. Off by default: a remote host should only reach the
            code the runner's owner listed.

    Raises:
        ValueError: A plugin's specifier is not a non-empty string.
        TypeError: A plugin is not callable.
    """

    def __init__(
        self, plugins: Mapping[str, Plugin] | None = None, *, importable: bool = False
    ) -> None:
        self._plugins = dict(plugins or {})
        for specifier, plugin in self._plugins.items():
            if not isinstance(specifier, str) or not specifier:
                raise ValueError(f"a plugin specifier must be a non-empty str, got {specifier!r}")
            if not callable(plugin):
                raise TypeError(f"the plugin for {specifier!r} is not callable: {plugin!r}")
        self._importable = importable
        self._codes: dict[str, tuple[Plugin, CodeIdentity]] = {}
        self._live: dict[str, _TaskUnit] = {}
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("this InProcessExecution is already running")
        stack = contextlib.AsyncExitStack()
        self._nursery = await stack.enter_async_context(open_background_nursery())
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack = self._stack
        assert stack is not None
        # Tasks cannot outlive the execution: whatever still runs is cancelled.
        for unit in list(self._live.values()):
            unit.cancel_outright()
        self._nursery = None
        self._stack = None
        return await stack.__aexit__(*exc_info)

    @property
    def running(self) -> int:
        """How many plugin tasks run now."""
        return len(self._live)

    def runs(self, child: ChildIdentity) -> bool:
        """True while the plugin task of ``child`` runs.

        Args:
            child: A unit's identity.

        Returns:
            Whether its task runs in this execution now.
        """
        return child.ref in self._live

    async def spawn(self, handle: Handle, load: Load, limits: Limits) -> Unit:
        """Resolve the load's specifier and make its unit, not yet started.

        Implements :meth:`trio_supervisor.abc.Execution.spawn` (L4). The plugin gets
        ``limits`` in its :class:`PluginContext`, unenforced.

        Raises:
            PackageError: No plugin has this specifier, or it cannot be imported.
            ExecutionError: The execution is not running (use ``async with``).
        """
        await trio.lowlevel.checkpoint()
        if self._nursery is None:
            raise ExecutionError(
                "InProcessExecution is not running: enter it with `async with` first"
            )
        plugin, code = self._resolve(load.specifier)
        context = PluginContext(
            key=handle.key, generation=handle.generation, config=load.config, limits=limits
        )
        identity = ChildIdentity(adapter=ADAPTER, ref=uuid.uuid4().hex)
        return _TaskUnit(self, identity, code, plugin, context)

    async def recover(self, child: ChildIdentity) -> Termination:
        """Kill a task left by an earlier supervisor in this process, if it still runs.

        A task cannot outlive its process: if the ref is unknown here, it is gone, and
        the termination says so with an unknown exit status.

        Implements :meth:`trio_supervisor.abc.Execution.recover` (V2).

        Raises:
            ExecutionError: ``child`` was not made by the in-process execution.
        """
        if child.adapter != ADAPTER:
            raise ExecutionError(f"{child} was not made by the in-process execution")
        unit = self._live.get(child.ref)
        if unit is None:
            await trio.lowlevel.checkpoint()
            return Termination(kind="exited", exit=ExitStatus(code=None, signal=None))
        await unit.kill()
        return Termination(kind="killed", exit=await unit.wait())

    def _resolve(self, specifier: str) -> tuple[Plugin, CodeIdentity]:
        known = self._codes.get(specifier)
        if known is not None:
            return known
        plugin = self._plugins.get(specifier)
        if plugin is None:
            if not self._importable or ":" not in specifier:
                raise PackageError(
                    f"cannot load {specifier!r}: no plugin is registered under that name"
                )
            plugin = _import(specifier)
        resolved = (plugin, _identify(specifier, plugin))
        self._codes[specifier] = resolved
        return resolved


def _import(specifier: str) -> Plugin:
    module_name, _, attribute = specifier.partition(":")
    if not module_name or not attribute:
        raise PackageError(f"cannot load {specifier!r}: a specifier is package.module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise PackageError(load_failure(specifier, error)) from error
    try:
        plugin: Plugin = entry_point(module, attribute, specifier)
    except Refused as error:
        raise PackageError(load_failure(specifier, error)) from error
    return plugin


def _identify(specifier: str, plugin: Plugin) -> CodeIdentity:
    function = inspect.unwrap(plugin)
    module = inspect.getmodule(function)
    origin = f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', '?')}"
    digest = version = None
    source = getattr(module, "__file__", None) if isinstance(module, types.ModuleType) else None
    if source:
        with contextlib.suppress(OSError), open(source, "rb") as file:
            digest = "sha256:" + hashlib.sha256(file.read()).hexdigest()
    if module is not None:
        top = module.__name__.partition(".")[0]
        for distribution in importlib.metadata.packages_distributions().get(top, []):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                version = importlib.metadata.version(distribution)
                break
    return CodeIdentity(specifier=specifier, origin=origin, digest=digest, version=version)


class _TaskUnit:
    """One plugin call as a Trio task."""

    def __init__(
        self,
        execution: InProcessExecution,
        identity: ChildIdentity,
        code: CodeIdentity,
        plugin: Plugin,
        context: PluginContext,
    ) -> None:
        self._execution = execution
        self.identity = identity
        self.code = code
        self._plugin = plugin
        self._context = context
        self._kill_scope = trio.CancelScope()
        self._interrupt_scope = trio.CancelScope()
        self._started = False
        self._exited = trio.Event()
        self._status: ExitStatus | None = None

    async def start(self) -> None:
        if self._started or self._exited.is_set():
            await trio.lowlevel.checkpoint()
            raise ExecutionError("this unit was started already, or stopped before it started")
        nursery = self._execution._nursery
        if nursery is None:
            await trio.lowlevel.checkpoint()
            raise ExecutionError("InProcessExecution is not running")
        self._started = True
        self._execution._live[self.identity.ref] = self
        await nursery.start(self._run, name=f"trio_supervisor plugin {self.code.specifier}")

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        code: int | None = None
        try:
            with self._kill_scope, self._interrupt_scope:
                task_status.started()
                result = await self._plugin(self._context)
                code = result if isinstance(result, int) and not isinstance(result, bool) else 0
        except Exception:
            key = self._context.key
            logger.exception(
                "the in-process plugin %r of %s/%s #%d raised",
                self.code.specifier,
                key.identity,
                key.instance,
                self._context.generation,
                extra=log_fields(key, self._context.generation),
            )
            code = 1
        finally:
            # No code: it was cancelled, by interrupt, by kill, or from outside (the
            # execution's nursery was cancelled).
            self._finish(_CANCELLED if code is None else ExitStatus(code=code))

    def _finish(self, status: ExitStatus) -> None:
        if self._status is None:
            self._status = status
            self._execution._live.pop(self.identity.ref, None)
            self._exited.set()

    def cancel_outright(self) -> None:
        self._kill_scope.cancel()
        if not self._started:
            self._finish(_CANCELLED)

    async def renew(self, lease: float) -> None:
        # The supervisor enforces the lease of a task: it shares our event loop.
        await trio.lowlevel.checkpoint()

    async def interrupt(self) -> None:
        await trio.lowlevel.checkpoint()
        self._interrupt_scope.cancel()
        if not self._started:
            self._finish(_CANCELLED)

    async def kill(self) -> None:
        await trio.lowlevel.checkpoint()
        self.cancel_outright()

    async def wait(self) -> ExitStatus:
        await self._exited.wait()
        assert self._status is not None
        return self._status

    async def aclose(self) -> None:
        # A task holds nothing to release; one that still runs is cancelled outright.
        await trio.lowlevel.checkpoint()
        self.cancel_outright()
