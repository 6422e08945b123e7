"""What operators see of a tenant's budget (``Budget.state``): its requests in flight, counted
from its leases under a concurrency limit and from the gateways' lists of open requests
without one (such a tenant takes no lease)."""

from __future__ import annotations

import secrets
import time

import pytest
import redis.asyncio as aioredis

from common import wire
from gateway.settings import GatewaySettings
from gateway.tenancy.budget import Budget
from gateway.tenancy.tenants import Limits, Tenant

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


@pytest.mark.parametrize("limit", [None, 5])
async def test_in_flight_counts_the_open_requests_with_or_without_a_limit(redis_url: str, limit: int | None) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        settings = GatewaySettings(redis_url=redis_url, model_name="m", gateway_id="gw-" + secrets.token_hex(4))
        await client.zadd(wire.GATEWAYS_ZSET, {settings.gateway_id: time.time()})
        budget = Budget(client, settings)
        tenant = Tenant("tn_" + secrets.token_hex(6), "t", 100.0, 1000, limits=Limits(max_concurrent=limit))
        other = Tenant("tn_" + secrets.token_hex(6), "u", 100.0, 1000)
        for rid in ("a", "b", "c"):
            assert (await budget.reserve(tenant, rid + tenant.id, 10, 0.0, 5)).status == "ok"
        assert (await budget.reserve(other, "x" + other.id, 10, 0.0, 5)).status == "ok"
        assert (await budget.state(tenant))["in_flight"] == 3
        assert await budget.settle_raw(tenant, "a" + tenant.id, 0, "done", 5, 5)
        assert (await budget.state(tenant))["in_flight"] == 2
        assert await client.exists(wire.in_flight(tenant.id)) == (limit is not None)  # a lease only under a limit
    finally:
        await client.zrem(wire.GATEWAYS_ZSET, settings.gateway_id)
        await client.aclose()
