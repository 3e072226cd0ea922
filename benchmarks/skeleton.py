"""The raw Trio baseline of the control scenarios: the shape a supervisor has, no more.

Per session: a task in one nursery, holding a lease cancel scope and a nursery with three
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
