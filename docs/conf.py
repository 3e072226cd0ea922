"""Sphinx configuration of the documentation site (``nox -s docs``).

The site is MyST Markdown. The reference is built from the code: autodoc reads the
package's docstrings, sphinx-click its command group, and the local extensions in
``docs/_ext/`` write the pages whose content is a table of the code (errors, the wire
API, metrics, log fields, the TOML files). The build is offline: no intersphinx
inventory is fetched, so names outside the package are listed in ``nitpick_ignore``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))  # the package, when the site is built from a clone

import trio_supervisor  # noqa: E402

project = "trio_supervisor"
author = "the trio_supervisor authors"
copyright = "the trio_supervisor authors"
release = trio_supervisor.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxcontrib_trio",
    "sphinx_click",
    # Local (docs/_ext/): two docstring habits napoleon misreads, the pages made from the
    # code, and references to a name by any of its paths.
    "docstrings",
    "generated",
    "reexports",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
# Files under docs/ that are not pages of the site.
exclude_patterns = [
    "_build",
    "_ext",
    "Thumbs.db",
    ".DS_Store",
]

# Every cross-reference must resolve (-n); a warning fails the build (-W).
nitpicky = True

# --- MyST ---------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "fieldlist"]
# Anchors for headings down to ####, so the existing `page.md#a-heading` links work.
myst_heading_anchors = 4

# --- autodoc and napoleon -------------------------------------------------------------
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# A class's "Attributes:" as fields of its entry, not entries of their own: a property
# documented both ways would be described twice.
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_class_signature = "separated"
autodoc_preserve_defaults = True

# --- HTML -----------------------------------------------------------------------------
html_theme = "furo"
html_title = f"trio_supervisor {release}"
html_static_path: list[str] = []

# Names outside the package: with no inventory fetched, a reference to them cannot
# resolve. Each is a type hint or a base class the reference shows. (Builtins and
# typing's names resolve without an inventory.)
nitpick_ignore = [
    ("py:func", "trio.move_on_after"),
    ("py:func", "trio.sleep"),
] + [
    ("py:class", name)
    for name in (
        "collections.abc.AsyncGenerator",
        "collections.abc.AsyncIterator",
        "collections.abc.Awaitable",
        "collections.abc.Callable",
        "collections.abc.Collection",
        "collections.abc.Iterable",
        "collections.abc.Mapping",
        "collections.abc.Sequence",
        "contextlib.AbstractAsyncContextManager",
        "pathlib.Path",
        "trio.testing.MockClock",
        # The package's private classes that a public property returns: no page
        # documents them.
        "trio_supervisor.executions.limits._cgroups.Hierarchies",
        "trio_supervisor.executions.limits._isolation.Isolated",
        "trio_supervisor.executions.trees._containment.Mechanism",
        "trio_supervisor.stores._postgres_link.Memory",
    )
]
