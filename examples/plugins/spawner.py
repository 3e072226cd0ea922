"""Spawns grandchildren that ignore SIGTERM; only a SIGKILL to the group ends them.

With ``config["leader"] == "dies at once"`` the plugin itself dies on SIGTERM without
cleaning up, leaving its grandchildren to the supervisor's kill after the grace.
"""

from __future__ import annotations

import signal
import subprocess
import time
from typing import Any


def main(context: Any) -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited across exec
    children = [
        subprocess.Popen(["sleep", "1000"]) for _ in range(int(context.config.get("children", 2)))
    ]
    signal.signal(
        signal.SIGTERM,
        signal.SIG_DFL if context.config.get("leader") == "dies at once" else previous,
    )
    print("grandchildren", " ".join(str(child.pid) for child in children), flush=True)
    while True:
        time.sleep(0.1)
