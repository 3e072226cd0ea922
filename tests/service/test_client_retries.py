"""The client retries the calls that are safe to repeat when a connection fails.

A transport in front of the real one fails the first requests it is given, as a network
that drops for a moment would; the runner behind it is a real server.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from trio_supervisor import Load, MemoryStore, StoppedRecord
from trio_supervisor.client import RemoteSupervisor, connect
from trio_supervisor.testing import FakeExecution

from ..support import HOSTS_TOKEN, KEY, served, supervise_embedded


class Flaky(httpx.AsyncBaseTransport):
    """Fails the next ``failures`` requests with ``error``, then passes them on."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.failures = 0
        self.error: Exception = httpx.ConnectError("connection refused")
        self.attempts: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.attempts.append(request.url.path)
        if self.failures:
            self.failures -= 1
            raise self.error
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@contextlib.asynccontextmanager
async def flaky_client(retry_for: float = 15.0) -> AsyncIterator[tuple[RemoteSupervisor, Flaky]]:
    async with (
        supervise_embedded(MemoryStore(), FakeExecution()) as supervisor,
        served(supervisor) as remote,
    ):
        flaky = Flaky()
        url = str(remote._client.base_url)
        async with connect(url, token=HOSTS_TOKEN, transport=flaky, retry_for=retry_for) as host:
            yield host, flaky


async def test_renew_status_dispose_and_high_water_retry_a_failed_connection() -> None:
    async with flaky_client() as (host, flaky):
        record = await host.open(KEY, "r1")
        await host.load(record.handle, Load(specifier="plugin"))
        flaky.attempts.clear()
        for call in (host.renew, host.status, host.dispose):
            flaky.failures = 2
            await call(record.handle)
        flaky.failures = 2
        assert await host.high_water(KEY) == 1
        assert isinstance(await host.status(record.handle), StoppedRecord)
    assert flaky.attempts == [
        *["/v1/renew"] * 3,
        *["/v1/status"] * 3,
        *["/v1/dispose"] * 3,
        *["/v1/high-water"] * 3,
        "/v1/status",
    ]


async def test_without_a_retry_window_a_failed_connection_is_raised_at_once() -> None:
    async with flaky_client(retry_for=0) as (host, flaky):
        record = await host.open(KEY, "r1")
        flaky.failures = 1
        with pytest.raises(httpx.ConnectError):
            await host.renew(record.handle)
        assert flaky.attempts == ["/v1/open", "/v1/renew"]


async def test_a_load_is_never_repeated() -> None:
    async with flaky_client() as (host, flaky):
        record = await host.open(KEY, "r1")
        flaky.failures = 1
        with pytest.raises(httpx.ConnectError):
            await host.load(record.handle, Load(specifier="plugin"))
        assert flaky.attempts == ["/v1/open", "/v1/load"]


async def test_a_refused_certificate_is_not_retried() -> None:
    async with flaky_client() as (host, flaky):
        record = await host.open(KEY, "r1")
        refused = httpx.ConnectError("handshake failed")
        refused.__cause__ = ssl.SSLCertVerificationError("certificate verify failed")
        flaky.error, flaky.failures = refused, 5
        started = trio.current_time()
        with pytest.raises(httpx.ConnectError):
            await host.status(record.handle)
        assert flaky.attempts == ["/v1/open", "/v1/status"]
        assert trio.current_time() - started < 1.0


@pytest.mark.parametrize("retry_for", [-1.0, float("inf"), float("nan"), True, "15"])
async def test_a_retry_window_that_is_not_a_finite_number_of_seconds_is_refused(
    retry_for: object,
) -> None:
    with pytest.raises(ValueError, match="retry_for must be a finite number of seconds >= 0"):
        async with connect("http://127.0.0.1:1", token="t", retry_for=retry_for):  # type: ignore[arg-type]
            pass
