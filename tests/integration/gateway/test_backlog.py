"""The backlog a scaler reads (docs/operations.md, "Scaling on backlog"): queued requests and
tokens per pool on /metrics and in Redis, rising while requests wait for a slot, the gpu pool's
demand visible though it has no worker, and back to zero once the queue drains."""

from __future__ import annotations

import asyncio
import re
import time

import orjson
import pytest
import redis.asyncio as aioredis

from common import wire
from gateway.dispatch.prompts import PromptBuilder
from tests.integration.gateway.conftest import Harness, make_harness
from workers.engine import EchoEngine
from workers.model_store import ModelSpec

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


async def _exported(h: Harness) -> dict[tuple[str, str], float]:
    text = (await h.http.get("/metrics")).text
    return {(kind, pool): float(v) for kind, pool, v in
            re.findall(rf'^tokengate_backlog_(requests|tokens)\{{model="{h.model}",pool="(\w+)"\}} (\S+)$', text,
                       re.MULTILINE)}


async def _stored(h: Harness) -> dict[str, object] | None:
    raw = await h.gw.client.hget(wire.BACKLOG_HASH, h.gw.settings.gateway_id)  # type: ignore[misc]
    return None if raw is None else orjson.loads(raw)


async def test_the_backlog_rises_while_requests_wait_and_falls_once_they_are_served(
    redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    slow = EchoEngine(tokens=8, slots=2, step_s=0.02)  # two at a time, ~0.16 s each
    async with make_harness(redis_url, prompts, model_spec.name, engine=slow) as h:
        _, key = await h.tenant("acme")
        assert (await _exported(h))[("requests", "cpu")] == 0.0
        load = asyncio.gather(*(h.complete(key) for _ in range(20)))
        started, seen = time.monotonic(), None
        while time.monotonic() - started < 5.0:  # at once, in fact: /metrics reads the queue (bench: < 1 s)
            exported = await _exported(h)
            if exported[("requests", "cpu")] > 0:
                seen = exported
                break
            await asyncio.sleep(0.02)
        assert seen is not None, "no backlog on /metrics within 5 s of 20 requests for 2 slots"
        assert seen[("tokens", "cpu")] > seen[("requests", "cpu")]  # prompt and expected output tokens
        # no gpu worker: the work a gpu worker would take shows as its pool's demand
        assert seen[("requests", "gpu")] > 0
        stored = None
        while stored is None or stored["cpu"]["requests"] == 0:  # type: ignore[index]
            assert time.monotonic() - started < 3.0, f"no backlog in {wire.BACKLOG_HASH}: {stored}"
            await asyncio.sleep(0.05)
            stored = await _stored(h)
        assert stored["at"] > time.time() - 5
        replies = await load
        assert [r.status_code for r in replies] == [200] * 20
        exported = await _exported(h)
        assert exported[("requests", "cpu")] == exported[("requests", "gpu")] == 0.0
        drained = time.monotonic()
        while (await _stored(h))["cpu"]["requests"]:  # type: ignore[index]
            assert time.monotonic() - drained < 2.0, "the stored backlog did not fall back to zero"
            await asyncio.sleep(0.05)
    assert await _stored_after_close(redis_url, h.gw.settings.gateway_id) is None  # a clean exit takes it away


async def _stored_after_close(redis_url: str, gateway_id: str) -> bytes | None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        return await client.hget(wire.BACKLOG_HASH, gateway_id)  # type: ignore[misc, no-any-return]
    finally:
        await client.aclose()
