"""Works for a while, then crashes (exit code 1)."""

from __future__ import annotations

import time
from typing import Any


def main(context: Any) -> None:
    time.sleep(float(context.config.get("after", 0.5)))
    raise RuntimeError("the crasher crashed, as it does")
