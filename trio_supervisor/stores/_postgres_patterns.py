"""fnmatch patterns as one PostgreSQL regular expression, matching exactly what
``fnmatch.fnmatchcase`` matches: how the store counts a tenant's records in SQL.

Theory of operation
-------------------
A pattern is read as ``fnmatch.translate`` reads it: ``*`` any run of characters, ``?``
any one, ``[seq]`` and ``[!seq]`` a set, and a ``[`` that no ``]`` closes a plain ``[``.
Everything else stands for itself: an ASCII letter or digit as itself, any other
character as a ``\\uXXXX`` (or ``\\UXXXXXXXX``) escape, so no character of an identity is
ever special to PostgreSQL.

A set's meaning (ranges, a ``-`` at either end, a ``]`` first, empty and reversed
ranges) is Python's, taken from Python itself rather than re-derived: the set is a
union of ranges whose ends are characters of the set's text, so whether a character
belongs can change only at such a character or just past it. Asking Python's own
compiled set about the first character of each of those few intervals gives the set
exactly, as ranges; the expression lists them. Surrogates are left out (a PostgreSQL
text cannot hold one), and so is NUL.

PostgreSQL's advanced regular expressions match ``.`` across newlines unless told
otherwise, and ``$`` only at the very end: as ``fnmatch``'s ``(?s:...)\\Z``. The store's
database must be UTF-8 for the escapes to name the characters they name.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from typing import Final

__all__ = ["identity_regex"]

_LAST: Final = 0x10FFFF
_SURROGATES: Final = (0xD800, 0xDFFF)


def identity_regex(patterns: Sequence[str]) -> str | None:
    """One PostgreSQL regular expression for ``identity ~ regex``, true exactly when
    ``fnmatch.fnmatchcase(identity, pattern)`` holds for one of ``patterns``.

    Returns:
        The expression, or None when no identity can match (no patterns, or only
        patterns with an empty set): ``identity ~ NULL`` matches nothing.
    """
    alternatives = [regex for regex in map(_pattern, patterns) if regex is not None]
    if not alternatives:
        return None
    return "^(?:" + "|".join(alternatives) + ")$"


def _pattern(pattern: str) -> str | None:
    """One pattern's expression, unanchored; None if it can match nothing."""
    parts: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if not parts or parts[-1] != ".*":  # fnmatch folds a run of stars into one
                parts.append(".*")
        elif c == "?":
            parts.append(".")
        elif c == "[":
            # Where the set ends, exactly as fnmatch.translate looks for it.
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                parts.append(_char(ord("[")))
                continue
            members = _set(pattern[i - 1 : j + 1])
            if members is None:
                return None
            parts.append(members)
            i = j + 1
        else:
            parts.append(_char(ord(c)))
    return "".join(parts)


def _set(bracket: str) -> str | None:
    """The expression of one ``[...]`` of a pattern; None for a set of no character."""
    python = re.compile(fnmatch.translate(bracket))
    # Membership is constant between two consecutive points of this list.
    points = sorted(
        {1, _SURROGATES[0], _SURROGATES[1] + 1}
        | {ord(c) for c in bracket}
        | {ord(c) + 1 for c in bracket if ord(c) < _LAST}
    )
    ranges: list[tuple[int, int]] = []
    for index, first in enumerate(points):
        last = points[index + 1] - 1 if index + 1 < len(points) else _LAST
        if first == 0 or _SURROGATES[0] <= first <= _SURROGATES[1]:
            continue
        if python.match(chr(first)) is None:
            continue
        if ranges and ranges[-1][1] == first - 1:
            ranges[-1] = (ranges[-1][0], last)
        else:
            ranges.append((first, last))
    if not ranges:
        return None
    if ranges == [(1, _SURROGATES[0] - 1), (_SURROGATES[1] + 1, _LAST)]:
        return "."
    return (
        "["
        + "".join(
            _char(first) if first == last else f"{_char(first)}-{_char(last)}"
            for first, last in ranges
        )
        + "]"
    )


def _char(code: int) -> str:
    """One character, as itself when it is an ASCII letter or digit (for whoever reads
    the expression), else as an escape no PostgreSQL expression reads as special."""
    if code < 0x80 and chr(code).isalnum():
        return chr(code)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
