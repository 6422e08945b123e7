"""A gateway in this process (httpx's ASGI transport) on the test Redis, with an echo worker
in a thread: the HTTP surface without subprocesses or a model."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.dispatch.prompts import PromptBuilder
from gateway.http.app import create_app
from gateway.http.services import Gateway, redis_client
from gateway.settings import GatewaySettings
from tests.integration.helpers import running_worker
from workers.engine import EchoEngine, Engine
from workers.model_store import ModelSpec

ADMIN = "integration-admin-token"
ECHO_TOKENS = 8


@dataclass
class Harness:
    gw: Gateway
    http: httpx.AsyncClient
    model: str

    async def admin(
        self, method: str, path: str, body: Any = None, token: str | None = ADMIN
    ) -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return await self.http.request(method, "/admin" + path, json=body, headers=headers)

    async def tenant(self, name: str, **fields: Any) -> tuple[dict[str, Any], str]:
        """A new tenant (rate 1000 tokens/s unless given) and a key for it."""
        r = await self.admin("POST", "/tenants", {"name": name, "rate": 1000, **fields})
        assert r.status_code == 201, r.text
        doc = r.json()
        k = await self.admin("POST", f"/tenants/{doc['id']}/keys", {"name": "test"})
        assert k.status_code == 201, k.text
        return doc, k.json()["key"]

    async def complete(self, key: str | None, **body: Any) -> httpx.Response:
        doc = {"model": self.model, "prompt": [1, 2, 3, 4, 5], "max_tokens": 10, **body}
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return await self.http.post("/v1/completions", json=doc, headers=headers)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def prompts(model_spec: ModelSpec) -> PromptBuilder:
    return PromptBuilder.load(model_spec.path)


@contextlib.asynccontextmanager
async def make_harness(
    redis_url: str,
    prompts: PromptBuilder,
    model: str,
    engine: Engine | None = None,
    client_url: str | None = None,
    worker_id: str | None = None,
    **settings: Any,
) -> AsyncIterator[Harness]:
    """A gateway on ``redis_url`` (its own client may log in as someone else: ``client_url``)
    with one worker running ``engine`` (the echo engine by default) in a thread."""
    config = GatewaySettings(
        redis_url=client_url or redis_url, model_name=model, admin_token=ADMIN, **{"request_timeout_s": 10, **settings}
    )
    client = redis_client(config)
    gw = Gateway(config, prompts, client)
    app = create_app(gw)
    # no self-profile: an instant echo engine would measure microsecond steps and every contract
    # would read 0 ms; these tests check the contracts' mechanics on the packaged priors (the
    # self-profile's own path is tests/e2e/test_worker_profiles.py)
    own = {"worker_id": worker_id} if worker_id else {}  # (two harnesses in one process: two ids)
    with running_worker(redis_url, engine or EchoEngine(tokens=ECHO_TOKENS), model=model, profile_s=0, **own):
        await gw.domain().dispatcher.start()
        deadline = time.monotonic() + 10
        while not gw.domain().dispatcher.workers:
            assert time.monotonic() < deadline, "the echo worker never sent a heartbeat"
            await asyncio.sleep(0.05)
            await gw.domain().dispatcher.refresh_workers()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            yield Harness(gw, http, model)
        await gw.drain()
        await gw.domain().dispatcher.close()
    await client.aclose()


@pytest.fixture
async def harness(redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec) -> AsyncIterator[Harness]:
    async with make_harness(redis_url, prompts, model_spec.name) as h:
        yield h
