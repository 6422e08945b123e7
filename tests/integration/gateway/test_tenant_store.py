"""Tenants and keys in a real Redis: CRUD, unique names, issue/list/revoke, cascade."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from common import wire
from gateway.errors import Conflict, NotFound
from gateway.tenancy import admin_protocol as ap
from gateway.tenancy.tenant_store import TenantStore
from tests.redis_text import everything

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[TenantStore]:
    client = aioredis.Redis.from_url(redis_url)
    yield TenantStore(client)
    await client.aclose()


async def test_create_read_list_update_delete(store: TenantStore) -> None:
    a = await store.create(ap.parse_create({"name": "acme", "rate": 10}))
    b = await store.create(ap.parse_create({"name": "beta", "rate": 20}))
    assert await store.get(a.id) == a and await store.get("acme") == a
    assert {t.name for t in await store.list_tenants()} == {"acme", "beta"}
    renamed = await store.update(
        "acme", lambda t: ap.apply_update(t, ap.parse_update({"name": "acme2"}))
    )
    assert renamed.id == a.id and (await store.get("acme2")).id == a.id
    with pytest.raises(NotFound):
        await store.get("acme")  # the old name is free again
    with pytest.raises(Conflict):
        await store.update(b.id, lambda t: ap.apply_update(t, ap.parse_update({"name": "acme2"})))
    await store.delete("acme2")
    with pytest.raises(NotFound):
        await store.get(a.id)
    with pytest.raises(NotFound):
        await store.delete(a.id)
    assert [t.name for t in await store.list_tenants()] == ["beta"]


async def test_a_tenant_stored_before_tenants_had_an_slo_loads_without_one(store: TenantStore) -> None:
    t = await store.create(ap.parse_create({"name": "acme", "rate": 10, "slo_ttft_ms": 900}))
    assert (await store.get("acme")).slo_ttft_ms == 900.0
    doc = orjson.loads(await store.client.get(wire.tenant(t.id)))
    del doc["slo_ttft_ms"], doc["slo_tpot_ms"]
    await store.client.set(wire.tenant(t.id), orjson.dumps(doc))
    old = await store.get("acme")
    assert old.slo_ttft_ms is None and old.slo_tpot_ms is None and old.rate == 10.0


async def test_names_are_unique(store: TenantStore) -> None:
    await store.create(ap.parse_create({"name": "acme", "rate": 10}))
    with pytest.raises(Conflict):
        await store.create(ap.parse_create({"name": "acme", "rate": 99}))


async def test_keys_issue_authenticate_list_revoke(store: TenantStore) -> None:
    t = await store.create(ap.parse_create({"name": "acme", "rate": 10}))
    key, info = await store.issue_key("acme", "ci")
    assert await store.authenticate(key) == t
    assert [k.prefix for k in await store.list_keys(t.id)] == [info.prefix]
    await store.revoke_key(info.prefix)
    assert await store.authenticate(key) is None
    assert await store.list_keys(t.id) == []
    with pytest.raises(NotFound):
        await store.revoke_key(info.prefix)


async def test_a_forged_secret_with_a_real_prefix_is_refused(store: TenantStore) -> None:
    await store.create(ap.parse_create({"name": "acme", "rate": 10}))
    key, info = await store.issue_key("acme")
    forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    assert await store.authenticate(forged) is None
    assert await store.authenticate("tg-deadbeef-" + "A" * 43) is None


async def test_deleting_a_tenant_revokes_its_keys(store: TenantStore, redis_url: str) -> None:
    t = await store.create(ap.parse_create({"name": "acme", "rate": 10}))
    key, info = await store.issue_key(t.id)
    await store.delete(t.id)
    assert await store.authenticate(key) is None
    client = aioredis.Redis.from_url(redis_url)
    assert not await client.exists(wire.api_key(info.prefix), wire.tenant_keys(t.id))
    await client.aclose()
    with pytest.raises(NotFound):
        await store.issue_key(t.id)


async def test_no_plaintext_key_is_stored(store: TenantStore, redis_client: redis.Redis) -> None:
    await store.create(ap.parse_create({"name": "acme", "rate": 10}))
    key, info = await store.issue_key("acme")
    held = everything(redis_client)
    assert info.prefix.encode() in held and key.split("-", 2)[2].encode() not in held
