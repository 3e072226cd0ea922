"""The client's errors are the package's errors: one hierarchy, one wire code each."""

from __future__ import annotations

import httpx
import pytest

import trio_supervisor
import trio_supervisor.client
from trio_supervisor import (
    ForbiddenError,
    Key,
    MemoryStore,
    OperatorsOnlyError,
    QuotaExceededError,
    RunnerAccessError,
    RunnerFullError,
    SessionLostError,
    StaleSessionError,
    SupervisorError,
    ThrottledError,
)
from trio_supervisor.client import connect
from trio_supervisor.errors import BY_CODE
from trio_supervisor.testing import FakeExecution

from ..support.service import HOSTS_TOKEN, OPERATOR_TOKEN, served
from ..support.sessions import KEY, supervise_embedded


def test_the_client_s_errors_are_supervisor_errors_with_wire_codes() -> None:
    kinds = (
        RunnerAccessError,
        ForbiddenError,
        OperatorsOnlyError,
        SessionLostError,
        QuotaExceededError,
        ThrottledError,
        RunnerFullError,
    )
    assert {kind.__name__: (kind.code, issubclass(kind, SupervisorError)) for kind in kinds} == {
        "RunnerAccessError": ("Unauthorized", True),
        "ForbiddenError": ("Forbidden", True),
        "OperatorsOnlyError": ("Forbidden", True),
        "SessionLostError": ("SessionLost", True),
        "QuotaExceededError": ("QuotaExceeded", True),
        "ThrottledError": ("Throttled", True),
        "RunnerFullError": ("RunnerFull", True),
    }
    for kind in kinds:
        # "Forbidden" names the documented class; an operators' call refused is its kind.
        assert BY_CODE[kind.code] is (ForbiddenError if kind is OperatorsOnlyError else kind)
        # The old import path still works, and names the same class.
        assert getattr(trio_supervisor.client, kind.__name__) is kind
        assert getattr(trio_supervisor, kind.__name__) is kind
    assert issubclass(OperatorsOnlyError, ForbiddenError)


def test_a_lost_session_error_keeps_its_cause() -> None:
    cause = StaleSessionError("superseded")
    lost = SessionLostError("the session was lost: superseded", cause)
    assert lost.cause is cause
    assert lost.again().cause is cause
    assert SessionLostError("no cause").cause is None


async def test_a_refused_token_and_an_operator_call_raise_the_codes_the_runner_sent() -> None:
    async with (
        supervise_embedded(MemoryStore(), FakeExecution()) as supervisor,
        served(supervisor) as remote,
    ):
        url = str(remote._client.base_url)
        async with httpx.AsyncClient(base_url=url) as bare:
            unknown = (await bare.post("/v1/high-water", json={}, headers={})).json()
            forbidden = (
                await bare.get("/v1/runners", headers={"Authorization": f"Bearer {HOSTS_TOKEN}"})
            ).json()
        async with connect(url, token="not-a-token") as stranger:
            with pytest.raises(RunnerAccessError) as refused:
                await stranger.high_water(KEY)
        assert type(refused.value) is RunnerAccessError
        assert (refused.value.code, refused.value.detail) == (unknown["code"], unknown["detail"])

        with pytest.raises(OperatorsOnlyError) as operators_only:
            await remote.runners()  # the hosts' token
        assert isinstance(operators_only.value, RunnerAccessError)
        assert (operators_only.value.code, operators_only.value.detail) == (
            forbidden["code"],
            forbidden["detail"],
        )

        async with connect(url, token=OPERATOR_TOKEN) as operator:
            assert await operator.sessions() == []

        # Without a token: health answers (it needs none), every other call is refused.
        async with connect(url, token=None) as anyone:
            assert (await anyone.health())["status"] == "ready"
            with pytest.raises(RunnerAccessError):
                await anyone.high_water(KEY)
        with pytest.raises(ValueError, match="non-empty str, or None"):
            async with connect(url, token=""):
                pass
        assert await remote.high_water(Key(identity="never", instance="opened")) is None
