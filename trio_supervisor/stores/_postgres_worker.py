"""The PostgreSQL store's worker: the thread that owns the store's connection, and the
jobs it serves.

Theory of operation
-------------------
Callers (``PostgresStore``, in the Trio run) put :class:`~._jobs.Job` s on a queue and
park; the worker takes everything queued, writes the saves of that batch in one
transaction through one call of ``save_batch`` (group commit), then serves the other
jobs one transaction each, and wakes each caller through its run's token. Every
statement runs under ``statement_timeout`` and ``lock_timeout``, on a socket with TCP
keepalives and ``tcp_user_timeout``, and every job under a watchdog
(:mod:`._postgres_connection`): no job waits on a dead network for more than seconds.
A connection that broke is dropped, and the next job connects again (its writes are
still fenced by the epoch, which is what a reconnect cannot bypass).

A read is a job like a save, served after the saves of its batch (so it sees them);
its caller may stop waiting for it at any time (``Job.abandon``). A takeover is a write:
its caller waits for its answer, as a save's does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from .._extras import needs_extra
from ..codec import encode
from ..errors import QuotaExceededError, StaleSessionError, StateStorageError
from ..model import (
    ExitStatus,
    FleetRecord,
    Key,
    OpenRecord,
    QuotaClaim,
    RunnerInfo,
    SessionRecord,
    StoppedRecord,
    Superseded,
    Termination,
    recovered,
)
from ._jobs import Job, deliver, next_batch
from ._postgres_connection import Settings, Watchdog
from ._postgres_patterns import identity_regex
from ._postgres_sql import (
    CLEAR_SCHEMA_VERSION,
    CREATE_SCHEMA_VERSION,
    DEAD,
    DEAD_ROW,
    DRAINING,
    DUE,
    EXPIRE,
    FENCED,
    FLEET_RECORDS,
    HELD,
    HIGH_WATER,
    LANDED,
    LIST,
    LOOKUP,
    MARKS,
    MIGRATION_LOCK,
    MIGRATIONS,
    NEXT_EPOCH,
    OLDER,
    OTHERS_ALIVE,
    OWN_ROW,
    OWNER,
    REGISTER,
    RENEW,
    RUNNERS,
    SAVE_BATCH,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    TAKE_MIGRATION_LOCK,
    WRITE_SCHEMA_VERSION,
    Kind,
    create_schema,
)
from ._rows import key_of, record_of

with needs_extra("postgres", "trio_supervisor.stores.postgres", "psycopg"):
    import psycopg
    from psycopg.types.json import Jsonb

__all__ = ["Worker", "migrate"]

logger = logging.getLogger("trio_supervisor.stores.postgres")

# What a dead runner's sessions are stopped with when another runner takes them over.
RUNNER_LOST: Final = Termination(kind="exited", exit=ExitStatus(runner_lost=True))
# Seconds before each look for a save whose answer the broken connection lost.
LOOK_PAUSES: Final = (0.0, 0.25, 1.0)


class Worker:
    """The thread that owns the store's connection.

    Everything it does runs inside :meth:`_attempt`, which turns a ``psycopg.Error`` (or
    anything but a :class:`StateStorageError`) into the :class:`StateStorageError` its
    callers get; no failure ends the thread, which would leave its callers waiting.
    """

    def __init__(self, settings: Settings, jobs: queue.SimpleQueue[Job]) -> None:
        self.settings = settings
        self._jobs = jobs
        # Written by this thread only, read by anyone.
        self.commits = 0
        self.epoch = 0
        self._connection: psycopg.Connection[Any] | None = None
        self._open_error: StateStorageError | None = None
        self._watchdog = Watchdog(
            2 * settings.statement_timeout + settings.connect_timeout, lambda: self._connection
        )

    def run(self) -> None:
        jobs = self._jobs
        self._watchdog.start()
        self._open_error = self._attempt("open the store", self._open)
        closing: Job | None = None
        while closing is None:
            taken, closing = next_batch(jobs)  # group commit
            self._serve(taken)
        if self._open_error is None:
            failure = self._attempt("mark this runner's row expired", self._close)
            if failure is not None:
                # Only a courtesy to the fleet (its lease runs out all the same); every
                # save that returned is durable.
                logger.warning("%s", failure)
        if self._connection is not None:
            with contextlib.suppress(psycopg.Error):
                self._connection.close()
        self._watchdog.stop()
        deliver([closing])

    def _serve(self, jobs: list[Job]) -> None:
        if self._open_error is not None:
            for job in jobs:
                job.error = self._open_error
            deliver(jobs)
            return
        # Writes first, so a read queued after a save sees it.
        saves = [job for job in jobs if job.kind == "save"]
        if saves:
            failure = self._attempt("save", functools.partial(self._save, saves))
            landed: set[int] = set()
            if failure is not None and self._connection is None:
                # The connection broke during the save: the batch may have committed
                # before its answer was lost. Look, on a new connection, rather than
                # report a failure for what landed (a runner then poisons itself, and
                # an Open that landed would be left without its session).
                # A blip of the network may outlast the break by a moment: the look is
                # tried again, briefly, before the save is reported failed.
                for pause in LOOK_PAUSES:
                    time.sleep(pause)
                    look = functools.partial(self._landed, saves, landed)
                    if self._attempt("look for a save whose answer was lost", look) is None:
                        break
            for index, job in enumerate(saves):
                if index in landed:
                    logger.warning(
                        "%s: the connection broke as a save committed; it had landed",
                        self.settings.shown,
                    )
                    job.error = None
                else:
                    job.error = job.error or failure
        for job in jobs:
            if job.kind == "open":
                continue  # the thread opened the store as it started: nothing left to do
            if job.kind != "save":
                action = _ACTIONS.get(job.kind, job.kind)
                job.error = self._attempt(action, functools.partial(self._do, job))
        deliver(jobs)

    def _attempt(self, action: str, work: Callable[[], None]) -> StateStorageError | None:
        """Run ``work`` in a transaction; return the error its callers are to get, if any."""
        try:
            with self._watchdog:
                work()
        except StateStorageError as error:  # RecordFormatError too: worded already
            self._end_transaction()
            return error
        except Exception as error:
            self._end_transaction()
            if self._watchdog.fired:
                text = (
                    f"{self.settings.shown}: cannot {action}: no answer within "
                    f"{self._watchdog.bound:g} s (the network or the server is stuck); "
                    "the connection was dropped"
                )
            else:
                text = self.settings.explain(action, error)
            failure = StateStorageError(text)
            failure.__cause__ = error
            return failure
        return None

    def _end_transaction(self) -> None:
        connection = self._connection
        if connection is None:
            return
        if connection.broken or connection.closed:
            # Dropped: the next job connects again.
            logger.warning(
                "%s: the connection broke; the next call reconnects", self.settings.shown
            )
            with contextlib.suppress(psycopg.Error):
                connection.close()
            self._connection = None
            return
        try:
            connection.rollback()
        except psycopg.Error:
            with contextlib.suppress(psycopg.Error):
                connection.close()
            self._connection = None

    def _connected(self) -> psycopg.Connection[Any]:
        if self._connection is None:
            self._connection = self.settings.connect()
        return self._connection

    # -- opening: the schema, then this runner's row ------------------------------------

    def _open(self) -> None:
        connection = self._connected()
        migrate(connection, self.settings)
        settings = self.settings
        runner = settings.runner_id
        previous = connection.execute(OWN_ROW, (runner,)).fetchone()
        row = connection.execute(
            REGISTER,
            {"runner": runner, "advertise": settings.advertise, "lease": settings.runner_lease},
        ).fetchone()
        others = connection.execute(OTHERS_ALIVE, (runner,)).fetchall()
        connection.commit()
        assert row is not None
        self.epoch = row[0]
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

    def _close(self) -> None:
        # Its row stops counting as alive now, so that the fleet need not wait out its
        # lease (a takeover still waits out each record's margin from here).
        if self._connection is None or self._connection.closed:
            return
        self._connection.execute(EXPIRE, (self.settings.runner_id, self.epoch))
        self._connection.commit()

    # -- saving ------------------------------------------------------------------------

    def _save(self, jobs: list[Job]) -> None:
        # A save's args are its quota claim, if it carries one (PostgresStore.save_within).
        claims = {index: job.args for index, job in enumerate(jobs) if job.args is not None}
        refused = self._write(
            self.settings.runner_id, self.epoch, [job.rows for job in jobs], claims
        )
        for index, refusal in refused.items():
            jobs[index].error = _refusal_error(refusal, claims.get(index))

    def _landed(self, jobs: list[Job], landed: set[int]) -> None:
        """Add to ``landed`` the index of every job of a batch that committed.

        The batch is one transaction: it committed if any of its tokens holds what the
        batch wrote last for it, under this runner's epoch. Then every job landed but
        one whose Open lost its compare-and-set (its token is absent), and one whose
        quota claim was refused (a row of it that is not Stopped does not hold what it
        wrote); a Stopped row absent was evicted by retention in the same batch.
        """
        connection = self._connected()
        last = {record.handle.token: body for job in jobs for record, body in job.rows}
        held = {
            token: (epoch, body)
            for token, epoch, body in connection.execute(LANDED, (list(last),)).fetchall()
        }
        connection.commit()
        if not any(held.get(token) == (self.epoch, body) for token, body in last.items()):
            return  # it did not commit: the failure stands
        for index, job in enumerate(jobs):
            if not any(
                (isinstance(record, OpenRecord) and record.handle.token not in held)
                or (
                    job.args is not None
                    and not isinstance(record, StoppedRecord)
                    and held.get(record.handle.token) != (self.epoch, body)
                )
                for record, body in job.rows
            ):
                landed.add(index)
        self.commits += 1

    def _write(
        self,
        runner: str,
        epoch: int,
        jobs: list[list[tuple[SessionRecord, str]]],
        claims: Mapping[int, QuotaClaim] | None = None,
    ) -> dict[int, tuple[Any, ...]]:
        """One call of save_batch and its commit; the jobs (each its rows, some with a
        quota claim, by index) refused, by index, with save_batch's row for each."""
        connection = self._connected()
        retention = self.settings.retention
        try:
            refused = connection.execute(
                SAVE_BATCH,
                (
                    runner,
                    epoch,
                    retention.stopped_per_key,
                    retention.stopped_total,
                    *columns(jobs),
                    None if not claims else Jsonb(claimed(claims)),
                ),
            ).fetchall()
            connection.commit()
        except psycopg.Error as error:
            if error.sqlstate == FENCED:
                raise StateStorageError(
                    f"{self.settings.shown}: cannot save: the epoch {epoch} of runner "
                    f"{runner} was taken over by another runner of the fleet; nothing "
                    "of this write landed"
                ) from error
            raise
        self.commits += 1
        return {row[0]: tuple(row[1:]) for row in refused}

    # -- everything else ---------------------------------------------------------------

    def _do(self, job: Job) -> None:
        connection = self._connected()
        job.result = getattr(self, f"_{job.kind}")(connection, *(job.args or ()))
        connection.commit()  # a read's too: no snapshot is held between jobs

    def _list(self, connection: psycopg.Connection[Any]) -> list[SessionRecord]:
        rows = connection.execute(LIST, (self.settings.runner_id,)).fetchall()
        return [record_of(self.settings.shown, *row) for row in rows]

    def _high_water(self, connection: psycopg.Connection[Any]) -> dict[Key, int]:
        rows = connection.execute(HIGH_WATER).fetchall()
        return {
            key_of(self.settings.shown, identity, instance): generation
            for identity, instance, generation in rows
        }

    def _lookup(
        self, connection: psycopg.Connection[Any], key: Key, request_id: str | None
    ) -> tuple[int, SessionRecord | None]:
        row = connection.execute(
            LOOKUP, {"i": key.identity, "n": key.instance, "r": request_id}
        ).fetchone()
        assert row is not None
        mark, token, body = row
        record = (
            None
            if token is None
            else record_of(self.settings.shown, token, key.identity, key.instance, body)
        )
        return mark or 0, record

    def _runners(
        self, connection: psycopg.Connection[Any], only: str | None = None
    ) -> list[RunnerInfo]:
        rows = connection.execute(RUNNERS, {"only": only}).fetchall()
        return [
            RunnerInfo(
                runner_id=runner,
                epoch=epoch,
                advertise=advertise,
                started_at=float(started),
                lease_until=float(until),
                alive=alive,
                sessions=sessions,
                stop_bound=stop_bound,
                draining=draining,
            )
            for (
                runner,
                epoch,
                advertise,
                started,
                until,
                alive,
                sessions,
                stop_bound,
                draining,
            ) in rows
        ]

    def _owner(self, connection: psycopg.Connection[Any], token: str) -> RunnerInfo | None:
        row = connection.execute(OWNER, (token,)).fetchone()
        if row is None:
            return None
        found = self._runners(connection, row[0])
        return found[0] if found else None

    def _held(self, connection: psycopg.Connection[Any], token: str) -> FleetRecord | None:
        row = connection.execute(HELD, (token,)).fetchone()
        if row is None:
            return None
        token, identity, instance, body, runner, epoch = row
        return FleetRecord(
            record=record_of(self.settings.shown, token, identity, instance, body),
            runner_id=runner,
            epoch=epoch,
        )

    def _fleet_records(self, connection: psycopg.Connection[Any]) -> list[FleetRecord]:
        rows = connection.execute(FLEET_RECORDS).fetchall()
        return [
            FleetRecord(
                record=record_of(self.settings.shown, token, identity, instance, body),
                runner_id=runner,
                epoch=epoch,
                age=age,
                lease_left=None if lease_left is None else max(lease_left, 0.0),
            )
            for token, identity, instance, body, runner, epoch, age, lease_left in rows
        ]

    def _renew(
        self,
        connection: psycopg.Connection[Any],
        stop_bound: float,
        times: Mapping[str, tuple[float, float]] | None = None,
    ) -> bool:
        """Renew this runner's row, publishing its sessions' ``times`` (by token: age and
        lease left, in seconds) as moments of the database's clock."""
        settings = self.settings
        tokens = list(times or {})
        ages = [times[token][0] for token in tokens] if times else []
        left = [times[token][1] for token in tokens] if times else []
        done = connection.execute(
            RENEW,
            (
                settings.runner_lease,
                stop_bound,
                tokens,
                ages,
                left,
                settings.runner_id,
                self.epoch,
            ),
        )
        return done.rowcount == 1

    def _draining(self, connection: psycopg.Connection[Any]) -> None:
        connection.execute(DRAINING, (self.settings.runner_id, self.epoch))

    def _marks(self, connection: psycopg.Connection[Any], keys: list[Key]) -> dict[Key, int]:
        rows = connection.execute(
            MARKS,
            ([key.identity for key in keys], [key.instance for key in keys]),
        ).fetchall()
        return {
            key_of(self.settings.shown, identity, instance): generation
            for identity, instance, generation in rows
        }

    def _older(
        self, connection: psycopg.Connection[Any], key: Key, generation: int
    ) -> list[tuple[str, int, int, float, float, float]]:
        """Unstopped records of ``key`` below ``generation`` on other runners: each
        one's runner, its epoch, the record's generation and lease, the runner's
        stop_bound, and for how long its row has been expired (negative: alive)."""
        rows = connection.execute(
            OLDER,
            (key.identity, key.instance, generation, self.settings.runner_id),
        ).fetchall()
        return [tuple(row) for row in rows]

    def _dead(self, connection: psycopg.Connection[Any]) -> list[tuple[str, int]]:
        """Other runners whose row expired with a record whose margin passed too."""
        rows = connection.execute(DEAD, (self.settings.runner_id,)).fetchall()
        return [(runner, epoch) for runner, epoch in rows]

    def _takeover(
        self, connection: psycopg.Connection[Any], runner: str, seen: int
    ) -> list[StoppedRecord]:
        """Take a dead runner's records over, if its row still is as it was seen."""
        row = connection.execute(DEAD_ROW, (runner,)).fetchone()
        if row is None or row[0] != seen or not row[1]:
            return []  # it renewed, restarted, or another runner took it over first
        rows = connection.execute(DUE, (runner,)).fetchall()
        # Its epoch moves on first: whatever its old incarnation still tries is refused.
        connection.execute(NEXT_EPOCH, (runner,))
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


_ACTIONS: Final = {
    "list": "list records",
    "high_water": "read the high-water marks",
    "lookup": "look a key up",
    "runners": "list the runners",
    "owner": "find a session's runner",
    "fleet_records": "list the fleet's records",
    "held": "read a session's record",
    "renew": "renew this runner's row",
    "draining": "mark this runner draining",
    "marks": "check the high-water of live keys",
    "older": "look for older generations",
    "dead": "look for dead runners",
    "takeover": "take a dead runner's records over",
}


def columns(jobs: Sequence[Sequence[tuple[SessionRecord, str]]]) -> tuple[list[Any], ...]:
    """save_batch's row arrays for ``jobs`` (each its records with their bodies), in its
    parameters' order: job, token, identity, instance, generation, request id, lease,
    kind, body, phase, and the memory_bytes and cpu_percent limits."""
    built: tuple[list[Any], ...] = ([], [], [], [], [], [], [], [], [], [], [], [])
    (
        numbers,
        tokens,
        identities,
        instances,
        generations,
        requests,
        leases,
        kinds,
        bodies,
        phases,
        memory,
        cpu,
    ) = built
    for number, rows in enumerate(jobs):
        for record, body in rows:
            handle = record.handle
            numbers.append(number)
            tokens.append(handle.token)
            identities.append(handle.key.identity)
            instances.append(handle.key.instance)
            generations.append(handle.generation)
            requests.append(record.request_id)
            leases.append(record.lease)
            kinds.append(_kind(record))
            bodies.append(body)
            phases.append(record.phase.value)
            memory.append(record.limits.memory_bytes)
            cpu.append(record.limits.cpu_percent)
    return built


def claimed(claims: Mapping[int, QuotaClaim]) -> dict[str, dict[str, Any]]:
    """save_batch's ``p_claims``: each job's claim by its number, as quota_refusal reads it."""
    return {
        str(number): {
            "tenant": claim.tenant,
            "pattern": identity_regex(claim.identities),
            "sessions": claim.sessions,
            "children": claim.children,
            "memory_bytes": claim.memory_bytes,
            "cpu_percent": claim.cpu_percent,
            "unlimited_memory_bytes": claim.unlimited_memory_bytes,
            "unlimited_cpu_percent": claim.unlimited_cpu_percent,
        }
        for number, claim in claims.items()
    }


def _refusal_error(
    refusal: tuple[Any, ...], claim: QuotaClaim | None
) -> StaleSessionError | QuotaExceededError:
    """What the caller of a job save_batch refused gets: its row says why."""
    identity, instance, generation, mark, quota, requested, used, hard = refusal
    if quota is None:
        return StaleSessionError(
            f"generation {generation} of {identity}/{instance} was not opened: the key's "
            f"high-water in the fleet is {mark}, so the next open is generation "
            f"{mark + 1} (another open claimed it first); nothing of this save was written"
        )
    tenant = claim.tenant if claim is not None else "?"
    return QuotaExceededError.of(tenant, quota, int(requested), int(used), int(hard))


def _kind(record: SessionRecord) -> int:
    if isinstance(record, OpenRecord):
        return Kind.OPEN
    if isinstance(record, StoppedRecord):
        return Kind.SUPERSEDED if isinstance(record.reason, Superseded) else Kind.STOPPED
    return Kind.OTHER


def migrate(connection: psycopg.Connection[Any], settings: Settings) -> None:
    """Create or migrate the schema, in one transaction under the advisory lock."""
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
    connection.commit()
