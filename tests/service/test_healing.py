"""B5's bookkeeping (``service/healing.py``): when a poisoned runner restarts, how long it
waits, when it gives up, and what it answers meanwhile. The restarts themselves, with
real runners and real servers, are in test_fleet_processes.py, test_fleet_availability.py
and test_store_availability.py."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator

import httpx
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client import generate_latest

from trio_supervisor import (
    ExecutionError,
    RunnerFencedError,
    StateStorageError,
    SupervisorError,
    TerminationUnconfirmedError,
)
from trio_supervisor.service.healing import (
    FIRST_BACKOFF,
    LAST_BACKOFF,
    Front,
    Healer,
    asgi,
    cause_of,
    restarting_app,
)
from trio_supervisor.service.metrics import Metrics
from trio_supervisor.service.tenants import Tenants
from trio_supervisor.service.tenants_file import Roster

OPERATORS = "operators-token-of-the-healing-tests"
HOSTS = "hosts-token-of-the-healing-tests"


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (RunnerFencedError("its row was taken over"), "fenced"),
        (StateStorageError("database or disk is full"), "store"),
        (TerminationUnconfirmedError("still there"), "termination"),
        (ExecutionError("cannot watch"), "execution"),
        (SupervisorError("a background task crashed"), "crash"),
    ],
)
def test_b5_each_poisoning_is_counted_under_its_cause(error: SupervisorError, cause: str) -> None:
    metrics = Metrics()
    healer = Healer((5, 600.0), metrics)
    assert healer.poisoned(error)
    assert cause_of(error) == cause
    text = generate_latest(metrics.registry).decode()
    assert f'trio_supervisor_restarts_total{{cause="{cause}"}} 1.0' in text
    assert "trio_supervisor_restarting 1.0" in text
    assert healer.why is not None
    assert cause in healer.why
    assert str(error) in healer.why


async def test_b5_restarts_back_off_doubling_to_a_ceiling_and_give_up_past_the_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    healer = Healer((7, 600.0), Metrics())
    waited = []
    for _ in range(7):
        assert healer.poisoned(StateStorageError("failed"))
        before = trio.current_time()
        await healer.pause()
        waited.append(trio.current_time() - before)
    assert waited == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert (FIRST_BACKOFF, LAST_BACKOFF) == (1.0, 30.0)
    # The eighth within the window is past the limit: the runner gives up.
    assert not healer.poisoned(StateStorageError("failed again"))
    assert healer.why is not None
    assert "gave up after 7 restarts within 600 s" in healer.why


def test_b5_a_limit_of_zero_gives_up_at_the_first_poisoning() -> None:
    assert not Healer((0, 600.0), Metrics()).poisoned(StateStorageError("failed"))


@contextlib.asynccontextmanager
async def restarting_runner(healer: Healer, metrics: Metrics) -> AsyncIterator[httpx.AsyncClient]:
    """A real Hypercorn server on a loopback port, serving a Front with no incarnation."""
    app = restarting_app(
        healer, operator_token=OPERATORS, tenants=Roster(Tenants.single(HOSTS)), metrics=metrics
    )
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            functools.partial(serve, asgi(Front(app)), config)  # type: ignore[arg-type]
        )
        async with httpx.AsyncClient(base_url=binds[0].replace("0.0.0.0", "127.0.0.1")) as client:
            yield client
        nursery.cancel_scope.cancel()


async def test_b5_while_restarting_the_runner_answers_why_and_keeps_its_guards() -> None:
    metrics = Metrics()
    healer = Healer((5, 600.0), metrics)
    healer.withdrawn(RunnerFencedError("could not renew its row"))
    async with restarting_runner(healer, metrics) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["code"] == "RunnerRestarting"
        assert "could not renew its row" in ready.json()["detail"]
        # A session call: a valid token gets the 503 and when to try again ...
        renew = await client.post(
            "/v1/renew", json={}, headers={"Authorization": f"Bearer {HOSTS}"}
        )
        assert renew.status_code == 503
        assert renew.json()["code"] == "RunnerRestarting"
        assert renew.headers["Retry-After"] == "1"
        # ... and no token, or a wrong one, still gets nothing but a 401.
        for headers in ({}, {"Authorization": "Bearer not-a-token"}):
            refused = await client.post("/v1/renew", json={}, headers=headers)
            assert refused.status_code == 401
            assert "RunnerRestarting" not in refused.text
        # The operators still read the metrics, which say it restarts.
        scraped = await client.get("/metrics", headers={"Authorization": f"Bearer {OPERATORS}"})
        assert scraped.status_code == 200
        assert "trio_supervisor_restarting 1.0" in scraped.text
        page = await client.get("/")
        assert page.status_code == 200
        assert "RunnerRestarting" in page.text
        unknown = await client.get("/no/such/path")
        assert unknown.status_code == 404
