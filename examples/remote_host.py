"""A host on another machine: it reaches a runner over HTTP with only a URL and a token.

It keeps two sessions alive while their plugins run (the client renews their leases in
the background), shows what the runner says to a load it cannot do and to a stolen
handle, and prints how each child ended.

    python examples/remote_host.py URL --token-file runner-state/token
    python examples/remote_host.py --serve    # starts a runner of its own, then stops it

With ``--serve`` it starts ``trio-supervisor serve`` on a free loopback port over the
example plugins, reads the URL from its first line and the token from its state
directory, and sends it SIGTERM at the end.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
import trio

from trio_supervisor import Key, Load, PackageError, StaleSessionError
from trio_supervisor.client import connect

PLUGINS = Path(__file__).parent / "plugins"


async def host(url: str, token: str, seconds: float) -> None:
    async with connect(url, token=token) as runner:
        print(f"connected to {url}")
        for name, specifier in (("beating", "heartbeat:main"), ("spawning", "spawner:main")):
            key = Key(identity="remote", instance=name)
            high = await runner.high_water(key)
            # A 1.5-second lease, kept alive by the client for as long as the block runs.
            async with runner.session(key, expected_generation=high, lease=1.5) as session:
                code = await session.load(Load(specifier=specifier, config={"period": 0.3}))
                print(
                    f"{name}: generation {session.handle.generation} runs {code.specifier} "
                    f"({code.digest[:19] if code.digest else '-'}...)"
                )
                await trio.sleep(seconds)
                record = await session.status()
                print(f"{name}: still {record.phase.value} after {seconds:g} s of 1.5-s leases")
            assert session.termination is not None
            print(f"{name}: disposed, {session.termination.describe()}")

        # What the runner says when it cannot do something, as the embedded API would.
        key = Key(identity="remote", instance="refused")
        record = await runner.open(
            key, "refused-1", expected_generation=await runner.high_water(key)
        )
        try:
            await runner.load(record.handle, Load(specifier="nowhere:main"))
        except PackageError as error:
            print(f"a load of nowhere:main: PackageError: {error.detail}")
        stolen = attrs.evolve(record.handle, token="0" * 36)
        try:
            await runner.status(stolen)
        except StaleSessionError as error:
            print(f"a guessed token: StaleSessionError: {error.detail}")


def serve_and_run(seconds: float) -> int:
    """Start a runner on a free port, run the host against it, stop the runner."""
    with tempfile.TemporaryDirectory(prefix="remote-host-") as state:
        command = [sys.executable, "-m", "trio_supervisor", "serve", "--state", state]
        command += ["--listen", "127.0.0.1:0", "--plugins", str(PLUGINS), "--grace", "1"]
        runner = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        try:
            assert runner.stdout is not None
            line = runner.stdout.readline()  # the readiness handshake
            if not line.startswith("listening on "):
                print(f"the runner did not start: {line!r}", file=sys.stderr)
                return 1
            url = line.split()[-1]
            token = (Path(state) / "token").read_text().strip()
            trio.run(host, url, token, seconds)
        finally:
            runner.send_signal(signal.SIGTERM)
            status = runner.wait(timeout=30)
        print(f"the runner stopped (exit status {status}), every child reaped")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("url", nargs="?", help="the runner's URL, from its 'listening on' line")
    parser.add_argument("--token-file", type=Path, help="the hosts' token (STATE/token)")
    parser.add_argument("--serve", action="store_true", help="start a runner of its own")
    parser.add_argument("--seconds", type=float, default=4.0, help="how long each plugin runs")
    arguments = parser.parse_args()
    if arguments.serve:
        return serve_and_run(arguments.seconds)
    if not arguments.url or not arguments.token_file:
        parser.error("give URL and --token-file, or --serve")
    token = arguments.token_file.read_text().strip()
    trio.run(host, arguments.url, token, arguments.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
