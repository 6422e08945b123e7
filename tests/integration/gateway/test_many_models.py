"""One gateway, several models behind one endpoint (issue 39): each model its own domain (its
workers, jobs streams, elected scheduler, metrics), the request's ``model`` picking it; a model
its workers announce is served as it appears. Echo workers that answer with a different number
of tokens per model tell which model's worker served each request."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from common import tokenizer_bundle, wire
from gateway.api import openai_protocol as oai
from gateway.cli import served
from gateway.dispatch.leading import YIELD_S
from gateway.dispatch.prompts import PromptBuilder
from gateway.http.app import create_app
from gateway.http.services import Gateway, redis_client
from gateway.settings import GatewaySettings
from tests.integration.gateway.conftest import ADMIN
from tests.integration.gateway.test_models import _jobs
from tests.integration.helpers import running_worker
from workers.engine import EchoEngine
from workers.model_store import ModelSpec

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

REQUESTS = 10
TOKENS = {"alpha": 3, "beta": 5}  # each model's echo worker answers with this many tokens


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _gateway(redis_url: str, prompts: PromptBuilder, *more: str,
                   **settings: Any) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    """A gateway serving ``alpha`` and ``more``, every domain started, with an HTTP client."""
    config = GatewaySettings(redis_url=redis_url, model_name="alpha", admin_token=ADMIN, request_timeout_s=10,
                             **settings)
    gw = Gateway(config, prompts, redis_client(config))
    for name in more:
        gw.add_model(name, prompts)
    for dom in gw.domains.values():
        await dom.dispatcher.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gw)), base_url="http://g") as http:
            yield gw, http
    finally:
        await gw.drain()
        for dom in list(gw.domains.values()):
            await dom.dispatcher.close()
        await gw.client.aclose()


async def _key(http: httpx.AsyncClient) -> str:
    admin = {"authorization": f"Bearer {ADMIN}"}
    tenant = (await http.post("/admin/tenants", json={"name": "t", "rate": 10**6, "burst": 10**8},
                              headers=admin)).json()
    return str((await http.post(f"/admin/tenants/{tenant['id']}/keys", json={}, headers=admin)).json()["key"])


async def test_one_gateway_serves_two_models_each_its_own_domain(redis_url: str, prompts: PromptBuilder) -> None:
    with running_worker(redis_url, EchoEngine(tokens=TOKENS["alpha"]), model="alpha", worker_id="w-alpha",
                        profile_s=0), \
            running_worker(redis_url, EchoEngine(tokens=TOKENS["beta"]), model="beta", worker_id="w-beta",
                           profile_s=0):
        async with _gateway(redis_url, prompts, "beta", "gamma") as (gw, http):
            alpha, beta, gamma = (gw.domain(m) for m in ("alpha", "beta", "gamma"))
            await _until(lambda: bool(alpha.dispatcher.workers and beta.dispatcher.workers), "both workers")
            assert set(alpha.dispatcher.workers) == {"w-alpha"} and set(beta.dispatcher.workers) == {"w-beta"}
            key = await _key(http)
            auth = {"authorization": f"Bearer {key}"}

            listed = (await http.get("/v1/models", headers=auth)).json()
            assert [m["id"] for m in listed["data"]] == ["alpha", "beta"]  # gamma: no live worker

            replies = await asyncio.gather(*(
                http.post("/v1/completions", headers=auth, json={"model": m, "prompt": [1, 2, 3], "max_tokens": 8})
                for m in ("alpha", "beta") for _ in range(REQUESTS)))
            assert [r.status_code for r in replies] == [200] * 2 * REQUESTS, [r.text for r in replies
                                                                               if r.status_code != 200]
            for r in replies:  # the worker of the model asked for answered: its token count says which
                doc = r.json()
                assert doc["usage"]["completion_tokens"] == TOKENS[doc["model"]], doc

            rids = {}
            for model, reader in (("alpha", "w-alpha"), ("beta", "w-beta")):
                rids[model], readers = await _jobs(gw.client, model)
                assert len(rids[model]) == REQUESTS and readers == {reader}  # 0 jobs to the other's worker
            assert not rids["alpha"] & rids["beta"]
            # each model elected its own scheduler: this gateway's domain of it
            assert await gw.client.get(wire.scheduler_lease("alpha")) == gw.settings.gateway_id.encode()
            assert await gw.client.get(wire.scheduler_lease("beta")) == f"{gw.settings.gateway_id}/beta".encode()

            r = await http.post("/v1/completions", headers=auth,
                                json={"model": "gamma", "prompt": [1], "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            assert r.json()["error"]["code"] == "no_worker" and "'gamma'" in r.json()["error"]["message"]
            assert gamma.dispatcher.workers == {}
            r = await http.post("/v1/completions", headers=auth,
                                json={"model": "nope", "prompt": [1], "max_tokens": 2})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

            metrics = (await http.get("/metrics")).text
            for model in ("alpha", "beta"):
                assert f'tokengate_admitted_total{{model="{model}"}} {float(REQUESTS)}' in metrics
                assert (f'tokengate_requests_total{{model="{model}",route="completions",status="200"}} '
                        f'{float(REQUESTS)}') in metrics
                tokens = float(REQUESTS * TOKENS[model])
                assert f'tokengate_tokens_total{{kind="completion",model="{model}"}} {tokens}' in metrics
                assert f'tokengate_workers_alive{{model="{model}",pool="cpu"}} 1.0' in metrics

            admin = {"authorization": f"Bearer {ADMIN}"}
            assert (await http.get("/admin/scheduler?model=beta", headers=admin)).json()["model"] == "beta"
            assert (await http.get("/admin/scheduler", headers=admin)).json()["model"] == "alpha"
            nope = await http.get("/admin/cluster?model=nope", headers=admin)
            assert nope.status_code == 404 and nope.json()["error"]["code"] == "model_not_found"
            view = (await http.get("/admin/cluster?model=beta", headers=admin)).json()
            assert view["model"] == "beta" and view["models"] == ["alpha", "beta", "gamma"]
            assert [w["worker"] for w in view["workers"]] == ["w-beta"]
            ready = (await http.get("/readyz")).json()
            assert ready["workers"] == 2 and {m: v["workers"] for m, v in ready["models"].items()} == {
                "alpha": 1, "beta": 1, "gamma": 0}


async def test_a_model_its_workers_announce_is_served_as_it_appears(redis_url: str, prompts: PromptBuilder,
                                                                     model_spec: ModelSpec, tmp_path: Path) -> None:
    """A worker of ``delta`` (the default model's tokenizer, under another name) publishes its
    tokenizer: the gateway, started with ``alpha`` alone, serves ``delta`` within a look or two."""
    bundle = tokenizer_bundle.pack(model_spec.path)
    assert bundle is not None
    fatal: list[str] = []
    async with _gateway(redis_url, prompts) as (gw, http):
        stop = asyncio.Event()
        watch = asyncio.create_task(served.watch(gw, tmp_path, fatal.append, stop.is_set))
        try:
            with running_worker(redis_url, EchoEngine(tokens=4), model="delta", worker_id="w-delta", profile_s=0,
                                tokenizer=bundle):
                await _until(lambda: "delta" in gw.domains and bool(gw.domain("delta").dispatcher.workers),
                             "the announced model's domain", timeout_s=served.WATCH_S * 3 + 10)
                key = await _key(http)
                auth = {"authorization": f"Bearer {key}"}
                r = await http.post("/v1/chat/completions", headers=auth, json={
                    "model": "delta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
                assert r.status_code == 200, r.text
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
                # counted with the published tokenizer: the same count as the model's own files give
                asked = oai.parse_chat({"model": "delta", "messages": [{"role": "user", "content": "hi"}]})
                assert r.json()["usage"]["prompt_tokens"] == len(prompts.token_ids(asked, 10_000))
                assert "delta" in [m["id"] for m in (await http.get("/v1/models", headers=auth)).json()["data"]]
        finally:
            stop.set()
            watch.cancel()
    assert not fatal


async def test_a_token_of_a_heavier_model_costs_the_budget_its_weight(redis_url: str, prompts: PromptBuilder) -> None:
    """``--token-weight beta=3``: the same request costs the tenant's budget three times as much
    on beta as on alpha, and usage shows the tokens and what was charged."""
    with running_worker(redis_url, EchoEngine(tokens=TOKENS["alpha"]), model="alpha", worker_id="w-alpha",
                        profile_s=0), \
            running_worker(redis_url, EchoEngine(tokens=TOKENS["beta"]), model="beta", worker_id="w-beta",
                           profile_s=0):
        async with _gateway(redis_url, prompts, "beta", token_weights=(("beta", 3.0),)) as (gw, http):
            await _until(lambda: all(d.dispatcher.workers for d in gw.domains.values()), "both workers")
            admin = {"authorization": f"Bearer {ADMIN}"}
            key = await _key(http)
            auth = {"authorization": f"Bearer {key}"}
            charged = {}
            for model in ("alpha", "beta"):
                r = await http.post("/v1/completions", headers=auth,
                                    json={"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 8})
                assert r.status_code == 200, r.text
                record = (await http.get(f"/v1/requests/{r.headers['x-request-id']}", headers=auth)).json()
                charged[model] = (record["reserved_tokens"], record["charged_tokens"])
            assert charged == {"alpha": (4 + 8, 4 + TOKENS["alpha"]), "beta": (3 * (4 + 8), 3 * (4 + TOKENS["beta"]))}
            usage = (await http.get("/admin/tenants/t/usage", headers=admin)).json()
            totals = usage["totals"]
            assert totals["total_tokens"] == 8 + TOKENS["alpha"] + TOKENS["beta"]
            assert totals["charged_tokens"] == (4 + TOKENS["alpha"]) + 3 * (4 + TOKENS["beta"])


async def test_a_model_s_step_time_model_learns_only_its_own_workers_steps(redis_url: str,
                                                                           prompts: PromptBuilder) -> None:
    """Every model's workers publish their steps on one telemetry stream: traffic on alpha refits
    alpha's step-time model and leaves beta's as it was."""
    with running_worker(redis_url, EchoEngine(tokens=TOKENS["alpha"]), model="alpha", worker_id="w-alpha",
                        profile_s=0), \
            running_worker(redis_url, EchoEngine(tokens=TOKENS["beta"]), model="beta", worker_id="w-beta",
                           profile_s=0):
        async with _gateway(redis_url, prompts, "beta") as (gw, http):
            await _until(lambda: all(d.dispatcher.workers for d in gw.domains.values()), "both workers")

            def fitted(model: str) -> int:
                return int(gw.domain(model).dispatcher.snapshot()["paths"]["cpu"]["fitted_steps"])

            await asyncio.sleep(1.0)  # the workers' warm-up telemetry is in
            before = {m: fitted(m) for m in ("alpha", "beta")}
            key = await _key(http)
            for _ in range(10):
                r = await http.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                                    json={"model": "alpha", "prompt": [1, 2, 3], "max_tokens": 8})
                assert r.status_code == 200, r.text
            await _until(lambda: fitted("alpha") > before["alpha"], "alpha's steps fitted")
            await asyncio.sleep(1.0)  # any step of alpha's worker that beta could have read is in by now
            assert fitted("beta") == before["beta"], (before, fitted("alpha"), fitted("beta"))


async def test_two_gateways_serving_two_models_elect_a_scheduler_each_and_one_takes_both_when_the_other_goes(
        redis_url: str, prompts: PromptBuilder) -> None:
    """The first gateway up takes alpha's lease and lets beta's lie (``Leading.turn``): the
    second gateway, scheduling nothing yet, takes beta's. When it goes, the first takes beta's
    too, once the lease has lapsed and lain free its ``YIELD_S``."""
    async with _gateway(redis_url, prompts, "beta", gateway_id="g1") as (one, _):
        async with _gateway(redis_url, prompts, "beta", gateway_id="g2") as (two, _):
            await asyncio.sleep(2 * YIELD_S)  # past any yield: the leases have settled
            assert await one.client.get(wire.scheduler_lease("alpha")) == b"g1"
            assert await one.client.get(wire.scheduler_lease("beta")) == b"g2/beta"
            assert one.domain("alpha").dispatcher.leading.leader and not one.domain("beta").dispatcher.leading.leader
            assert two.domain("beta").dispatcher.leading.leader and not two.domain("alpha").dispatcher.leading.leader
        await _until(lambda: one.domain("beta").dispatcher.leading.leader, "g1 scheduling beta", timeout_s=5)
        assert await one.client.get(wire.scheduler_lease("beta")) == b"g1/beta"
