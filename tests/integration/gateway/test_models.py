"""Two models on one Redis, each its own scheduling domain (issue 39): a gateway serving
``alpha`` and one serving ``beta``, each with its own echo worker. Tenants and keys are shared;
no job reaches the other model's worker, each gateway sees only its model's worker, and each
model has its own elected scheduler."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis.asyncio as aioredis

from common import protocol as p
from common import wire
from gateway.dispatch.prompts import PromptBuilder
from gateway.http.app import create_app
from gateway.http.services import Gateway, redis_client
from gateway.settings import GatewaySettings
from tests.integration.gateway.conftest import ADMIN, make_harness

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

REQUESTS = 12


async def _jobs(client: aioredis.Redis, model: str) -> tuple[set[str], set[str]]:
    """The request ids on ``model``'s cpu jobs stream, and the consumers that read them."""
    stream = wire.jobs_stream(model, "cpu")
    rids = {seq.rid for _id, fields in await client.xrange(stream) for seq in p.decode_job(fields).seqs}
    consumers = {wire.text(c["name"]) for c in await client.xinfo_consumers(stream, wire.GROUP)}
    return rids, consumers


async def test_two_models_share_tenants_but_not_jobs_workers_or_schedulers(redis_url: str,
                                                                           prompts: PromptBuilder) -> None:
    async with make_harness(redis_url, prompts, "alpha", worker_id="w-alpha") as alpha, \
            make_harness(redis_url, prompts, "beta", worker_id="w-beta") as beta:
        assert set(alpha.gw.domain().dispatcher.workers) == {"w-alpha"}
        assert set(beta.gw.domain().dispatcher.workers) == {"w-beta"}
        _, key = await alpha.tenant("shared", rate=10**6, burst=10**8)  # made through alpha, used on both
        replies = await asyncio.gather(*(h.complete(key) for h in (alpha, beta) for _ in range(REQUESTS)))
        refused = [r.text for r in replies if r.status_code != 200]
        assert not refused, refused
        assert {r.json()["model"] for r in replies[:REQUESTS]} == {"alpha"}
        assert {r.json()["model"] for r in replies[REQUESTS:]} == {"beta"}

        client = alpha.gw.client
        alpha_rids, alpha_readers = await _jobs(client, "alpha")
        beta_rids, beta_readers = await _jobs(client, "beta")
        assert len(alpha_rids) == len(beta_rids) == REQUESTS and not alpha_rids & beta_rids
        assert alpha_readers == {"w-alpha"} and beta_readers == {"w-beta"}  # 0 jobs to the other model's worker
        for h in (alpha, beta):  # each model elected its own scheduler: the one gateway serving it
            assert await client.get(wire.scheduler_lease(h.model)) == h.gw.settings.gateway_id.encode()
            assert h.gw.domain().dispatcher.leading.leader


async def test_a_model_whose_workers_are_all_of_another_model_gets_503_naming_it(redis_url: str,
                                                                                 prompts: PromptBuilder) -> None:
    """A worker of ``alpha`` is live; a gateway of ``gamma`` beside it has no worker: 503
    ``no_worker`` with Retry-After, naming ``gamma``, and nothing on either jobs stream."""
    async with make_harness(redis_url, prompts, "alpha", worker_id="w-alpha") as alpha:
        _, key = await alpha.tenant("t", rate=10**6, burst=10**8)
        config = GatewaySettings(redis_url=redis_url, model_name="gamma", admin_token=ADMIN)
        gw = Gateway(config, prompts, redis_client(config))
        await gw.domain().dispatcher.start()
        await gw.domain().dispatcher.refresh_workers()
        try:
            transport = httpx.ASGITransport(app=create_app(gw))
            async with httpx.AsyncClient(transport=transport, base_url="http://g") as http:
                r = await http.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                                    json={"model": "gamma", "prompt": [1, 2, 3], "max_tokens": 4})
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            assert r.json()["error"]["code"] == "no_worker" and "'gamma'" in r.json()["error"]["message"]
            assert gw.domain().dispatcher.workers == {}  # alpha's worker is not in gamma's view
            assert not await alpha.gw.client.exists(wire.jobs_stream("gamma", "cpu"))
        finally:
            await gw.drain()
