"""``trio-supervisor serve`` isolates its children (issue 35): the operator's scenario.

A real runner process, a host loading a hostile plugin over HTTP: the plugin goes after
the runner's token files, store, state directory, other sessions' logs, the runner
process, and (with ``--child-network none``) the runner's port. Everything is refused,
and the runner goes on serving. Readiness: the runner's ``listening on URL`` line, the
plugin's ``done`` in its log.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

import pytest

from trio_supervisor import Key, Load, LoadedRecord

from ..support.plugins import ISOLATION, without_the_way_down
from ..support.runners import serving
from ..support.waits import until

ATTACKS_BOUND = 30.0

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="children get uids of their own as root")


def outcomes(log: str) -> dict[str, str]:
    found = {}
    for line in log.splitlines():
        if line.startswith("ATTACK "):
            for outcome in (" refused ", " SUCCEEDED "):
                name, said, detail = line.removeprefix("ATTACK ").partition(outcome)
                if said:
                    found[name] = said.strip() + " " + detail
    return found


@pytest.mark.parametrize("fork", [(), ("--fork-server",)], ids=["started", "forked"])
async def test_a_hostile_plugin_gets_nothing_of_the_runners(
    tmp_path: Path, fork: tuple[str, ...]
) -> None:
    state = tmp_path / "state"
    with serving(state, *fork, plugins=[ISOLATION]) as runner:
        async with runner.host() as host:
            victim = await host.open(Key(identity="other", instance="v"), "v", lease=60.0)
            await host.load(victim.handle, Load(specifier="attacks:identity"))
            attacker = await host.open(Key(identity="evil", instance="e"), "e", lease=60.0)
            config = {
                "state": str(state),
                "other_log": str(next((state / "logs").iterdir())),
                "other_home": str(state / "children"),
                "runner": runner.process.pid,
            }
            await host.load(attacker.handle, Load(specifier="attacks:everything", config=config))
            async with runner.operator() as operator:

                async def log() -> str:
                    return await operator.logs(attacker.handle.key, 1)

                await until(lambda: _done(log), "the attacks are done", bound=ATTACKS_BOUND)
                said = outcomes(await log())
            assert said.pop("write in its TMPDIR").startswith("SUCCEEDED"), said
            assert len(said) == 17
            record = await host.status(attacker.handle)
            assert isinstance(record, LoadedRecord)
            said = without_the_way_down(said, state, record.child.uid)
            assert {name: how for name, how in said.items() if not how.startswith("refused")} == {}
            # The runner serves on: the host's sessions are as they were, and end cleanly.
            assert runner.process.poll() is None
            assert (await host.status(victim.handle)).handle == victim.handle
            for handle in (attacker.handle, victim.handle):
                await host.dispose(handle)


async def _done(log: object) -> bool:
    assert callable(log)
    return "done" in await log()


async def test_without_a_network_a_child_cannot_reach_the_runners_port(tmp_path: Path) -> None:
    with serving(tmp_path / "state", "--child-network", "none", plugins=[ISOLATION]) as runner:
        port = urllib.parse.urlsplit(runner.url).port
        async with runner.host() as host, runner.operator() as operator:
            record = await host.open(Key(identity="evil", instance="net"), "n", lease=60.0)
            await host.load(record.handle, Load(specifier="attacks:connect", config={"port": port}))

            async def log() -> str:
                return await operator.logs(record.handle.key, 1)

            await until(lambda: _done(log), "the attempt is done", bound=ATTACKS_BOUND)
            [outcome] = outcomes(await log()).values()
            assert outcome.startswith("refused ConnectionRefusedError"), outcome
            await host.dispose(record.handle)
