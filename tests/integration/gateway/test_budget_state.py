"""What operators see of a tenant's budget (``Budget.state``): its requests in flight, the
requests admitted and not settled, whether or not it has a concurrency limit (only under one
does a request take a lease)."""

from __future__ import annotations

import secrets

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
        budget = Budget(client, GatewaySettings(redis_url=redis_url, model_name="m"))
        tenant = Tenant("tn_" + secrets.token_hex(6), "t", 100.0, 1000, limits=Limits(max_concurrent=limit))
        other = Tenant("tn_" + secrets.token_hex(6), "u", 100.0, 1000)
        for rid in ("a", "b", "c"):
            assert (await budget.reserve(tenant, rid, 10, 0.0, 5)).status == "ok"
        assert (await budget.reserve(other, "x", 10, 0.0, 5)).status == "ok"
        assert (await budget.state(tenant))["in_flight"] == 3
        assert await budget.settle_raw(tenant, "a", 0, "done", 5, 5)
        assert (await budget.state(tenant))["in_flight"] == 2
        assert await client.exists(wire.in_flight(tenant.id)) == (limit is not None)  # a lease only under a limit
    finally:
        await client.aclose()
