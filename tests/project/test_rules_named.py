"""Every rule of docs/design.md is named by a test: a rule id (O1, F7, ...) in a test's
name, as ``test_f7_a_killed_runner_...``, so that a rule without a test shows."""

from __future__ import annotations

import re

from ..support import ROOT


def test_every_rule_id_of_the_design_is_named_by_a_test() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    rules = set(re.findall(r"^- \*\*([A-Z]\d+)\*\*", design, flags=re.MULTILINE))
    assert len(rules) > 50, "the design's rules were not found: has their form changed?"
    names = " ".join(
        name
        for path in (ROOT / "tests").rglob("test_*.py")
        for name in re.findall(r"def (test_\w+)", path.read_text())
    )
    named = {rule for rule in rules if re.search(rf"(?<![a-z0-9]){rule.lower()}(?![0-9])", names)}
    assert rules - named == set(), f"rules no test names: {sorted(rules - named)}"
