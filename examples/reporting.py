"""What the examples share: a store that remembers each phase it saved, and a table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trio_supervisor import SessionRecord, SqliteStore, StoppedRecord


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
