"""What each step of a child's isolation costs, on the real code (root only).

``python -m benchmarks.isolation_steps``: the children's view made once per execution,
a uid claimed and given back by the runner, and ``isolate()`` as the plugin process runs
it before "start" (in a process forked into a PID namespace of its own, as a plugin is),
with the host's network and with none, and without a ``/proc`` of its own. Medians
of 50. Not a comparison with a baseline: docs/benchmarks.md ("Isolation") sets these
beside ``child.cycle`` and ``child.cycle.no_isolation`` of the same day.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

from trio_supervisor.executions.child import _bootstrap
from trio_supervisor.executions.child._protocol import IsolationSpec
from trio_supervisor.executions.limits import _isolation, _view
from trio_supervisor.executions.limits._isolation import Network
from trio_supervisor.executions.starting._standby import compile_bootstrap

USERS = range(2_100_000_000, 2_100_000_100)  # not the default range: runners may run
TIMES = 50


def median_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1000:.3f} ms"


async def prepared(state: Path, bootstrap: Path) -> _isolation.Isolated:
    return await _view.prepare(
        "users",
        USERS,
        "host",
        state=state,
        python=sys.executable,
        bootstrap=bootstrap,
        entry_paths=[],
        executables=[],
    )


async def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        state = Path(directory)
        bootstrap = compile_bootstrap(state)
        made = []
        for _ in range(2):  # the first asks the interpreter for its path
            started = time.perf_counter()
            (await prepared(state, bootstrap)).close()
            made.append(time.perf_counter() - started)
        print(f"prepare, per execution: first {made[0] * 1000:.1f} ms, then {made[1] * 1000:.1f}")
        isolated = await prepared(state, bootstrap)
        try:
            claims, releases = [], []
            for _ in range(TIMES):
                started = time.perf_counter()
                grant = await isolated.claim()
                claims.append(time.perf_counter() - started)
                started = time.perf_counter()
                await isolated.release(grant)
                releases.append(time.perf_counter() - started)
            print(f"claim, per child: {median_ms(claims)}; give back: {median_ms(releases)}")
            _bootstrap.bind("unshare", "prctl", "setns")
            _bootstrap.bind_mount()  # as a bootstrap does before its spawn message
            settings: tuple[tuple[Network, bool], ...] = (
                ("host", True),
                ("none", True),
                ("host", False),
            )
            for network, proc in settings:
                steps = []
                for _ in range(TIMES):
                    grant = await isolated.claim()
                    spec = isolated.spec(grant)
                    spec["network"], spec["proc"] = network, proc
                    steps.append(_isolate_in_a_child(spec))
                    await isolated.release(grant)
                print(
                    f"isolate() in the plugin process, network {network}, "
                    f"{'a /proc of its own' if proc else 'the host /proc'}: {median_ms(steps)}"
                )
        finally:
            isolated.close()


def _isolate_in_a_child(spec: IsolationSpec) -> float:
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover  # the middle process: a PID namespace, and its PID 1
        _bootstrap.unshare("pid")
        init = os.fork()
        if init == 0:
            started = time.perf_counter()
            _bootstrap.isolate(spec, own_pids=True)
            os.write(writer, repr(time.perf_counter() - started).encode())
            os._exit(0)
        os.waitpid(init, 0)
        os._exit(0)
    os.close(writer)
    took = float(os.read(reader, 64))
    os.close(reader)
    os.waitpid(pid, 0)
    return took


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("isolation_steps measures children with uids of their own: run it as root")
    trio.run(main)
