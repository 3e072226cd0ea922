"""What the examples share: a store that remembers each phase it saved, a table, and
what they say when their store is held by another process."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trio_supervisor import SessionRecord, SqliteStore, StateStorageError, StoppedRecord


class Journal(SqliteStore):
    """A SqliteStore that also remembers, per session, each phase it made durable."""

    def __init__(self, path: Path, **options: Any) -> None:
        super().__init__(path, **options)
        self.paths: dict[str, list[str]] = {}

    async def save(self, record: SessionRecord) -> None:
        await super().save(record)
        self.note(record)

    async def save_many(self, records: Sequence[SessionRecord]) -> None:
        await super().save_many(records)
        for record in records:
            self.note(record)

    def note(self, record: SessionRecord) -> None:
        phases = self.paths.setdefault(record.handle.token, [])
        if not phases or phases[-1] != record.phase.value:
            phases.append(record.phase.value)


def table(rows: Sequence[Sequence[str]]) -> str:
    """Rows as aligned columns, the first row a header."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def describe(record: SessionRecord, phases: Mapping[str, list[str]]) -> list[str]:
    """Session, generation, phases, stop reason and termination of one record."""
    key = record.handle.key
    path = " > ".join(phases.get(record.handle.token, [record.phase.value]))
    reason = termination = ""
    if isinstance(record, StoppedRecord):
        reason = record.reason.kind
        termination = record.termination.describe()
    return [
        f"{key.identity}/{key.instance}",
        str(record.handle.generation),
        path,
        reason,
        termination,
    ]


def run_or_explain_lock(run: Callable[[], object], state: Path) -> None:
    """Call ``run``; if its SQLite store is locked by another process, exit with one
    sentence saying so (and how to give the example a store of its own), not a traceback.

    Another process holding the file is most likely ``trio-supervisor serve``, or this
    example, running on the same state directory.
    """
    try:
        run()
    except (StateStorageError, BaseExceptionGroup) as error:
        if not _all_locked(error):
            raise
        raise SystemExit(
            f"the store in {state} is locked by another process (a runner serving on "
            f"{state}?): stop it, or give this example a state directory of its own "
            "with --state DIR"
        ) from None


def _all_locked(error: BaseException) -> bool:
    if isinstance(error, BaseExceptionGroup):
        return all(_all_locked(inner) for inner in error.exceptions)
    # SQLite's own words, which the store's message quotes: "database is locked".
    return isinstance(error, StateStorageError) and "locked" in error.detail
