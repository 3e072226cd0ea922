"""Pages whose tables are made from the code at build time.

A page holds a marker line, ``<!-- generated: NAME -->``; as Sphinx reads the page, the
marker is replaced by the Markdown that ``NAME``'s generator makes from the code (the
errors and their statuses, the wire API, the metrics, the TOML keys). The rest of the
page is written by hand around it. A page with a marker is read again on every build, so
the tables never lag the code; a marker no generator knows fails the build.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import config_page
import errors_page
import metrics_page
import wire_page
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging

logger = logging.getLogger(__name__)

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)

GENERATORS: dict[str, Callable[[], str]] = {
    "errors": errors_page.error_table,
    "problem-codes": errors_page.problem_codes,
    "wire-calls": wire_page.calls,
    "wire-schemas": wire_page.schemas,
    "metrics": metrics_page.metrics,
    "log-fields": metrics_page.log_fields,
    "config-keys": config_page.config_keys,
    "limits-keys": config_page.limits_keys,
    "tenants-keys": config_page.tenants_keys,
}


def _fill(app: Sphinx, docname: str, source: list[str]) -> None:
    def replace(found: re.Match[str]) -> str:
        name = found[1]
        if name not in GENERATORS:
            logger.warning("%s: no generator called %r", docname, name, location=docname)
            return ""
        return GENERATORS[name]()

    source[0] = MARKER.sub(replace, source[0])


def _outdated(
    app: Sphinx,
    env: BuildEnvironment,
    added: set[str],
    changed: set[str],
    removed: set[str],
) -> list[str]:
    """The pages with a marker, read again on every build (their code may have changed)."""
    pages = []
    for docname in sorted(env.found_docs - added - changed - removed):
        path = env.doc2path(docname)
        if path.suffix == ".md" and MARKER.search(path.read_text(encoding="utf-8")):
            pages.append(docname)
    return pages


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("source-read", _fill)
    app.connect("env-get-outdated", _outdated)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
