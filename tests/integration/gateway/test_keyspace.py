"""A Redis holding the names of a release before the hash tag: a starting gateway renames them."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from common import wire
from gateway import keyspace

pytestmark = pytest.mark.anyio


async def test_old_names_are_renamed_once_keeping_their_values_and_ttls(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.set("tg:tenant:t1", b'{"id": "t1"}')
        await client.sadd("tg:tenants", "t1")
        await client.hset("tg:key:abcd1234", mapping={"tenant": "t1"})
        await client.set("tg:req:r1", b"{}", ex=300)
        await client.set("tg:model:m", b"old")
        await client.set(wire.model_key("m"), b"new")  # written by the new release already: kept
        await client.set("tg-not-ours", b"x")
        assert await keyspace.migrate(client, "m") == 4
        assert await client.get(wire.tenant("t1")) == b'{"id": "t1"}'
        assert await client.smembers(wire.TENANT_IDS) == {b"t1"}
        assert await client.hget(wire.api_key("abcd1234"), "tenant") == b"t1"
        assert 0 < await client.ttl(wire.request("r1")) <= 300
        assert await client.get(wire.model_key("m")) == b"new" and await client.get("tg:model:m") == b"old"
        assert await client.get("tg-not-ours") == b"x"
        assert await keyspace.migrate(client, "m") == 0  # nothing left to rename
    finally:
        await client.aclose()


async def test_a_redis_of_one_model_hands_its_scheduling_names_to_the_model_its_gateway_serves(redis_url: str) -> None:
    """Before each model was a scheduling domain, the jobs streams, the arrivals stream and the
    lease's term had no model in their names: queued jobs, their group and pending entries move
    to the model's names (a legacy ``tg:`` name too, through its hash-tagged one)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.xgroup_create("tg:jobs:cpu", wire.GROUP, id="0", mkstream=True)
        await client.xadd("tg:jobs:cpu", {"v": "1", "m": b"queued"})
        await client.xadd("{tg}:arrivals", {"k": b"a"})
        await client.set("{tg}:scheduler:term", 7)
        await client.xadd(wire.jobs_stream("m", "gpu"), {"v": "1"})  # the new release's already
        await client.xadd("{tg}:jobs:gpu", {"v": "1"})
        assert await keyspace.migrate(client, "m") == 4  # tg:jobs:cpu twice, arrivals, term
        assert await client.xlen(wire.jobs_stream("m", "cpu")) == 1
        assert (await client.xinfo_groups(wire.jobs_stream("m", "cpu")))[0]["name"] == wire.GROUP.encode()
        assert await client.xlen(wire.arrivals_stream("m")) == 1 and await client.get(wire.scheduler_term("m")) == b"7"
        assert await client.exists("{tg}:jobs:gpu") == 1  # kept: the model's exists (logged)
        assert await keyspace.migrate(client, "m") == 0
    finally:
        await client.aclose()
