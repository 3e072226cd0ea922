"""``trio-supervisor serve`` processes: the one way a test starts a runner
(:func:`serving`, which waits for its ``listening on URL`` line), its clients, its
records, and sessions opened on it."""

from __future__ import annotations

import contextlib
import re
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import httpx

from trio_supervisor import Handle, Key, Load
from trio_supervisor.client import RemoteSupervisor, connect

from . import ROOT
from .plugins import PLUGINS
from .processes import Launched, NotReady, launched
from .waits import until

LISTENING: Final = re.compile(
    r"listening on (?P<scheme>https?)://(?P<host>[^\s:/]+):(?P<port>\d+)\n"
)
LEASE: Final = 120.0  # seconds: no session of the runner tests expires while it runs


class Runner(Launched):
    """A ``trio-supervisor serve`` process that said it listens (see :func:`serving`).

    Attributes:
        line: Its first line on stdout, as it printed it (``listening on URL\\n``).
        url: The URL the line names.
        state: Its state directory.
    """

    def __init__(self, started: Launched, state: Path) -> None:
        super().__init__(started.process, started.lines, started.log)
        self.line = started.lines[-1]
        self.url = self.line.removeprefix("listening on ").strip()
        self.state = state

    def token(self, name: str = "token") -> str:
        """A token from its state directory: ``token`` (hosts) or ``operator-token``."""
        return (self.state / name).read_text().strip()

    @property
    def hosts_token(self) -> str:
        return self.token("token")

    @property
    def operator_token(self) -> str:
        return self.token("operator-token")

    def host(
        self, token: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[RemoteSupervisor]:
        """A host's client: the URL and the hosts' token (or ``token``), nothing else."""
        return connect(self.url, token=token or self.hosts_token)

    def operator(self) -> contextlib.AbstractAsyncContextManager[RemoteSupervisor]:
        """An operator's client: the URL and the operators' token."""
        return connect(self.url, token=self.operator_token)

    def http(self, token: str | None = None) -> httpx.AsyncClient:
        """A bare HTTP client with ``token`` (the operators' by default) as its bearer."""
        bearer = {"Authorization": f"Bearer {token or self.operator_token}"}
        return httpx.AsyncClient(base_url=self.url, headers=bearer, timeout=30.0)

    async def sessions(self) -> list[dict[str, Any]]:
        """Every record the runner holds, as ``GET /v1/sessions`` lists it."""
        return await self.sessions_as(self.operator_token)

    async def sessions_as(self, token: str) -> list[dict[str, Any]]:
        """:meth:`sessions`, asked with ``token`` (an operators' token kept elsewhere)."""
        async with self.http(token) as operator:
            answer = await operator.get("/v1/sessions", params={"limit": 1000})
        assert answer.status_code == 200, answer.text
        sessions: list[dict[str, Any]] = answer.json()["sessions"]
        return sessions

    async def record(self, key: Key, generation: int) -> dict[str, Any] | None:
        """The runner's record of one session, as an operator lists it (no token)."""
        wanted = {"key": {"identity": key.identity, "instance": key.instance}}
        for record in await self.sessions():
            if record["handle"] == {**wanted, "generation": generation}:
                return record
        return None


@contextlib.contextmanager
def serving(
    state: Path | None,
    *flags: str | Path,
    plugins: Sequence[Path] = (PLUGINS,),
    listen: str | None = "127.0.0.1:0",
    cwd: Path = ROOT,
    log: Path | None = None,
) -> Iterator[Runner]:
    """Run ``trio-supervisor serve`` until it listens; on the way out, stop it (SIGTERM,
    then SIGKILL after SHUTDOWN seconds) if it still runs.

    The readiness handshake is its first line on stdout, ``listening on URL`` (SERVICE.md
    section A), never a guessed while.

    Args:
        state: Its ``--state``; None leaves the flag out (``./runner-state`` in ``cwd``).
        flags: More flags.
        plugins: A ``--plugins`` flag for each (the example plugins by default).
        listen: Its ``--listen``; None leaves the flag out (a config file gives it).
        cwd: Its working directory.
        log: Where its stderr goes (beside the state directory by default).

    Raises:
        NotReady: Its first line was not ``listening on URL``, within STARTUP seconds.
    """
    state_path = cwd / "runner-state" if state is None else state
    command: list[str | Path] = [sys.executable, "-m", "trio_supervisor", "serve"]
    if state is not None:
        command += ["--state", state]
    if listen is not None:
        command += ["--listen", listen]
    for directory in plugins:
        command += ["--plugins", directory]
    command += flags
    log = log or state_path.with_name(state_path.name + ".stderr")
    with launched(command, ready=lambda line: True, cwd=cwd, log=log) as started:
        if not LISTENING.fullmatch(started.lines[-1]):
            raise NotReady(
                f"serve printed {started.lines[-1]!r} as its first line; its stderr:\n"
                + started.stderr()
            )
        yield Runner(started, state_path)


async def open_sessions(
    runner: Runner, count: int, *, loaded: int = 0, first: int = 1
) -> list[Handle]:
    """Open ``count`` sessions of the identity ``acme`` (instances ``eu-FIRST``, ...); load
    ``heartbeat:main`` in the first ``loaded`` of them. Their lease is LEASE seconds."""
    handles = []
    async with runner.host() as host:
        for number in range(count):
            key = Key(identity="acme", instance=f"eu-{first + number}")
            record = await host.open(key, f"open-{uuid.uuid4()}", lease=LEASE)
            if number < loaded:
                await host.load(record.handle, Load(specifier="heartbeat:main"))
            handles.append(record.handle)
    return handles


async def heartbeat_heard(
    host: RemoteSupervisor, operators: RemoteSupervisor, key: Key, generation: int
) -> Handle:
    """Open ``key``'s ``generation`` (the next after ``generation - 1``), load
    ``heartbeat:main`` in it, and wait until its log holds its first beat; its handle."""
    record = await host.open(
        key, str(generation), expected_generation=generation - 1 or None, lease=LEASE
    )
    await host.load(record.handle, Load(specifier="heartbeat:main"))
    beat = f"beat 1 of {key.identity}/{key.instance} #{generation}\n"

    async def said() -> bool:
        return beat in await operators.logs(key, generation)

    await until(said, f"{beat!r} in the log")
    return record.handle
