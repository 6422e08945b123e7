"""The gateway's services, built once per process and shared by every request: Redis, the
tenant store, authentication, metrics, the long-prompt thread, background tasks, and one
``Domain`` per model it serves (its tokenizer, its dispatcher, its budget's books). ``Gateway``
only holds them: ``gateway.http.app`` routes requests to them, and ``gateway.http.lifecycle``
drives one request through them (its tokenizing, its settlement)."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.api import openai_protocol as oai
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.prompts import LongPrompts, PromptBuilder
from gateway.http.saturation import LoopLag
from gateway.metrics import Metrics, ModelMetrics
from gateway.redis_batch import AutoPipeline
from gateway.settings import GatewaySettings
from gateway.tasks import Tasks
from gateway.tenancy import limits
from gateway.tenancy.auth import Authenticator
from gateway.tenancy.budget import Budget
from gateway.tenancy.tenant_store import TenantStore
from gateway.tenancy.tenants import Tenant
from gateway.tenancy.usage import UsageBook

CANCEL_DRAIN_S = 5.0  # how long a cancelled request's final token count is awaited

log = logging.getLogger("tokengate.gateway")


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


@dataclass(slots=True)
class Domain:
    """One model this gateway serves: its own scheduling domain (issue 39). It acts as a
    gateway of its own on the shared Redis: its dispatcher elects (or follows) the model's
    scheduler, reads the model's workers and has its own reply stream, gateway entry and list
    of requests to settle, under ``settings.gateway_id`` (the process's id for its first model,
    ``<id>/<model>`` for the others); tenants, keys and budgets are the process's."""

    name: str
    settings: GatewaySettings  # the gateway's, with this model's name and the domain's gateway id
    prompts: PromptBuilder
    sampling: oai.SamplingDefaults  # what a request that leaves temperature/top_p out gets
    dispatcher: Dispatcher
    budget: Budget  # admits and settles against the tenant's bucket; keeps this domain's books
    metrics: ModelMetrics


class Gateway:
    """Everything a request handler needs, built once at start-up; no behaviour of its own."""

    def __init__(self, settings: GatewaySettings, prompts: PromptBuilder, client: aioredis.Redis,
                 sampling: oai.SamplingDefaults | None = None) -> None:
        self.settings = settings
        self.client = client
        self.metrics = Metrics()
        self.batch = AutoPipeline(client)  # admissions, settlements and jobs of one loop turn: one round trip
        self.domains: dict[str, Domain] = {}  # by model name, in the order they were added
        self.tenants = TenantStore(client)
        self.usage = UsageBook(client, settings.usage_retention_s)  # every model's requests' usage, written each second
        self.auth = Authenticator(self.tenants, settings.auth_cache_s)
        self.started = int(time.time())
        self.in_flight = 0  # requests between admission and their end (RequestLife)
        self.tasks = Tasks("settlements")
        self.long_prompts = LongPrompts()
        self.refusals = limits.RefusalBucket()  # refusals for size, per tenant: bursts allowed, floods held
        self.lag = LoopLag()  # how far behind the event loop runs: this process saturated
        self.add_model(settings.model_name, prompts, sampling)

    def add_model(self, name: str, prompts: PromptBuilder, sampling: oai.SamplingDefaults | None = None) -> Domain:
        """A model's domain (not started: ``Domain.dispatcher.start``); its first is the process's
        own gateway id, the others' ``<id>/<model>``."""
        gid = self.settings.gateway_id if not self.domains else f"{self.settings.gateway_id}/{name}"
        settings = dataclasses.replace(self.settings, model_name=name, gateway_id=gid)
        metrics = self.metrics.of(name)
        dispatcher = Dispatcher(settings, self.client, config=settings.scheduler, batch=self.batch,
                                on_workers=lambda found: metrics.observe_workers(found, settings.pools),
                                on_accuracy=metrics.observe_contract,
                                leads_elsewhere=lambda: sum(d.dispatcher.leading.leader for m, d in self.domains.items()
                                                            if m != name))
        domain = self.domains[name] = Domain(
            name, settings, prompts,
            sampling or oai.SamplingDefaults(settings.default_temperature, settings.default_top_p),
            dispatcher, Budget(self.client, settings, self.batch, self.usage), metrics,
        )
        return domain

    def domain(self, model: str | None = None) -> Domain:
        """``model``'s domain; the first model's (``--model``'s first) where None. KeyError for a
        model this gateway does not serve."""
        return self.domains[model] if model is not None else next(iter(self.domains.values()))

    def serves(self, model: str, tenant: Tenant) -> bool:
        """Whether this gateway serves ``model`` to ``tenant`` (a model it has a domain for, in
        the tenant's allowed models)."""
        return model in self.domains and tenant.may_use(model)

    def served(self) -> list[tuple[int, float]]:
        """Each model's (context, token weight): the largest request a tenant may send, for the
        burst rule (``tenancy.tenants.largest_request``)."""
        return [(d.prompts.context_tokens, d.budget.weight) for d in self.domains.values()]

    async def drain(self) -> None:
        """At shutdown: waits for settlements still in flight, then closes what was opened."""
        await self.tasks.drain(CANCEL_DRAIN_S + 1)
        try:
            await self.usage.flush()
        except RedisError as exc:
            log.warning("the last usage counts were not written: %s", exc)
        await self.batch.close()
        self.long_prompts.close()
