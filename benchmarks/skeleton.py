"""The raw Trio baselines of the control scenarios: the lean one and the skeleton.

:class:`Lean` is the baseline of ``control.sequential`` and ``control.concurrent``.
:class:`Skeleton` is the older, heavier one, kept for the informational ``*.skeleton`` rows
and as the baseline of ``memory.idle_session``. Per skeleton session: a task in one
nursery, holding a lease cancel scope and a nursery with three
tasks (lease timer, loader, exit watcher stand-ins); the state in a dict. Open starts it,
renew moves the deadline, dispose cancels the scope and waits for the task to end.
"""

from __future__ import annotations

import uuid

import trio

LEASE = 1e6


class Skeleton:
    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.sessions: dict[str, tuple[object, trio.CancelScope, trio.Event]] = {}

    async def open(self, key: object) -> str:
        token = str(uuid.uuid4())
        scope = trio.CancelScope(deadline=trio.current_time() + LEASE)
        done = trio.Event()
        self.sessions[token] = (key, scope, done)
        await self.nursery.start(self._session, scope, done)
        return token

    async def _session(
        self, scope: trio.CancelScope, done: trio.Event, *, task_status: trio.TaskStatus[None]
    ) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(trio.sleep_forever)
                task_status.started()
        done.set()

    async def renew(self, token: str) -> None:
        _, scope, _ = self.sessions[token]
        scope.deadline = trio.current_time() + LEASE
        await trio.lowlevel.checkpoint()

    async def dispose(self, token: str) -> None:
        _, scope, done = self.sessions.pop(token)
        scope.cancel()
        await done.wait()


class Lean:
    """The lean raw Trio baseline of the control scenarios: our shape, nothing else.

    Per childless session: one task parked in ``trio.sleep_forever`` inside the session's
    cancel scope, whose deadline is the lease. Open checks the key's generation against the
    expected one and takes the next, makes a random token (uuid4) and writes a record (a
    small dict) to a dict; renew moves the deadline; dispose writes the stopping record,
    cancels the scope, waits for the task to finish and writes the stopped record.
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.generations: dict[object, int] = {}
        self.records: dict[str, dict[str, object]] = {}
        self.sessions: dict[str, tuple[trio.CancelScope, trio.Event]] = {}

    async def open(self, key: object, expected: int | None) -> tuple[str, int]:
        current = self.generations.get(key)
        if current != expected:
            raise ValueError(f"generation {current}, expected {expected}")
        generation = (current or 0) + 1
        self.generations[key] = generation
        token = str(uuid.uuid4())
        deadline = trio.current_time() + LEASE
        self.records[token] = {
            "key": key,
            "generation": generation,
            "phase": "open",
            "deadline": deadline,
        }
        scope = trio.CancelScope(deadline=deadline)
        done = trio.Event()
        self.sessions[token] = (scope, done)
        self.nursery.start_soon(self._session, scope, done)
        await trio.lowlevel.checkpoint()
        return token, generation

    async def _session(self, scope: trio.CancelScope, done: trio.Event) -> None:
        with scope:
            await trio.sleep_forever()
        done.set()

    async def renew(self, token: str) -> None:
        scope, _ = self.sessions[token]
        scope.deadline = trio.current_time() + LEASE
        await trio.lowlevel.checkpoint()

    async def dispose(self, token: str) -> None:
        scope, done = self.sessions.pop(token)
        record = self.records[token]
        self.records[token] = {**record, "phase": "stopping"}
        scope.cancel()
        await done.wait()
        self.records[token] = {**record, "phase": "stopped"}
