"""Every snippet of the README and of docs/ runs: the pages' blocks are collected here
(tests/support/snippets.py says how each kind runs, tests/project/conftest.py gives each
page its directory), a page to a worker, its blocks in order, after these tests."""

from __future__ import annotations

from ..support import ROOT
from ..support.snippets import FENCE, PENDING, commands, matches, pages


def test_the_readme_and_every_page_of_the_site_are_read() -> None:
    names = [str(path.relative_to(ROOT)) for path in pages()]
    assert names[0] == "README.md"
    assert "docs/tutorial/embedding.md" in names
    assert not [name for name in names if name.startswith("docs/_build/")]


def test_each_pending_block_is_still_there() -> None:
    # An entry whose block its owner rewrote (or marked) goes.
    for page, holds in PENDING:
        blocks = [block["source"] for block in FENCE.finditer((ROOT / page).read_text())]
        assert [block for block in blocks if holds in block], (page, holds)


def test_a_console_block_reads_as_a_reader_types_it() -> None:
    block = "$ echo a \\\n  b\na b\n$ true\n"
    assert list(commands(block)) == [("echo a \\\n  b", "a b"), ("true", "")]


def test_what_varies_from_run_to_run_is_compared_as_alike() -> None:
    shown = '{"token":"257ae9c6-0000-4000-8000-000000000000","age":6.87,"pid":...}'
    printed = '{"token":"0f2c3e4d-1111-4111-8111-111111111111","age":0.5,"pid":4242}'
    assert matches(shown, printed)
    assert matches("│ acme/eu-1 │ 1  │", "│ acme/eu-1    │ 1 │")
    assert not matches('{"lease":60.0}', '{"generation":1}')
