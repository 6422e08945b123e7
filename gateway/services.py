"""The gateway's services, built once per process and shared by every request: Redis, the
budget, the dispatcher, the tenant store, authentication, metrics, settlements. ``gateway.http.app``
routes requests to them; ``gateway.dispatch.lifecycle`` drives one request through them."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common import protocol as p
from gateway.dispatch.dispatcher import BACKOFF, Dispatcher
from gateway.dispatch.meter import Meter
from gateway.dispatch.prompts import PromptBuilder, PromptTooLong
from gateway.errors import (
    RETRY_AFTER_S,
    Overloaded,
    RateLimited,
)
from gateway.http import openai_protocol as oai
from gateway.http.saturation import LoopLag
from gateway.metrics import Metrics
from gateway.redis_batch import AutoPipeline
from gateway.settings import GatewaySettings
from gateway.tenancy import limits
from gateway.tenancy.auth import Authenticator
from gateway.tenancy.budget import Admission, Budget
from gateway.tenancy.tenant_store import TenantStore
from gateway.tenancy.tenants import Tenant

log = logging.getLogger("tokengate.gateway")

LARGE_PROMPT_CHARS = 4096  # prompts longer than this are tokenized off the event loop
LARGE_PROMPTS_PER_TENANT = 2  # ... at most this many at a time per tenant (429 beyond)
LARGE_PROMPTS_QUEUED = 16  # ... and this many in all (503 beyond)
CANCEL_DRAIN_S = 5.0  # how long a cancelled request's final token count is awaited


def redis_client(settings: GatewaySettings) -> aioredis.Redis:
    """The gateway's Redis client: a bounded pool where a request waits (up to the Redis
    timeout) for a free connection instead of failing, and commands that give up after the
    Redis timeout, so a stalled Redis becomes a 503 within the request's deadline."""
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_timeout_s,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
    )
    return aioredis.Redis(connection_pool=pool)


class Gateway:
    """Everything a request handler needs, built once at start-up."""

    def __init__(self, settings: GatewaySettings, prompts: PromptBuilder, client: aioredis.Redis,
                 sampling: oai.SamplingDefaults | None = None) -> None:
        self.settings = settings
        self.prompts = prompts
        # what a request that leaves temperature/top_p out gets (default: the settings' alone)
        self.sampling = sampling or oai.SamplingDefaults(settings.default_temperature, settings.default_top_p)
        self.client = client
        self.metrics = Metrics()
        self.batch = AutoPipeline(client)  # admissions, settlements and jobs of one loop turn: one round trip
        self.dispatcher = Dispatcher(settings, client, on_workers=self._count_workers, config=settings.scheduler,
                                     batch=self.batch)
        self.tenants = TenantStore(client)
        self.auth = Authenticator(self.tenants, settings.auth_cache_s)
        self.budget = Budget(client, settings, self.batch)
        self.started = int(time.time())
        self.in_flight = 0  # requests between admission and their end (RequestLife)
        self._tasks: set[asyncio.Future[Any]] = set()
        self._tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._large: dict[str, int] = {}  # tenant id -> large prompts being tokenized
        self.refusals = limits.RefusalBucket()  # refusals for size, per tenant: bursts allowed, floods held
        self.lag = LoopLag()  # how far behind the event loop runs: this process saturated

    def _count_workers(self, workers: dict[str, p.Heartbeat]) -> None:
        for pool in self.settings.pools:
            self.metrics.workers.labels(pool).set(sum(1 for w in workers.values() if w.pool == pool))
        self.metrics.observe_profiles(workers)

    def serves(self, model: str, tenant: Tenant) -> bool:
        """Whether this gateway serves ``model`` to ``tenant`` (a model it runs, in the tenant's
        allowed models)."""
        return model == self.settings.model_name and tenant.may_use(model)

    def new_rid(self) -> str:
        return secrets.token_hex(12)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        """A task the gateway keeps until it ends (and awaits at shutdown)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def tokenize(self, gen: oai.Generation, tenant: Tenant) -> tuple[int, ...]:
        """The prompt's token ids, bounded (``gateway.dispatch.prompts``). A long prompt is tokenized on
        a thread of its own, at most ``LARGE_PROMPTS_PER_TENANT`` per tenant at once, so one
        sender of huge prompts slows only itself."""
        limit = limits.prompt_limit(self.prompts.context_tokens, tenant)
        try:
            if PromptBuilder.chars(gen) <= LARGE_PROMPT_CHARS:
                return self.prompts.token_ids(gen, limit)
            busy = self._large.get(tenant.id, 0)
            if busy >= LARGE_PROMPTS_PER_TENANT:
                raise RateLimited(
                    f"Tenant '{tenant.name}' already has {busy} long prompts being tokenized; retry after "
                    f"{RETRY_AFTER_S} s, or when they are done.",
                    headers={"retry-after": str(RETRY_AFTER_S)},
                )
            if sum(self._large.values()) >= LARGE_PROMPTS_QUEUED:
                raise Overloaded("Too many long prompts are being tokenized; retry shortly.")
            self._large[tenant.id] = busy + 1
            try:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._tokenizer, self.prompts.token_ids, gen, limit)
            finally:
                left = self._large[tenant.id] - 1
                if left:
                    self._large[tenant.id] = left
                else:
                    del self._large[tenant.id]
        except PromptTooLong as exc:
            raise limits.prompt_too_long(gen, exc.tokens, exc.exact, self.prompts.context_tokens, tenant) from None

    def scheduler_snapshot(self) -> dict[str, Any]:
        """This gateway's scheduler for ``GET /admin/scheduler``: queues per bucket, fitted
        cost curves, derived thresholds, per-tenant counters, capacity per path."""
        return self.dispatcher.snapshot()

    def settle(self, admission: Admission, meter: Meter) -> asyncio.Future[bool]:
        """Settles the request's budget once; later calls return the same future. It runs as
        its own task, so a handler cancelled by a disconnect cannot stop it half-way."""
        if meter.settling is None:
            prompt, completion = meter.charge()
            meter.settling = self.spawn(self._settle(admission, meter.outcome, prompt, completion, meter.record()))
        return meter.settling

    async def _settle(
        self, admission: Admission, state: str, prompt: int, completion: int, record: dict[str, float]
    ) -> bool:
        self.metrics.observe_contract(self.dispatcher.outcome(admission.rid, record.get("ttft_s"),
                                                              record.get("total_s"), completion))
        return await self._until_settled(
            admission.rid, lambda: self.budget.settle(admission, state, prompt, completion, record)
        )

    def refund_if_admitted(self, tenant: Tenant, rid: str, reserved: int) -> None:
        """An admission whose reply was lost (Redis failed mid-call) may or may not have run:
        settling it as failed refunds it if it did, and does nothing if it did not."""
        self.spawn(self._until_settled(rid, lambda: self.budget.settle_raw(tenant, rid, -reserved, "failed", 0, 0)))

    async def _until_settled(self, rid: str, attempt: Callable[[], Awaitable[bool]]) -> bool:
        """Settling is idempotent (only the call that ends the lease changes anything), so a
        settlement that Redis failed is tried again, with backoff, for as long as its lease
        can last; a refund is never silently lost to a Redis hiccup."""
        give_up = time.monotonic() + self.settings.request_timeout_s + 30.0
        failures = 0
        while True:
            try:
                return await attempt()
            except RedisError as exc:
                failures += 1
                delay = BACKOFF.compute(failures)
                if time.monotonic() + delay > give_up:
                    log.error("settling request %s failed for good: %s", rid, exc)
                    return False
                if failures == 1:
                    log.warning("settling request %s failed (%s); retrying", rid, exc)
                await asyncio.sleep(delay)

    async def drain(self) -> None:
        """Waits for settlements still in flight (at shutdown)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=CANCEL_DRAIN_S + 1)
        await self.batch.close()
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
