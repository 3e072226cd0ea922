"""The documentation's snippets: test_docs.py collects each page's (tests/support/snippets.py),
and each page runs in a directory of its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ..support import ROOT
from ..support.snippets import Page, Pages, page_directory


def pytest_pycollect_makemodule(
    module_path: Path, parent: pytest.Collector
) -> pytest.Module | None:
    """test_docs.py's tests, and then the pages' snippets."""
    if module_path.name == "test_docs.py":
        return Pages.from_parent(parent, path=module_path)
    return None


@pytest.fixture(scope="module")
def snippet_page(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Page]:
    """The page whose snippets run (a module, to pytest: one page), in a directory of its own;
    the runners it started are stopped when it ends."""
    path = Path(request.node.path)
    with page_directory(str(path.relative_to(ROOT)), tmp_path_factory.mktemp("page")) as page:
        yield page
