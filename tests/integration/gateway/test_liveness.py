"""Gateway liveness on a real Redis: the renewal script against its specification, and what
a survivor does with a dead gateway's requests, jobs and reply stream."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from common import wire
from gateway.dispatch.liveness import Liveness, classify
from gateway.settings import GatewaySettings
from gateway.tenancy.budget import Budget
from gateway.tenancy.tenants import Tenant

pytestmark = pytest.mark.redis

T0 = 1_800_000_000.5
DEAD = 15.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _settings(url: str, gid: str) -> GatewaySettings:
    return GatewaySettings(redis_url=url, model_name="m", gateway_id=gid, gateway_dead_after_s=DEAD)


def test_renewal_matches_its_specification(redis_url: str) -> None:
    loop = asyncio.new_event_loop()
    client = aioredis.Redis.from_url(redis_url)
    me = Liveness(client, _settings(redis_url, "me"))
    ages = st.sampled_from([0.0, 1.0, 14.999, 15.0, 15.001, 99.0])

    @settings(max_examples=60, deadline=None)
    @given(st.dictionaries(st.sampled_from("abcdefg"), ages))
    def check(gateway_ages: dict[str, float]) -> None:
        scores = {g: T0 - age for g, age in gateway_ages.items()}

        async def renew() -> tuple[int, tuple[str, ...]]:
            await client.delete(wire.GATEWAYS_ZSET)
            if scores:
                await client.zadd(wire.GATEWAYS_ZSET, scores)
            view = await me.renew(wire.replies_stream("m", "me"), now=T0)
            return view.alive, view.dead

        assert loop.run_until_complete(renew()) == classify(scores, "me", T0, DEAD)

    try:
        check()
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()


@pytest.mark.anyio
async def test_a_gateway_that_redis_forgot_learns_it(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    me = Liveness(client, _settings(redis_url, "me"))
    assert not (await me.renew(wire.replies_stream("m", "me"))).forgotten  # joining is not forgetting
    assert not (await me.renew(wire.replies_stream("m", "me"))).forgotten
    await client.flushall()  # Redis restarted without its data
    assert (await me.renew(wire.replies_stream("m", "me"))).forgotten
    assert not (await me.renew(wire.replies_stream("m", "me"))).forgotten
    await client.aclose()


@pytest.mark.anyio
async def test_a_dead_gateway_is_swept_once_by_a_survivor(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    dead, alive = _settings(redis_url, "dead"), _settings(redis_url, "alive")
    tenant = Tenant("tn_1", "acme", rate=100.0, burst=1000)
    await client.sadd(wire.TENANT_IDS, tenant.id)  # a sweep looks in every tenant's slot
    budget = Budget(client, dead)
    for rid in ("r1", "r2"):
        await budget.admit(tenant, rid, 10, 90)  # 200 of 1000 tokens reserved, two leases
    await budget.settle_raw(tenant, "r2", -50, "done", 10, 40)  # r2 ended normally
    replies = wire.replies_stream("m", "dead")
    await Liveness(client, dead).renew(replies)  # it joined (its reply stream known), then died
    await client.xadd(replies, {"v": "1", "m": "{}"})
    await client.zadd(wire.GATEWAYS_ZSET, {"dead": 1.0})  # its last renewal: long ago
    survivor = Liveness(client, alive)
    view = await survivor.renew(wire.replies_stream("m", "alive"))
    assert view.dead == ("dead",) and view.alive == 1
    assert await survivor.sweep("dead") == 1  # r1 only: r2 was settled already
    assert await survivor.sweep("dead") == -1
    state = await Budget(client, alive).state(tenant)
    # r2 used 50 of its 100: the bucket lacks 50 tokens (plus what drained back meanwhile)
    assert 950 <= state["remaining_tokens"] <= 1000 and state["in_flight"] == 0
    assert (await client.hget(wire.request(tenant.id, "r1"), "state")) == b"abandoned"
    assert await client.exists(replies) == 0
    assert await client.exists(wire.gone_key(replies)) == 1  # workers drop its queued jobs
    assert await client.zscore(wire.GATEWAYS_ZSET, "dead") is None
    assert await client.hget(wire.GATEWAY_REPLIES, "dead") is None
    await client.aclose()


@pytest.mark.anyio
async def test_a_live_gateway_is_never_swept(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    me = Liveness(client, _settings(redis_url, "me"))
    await me.renew(wire.replies_stream("m", "me"))
    assert await Liveness(client, _settings(redis_url, "other")).sweep("me") == -1
    await me.leave(wire.replies_stream("m", "me"))  # a clean exit sweeps itself
    assert await client.zscore(wire.GATEWAYS_ZSET, "me") is None
    await client.aclose()
