"""A live runner for the API fuzzer: ``trio-supervisor serve`` as a real process.

:func:`live_runner` starts ``python -m trio_supervisor serve`` on an ephemeral loopback
port with a fresh state directory and the example plugins, takes its first stdout line
(``listening on URL``, docs/service.md section A) as the sign that it listens, reads the
tokens it made, and on the way out stops it with SIGTERM, waits for it to exit (every
child reaped) and kills it if it hangs. Its stderr goes to a file, so that a failure can
show what the runner logged (the traceback behind a 500, say).

How many examples the fuzzer draws per operation comes from the environment:
:data:`EXAMPLES_VARIABLE` (``nox -s api`` sets it high; plain pytest runs a short pass).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "DEFAULT_EXAMPLES",
    "EXAMPLES_VARIABLE",
    "PLUGINS",
    "REPO",
    "LiveRunner",
    "examples_per_operation",
    "live_runner",
]

REPO: Final = Path(__file__).resolve().parents[2]
PLUGINS: Final = REPO / "examples" / "plugins"

EXAMPLES_VARIABLE: Final = "TRIO_SUPERVISOR_API_EXAMPLES"
DEFAULT_EXAMPLES: Final = 25  # per operation: the short pass of plain pytest (and CI)

STARTUP_SECONDS: Final = 30.0  # for the "listening on" line
STOP_SECONDS: Final = 30.0  # for the exit after SIGTERM (children get their grace)


def examples_per_operation() -> int:
    """The number of generated examples per operation: the variable's, or the default."""
    raw = os.environ.get(EXAMPLES_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_EXAMPLES
    number = int(raw)
    if number < 1:
        raise ValueError(f"{EXAMPLES_VARIABLE} must be >= 1, got {raw!r}")
    return number


@dataclass(frozen=True)
class LiveRunner:
    """A runner process that listens.

    Attributes:
        url: ``http://127.0.0.1:PORT``, from its ``listening on`` line.
        state: Its state directory.
        operator_token: The operators' token (every call is allowed).
        hosts_token: The hosts' token (the session calls only).
        stderr: The file its log goes to.
        process: The process itself.
    """

    url: str
    state: Path
    operator_token: str
    hosts_token: str
    stderr: Path
    process: subprocess.Popen[str]

    def log(self, last: int = 60) -> str:
        """The last lines the runner logged."""
        try:
            lines = self.stderr.read_text(errors="replace").splitlines()
        except OSError as error:
            return f"(no log: {error})"
        return "\n".join(lines[-last:])


def _first_line(process: subprocess.Popen[str], timeout: float) -> str:
    """The first stdout line of ``process``, or "" if it exits or stays silent too long."""
    assert process.stdout is not None
    stdout = process.stdout
    found: list[str] = []

    def read() -> None:
        found.append(stdout.readline())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return found[0].strip() if found else ""


def _stop(process: subprocess.Popen[str]) -> int:
    """SIGTERM, wait for the exit; SIGKILL if it does not come. Returns the status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(STOP_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


@contextlib.contextmanager
def live_runner(state: Path, *flags: str) -> Iterator[LiveRunner]:
    """Run ``trio-supervisor serve`` on a free loopback port for the block's duration.

    Args:
        state: The state directory (made by the runner; should not exist yet).
        flags: More flags for ``serve``.

    Raises:
        RuntimeError: The runner did not say it listens, or did not exit 0 on SIGTERM.
    """
    stderr = state.with_name(state.name + ".stderr")
    command = [
        sys.executable,
        "-m",
        "trio_supervisor",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--state",
        str(state),
        "--plugins",
        str(PLUGINS),
        *flags,
    ]
    with stderr.open("w") as log:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    runner: LiveRunner | None = None
    try:
        line = _first_line(process, STARTUP_SECONDS)
        prefix = "listening on "
        if not line.startswith(prefix):
            raise RuntimeError(
                f"the runner did not say it listens (first line {line!r}, exit status "
                f"{process.poll()}); its log:\n{stderr.read_text(errors='replace')}"
            )
        runner = LiveRunner(
            url=line.removeprefix(prefix),
            state=state,
            operator_token=(state / "operator-token").read_text().strip(),
            hosts_token=(state / "token").read_text().strip(),
            stderr=stderr,
            process=process,
        )
        yield runner
    finally:
        try:
            status = _stop(process)
        finally:
            assert process.stdout is not None
            process.stdout.close()
    if status != 0:
        log_tail = runner.log() if runner is not None else ""
        raise RuntimeError(f"the runner exited {status} on SIGTERM; its log:\n{log_tail}")
