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
        await client.hset("tg:req:r1", "tenant", "t1")
        await client.expire("tg:req:r1", 300)
        await client.set("tg:model:m", b"old")
        await client.set(wire.model_key("m"), b"new")  # written by the new release already: kept
        await client.set("tg-not-ours", b"x")
        assert await keyspace.migrate(client, "m") == 6  # five renamed, then the record to its tenant's slot
        assert await client.get(wire.tenant("t1")) == b'{"id": "t1"}'
        assert await client.smembers(wire.TENANT_IDS) == {b"t1"}
        assert await client.hget(wire.api_key("abcd1234"), "tenant") == b"t1"
        assert 0 < await client.ttl(wire.request("t1", "r1")) <= 300
        assert await client.get(wire.model_key("m")) == b"new" and await client.get("{tg}:model:m") == b"old"
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


async def test_a_tenants_keys_move_from_the_one_slot_to_its_own(redis_url: str) -> None:
    """Budget, leases, usage minutes and request records renamed (values and TTLs kept); the
    key set becomes the hash of the keys' digests; a gateway's open requests become its
    tenants' (value: rate, reservation, gateway), so a gateway of the old release is still swept."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.sadd(wire.TENANT_IDS, "t2")
        await client.set("{tg}:budget:t2", b"123.5", ex=100)
        await client.zadd("{tg}:inflight:t2", {"r9": 5.0})
        await client.hset("{tg}:usage:t2:29000000", mapping={"requests": 3})
        await client.hset("{tg}:req:r9", mapping={"tenant": "t2", "state": "admitted"})
        await client.sadd("{tg}:tenant-keys:t2", "feedbeef")
        await client.hset(wire.api_key("feedbeef"), mapping={"tenant": "t2", "digest": "d1"})
        await client.hset("{tg}:gateway-requests:gw-1/m", "r9", "t2 2.5 40")
        await keyspace.migrate(client, "m")
        assert await client.get(wire.budget("t2")) == b"123.5" and 0 < await client.ttl(wire.budget("t2")) <= 100
        assert await client.zscore(wire.in_flight("t2"), "r9") == 5.0
        assert await client.hget(wire.usage("t2", 29000000), "requests") == b"3"
        assert await client.hget(wire.request("t2", "r9"), "state") == b"admitted"
        assert await client.hgetall(wire.tenant_keys("t2")) == {b"feedbeef": b"d1"}
        assert await client.hgetall(wire.open_requests("t2")) == {b"r9": b"2.5 40 gw-1/m"}
        assert not await client.keys("{tg}:budget:*") and not await client.keys("{tg}:gateway-requests:*")
        assert not await client.keys("{tg}:tenant-keys:*") and not await client.keys("{tg}:req:*")
        assert await keyspace.migrate(client, "m") == 0
    finally:
        await client.aclose()


async def test_a_models_keys_move_from_the_one_slot_to_its_own(redis_url: str) -> None:
    """Queued jobs (with their group and pending entries), arrivals, the scheduler's lease and
    term, the fitted model and the dead letters move to the model's slot; the shared telemetry
    stream and the doorbells (no TTL) go."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.xgroup_create("{tg}:jobs:alpha:cpu", wire.GROUP, id="0", mkstream=True)
        await client.xadd("{tg}:jobs:alpha:cpu", {"v": "1", "m": b"queued"})
        await client.xreadgroup(wire.GROUP, "w1", {"{tg}:jobs:alpha:cpu": ">"})  # pending on w1
        await client.xadd("{tg}:arrivals:alpha", {"k": b"a"})
        await client.set("{tg}:scheduler:alpha", "gw-1", ex=60)
        await client.set("{tg}:scheduler-term:alpha", 3)
        await client.set("{tg}:model:alpha", b"fitted")
        await client.xadd("{tg}:dead", {"m": b"poison"})
        await client.xadd("{tg}:steps", {"m": b"step"})
        await client.xadd("{tg}:bell:w1", {"j": b"1-0"})
        await keyspace.migrate(client, "alpha")
        pending = await client.xpending(wire.jobs_stream("alpha", "cpu"), wire.GROUP)
        assert pending["pending"] == 1 and pending["consumers"][0]["name"] == b"w1"
        assert await client.xlen(wire.arrivals_stream("alpha")) == 1
        assert await client.get(wire.scheduler_lease("alpha")) == b"gw-1"
        assert await client.get(wire.scheduler_term("alpha")) == b"3"
        assert await client.get(wire.model_key("alpha")) == b"fitted"
        assert await client.xlen(wire.dead_letter_stream("alpha")) == 1
        assert not await client.keys("{tg}:*")  # nothing left under the one slot
        assert await keyspace.migrate(client, "alpha") == 0
    finally:
        await client.aclose()
