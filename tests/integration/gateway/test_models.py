"""Two models on one Redis, each its own scheduling domain (issue 39): a gateway serving
``alpha`` and one serving ``beta``, each with its own echo worker. Tenants and keys are shared;
no job reaches the other model's worker, each gateway sees only its model's worker, and each
model has its own elected scheduler."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from common import protocol as p
from common import wire
from gateway.dispatch.prompts import PromptBuilder
from tests.integration.gateway.conftest import make_harness

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
        assert set(alpha.gw.dispatcher.workers) == {"w-alpha"} and set(beta.gw.dispatcher.workers) == {"w-beta"}
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
            assert h.gw.dispatcher.leading.leader
