"""The PostgreSQL store's worker, third layer: this runner as a member of the fleet.

Opening the store migrates the schema (:func:`migrate`, under its advisory lock),
refuses a pooler that shares server sessions (B7), and registers this runner: its row
gets a new epoch. Then the row is renewed (or marked draining), its inbox of supersedes
read, the fleet's sessions' times asked for and published, older generations of a key
and dead runners looked for, and a dead runner's records taken over: its epoch moves on
and its sessions are written Stopped (``runner_lost``). Closing marks the row expired.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any, Final

from .._extras import needs_extra
from ..codec import encode
from ..errors import StateStorageError
from ..model import ExitStatus, Key, StoppedRecord, Termination, recovered
from ._postgres_connection import Settings
from ._postgres_records import Older, Records
from ._postgres_schema import (
    CLEAR_SCHEMA_VERSION,
    CREATE_SCHEMA_VERSION,
    MIGRATION_LOCK,
    MIGRATIONS,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    TAKE_MIGRATION_LOCK,
    WRITE_SCHEMA_VERSION,
    create_schema,
)
from ._postgres_sql import (
    ASK_TIMES,
    CHECKED,
    DEAD,
    DEAD_ROW,
    DRAINING,
    DUE,
    EXPIRE,
    INBOX,
    NEXT_EPOCH,
    OLDER,
    OTHERS_ALIVE,
    OWN_ROW,
    POOL_MARK,
    POOL_SEEN,
    PUBLISH_TIMES,
    REGISTER,
    RENEW,
    TIMES_DUE,
    UNCHECKED,
)
from ._rows import key_of, record_of

with needs_extra("postgres", "trio_supervisor.stores.postgres", "psycopg"):
    import psycopg

__all__ = ["RUNNER_LOST", "Membership", "migrate"]

logger = logging.getLogger("trio_supervisor.stores.postgres")

# What a dead runner's sessions are stopped with when another runner takes them over.
RUNNER_LOST: Final = Termination(kind="exited", exit=ExitStatus(runner_lost=True))


class Membership(Records):
    """The worker's jobs for this runner's row and the fleet's other runners."""

    def _open(self) -> None:
        connection = self._connected()
        self._refuse_transaction_pooling(connection)
        migrate(connection, self.settings)
        settings = self.settings
        runner = settings.runner_id
        with connection.transaction():
            previous = connection.execute(OWN_ROW, (runner,)).fetchone()
            row = connection.execute(
                REGISTER,
                {"runner": runner, "advertise": settings.advertise, "lease": settings.runner_lease},
            ).fetchone()
            others = connection.execute(OTHERS_ALIVE, (runner,)).fetchall()
        assert row is not None
        self.epoch = row[0]
        if self.memory.check_lost:
            self._restore(connection)  # the last incarnation's writes, on a new server
        else:
            connection.execute(CHECKED, (self.memory.server, runner, self.epoch))
        twins = [other for other, where in others if where and where == settings.advertise]
        if twins:
            logger.warning(
                "%s: runner %s advertises %s, as %s already does%s: hosts sent there reach "
                "only one of them; give each runner its own --advertise URL",
                settings.shown,
                runner,
                settings.advertise,
                ", ".join(twins),
                "" if len(twins) == 1 else " each",
            )
        if previous is not None and previous[1]:
            logger.warning(
                "%s: runner %s registered as epoch %d while the row of its epoch %d was "
                "still within its lease: another process may be running under this id",
                settings.shown,
                runner,
                self.epoch,
                previous[0],
            )
        else:
            logger.info(
                "%s: runner %s registered as epoch %d; %s",
                settings.shown,
                runner,
                self.epoch,
                f"{len(others)} other runner{'s' if len(others) != 1 else ''} alive "
                f"({', '.join(other for other, _ in others)})"
                if others
                else "no other runner alive",
            )

    def _refuse_transaction_pooling(self, connection: psycopg.Connection[Any]) -> None:
        """Refuse a pooler that shares server sessions between transactions (B7).

        The store needs a session of its own: its settings (timeouts, search path) are
        set once per connection, and its LISTEN lasts as long as the session. A mark set
        in this session is looked for from a second connection: through PgBouncer's
        ``pool_mode=transaction`` the second gets the server session the first left idle
        (its pools are last-in first-out), and sees the mark.
        """
        mark = uuid.uuid4().hex
        connection.execute(POOL_MARK, (mark,))
        with self.settings.connect(autocommit=True) as other:
            row = other.execute(POOL_SEEN).fetchone()
        if row is not None and row[0] == mark:
            raise StateStorageError(
                f"{self.settings.shown}: this store shares one server session between "
                "its clients' transactions (a pooler such as PgBouncer with "
                "pool_mode=transaction or statement), and the fleet needs sessions of "
                "its own (its settings, and LISTEN for supersedes): point --store at the "
                "server, or at a pool with pool_mode=session"
            )

    def _close(self) -> None:
        # Its row stops counting as alive now, so that the fleet need not wait out its
        # lease (a takeover still waits out each record's margin from here).
        if self._connection is None or self._connection.closed:
            return
        self._connection.execute(EXPIRE, (self.settings.runner_id, self.epoch))

    # -- the fleet ---------------------------------------------------------------------

    def _unchecked(self, connection: psycopg.Connection[Any]) -> list[str]:
        """The fleet's live runners that have not checked their writes on this server."""
        rows = connection.execute(
            UNCHECKED, (self.settings.runner_id, self.memory.server or "")
        ).fetchall()
        return [runner for (runner,) in rows]

    def _renew(self, connection: psycopg.Connection[Any], stop_bound: float) -> bool:
        """Renew this runner's row; whether it still held this epoch."""
        settings = self.settings
        done = connection.execute(
            RENEW, (settings.runner_lease, stop_bound, settings.runner_id, self.epoch)
        )
        return done.rowcount == 1

    def _draining(self, connection: psycopg.Connection[Any]) -> None:
        connection.execute(DRAINING, (self.settings.runner_id, self.epoch))

    def _inbox(self, connection: psycopg.Connection[Any]) -> dict[Key, int]:
        """This runner's inbox, read and cleared: the keys of its sessions a later
        generation opened elsewhere supersedes, with that generation (F5)."""
        rows = connection.execute(INBOX, (self.settings.runner_id,)).fetchall()
        return {
            key_of(self.settings.shown, identity, instance): generation
            for identity, instance, generation in rows
        }

    def _ask_times(self, connection: psycopg.Connection[Any]) -> float:
        """Ask every runner of the fleet for its sessions' times; the moment asked."""
        row = connection.execute(ASK_TIMES).fetchone()
        assert row is not None
        return float(row[0])

    def _times_due(self, connection: psycopg.Connection[Any], asked: float) -> list[str]:
        """The live runners that answer such requests and did not since ``asked``."""
        return [runner for (runner,) in connection.execute(TIMES_DUE, (asked,)).fetchall()]

    def _publish_times(
        self, connection: psycopg.Connection[Any], times: Mapping[str, tuple[float, float]]
    ) -> None:
        """Publish this runner's sessions' ``times`` (by token: age and lease left, in
        seconds) as moments of the database's clock."""
        tokens = list(times)
        connection.execute(
            PUBLISH_TIMES,
            (
                self.settings.runner_id,
                tokens,
                [times[token][0] for token in tokens],
                [times[token][1] for token in tokens],
            ),
        )

    def _older(self, connection: psycopg.Connection[Any], key: Key, generation: int) -> list[Older]:
        """Unstopped records of ``key`` below ``generation`` on other runners."""
        rows = connection.execute(
            OLDER,
            (key.identity, key.instance, generation, self.settings.runner_id),
        ).fetchall()
        return [Older(*row) for row in rows]

    def _dead(self, connection: psycopg.Connection[Any]) -> list[tuple[str, int]]:
        """Other runners whose row expired with a record whose margin passed too."""
        rows = connection.execute(DEAD, (self.settings.runner_id,)).fetchall()
        return [(runner, epoch) for runner, epoch in rows]

    def _takeover(
        self, connection: psycopg.Connection[Any], runner: str, seen: int
    ) -> list[StoppedRecord]:
        """Take a dead runner's records over, if its row still is as it was seen."""
        with connection.transaction():
            row = connection.execute(DEAD_ROW, (runner,)).fetchone()
            if row is None or row[0] != seen or not row[1]:
                return []  # it renewed, restarted, or another runner took it over first
            rows = connection.execute(DUE, (runner,)).fetchall()
            # Its epoch moves on first: whatever its old incarnation still tries is refused.
            connection.execute(NEXT_EPOCH, {"runner": runner, "by": self.settings.runner_id})
            stopped = [recovered(record_of(self.settings.shown, *row), RUNNER_LOST) for row in rows]
            self._write(runner, seen + 1, [[(record, encode(record)) for record in stopped]])
        logger.warning(
            "%s: runner %s (epoch %d) is dead past its takeover margin; took over %d of its "
            "sessions: %s",
            self.settings.shown,
            runner,
            seen,
            len(stopped),
            ", ".join(
                f"{r.handle.key.identity}/{r.handle.key.instance}#{r.handle.generation}"
                for r in stopped
            )
            or "none",
        )
        return stopped


def migrate(connection: psycopg.Connection[Any], settings: Settings) -> None:
    """Create or migrate the schema, in one transaction under the advisory lock."""
    with connection.transaction():
        connection.execute(TAKE_MIGRATION_LOCK, (MIGRATION_LOCK,))
        connection.execute(create_schema(settings.schema))
        connection.execute(CREATE_SCHEMA_VERSION)
        versions = [row[0] for row in connection.execute(SCHEMA_VERSIONS)]
        version = max(versions, default=0)
        if version > SCHEMA_VERSION:
            raise StateStorageError(
                f"{settings.shown}: the schema {settings.schema} has version {version}; this "
                f"library knows version {SCHEMA_VERSION} at most (a newer trio_supervisor "
                "wrote it)"
            )
        for step in range(version + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[step]:
                connection.execute(statement)
        if version < SCHEMA_VERSION:
            connection.execute(CLEAR_SCHEMA_VERSION)
            connection.execute(WRITE_SCHEMA_VERSION, (SCHEMA_VERSION,))
            logger.info(
                "%s: schema %s migrated from version %d to %d",
                settings.shown,
                settings.schema,
                version,
                SCHEMA_VERSION,
            )
