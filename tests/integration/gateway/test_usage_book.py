"""The gateway's usage book on a real Redis: what the budget scripts decide is counted once,
written in one transaction, and kept through a Redis error until a write succeeds."""

from __future__ import annotations

import secrets

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common import wire
from gateway.settings import GatewaySettings
from gateway.tenancy.budget import Budget
from gateway.tenancy.tenants import Limits, Tenant
from gateway.tenancy.usage import UsageBook

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

T0 = 1_800_000_000.0  # a minute's start


async def test_admissions_refusals_and_settlements_are_counted_once(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        budget = Budget(client, GatewaySettings(redis_url=redis_url, model_name="m"))
        tenant = Tenant("tn_" + secrets.token_hex(6), "t", 10.0, 100, limits=Limits(max_concurrent=2))
        rids = [secrets.token_hex(4) for _ in range(3)]
        verdicts = [await budget.reserve(tenant, rid, 30, 0.0, 10, now=T0, wall=T0) for rid in rids]
        assert [v.status for v in verdicts] == ["ok", "ok", "concurrency"]
        assert await budget.reserve(tenant, "big", 200, 0.0, 10, now=T0, wall=T0) is not None  # too large: no count
        assert await budget.settle_raw(tenant, rids[0], -10, "done", 10, 10, now=T0, wall=T0, charged=25, slo=True)
        assert not await budget.settle_raw(tenant, rids[0], -10, "done", 10, 10, now=T0, wall=T0, slo=True)  # again
        assert await budget.settle_raw(tenant, rids[1], -30, "failed", 0, 0, now=T0, wall=T0 + 60, slo=False)
        key = wire.usage(tenant.id, int(T0 // 60))
        assert await client.exists(key) == 0  # nothing written before the book's write
        await budget.usage.flush()
        first = await client.hgetall(key)
        assert {k.decode(): int(v) for k, v in first.items()} == {
            "requests": 2, "rate_limited": 1, "prompt_tokens": 10, "completion_tokens": 10,
            "weighted_extra_tokens": 5, "slo_met": 1}
        later = await client.hgetall(wire.usage(tenant.id, int(T0 // 60) + 1))
        assert {k.decode(): int(v) for k, v in later.items()} == {"slo_missed": 1}  # counted in its own minute
        assert 0 < await client.ttl(key) <= budget.settings.usage_retention_s
        await budget.usage.flush()  # nothing new: nothing more
        assert await client.hgetall(key) == first
    finally:
        await client.aclose()


async def test_a_write_that_fails_keeps_the_counts_for_the_next(redis_url: str) -> None:
    down = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    client = aioredis.Redis.from_url(redis_url)
    try:
        tid = "tn_" + secrets.token_hex(6)
        book = UsageBook(down, 3600)
        book.add(tid, T0, requests=2, prompt_tokens=7)
        with pytest.raises(RedisError):
            await book.flush()
        book.add(tid, T0, requests=1)
        book.client = client  # Redis is back
        await book.flush()
        got = await client.hgetall(wire.usage(tid, int(T0 // 60)))
        assert {k.decode(): int(v) for k, v in got.items()} == {"requests": 3, "prompt_tokens": 7}
    finally:
        await down.aclose()
        await client.aclose()
