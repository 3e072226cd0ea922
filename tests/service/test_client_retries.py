"""The client retries the calls that are safe to repeat when a connection fails.

A transport in front of the real one fails the first requests it is given, as a network
that drops for a moment would; the runner behind it is a real server. A connection
refused is tried again for any call (nothing reached the runner) within ``connect_for``;
one that failed mid-call only for the calls that are safe to repeat, within
``retry_for``. What is not mended in time is one :class:`RunnerUnreachableError` naming
the URL, never a transport's exception.
"""

from __future__ import annotations

import contextlib
import gc
import ssl
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from trio_supervisor import Handle, Load, MemoryStore, RunnerUnreachableError, StoppedRecord
from trio_supervisor.client import RemoteSupervisor, connect
from trio_supervisor.testing import FakeExecution

from ..support.service import HOSTS_TOKEN, served
from ..support.sessions import KEY, supervise_embedded


class Flaky(httpx.AsyncBaseTransport):
    """Fails the next ``failures`` requests with ``error``, then passes them on."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.failures = 0
        self.error: Exception = httpx.ConnectError("connection refused")
        self.midway = False  # fail while sending the body, not before
        self.attempts: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.attempts.append(request.url.path)
        if self.failures:
            self.failures -= 1
            if self.midway:
                # As httpcore's write of the body would fail on a reset connection: the
                # body's iteration is left where it was.
                async for _ in request.stream:  # type: ignore[union-attr]
                    raise self.error
            raise self.error
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@contextlib.asynccontextmanager
async def flaky_client(
    retry_for: float = 15.0, connect_for: float = 5.0
) -> AsyncIterator[tuple[RemoteSupervisor, Flaky]]:
    async with (
        supervise_embedded(MemoryStore(), FakeExecution()) as supervisor,
        served(supervisor) as remote,
    ):
        flaky = Flaky()
        url = str(remote._client.base_url)
        async with connect(
            url, token=HOSTS_TOKEN, transport=flaky, retry_for=retry_for, connect_for=connect_for
        ) as host:
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


async def test_a_send_that_fails_midway_is_retried_and_leaves_nothing_for_trio_to_warn_of(
    recwarn: pytest.WarningsRecorder,
) -> None:
    """A connection reset while the body is sent leaves its iteration unfinished; Trio
    warns of an async generator collected so (httpx's own body is one: encode/httpx#3686)."""
    async with flaky_client() as (host, flaky):
        record = await host.open(KEY, "r1")
        flaky.error, flaky.midway = httpx.WriteError("connection reset by peer"), True
        for _ in range(3):
            flaky.failures = 2
            await host.renew(record.handle)
            gc.collect()
            await trio.lowlevel.checkpoint()  # Trio's finalizer of async generators runs
    assert flaky.attempts.count("/v1/renew") == 9
    assert [str(warning.message) for warning in recwarn] == []


async def test_without_windows_a_failed_connection_is_raised_at_once_naming_the_url() -> None:
    async with flaky_client(retry_for=0, connect_for=0) as (host, flaky):
        record = await host.open(KEY, "r1")
        flaky.failures = 1
        with pytest.raises(RunnerUnreachableError) as raised:
            await host.renew(record.handle)
        assert flaky.attempts == ["/v1/open", "/v1/renew"]
        url = str(host._client.base_url).rstrip("/")
        assert raised.value.url == url
        assert raised.value.detail == (
            f"the runner at {url} is not answering: ConnectError: connection refused"
        )
        assert isinstance(raised.value.__cause__, httpx.ConnectError)


async def test_a_load_is_never_repeated_once_it_was_sent() -> None:
    async with flaky_client() as (host, flaky):
        record = await host.open(KEY, "r1")
        flaky.error, flaky.failures = httpx.ReadError("connection reset"), 1
        with pytest.raises(RunnerUnreachableError, match="stopped answering the call: ReadError"):
            await host.load(record.handle, Load(specifier="plugin"))
        assert flaky.attempts == ["/v1/open", "/v1/load"]


async def test_a_refused_connection_is_tried_again_for_any_call_a_load_too() -> None:
    async with flaky_client() as (host, flaky):
        record = await host.open(KEY, "r1")
        flaky.failures = 2  # connection refused: the load never reached the runner
        await host.load(record.handle, Load(specifier="plugin"))
        assert flaky.attempts == ["/v1/open", *["/v1/load"] * 3]
        assert (await host.status(record.handle)).phase.value == "Loaded"


async def test_a_refused_certificate_is_not_retried() -> None:
    async with flaky_client() as (host, flaky):
        record = await host.open(KEY, "r1")
        refused = httpx.ConnectError("handshake failed")
        refused.__cause__ = ssl.SSLCertVerificationError("certificate verify failed")
        flaky.error, flaky.failures = refused, 5
        started = trio.current_time()
        with pytest.raises(RunnerUnreachableError, match="refused the TLS handshake"):
            await host.status(record.handle)
        assert flaky.attempts == ["/v1/open", "/v1/status"]
        assert trio.current_time() - started < 1.0


class Nobody(httpx.AsyncBaseTransport):
    """A runner that is not there: every connection refused, and counted."""

    def __init__(self) -> None:
        self.attempts = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        raise httpx.ConnectError("[Errno 111] Connection refused")


async def test_a_client_pointed_at_nothing_says_so_after_its_connect_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    nobody = Nobody()
    async with connect("http://127.0.0.1:9", token="t", transport=nobody) as host:
        started = trio.current_time()
        with pytest.raises(RunnerUnreachableError) as raised:
            await host.high_water(KEY)
        waited = trio.current_time() - started
    # The connect window (5 s by default), not the 15 s retry window of a repeatable call.
    assert waited == pytest.approx(5.0), waited
    assert nobody.attempts > 3
    assert raised.value.url == "http://127.0.0.1:9"
    assert raised.value.detail.startswith(
        "the runner at http://127.0.0.1:9 is not answering (tried for 5.0 s): ConnectError: "
    )


async def test_a_client_pointed_at_a_closed_port_raises_one_clear_error() -> None:
    async with connect("http://127.0.0.1:1", token="t", connect_for=0.2) as host:
        with pytest.raises(RunnerUnreachableError, match=r"127\.0\.0\.1:1 is not answering"):
            await host.status(Handle(key=KEY, token="t", generation=1))


@pytest.mark.parametrize("name", ["retry_for", "connect_for"])
@pytest.mark.parametrize("seconds", [-1.0, float("inf"), float("nan"), True, "15"])
async def test_a_window_that_is_not_a_finite_number_of_seconds_is_refused(
    name: str, seconds: object
) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds >= 0"):
        async with connect("http://127.0.0.1:1", token="t", **{name: seconds}):  # type: ignore[arg-type]
            pass
