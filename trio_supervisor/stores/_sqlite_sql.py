"""The SQLite store's schema and every statement it runs.

The file holds three tables: ``schema_version``, ``records`` and ``high_water``
(:data:`SCHEMA`). A batch of saves is one statement into the ``changes`` view, whose
trigger applies each row (:data:`CHANGES`, in the connection's temporary schema; the
file never holds them); a batch too large for one statement is written by the plain
statements the functions at the end build. The worker (:mod:`._sqlite_worker`) holds
no SQL of its own.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BEGIN",
    "CHANGES",
    "COMMIT",
    "EXCLUSIVE",
    "HIGH_WATER",
    "LAST_SAVED",
    "MIGRATIONS",
    "RECORDS",
    "RECORDS_IN_SAVE_ORDER",
    "ROLLBACK",
    "ROWS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SCHEMA_VERSIONS",
    "STOPS",
    "SYNCHRONOUS",
    "UPDATE_SCHEMA_VERSION",
    "WAL",
    "WRITE_SCHEMA_VERSION",
    "apply_changes",
    "delete_records",
    "raise_marks",
    "upsert_records",
]

# The version of the schema below; a file of an earlier one is migrated (MIGRATIONS), a
# file of a later one (a newer library's) is refused.
SCHEMA_VERSION: Final = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    token    TEXT PRIMARY KEY,
    identity TEXT NOT NULL,
    instance TEXT NOT NULL,
    saved    INTEGER NOT NULL,  -- save order, for list()
    stopped  INTEGER,           -- stop order, NULL while not Stopped: retention's order
    body     TEXT NOT NULL,     -- the versioned JSON record
    stopped_at REAL             -- when it stopped (Unix time): retention's stopped_for
);
-- No secondary indexes: every write goes by token, and the orders above are only read
-- when the file opens (retention's) or at recovery (list's), by one scan each. An index
-- would cost every save an update to spare those two scans a sort.
CREATE TABLE IF NOT EXISTS high_water (
    identity   TEXT NOT NULL,
    instance   TEXT NOT NULL,
    generation INTEGER NOT NULL,
    PRIMARY KEY (identity, instance)
) WITHOUT ROWID;
"""
# The tables, one statement each, made if the file does not hold them yet.
SCHEMA: Final = tuple(statement for statement in _SCHEMA.split(";") if statement.strip())
# From version N - 1 to N: the statements, run in the transaction that opens the file.
# Version 2: each Stopped record's time, for retention's stopped_for; a record stopped
# before it has none, and counts as stopped long ago.
MIGRATIONS: Final[dict[int, tuple[str, ...]]] = {
    2: ("ALTER TABLE records ADD COLUMN stopped_at REAL",),
}

# -- opening: the connection's settings, then the schema in one transaction -------------

# One store owns the file: the lock SQLite takes first is kept until the connection
# closes (sqlite.py's module docs say why).
EXCLUSIVE: Final = "PRAGMA locking_mode = EXCLUSIVE"
# Write-ahead logging; answers the mode in force ("wal" unless SQLite refused it).
WAL: Final = "PRAGMA journal_mode = WAL"
# A commit is on the disk when it returns: a save survives a crash of the machine.
SYNCHRONOUS: Final = "PRAGMA synchronous = FULL"
BEGIN: Final = "BEGIN IMMEDIATE"
COMMIT: Final = "COMMIT"
ROLLBACK: Final = "ROLLBACK"
SCHEMA_VERSIONS: Final = "SELECT version FROM schema_version"
WRITE_SCHEMA_VERSION: Final = "INSERT INTO schema_version (version) VALUES (?)"
UPDATE_SCHEMA_VERSION: Final = "UPDATE schema_version SET version = ?"

# A batch (of up to ROWS changes: nearly every batch but recovery's) is one statement:
# rows inserted into this view, each a change that the trigger applies (a record to
# write, with the high-water mark it raises if any; a record to delete; a mark alone,
# when the batch evicted the record that raised it). One statement is one call into
# SQLite, which runs without the GIL: the worker needs the GIL back once per batch, not
# once per row, and the event loop keeps it meanwhile.
# Both live in the connection's temporary schema; the file never holds them.
CHANGES: Final = (
    """
CREATE TEMP VIEW changes (
    token, identity, instance, saved, stopped, body, generation, stopped_at
) AS SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL WHERE 0
""",
    """
CREATE TEMP TRIGGER apply_change INSTEAD OF INSERT ON changes BEGIN
    DELETE FROM records WHERE NEW.body IS NULL AND token = NEW.token;
    INSERT INTO records (token, identity, instance, saved, stopped, body, stopped_at)
        SELECT NEW.token, NEW.identity, NEW.instance, NEW.saved, NEW.stopped, NEW.body,
            NEW.stopped_at
        WHERE NEW.body IS NOT NULL
        ON CONFLICT (token) DO UPDATE SET
            saved = excluded.saved, stopped = excluded.stopped, body = excluded.body,
            stopped_at = excluded.stopped_at;
    INSERT INTO high_water (identity, instance, generation)
        SELECT NEW.identity, NEW.instance, NEW.generation
        WHERE NEW.generation IS NOT NULL
        ON CONFLICT (identity, instance) DO UPDATE SET
            generation = max(generation, excluded.generation);
END
""",
)

# -- what the worker's mirror reads as the file opens (and after a failed write) --------

# The last save order given.
LAST_SAVED: Final = "SELECT coalesce(max(saved), 0) FROM records"
# Every Stopped record's token, key and time, in stop order: retention's order. A
# record stopped before version 2 kept times counts as stopped long ago.
STOPS: Final = (
    "SELECT token, identity, instance, stopped, coalesce(stopped_at, 0.0) FROM records "
    "WHERE stopped IS NOT NULL ORDER BY stopped"
)
# Every key's mark (high_water() reads it too).
HIGH_WATER: Final = "SELECT identity, instance, generation FROM high_water"

# -- list(): every record, with its save order -------------------------------------------

# Unsorted: the worker sorts them (no index serves the order: see SCHEMA).
RECORDS: Final = "SELECT token, identity, instance, body, saved FROM records"
# Sorted by SQLite, for a file whose save orders Python cannot compare (edited by hand).
RECORDS_IN_SAVE_ORDER: Final = RECORDS + " ORDER BY saved"

# -- writing a batch ---------------------------------------------------------------------

# The most rows of a statement (fewer if the connection's variable limit is lower): a
# batch of at most this many changes is one statement through the view, a larger one
# several plain ones. A statement's text is SQLite's to parse anew unless sqlite3 has it
# prepared (it keeps the last 128, by their text), and parsing a statement of 10,000
# rows cost recovery about half as much as running it; so statements stay this short.
ROWS: Final = 256


def _rows(count: int, width: int) -> str:
    """``count`` rows of ``width`` placeholders each, for a VALUES list."""
    return ", ".join(["(" + ", ".join(["?"] * width) + ")"] * count)


def apply_changes(count: int) -> str:
    """``count`` rows of the ``changes`` view, in one statement (its own transaction):
    token, identity, instance, saved, stopped, body, generation, stopped_at each."""
    # SQL's keywords and names read the same in any case: mutants that change the case
    # of these strings are equivalent (mutmut leaves them out).
    # pragma: no mutate block
    return "INSERT INTO changes VALUES " + _rows(count, 8)


# A batch too large for one statement applies the trigger's changes by these
# (Worker._write_large), in one transaction, each with up to ROWS rows.


def delete_records(count: int) -> str:
    """Delete the records of ``count`` tokens."""
    return f"DELETE FROM records WHERE token IN ({', '.join(['?'] * count)})"


def upsert_records(count: int) -> str:
    """Write ``count`` records: token, identity, instance, saved, stopped, body and
    stopped_at each."""
    # SQL's keywords and names read the same in any case: mutants that change the case
    # of these strings are equivalent (mutmut leaves them out).
    # pragma: no mutate block
    return (
        f"INSERT INTO records (token, identity, instance, saved, stopped, body, stopped_at) "
        f"VALUES {_rows(count, 7)} "
        "ON CONFLICT (token) DO UPDATE SET "
        "saved = excluded.saved, stopped = excluded.stopped, body = excluded.body, "
        "stopped_at = excluded.stopped_at"
    )


def raise_marks(count: int) -> str:
    """Raise ``count`` keys' marks: identity, instance, generation each."""
    # SQL's keywords and names read the same in any case: mutants that change the case
    # of these strings are equivalent (mutmut leaves them out).
    # pragma: no mutate block
    return (
        f"INSERT INTO high_water (identity, instance, generation) VALUES {_rows(count, 3)} "
        "ON CONFLICT (identity, instance) DO UPDATE SET "
        "generation = max(generation, excluded.generation)"
    )
