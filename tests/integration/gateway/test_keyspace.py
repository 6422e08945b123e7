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
        assert await keyspace.migrate(client) == 4
        assert await client.get(wire.tenant("t1")) == b'{"id": "t1"}'
        assert await client.smembers(wire.TENANT_IDS) == {b"t1"}
        assert await client.hget(wire.api_key("abcd1234"), "tenant") == b"t1"
        assert 0 < await client.ttl(wire.request("r1")) <= 300
        assert await client.get(wire.model_key("m")) == b"new" and await client.get("tg:model:m") == b"old"
        assert await client.get("tg-not-ours") == b"x"
        assert await keyspace.migrate(client) == 0  # nothing left to rename
    finally:
        await client.aclose()
