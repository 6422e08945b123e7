"""``GET /health``, vLLM's health check (issue 38: ``guidellm`` and other vLLM clients probe it
first and stop on a 404): 200 with an empty text/plain body when the gateway can serve, 503
when it cannot, by the same rule as ``/readyz`` and with its body; both as the document says."""

from __future__ import annotations

from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tests.integration.gateway.conftest import Harness
from tests.integration.gateway.test_openapi import Conformance

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


async def test_ready_is_200_with_an_empty_text_body(harness: Harness) -> None:
    ready = await harness.http.get("/readyz")
    health = await harness.http.get("/health")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    assert health.status_code == 200, health.text
    assert health.headers["content-type"].split(";")[0] == "text/plain"
    assert health.content == b""  # as vLLM answers it
    assert (await harness.http.head("/health")).status_code == 200


async def _redis_down(*args: Any, **kwargs: Any) -> Any:
    raise RedisConnectionError("connection refused")


@pytest.mark.parametrize("cause", ["loop stopped", "no worker", "redis down"])
async def test_not_ready_is_503_as_readyz_judges(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    conformance = Conformance((await harness.http.get("/openapi.json")).json())
    dispatcher = harness.gw.domain().dispatcher
    if cause == "loop stopped":
        monkeypatch.setattr(dispatcher, "failed", "the send loop stopped: RuntimeError('test')")
    elif cause == "no worker":
        monkeypatch.setattr(dispatcher, "alive_pools", set)
    else:
        monkeypatch.setattr(harness.gw.batch, "call", _redis_down)
    ready = conformance.check(await harness.http.get("/readyz"))
    health = conformance.check(await harness.http.get("/health"))  # NotReady, documented, no Retry-After
    assert ready.status_code == health.status_code == 503
    assert health.json() == ready.json() and health.json()["ready"] is False
    assert {"loop stopped": "send loop stopped", "no worker": "no worker has a live heartbeat",
            "redis down": "redis: connection refused"}[cause] in health.json()["reason"]
