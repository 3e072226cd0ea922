"""Reports what its child process looks like: environment, limits, then waits."""

from __future__ import annotations

import json
import os
import resource
import time
from typing import Any


def main(context: Any) -> None:
    limits = {
        name: resource.getrlimit(getattr(resource, name))[0]
        for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NOFILE", "RLIMIT_FSIZE")
    }
    report = {"environment": dict(os.environ), "limits": limits, "config": dict(context.config)}
    print("REPORT " + json.dumps(report), flush=True)
    print("x" * int(context.config.get("chatter", 0)), flush=True)
    while True:
        time.sleep(0.1)
