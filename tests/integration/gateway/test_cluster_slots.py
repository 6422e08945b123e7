"""tokengate on a Redis that refuses what a Redis Cluster refuses (``tests.conftest.ClusterNodeRedis``:
one node in cluster mode, owning every slot): no script, ``MGET``, transaction or stream read
may mix slots (``CROSSSLOT``). A tenant's budget, leases, open requests, records, key digests
and usage are in its own slot (``wire.tenant_slot``); the flows that touch them run here as they
run on one Redis (issue 39: keys laid out for a Redis Cluster)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from gateway.dispatch.prompts import PromptBuilder
from gateway.tenancy import admin_protocol as ap
from gateway.tenancy.tenant_store import TenantStore
from tests.integration.gateway import test_many_models
from tests.integration.gateway.test_budget_lua import BudgetMachine

pytestmark = pytest.mark.redis


def test_the_budget_scripts_and_the_sweep_keep_to_one_slot(cluster_url: str) -> None:
    class Machine(BudgetMachine):
        url = cluster_url

    run_state_machine_as_test(Machine, settings=settings(max_examples=25, stateful_step_count=30, deadline=None))


@pytest.mark.anyio
async def test_tenants_and_keys_from_creation_to_deletion(cluster_url: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(cluster_url)
    try:
        store = TenantStore(client)
        t = await store.create(ap.parse_create({"name": "acme", "rate": 10}))
        key, info = await store.issue_key(t.id, "laptop")
        assert (await store.authenticate(key)) is not None
        assert [k.prefix for k in await store.list_keys("acme")] == [info.prefix]
        assert [x.id for x in await store.list_tenants()] == [t.id]
        await store.update("acme", lambda old: old)
        await store.revoke_key(info.prefix)
        assert await store.authenticate(key) is None
        await store.issue_key(t.id)
        await store.delete("acme")
        assert await store.list_tenants() == []
    finally:
        await client.aclose()


@pytest.mark.anyio
async def test_requests_of_two_models_from_admission_to_usage(cluster_url: str, prompts: PromptBuilder) -> None:
    """The whole gateway and its workers: tenants and keys made over the admin API, requests
    admitted, dispatched, answered and settled, usage written, the gateway's clean exit swept."""
    await test_many_models.test_one_gateway_serves_two_models_each_its_own_domain(cluster_url, prompts)
