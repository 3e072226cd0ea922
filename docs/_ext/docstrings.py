"""Two habits of the package's Google-style docstrings that napoleon reads otherwise.

- One entry for several names (``lease, grace: The supervisor's, in seconds.``) in an
  ``Args:`` or ``Attributes:`` section: napoleon would make ``lease,`` the type of
  ``grace``. Each name gets the entry of its own, with the same text.
- A property's or a constant's docstring is prose (its type is its annotation): napoleon
  would read a first line with a colon (``The database, as errors name it: ...``) as
  ``TYPE: text``. Such a docstring is left as written.

Both run on ``autodoc-process-docstring``, around napoleon's own handler.
"""

from __future__ import annotations

import re
from typing import Any

from sphinx.application import Sphinx

_SECTIONS = {"Args:", "Arguments:", "Attributes:", "Keyword Args:", "Parameters:"}
_SHARED = re.compile(r"^(\s+)(\w+(?:, \w+)+):(.*)$")
_PROSE = {"attribute", "data", "property"}
_KEPT: dict[tuple[str, str], list[str]] = {}


def _indent(line: str) -> int:
    """How far a line is indented (an empty line: not at all, so it ends an entry)."""
    return len(line) - len(line.lstrip()) if line.strip() else 0


def _split_shared(lines: list[str]) -> list[str]:
    out: list[str] = []
    inside = False
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.strip() in _SECTIONS:
            inside = True
        elif line and not line[0].isspace():
            inside = False
        found = _SHARED.match(line) if inside else None
        if found is None:
            out.append(line)
            index += 1
            continue
        indent, names, text = found[1], found[2].split(", "), found[3]
        body = [text]
        index += 1
        while index < len(lines) and _indent(lines[index]) > len(indent):
            body.append(lines[index])
            index += 1
        for name in names:
            out.append(f"{indent}{name}:{body[0]}")
            out.extend(body[1:])
    return out


def _before(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    if what in _PROSE:
        _KEPT[(what, name)] = list(lines)
        return
    lines[:] = _split_shared(lines)


def _after(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    kept = _KEPT.pop((what, name), None)
    if kept is not None:
        lines[:] = kept


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("sphinx.ext.napoleon")  # its handler runs at the default priority
    app.connect("autodoc-process-docstring", _before, priority=400)
    app.connect("autodoc-process-docstring", _after, priority=600)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
