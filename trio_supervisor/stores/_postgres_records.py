"""The PostgreSQL store's worker, second layer: the session records.

A batch of saves is one call of ``write_batch`` (:meth:`Records._write`): its jobs'
rows as parallel arrays (:func:`columns`), their quota claims (:func:`claimed`), and
back the jobs it refused, each with why (:func:`refusal_error`), and the older
generations each job's Opens superseded on other runners (:class:`Older`). A batch whose
answer was lost is looked for (:meth:`Records._landed`); the writes a failover lost are
written back (:meth:`Records._restore`, B6). And the reads of records: this runner's,
the fleet's, one key's, one token's, the runners'.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from .._extras import needs_extra
from ..errors import QuotaExceededError, RunnerFencedError, StaleSessionError
from ..model import (
    FleetRecord,
    Key,
    OpenRecord,
    Phase,
    QuotaClaim,
    RunnerInfo,
    SessionRecord,
    StoppedRecord,
    Superseded,
)
from ._jobs import Job
from ._postgres_link import Link
from ._postgres_patterns import identity_regex
from ._postgres_schema import FENCED, Kind
from ._postgres_sql import (
    CHECKED,
    FLEET_RECORDS,
    HELD,
    HIGH_WATER,
    LANDED,
    LIST,
    LOOKUP,
    LOW_MARKS,
    OLDER,
    OWNER,
    RAISE_MARKS,
    REFILL_INBOX,
    RUNNERS,
    SAVE_BATCH,
    WRITTEN_PHASES,
)
from ._rows import key_of, record_of

with needs_extra("postgres", "trio_supervisor.stores.postgres", "psycopg"):
    import psycopg
    from psycopg.types.json import Jsonb

__all__ = ["Older", "Records", "claimed", "columns", "refusal_error"]

logger = logging.getLogger("trio_supervisor.stores.postgres")

_PHASES: Final = [phase.value for phase in Phase]  # the order a record moves in


class Older(NamedTuple):
    """An unstopped record of a key, below a generation opened, on another runner."""

    runner: str
    epoch: int  # its runner's
    generation: int
    lease: float  # the record's
    stop_bound: float  # its runner's
    expired_for: float  # seconds since its runner's row expired; negative: alive


class Records(Link):
    """The worker's writes of session records, and its reads of them."""

    def _save(self, jobs: list[Job]) -> None:
        # A save's args are its quota claim, if it carries one (PostgresStore.save_within).
        claims = {index: job.args for index, job in enumerate(jobs) if job.args is not None}
        refused, older = self._write(
            self.settings.runner_id, self.epoch, [job.rows for job in jobs], claims
        )
        for index, refusal in refused.items():
            jobs[index].error = refusal_error(refusal, claims.get(index))
        for index, job in enumerate(jobs):
            job.result = older.get(index, [])
        self._remember(job for index, job in enumerate(jobs) if index not in refused)

    def _remember(self, jobs: Iterable[Job]) -> None:
        for job in jobs:
            self.memory.wrote(job.rows)

    def _restore(self, connection: psycopg.Connection[Any]) -> None:
        """After a change of server: check that every record this runner wrote last is
        there, at least as far on as it wrote it, and no key's mark is below what it
        handed out; write back what the database lost (B6), say so, and check in, so
        that the fleet's other runners may hand out generations again."""
        memory = self.memory
        written = memory.written
        held = dict(connection.execute(WRITTEN_PHASES, (list(written),)).fetchall())
        lost = [
            rows
            for token, rows in written.items()
            # A Stopped record that is gone was evicted (retention); a row further on
            # than this runner wrote it was moved on by the fleet (a takeover): both
            # stay as they are.
            if (token not in held and not isinstance(rows[0], StoppedRecord))
            or (token in held and _PHASES.index(held[token]) < _PHASES.index(rows[0].phase.value))
        ]
        keys = list(memory.handed)
        marks = (
            [key.identity for key in keys],
            [key.instance for key in keys],
            [memory.handed[key] for key in keys],
        )
        with connection.transaction():
            low = connection.execute(LOW_MARKS, marks).fetchall()
            if lost or low:
                connection.execute(RAISE_MARKS, marks)
                # Another runner's live older generation of such a key is superseded,
                # and the Open's row in its inbox may be lost too: written again.
                connection.execute(REFILL_INBOX, (*marks, self.settings.runner_id))
            connection.execute(CHECKED, (memory.server, self.settings.runner_id, self.epoch))
        if lost:
            # Written again as they were (no Open's compare-and-set: their generations
            # were handed out already), under this runner's epoch, which fences it.
            self._write(self.settings.runner_id, self.epoch, [lost], restore=True)
        memory.check_lost = False
        if not lost and not low:
            logger.info("%s: no write of this runner was lost", self.settings.shown)
            return
        self.lost_writes += len(lost) + len(low)
        logger.critical(
            "%s: the database lost writes of this runner (a failover to a standby that "
            "had not received them): %d record%s (%s) and %d high-water mark%s below "
            "generations it handed out; written back, so no generation is handed out "
            "twice by the fleet's live runners. Only synchronous replication keeps every "
            "acknowledged write through a failover",
            self.settings.shown,
            len(lost),
            "" if len(lost) == 1 else "s",
            ", ".join(
                f"{r.handle.key.identity}/{r.handle.key.instance}#{r.handle.generation} "
                f"{r.phase.value}"
                for r, _ in lost
            )
            or "none",
            len(low),
            "" if len(low) == 1 else "s",
        )

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
        for index in landed:
            # What write_batch said of the older generations the job's Opens superseded
            # was lost with its answer: looked up again (the opener waits for them, F6).
            jobs[index].result = [
                Older(*row)
                for record, _ in jobs[index].rows
                if isinstance(record, OpenRecord)
                for row in connection.execute(
                    OLDER,
                    (
                        record.handle.key.identity,
                        record.handle.key.instance,
                        record.handle.generation,
                        self.settings.runner_id,
                    ),
                ).fetchall()
            ]
        self.commits += 1
        self._remember(jobs[index] for index in landed)

    def _write(
        self,
        runner: str,
        epoch: int,
        jobs: list[list[tuple[SessionRecord, str]]],
        claims: Mapping[int, QuotaClaim] | None = None,
        *,
        restore: bool = False,
    ) -> tuple[dict[int, tuple[Any, ...]], dict[int, list[Older]]]:
        """One call of write_batch, in autocommit (or in the caller's transaction): one
        round trip. The jobs (each its rows, some with a quota claim, by index) refused,
        by index, with write_batch's row for each; and the older generations of its keys
        each job's Opens superseded on other runners, by index.
        ``restore``: rows written back after a lost write, Opens without their
        compare-and-set (their marks rise with them)."""
        connection = self._connected()
        retention = self.settings.retention
        try:
            self._sent = True
            rows = connection.execute(
                SAVE_BATCH,
                (
                    runner,
                    epoch,
                    retention.stopped_per_key,
                    retention.stopped_total,
                    retention.stopped_for,
                    *columns(jobs, restore=restore),
                    None if not claims else Jsonb(claimed(claims)),
                ),
            ).fetchall()
        except psycopg.Error as error:
            if error.sqlstate == FENCED:
                raise RunnerFencedError(
                    f"{self.settings.shown}: cannot save: the epoch {epoch} of runner "
                    f"{runner} was taken over by another runner of the fleet; nothing "
                    "of this write landed"
                ) from error
            raise
        self.commits += 1
        refusals: dict[int, tuple[Any, ...]] = {}
        older: dict[int, list[Older]] = {}
        for row in rows:
            if row[9] is None:
                refusals[row[0]] = tuple(row[1:9])
            else:
                older.setdefault(row[0], []).append(Older(*row[9:15]))
        return refusals, older

    # -- reads ---------------------------------------------------------------------------

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
                taken_over_at=None if taken_at is None else float(taken_at),
                taken_over_by=taken_by,
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
                taken_at,
                taken_by,
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


def columns(
    jobs: Sequence[Sequence[tuple[SessionRecord, str]]], *, restore: bool = False
) -> tuple[list[Any], ...]:
    """write_batch's row arrays for ``jobs`` (each its records with their bodies), in its
    parameters' order: job, token, identity, instance, generation, request id, lease,
    kind, body, phase, and the memory_bytes and cpu_percent limits. ``restore``: no
    record is an Open (see :meth:`Worker._write`)."""
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
            opened = restore and isinstance(record, OpenRecord)
            kinds.append(Kind.OTHER if opened else _kind(record))
            bodies.append(body)
            phases.append(record.phase.value)
            memory.append(record.limits.memory_bytes)
            cpu.append(record.limits.cpu_percent)
    return built


def claimed(claims: Mapping[int, QuotaClaim]) -> dict[str, dict[str, Any]]:
    """write_batch's ``p_claims``: each job's claim by its number, as quota_refusal reads it."""
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


def refusal_error(
    refusal: tuple[Any, ...], claim: QuotaClaim | None
) -> StaleSessionError | QuotaExceededError:
    """What the caller of a job write_batch refused gets: its row says why."""
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
