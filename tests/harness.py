"""What the tests share: keys, and a supervisor with test timings."""

from __future__ import annotations

import contextlib
from typing import Any

from trio_supervisor import Handle, Key, Supervisor, open_supervisor
from trio_supervisor.stores.base import Store

KEY = Key(identity="plugin", instance="a")
OTHER = Key(identity="plugin", instance="b")


def supervise(
    store: Store, execution: Any, **options: Any
) -> contextlib.AbstractAsyncContextManager[Supervisor]:
    """open_supervisor with the short timings the tests use unless they say otherwise."""
    settings: dict[str, Any] = {"lease": 10.0, "grace": 1.0, "confirmation_timeout": 1.0}
    settings.update(options)
    return open_supervisor(store, execution, **settings)


async def opened(
    supervisor: Supervisor, key: Key = KEY, request_id: str = "r1", **options: Any
) -> Handle:
    """Open a session of ``key`` at the next generation; return its handle."""
    expected = await supervisor.high_water(key)
    record = await supervisor.open(key, request_id, expected_generation=expected, **options)
    return record.handle
