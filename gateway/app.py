"""The Starlette application: OpenAI-compatible routes, admin API, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import redis.asyncio as aioredis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import admin, limits, records
from gateway import openai_protocol as oai
from gateway.auth import AdminGuard, Authenticator
from gateway.budget import Admission, Budget
from gateway.dispatch import Dispatcher, Pending
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    Timeout,
    Unavailable,
    WorkerFailed,
    error_body,
    error_response,
)
from gateway.meter import Meter
from gateway.metrics import Metrics
from gateway.prompts import PromptBuilder
from gateway.scheduling import Origin
from gateway.settings import GatewaySettings
from gateway.tenant_store import TenantStore
from gateway.tenants import Tenant
from gateway.web import ORJSONResponse, read_json
from sched_core import Contract, Reject
from workers import protocol as p

log = logging.getLogger("tokengate.gateway")

DEADLINE_HEADER = "x-tokengate-deadline-ms"
CANCEL_DRAIN_S = 5.0  # how long a cancelled request's final token count is awaited


class Gateway:
    """Everything a request handler needs, built once at start-up."""

    def __init__(self, settings: GatewaySettings, prompts: PromptBuilder, client: aioredis.Redis) -> None:
        self.settings = settings
        self.prompts = prompts
        self.client = client
        self.metrics = Metrics()
        self.dispatcher = Dispatcher(settings, client, on_workers=self._count_workers, config=settings.scheduler)
        self.tenants = TenantStore(client)
        self.auth = Authenticator(self.tenants, settings.auth_cache_s)
        self.budget = Budget(client, settings)
        self.started = int(time.time())
        self._settling: set[asyncio.Future[bool]] = set()

    def _count_workers(self, workers: dict[str, p.Heartbeat]) -> None:
        for pool in self.settings.pools:
            self.metrics.workers.labels(pool).set(sum(1 for w in workers.values() if w.pool == pool))

    def scheduler_snapshot(self) -> dict[str, Any]:
        """This gateway's scheduler for ``GET /admin/scheduler``: queues per bucket, fitted
        cost curves, derived thresholds, per-tenant counters, capacity per path."""
        return self.dispatcher.snapshot()

    def after_cancel(self, pending: Pending, admission: Admission, meter: Meter) -> None:
        """A dispatched request whose client left: wait (briefly) for the worker's final
        event, so the tenant is charged what was really generated, then settle."""
        task = asyncio.ensure_future(self._drain_then_settle(pending, admission, meter))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _drain_then_settle(self, pending: Pending, admission: Admission, meter: Meter) -> None:
        try:
            async with asyncio.timeout(CANCEL_DRAIN_S):
                while True:
                    ev = await pending.events.get()
                    if isinstance(ev, p.Delta):
                        meter.completion_tokens = ev.tokens
                    elif isinstance(ev, p.Finished | p.Failed):
                        meter.completion_tokens = max(meter.completion_tokens, getattr(ev, "completion_tokens", 0))
                        break
        except TimeoutError:
            pass
        finally:
            self.dispatcher.forget(pending.seq.rid)
        await self.settle(admission, meter)

    def settle(self, admission: Admission, meter: Meter) -> asyncio.Future[bool]:
        """Settles the request's budget once; later calls return the same future. It runs as
        its own task, so a handler cancelled by a disconnect cannot stop it half-way."""
        if meter.settling is None:
            prompt, completion = meter.charge()
            task = asyncio.ensure_future(
                self._settle(admission, meter.outcome, prompt, completion, meter.record())
            )
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
            meter.settling = task
        return meter.settling

    async def _settle(
        self, admission: Admission, state: str, prompt: int, completion: int, record: dict[str, float]
    ) -> bool:
        self.metrics.observe_contract(record)
        try:
            return await self.budget.settle(admission, state, prompt, completion, record)
        except RedisError as exc:  # the lease expires on its own; the reservation stays charged
            log.warning("settling request %s failed: %s", admission.rid, exc)
            return False

    async def drain(self) -> None:
        """Waits for settlements still in flight (at shutdown)."""
        if self._settling:
            await asyncio.wait(set(self._settling), timeout=5)


# -- generation ------------------------------------------------------------------------


def _prepare(gw: Gateway, gen: oai.Generation, tenant: Tenant) -> p.SeqJob:
    """The job for a request, or the 400/404/503 that refuses it before anything is queued."""
    if gen.model != gw.settings.model_name or not tenant.may_use(gen.model):
        raise ModelNotFound(f"The model '{gen.model}' does not exist.", param="model")
    ids = gw.prompts.token_ids(gen)
    max_tokens = limits.output_tokens(
        gen, len(ids), gw.prompts.context_tokens, gw.settings.default_max_tokens, tenant
    )
    if not gw.dispatcher.alive_pools():
        raise Unavailable("No worker is alive to serve this request; try again shortly.")
    return p.SeqJob(secrets.token_hex(12), tuple(ids), gen.sampling(max_tokens), gen.stream)


def _failure(ev: p.Failed) -> GatewayError:
    if ev.code in ("no_worker", "redis"):
        return Unavailable(ev.message)
    if ev.code == "deadline":  # the scheduler dropped it from the queue: it could no longer make it
        return Unavailable(f"Request {ev.rid} cannot finish before its deadline: {ev.message}", code="deadline_unmet")
    return WorkerFailed(f"Request {ev.rid} failed: {ev.message}", code=ev.code)


async def _next_event(pending: Pending, deadline: float) -> p.Event:
    if not pending.events.empty():
        return pending.events.get_nowait()
    async with asyncio.timeout_at(asyncio.get_running_loop().time() + deadline - time.monotonic()):
        return await pending.events.get()


async def _collect(
    gw: Gateway, gen: oai.Generation, pending: Pending, deadline: float, meter: Meter
) -> Response:
    parts: list[str] = []
    while True:
        try:
            ev = await _next_event(pending, deadline)
        except TimeoutError:
            meter.fail()
            raise Timeout(f"Request {pending.seq.rid} timed out after {gw.settings.request_timeout_s:g} s.") from None
        meter.observe(ev)
        if isinstance(ev, p.Delta):
            parts.append(ev.text)
        elif isinstance(ev, p.Finished):
            parts.append(ev.text)
            gw.metrics.tokens.labels("prompt").inc(ev.prompt_tokens)
            gw.metrics.tokens.labels("completion").inc(ev.completion_tokens)
            body = oai.completion_body(
                gen, pending.seq.rid, "".join(parts), ev.finish_reason, ev.prompt_tokens, ev.completion_tokens
            )
            return ORJSONResponse(body)
        elif isinstance(ev, p.Failed):
            raise _failure(ev)


def _sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


async def _stream(
    gw: Gateway,
    gen: oai.Generation,
    pending: Pending,
    deadline: float,
    admission: Admission,
    meter: Meter,
) -> AsyncIterator[bytes]:
    rid = pending.seq.rid
    created = int(time.time())
    route = "chat" if gen.kind == "chat" else "completions"
    finished = False
    try:
        if gen.kind == "chat":
            yield _sse(oai.chunk_body(gen, rid, created, "", first=True))
        first_token = True
        while True:
            try:
                ev = await _next_event(pending, deadline)
            except TimeoutError:
                meter.fail()
                err = Timeout(f"Request {rid} timed out after {gw.settings.request_timeout_s:g} s.")
                yield _sse(error_body(err))
                return
            meter.observe(ev)
            if isinstance(ev, p.Delta):
                if first_token:
                    gw.metrics.ttft.labels(route).observe(time.monotonic() - pending.created)
                    first_token = False
                yield _sse(oai.chunk_body(gen, rid, created, ev.text))
            elif isinstance(ev, p.Finished):
                if ev.text:
                    yield _sse(oai.chunk_body(gen, rid, created, ev.text))
                yield _sse(oai.chunk_body(gen, rid, created, None, ev.finish_reason))
                if gen.include_usage:
                    yield _sse(oai.usage_chunk(gen, rid, created, ev.prompt_tokens, ev.completion_tokens))
                gw.metrics.tokens.labels("prompt").inc(ev.prompt_tokens)
                gw.metrics.tokens.labels("completion").inc(ev.completion_tokens)
                finished = True
                await gw.settle(admission, meter)  # before [DONE]: a client may reuse the slot
                yield b"data: [DONE]\n\n"
                return
            elif isinstance(ev, p.Failed):
                finished = True
                yield _sse(error_body(_failure(ev)))
                return
    finally:
        gw.metrics.in_flight.dec()
        if finished:
            gw.dispatcher.forget(rid)
            gw.settle(admission, meter)  # not awaited: a disconnect may have cancelled us
        else:  # a client that went away cancels its work; so does a timeout
            _cancel(gw, pending, admission, meter)


def _cancel(gw: Gateway, pending: Pending, admission: Admission, meter: Meter) -> None:
    """Stop a request's work and settle it: at once if it never left this gateway's queue
    (it costs nothing), else once its worker reports what it had generated."""
    if gw.dispatcher.cancel(pending.seq.rid):
        meter.started = False
        gw.settle(admission, meter)
    else:
        gw.after_cancel(pending, admission, meter)


def _deadline_s(request: Request) -> float | None:
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not 0 < ms < 86_400_000:
        raise InvalidRequest(
            f"The {DEADLINE_HEADER} header must be a positive number of milliseconds.", param=DEADLINE_HEADER
        )
    return ms / 1000


def _refused(rid: str, reject: Reject, meter: Meter) -> GatewayError:
    """The scheduler will not run the request: say why, with its estimate."""
    estimate = {"estimate_ms": round(reject.estimate_s * 1000, 1)} if reject.estimate_s else {}
    retry = {"retry-after": str(max(1, math.ceil(reject.retry_after_s)))} if reject.retry_after_s else {}
    if reject.reason == "too_long":
        return InvalidRequest(f"Request {rid}: {reject.message}", param="messages", code="prompt_too_long")
    code = "deadline_unmet" if reject.reason == "deadline" else reject.reason
    return Unavailable(
        f"Request {rid} cannot be served in time: {reject.message}",
        code=code,
        headers={**retry, **({"x-tokengate-estimate-ms": str(estimate["estimate_ms"])} if estimate else {})},
        extra=estimate,
    )


def contract_headers(c: Contract) -> dict[str, str]:
    """The latency contract (milliseconds from when the gateway received the request)."""
    return {
        "x-tokengate-ttft-ms": f"{c.ttft_s * 1000:.1f}",
        "x-tokengate-latency-ms": f"{c.total_s * 1000:.1f}",
        "x-tokengate-p99-ms": f"{c.p99_s * 1000:.1f}",
        "x-tokengate-tokens-ahead": str(c.tokens_ahead),
        "x-tokengate-budget-wait-ms": f"{c.budget_wait_s * 1000:.1f}",
        "x-tokengate-bucket": str(c.bucket),
        "x-tokengate-path": c.path,
    }


async def _generate(request: Request, parse: Any) -> Response:
    gw: Gateway = request.app.state.gateway
    caller = await gw.auth.caller(request.headers)
    tenant = caller.tenant
    gen = parse(await read_json(request, gw.settings.max_body_bytes))
    deadline_s = _deadline_s(request)
    meter = Meter(0)
    seq = _prepare(gw, gen, tenant)
    meter.prompt_tokens = len(seq.prompt_ids)
    admission = await gw.budget.admit(
        tenant, seq.rid, len(seq.prompt_ids), seq.params.max_tokens, key=caller.key, deadline_s=deadline_s
    )
    try:
        if admission.wait_s > 0.0:
            gw.metrics.budget_wait.observe(admission.wait_s)
            await asyncio.sleep(admission.wait_s)
        who = Origin(
            tenant=tenant.id,
            weight=tenant.weight,
            priority=tenant.priority,
            budget_wait_s=admission.wait_s,
            deadline_s=None if deadline_s is None else deadline_s - (time.monotonic() - meter.received),
        )
        decision = gw.dispatcher.submit(seq, who)
        if isinstance(decision, Reject):
            raise _refused(seq.rid, decision, meter)
        pending = decision
        meter.started = True
        meter.contract = pending.contract
    except BaseException:
        await asyncio.shield(gw.settle(admission, meter))
        raise
    gw.metrics.in_flight.inc()
    timeout_at = pending.created + gw.settings.request_timeout_s
    headers = {"x-request-id": seq.rid, **admission.headers, **contract_headers(pending.contract)}
    if gen.stream:
        return StreamingResponse(
            _stream(gw, gen, pending, timeout_at, admission, meter),
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache"},
        )
    collect = asyncio.ensure_future(_collect(gw, gen, pending, timeout_at, meter))
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((collect, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gw.metrics.in_flight.dec()
        timed_out = collect.done() and not collect.cancelled() and isinstance(collect.exception(), Timeout)
        if collect.done() and not timed_out:
            gw.dispatcher.forget(seq.rid)
            await asyncio.shield(gw.settle(admission, meter))
        else:  # the client went away, or we gave up on it: cancel its work
            collect.cancel()
            _cancel(gw, pending, admission, meter)
    if collect.cancelled():
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    response = collect.result()
    response.headers.update(headers)
    return response


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def chat_completions(request: Request) -> Response:
    return await _generate(request, oai.parse_chat)


async def completions(request: Request) -> Response:
    return await _generate(request, oai.parse_completion)


async def models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    tenant = await gw.auth.tenant(request.headers)
    served = [m for m in (gw.settings.model_name,) if tenant.may_use(m)]
    return ORJSONResponse(oai.models_body(served, gw.started))


async def get_request(request: Request) -> Response:
    """The caller's own request: owner, state, tokens, budget wait; 404 for any other."""
    gw: Gateway = request.app.state.gateway
    tenant = await gw.auth.tenant(request.headers)
    doc = await records.read(gw.client, request.path_params["rid"], tenant.id)
    schedule = gw.dispatcher.explain(doc["id"])  # only the gateway that admitted it knows
    if schedule is not None:
        doc["schedule"] = schedule
    return ORJSONResponse(doc)


async def healthz(request: Request) -> Response:
    return ORJSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        await gw.client.ping()
    except RedisError as exc:
        return ORJSONResponse({"ready": False, "reason": f"redis: {exc}"}, status_code=503)
    pools = sorted(gw.dispatcher.alive_pools())
    if not pools:
        return ORJSONResponse({"ready": False, "reason": "no worker has a live heartbeat"}, status_code=503)
    return ORJSONResponse({"ready": True, "pools": pools, "workers": len(gw.dispatcher.workers)})


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# -- errors and instrumentation -----------------------------------------------------------


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return error_response(exc)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return error_response(GatewayError("The server had an error while processing your request."))


async def _http_error(request: Request, exc: Exception) -> Response:
    from starlette.exceptions import HTTPException

    assert isinstance(exc, HTTPException)
    err = GatewayError(str(exc.detail))
    err.status = exc.status_code
    err.type = "invalid_request_error"
    return error_response(err)


class Instrument:
    """Counts requests and observes latency per route, as raw ASGI (no per-request task)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        route = _route_label(scope["path"])
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)


_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models"}


def _route_label(path: str) -> str:
    if path in _ROUTES:
        return _ROUTES[path]
    if path.startswith("/v1/requests/"):
        return "requests"
    return "admin" if path.startswith("/admin") else "other"


def create_app(gw: Gateway) -> ASGIApp:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.dispatcher.start()
        try:
            yield
        finally:
            await gw.drain()
            await gw.dispatcher.close()

    from starlette.exceptions import HTTPException

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/requests/{rid}", get_request, methods=["GET"]),
            Mount(
                "/admin",
                routes=admin.routes(),
                middleware=[Middleware(AdminGuard, token=gw.settings.admin_token)],
            ),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={
            GatewayError: _gateway_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
        lifespan=lifespan,
    )
    app.state.gateway = gw
    return Instrument(app, gw.metrics)
