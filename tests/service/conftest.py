"""The service's tests' shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..support.members import write_tokens


@pytest.fixture
def tokens(tmp_path: Path) -> tuple[Path, Path]:
    """The token files every runner of a fleet is given (copies, on real machines)."""
    return write_tokens(tmp_path)
