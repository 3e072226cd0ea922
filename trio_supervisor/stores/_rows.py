"""A store's rows read back: where a stored row becomes a record or a key again, for
the SQLite and the PostgreSQL store alike.

Both keep a record as its versioned JSON (:func:`~trio_supervisor.codec.encode`) beside
the token and key it is stored under, and a high-water mark as a key and a generation.
A row that does not give back what was stored is a
:class:`~trio_supervisor.errors.RecordFormatError` naming the store and the row, worded
here once: a record that is unreadable (not JSON, or of a version this library does not
know), a row that holds the record of another session (its columns and its record
disagree: a row copied or edited by hand), and a row that no record or key can hold at
all (a value the database let through, such as a NULL in SQLite's primary key).
"""

from __future__ import annotations

from ..codec import decode
from ..errors import RecordFormatError
from ..model import Key, SessionRecord

__all__ = ["key_of", "record_of"]


def record_of(where: str, token: str, identity: str, instance: str, body: str) -> SessionRecord:
    """The record a row holds.

    Args:
        where: The store, as its errors name it (its file, or its DSN without a password).
        token: The token the row is stored under.
        identity: The identity of the key it is stored under.
        instance: The instance of that key.
        body: The record's versioned JSON.

    Raises:
        RecordFormatError: The record is unreadable, belongs to another session than
            the row's, or the row is malformed; the message names the row.
    """
    try:
        return _checked(where, token, identity, instance, body)
    except (TypeError, ValueError) as error:
        # Columns no record can be stored under (a NULL token, say) fail on the way.
        raise RecordFormatError(f"{where}: a record row is malformed: {error}") from error


def _checked(where: str, token: str, identity: str, instance: str, body: str) -> SessionRecord:
    try:
        record = decode(body)
    except RecordFormatError as error:
        row = _row(where, token, identity, instance)
        raise RecordFormatError(f"{row} is unreadable: {error.detail}") from error
    handle = record.handle
    key = handle.key
    if handle.token != token or key.identity != identity or key.instance != instance:
        raise RecordFormatError(
            f"{_row(where, token, identity, instance)} holds the record of another session "
            f"({key.identity}/{key.instance}, token {handle.token[:8]}...)"
        )
    return record


def _row(where: str, token: str, identity: str, instance: str) -> str:
    """A row as an error names it (worded only for a row that is wrong)."""
    return f"{where}: the record of {identity}/{instance} (token {token[:8]}...)"


def key_of(where: str, identity: str, instance: str) -> Key:
    """The key of a high-water row.

    Raises:
        RecordFormatError: No key can hold the row's identity and instance.
    """
    try:
        return Key(identity=identity, instance=instance)
    except (TypeError, ValueError) as error:
        raise RecordFormatError(f"{where}: a high-water row is malformed: {error}") from error
