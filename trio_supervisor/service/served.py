"""What the service reads of the supervisor it serves: :class:`ServedSupervisor`.

The hosts' calls are :class:`~trio_supervisor.abc.SupervisorAPI`'s, which the runner's
client offers too; the service needs more of its own supervisor, and only of an embedded
one: the records, for the operators' listings and the drain; the live sessions, for
admission; every record as it is made durable, for the ledger, the metrics and the events
stream; and the owner's ``quota`` keyword of ``open`` and ``load``, for a fleet's quotas
(docs/design.md, F9). These stay out of ``SupervisorAPI``: a host has no use for them,
and the client could not offer them. :class:`~trio_supervisor.Supervisor` satisfies this
protocol; the runner, which makes one, is checked against it by mypy where it hands it to
:func:`~trio_supervisor.service.app.create_app`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .._core.events import DEFAULT_BUFFER, Watch
from ..abc import SupervisorAPI
from ..errors import SupervisorError
from ..model import CodeIdentity, Handle, Key, Limits, Load, QuotaClaim, SessionRecord

__all__ = ["ServedSupervisor"]


class ServedSupervisor(SupervisorAPI, Protocol):
    """The supervisor a runner serves: the hosts' calls, and what its service reads."""

    @property
    def poisoned(self) -> SupervisorError | None:
        """The error that poisoned the supervisor, or None while it is healthy."""
        ...

    @property
    def closing(self) -> bool:
        """True once the shutdown began (Z1)."""
        ...

    async def open(
        self,
        key: Key,
        request_id: str,
        *,
        expected_generation: int | None = None,
        lease: float | None = None,
        limits: Limits | None = None,
        quota: QuotaClaim | None = None,
    ) -> SessionRecord:
        """``SupervisorAPI.open``, with the tenant's ``quota`` for a fleet's store."""
        ...

    async def load(
        self, handle: Handle, load: Load, *, quota: QuotaClaim | None = None
    ) -> CodeIdentity:
        """``SupervisorAPI.load``, with the tenant's ``quota`` for a fleet's store."""
        ...

    def records(self) -> list[SessionRecord]:
        """Every retained record, in the order it was last saved."""
        ...

    def live_records(self) -> list[SessionRecord]:
        """The last durable record of every session whose task runs here."""
        ...

    def retained_request(self, key: Key, request_id: str) -> SessionRecord | None:
        """The retained record an open of ``key`` with ``request_id`` made here (O3)."""
        ...

    def holds_key(self, key: Key) -> bool:
        """Whether a session of ``key`` runs here (O5)."""
        ...

    def find(self, key: Key, generation: int) -> SessionRecord | None:
        """The retained record of ``key``'s ``generation``, if any."""
        ...

    def times(self, handle: Handle) -> tuple[float, float] | None:
        """How long the session has existed and how long its lease has left, in seconds."""
        ...

    def watch(self, buffer: int = DEFAULT_BUFFER) -> Watch:
        """Every record made durable from now on, buffered; an overflow when behind."""
        ...

    def listen(self, listener: Callable[[SessionRecord], None]) -> Callable[[], None]:
        """Call ``listener`` with every record made durable from now on, at once."""
        ...
