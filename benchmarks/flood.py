"""A flooding tenant, as a process of its own: ``python -m benchmarks.flood URL TOKEN N``.

``N`` tasks open sessions of new keys as fast as the runner answers, and go on whatever
it answers (429 mostly). The first line on stdout, ``flooding``, says that the runner
has answered the first of them: the readiness handshake. It runs until it is signalled.
"""

from __future__ import annotations

import itertools
import sys

import httpx
import trio


async def flood(url: str, token: str, tasks: int) -> None:
    numbers = itertools.count()
    started = trio.Event()
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=tasks)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits) as client:

        async def one() -> None:
            while True:
                number = next(numbers)
                body = {"key": {"identity": "flood", "instance": f"{number}"}, "request_id": "r"}
                await client.post("/v1/open", json=body)
                if not started.is_set():
                    started.set()
                    print("flooding", flush=True)

        async with trio.open_nursery() as nursery:
            for _ in range(tasks):
                nursery.start_soon(one)


if __name__ == "__main__":
    trio.run(flood, sys.argv[1], sys.argv[2], int(sys.argv[3]))
