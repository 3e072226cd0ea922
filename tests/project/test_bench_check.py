"""The benchmarks' regression guard (``nox -s bench-check``, ``benchmarks/check.py``):
its references live in docs/benchmarks.md, and a drop beyond a row's band fails it.

No benchmark runs here: the block is read, and verdicts are given on made-up results.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.check import DOC, LEAST_BAND, MARK, judge, read_block, reference, write_block
from benchmarks.measure import Result


def result(name: str, ratio: float, better: str = "higher") -> Result:
    return Result(
        name=name,
        unit="cycles/s",
        better="higher" if better == "higher" else "lower",
        target=1.0,
        ours=[ratio],
        baseline=[1.0],
        baseline_name="a made-up baseline",
    )


def test_the_references_are_one_block_of_docs_benchmarks_md() -> None:
    text = DOC.read_text()
    assert text.count(MARK) == 1
    block = read_block(text)
    assert block["rows"], "no reference measured"
    for name, figures in block["rows"].items():
        assert figures["better"] in ("higher", "lower"), name
        assert figures["band"] >= LEAST_BAND, name
        # Each reference is what its runs give: the median, the spread and the band.
        assert figures == reference(figures["better"], figures["runs"]), name
    # Written back unchanged, it reads the same.
    assert read_block(write_block(text, block)) == block


@pytest.mark.parametrize(
    ("better", "ratio", "dropped"),
    [
        ("higher", 0.91, False),  # 9% worse, within the band of 10%
        ("higher", 0.89, True),
        ("higher", 1.50, False),  # better is never a drop
        ("lower", 1.09, False),
        ("lower", 1.11, True),
        ("lower", 0.50, False),
    ],
)
def test_a_ratio_worse_than_its_reference_by_more_than_its_band_is_a_drop(
    better: str, ratio: float, dropped: bool
) -> None:
    block: dict[str, Any] = {
        "rows": {"row": {"ratio": 1.0, "band": 0.1, "better": better, "runs": [1.0]}}
    }
    rows, flagged = judge({"row": result("row", ratio, better)}, block)
    assert flagged == (["row"] if dropped else [])
    assert rows[1][-1] == ("DROP" if dropped else "ok")


def test_a_row_not_measured_is_said_so_and_not_a_drop() -> None:
    block: dict[str, Any] = {
        "rows": {"row": {"ratio": 1.0, "band": 0.1, "better": "higher", "runs": [1.0]}}
    }
    rows, flagged = judge({}, block)
    assert flagged == []
    assert rows[1][-1] == "not measured"


def test_a_row_without_a_reference_is_shown_and_not_judged() -> None:
    block: dict[str, Any] = {
        "rows": {"row": {"ratio": 1.0, "band": 0.1, "better": "higher", "runs": [1.0]}}
    }
    rows, flagged = judge(
        {"row": result("row", 1.0, "higher"), "new": result("new", 9.0, "lower")}, block
    )
    assert flagged == []
    assert rows[-1][0] == "new"
    assert rows[-1][-1] == "no reference"
