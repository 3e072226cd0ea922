"""The README's embedding example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_the_embedding_example_runs(tmp_path: Path) -> None:
    [code] = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "generation 1" in done.stdout
    assert (
        done.stdout.splitlines()[-1] == "exited ExitStatus(code=None, signal=<Signals.SIGTERM: 15>)"
    )
    assert (tmp_path / "state.db").exists()
