"""What the README and the guides say about the example plugins holds: every plugin they
load resolves, and the failed load they quote is worded as such a load's error is.

The README's and the site's snippets themselves run in test_docs.py (the embedding
example twice, the client against a served runner, the conformance kit under pytest).
"""

from __future__ import annotations

import re
from pathlib import Path

from trio_supervisor import (
    Key,
    Load,
    MemoryStore,
    PackageError,
    SubprocessExecution,
    open_supervisor,
)

from ..support.plugins import PLUGINS
from ..support.snippets import FENCE, pages

# The README and the pages that load the example plugins (the reference and the
# explanations name them only in passing).
PAGES = [
    path
    for path in pages()
    if path.name == "README.md" or path.parent.name in ("tutorial", "how-to")
]


def python_blocks() -> list[str]:
    """Every Python block of those pages."""
    return [
        block["source"]
        for path in PAGES
        for block in FENCE.finditer(path.read_text())
        if block["language"] == "python"
    ]


# A name passed to load: Load(specifier="..."), or a wire body's "specifier" (in a shell
# line its quotes are escaped).
LOADED = re.compile(r'specifier=\\?"([^"\\]+)\\?"|\\?"specifier\\?":\s*\\?"([^"\\]+)\\?"')
# The example of a load that fails: `cannot load 'SPECIFIER': ...`, quoted whole.
FAILED = re.compile(r"`(cannot load '([^']+)':[^`]+)`")
# A plugin module a page has its reader write (``# content of plugins/NAME.py``).
WRITTEN = re.compile(r"#\s*content of \S*?(\w+)\.py")


async def loaded(specifiers: set[str], state: Path) -> dict[str, str | None]:
    """Each ``module:function`` loaded for real into a child, from the examples' entry
    path (``serve --plugins examples/plugins``): None, or the sentence the load failed
    with."""
    found: dict[str, str | None] = {}
    async with (
        MemoryStore() as store,
        SubprocessExecution(state, entry_paths=[PLUGINS], isolation="none") as execution,
        open_supervisor(store, execution, lease=30.0, grace=1.0) as supervisor,
    ):
        for number, specifier in enumerate(sorted(specifiers)):
            record = await supervisor.open(Key(identity="readme", instance=str(number)), "r")
            try:
                await supervisor.load(record.handle, Load(specifier=specifier))
            except PackageError as error:
                found[specifier] = error.detail
            else:
                found[specifier] = None
                await supervisor.dispose(record.handle)
    return found


async def test_every_example_plugin_the_pages_load_resolves(tmp_path: Path) -> None:
    text = "\n".join(path.read_text() for path in PAGES)
    named = {first or second for first, second in LOADED.findall(text)}
    written = set(WRITTEN.findall(text))  # the pages' own plugins run in test_docs.py
    specifiers = {name for name in named if ":" in name and name.split(":")[0] not in written}
    assert "heartbeat:main" in specifiers  # the wire example's and the client's
    for specifier, failure in (await loaded(specifiers, tmp_path)).items():
        assert failure is None, f"a page loads {specifier!r}, but {failure}"
    # A bare name is an in-process plugin: a name of the InProcessExecution beside it
    # (but for a misspelling whose failure the page shows).
    misspelled = set(re.findall(r"cannot load '([^':]+)'", text))
    for name in named - {name for name in named if ":" in name} - misspelled:
        where = [block for block in python_blocks() if f'specifier="{name}"' in block]
        assert where, name
        for block in where:
            assert re.search(rf'InProcessExecution\(\{{[^}}]*"{name}": ', block), name
            assert f"def {name}(" in block, name  # defined there, as plain or async


async def test_the_failed_load_the_pages_quote_is_what_such_a_load_says(tmp_path: Path) -> None:
    # The pages' example of a load that fails is a real misspelling, worded as it is.
    text = " ".join(" ".join(path.read_text().split()) for path in PAGES)  # it may wrap
    examples = {specifier: sentence for sentence, specifier in FAILED.findall(text)}
    assert examples, "no page shows a failed load"
    assert await loaded(set(examples), tmp_path) == examples
