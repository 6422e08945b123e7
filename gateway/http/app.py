"""The Starlette application: OpenAI-compatible routes, admin API, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api import openai_protocol as oai
from gateway.api.shapes import Health, NotReady, Ready
from gateway.dispatch import records
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    Unavailable,
    error_response,
)
from gateway.http import admin, console, openapi
from gateway.http.lifecycle import RequestLife
from gateway.http.saturation import SATURATED_S
from gateway.http.services import Gateway
from gateway.http.web import ORJSONResponse, declared_length, parse_json, read_body
from gateway.metrics import Metrics
from gateway.tenancy.auth import AdminGuard
from gateway.tenancy.tenants import SLO_MS_MIN, Tenant

log = logging.getLogger("tokengate.gateway")

DEADLINE_HEADER = openapi.DEADLINE_HEADER


OVERSIZE_CODES = frozenset({"context_length_exceeded", "prompt_too_long"})  # 400s for size (413: PayloadTooLarge)
READY_PROBE_S = 0.5  # /readyz answers 503 when Redis has not answered its PING within this (probes time out at 1 s)


# -- generation ------------------------------------------------------------------------


def _header_s(request: Request, name: str, valid: Callable[[float], bool], rule: str) -> float | None:
    """A header of milliseconds, in seconds; None if absent; a 400 naming it if not ``valid``."""
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not valid(ms):
        raise InvalidRequest(f"The {name} header must be {rule}.", param=name)
    return ms / 1000


def _deadline_ok(ms: float) -> bool:
    return 0 < ms < openapi.DEADLINE_MS_MAX


def _deadline_s(request: Request) -> float | None:
    return _header_s(request, DEADLINE_HEADER, _deadline_ok, "a positive number of milliseconds")


def _slo_rule(top: float) -> tuple[Callable[[float], bool], str]:
    return (lambda ms: SLO_MS_MIN <= ms <= top), f"a number of milliseconds in [{SLO_MS_MIN:g}, {top:.0f}]"


_SLO_RULES = [(name, *_slo_rule(top)) for name, top in openapi.SLO_HEADERS.items()]  # (TTFT, TPOT), built once


def _slo_s(request: Request) -> tuple[float | None, float | None]:
    """The client's SLO headers (TTFT, TPOT) in seconds; None where absent."""
    (ttft, ttft_ok, ttft_rule), (tpot, tpot_ok, tpot_rule) = _SLO_RULES
    return _header_s(request, ttft, ttft_ok, ttft_rule), _header_s(request, tpot, tpot_ok, tpot_rule)


HELD_READ_BYTES = 64 << 10  # a held tenant's body up to this size is still read, for its own 400


def _held(gw: Gateway, tenant: Tenant) -> RateLimited | None:
    """The 429 for a tenant whose refusals for size overflow its bucket
    (``limits.RefusalBucket``); the connection closes, so a body it is sending is not read."""
    held = gw.refusals.wait_s(tenant.id, time.monotonic())
    if held <= 0.0:
        return None
    wait = max(1, math.ceil(held))
    return RateLimited(
        f"Tenant '{tenant.name}' keeps sending requests too large to serve ({gw.refusals.burst >> 20} MiB of "
        f"refused bytes at once, {gw.refusals.bytes_per_s / 1e6:g} MB/s sustained, are allowed); retry after "
        f"{wait} s.",
        code="oversize_held",
        headers={"retry-after": str(wait), "connection": "close"},
    )


def _refused_unread(request: Request, refusal: RateLimited | None) -> RateLimited | None:
    """A held tenant's request is refused from its headers unless its body is small enough to
    read and check first (a malformed request gets its own 400 before the 429)."""
    if refusal is None:
        return None
    declared = declared_length(request)
    return None if declared is not None and declared <= HELD_READ_BYTES else refusal


class GenerationRoute:
    """Raw ASGI for the two generation routes (``POST /v1/chat/completions`` and
    ``/v1/completions``), ahead of the admin guard and Starlette's router, middleware and
    exception handlers: the hot path pays none of them, and gives the same validation,
    errors and headers (Starlette's routes for them stay, for the OpenAPI document and the
    405 of other methods). A held tenant's request is refused from its headers alone, the
    cheapest refusal there is (the handler checks again for keys not in the auth cache)."""

    def __init__(self, app: ASGIApp, gw: Gateway) -> None:
        self.app = app
        self.gw = gw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        parse = _PARSERS.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if parse is None:
            await self.app(scope, receive, send)
            return
        behind = self.gw.lag.behind_s(asyncio.get_running_loop().time())
        if behind > SATURATED_S:  # the cheapest refusal: before the headers are even read
            await error_response(Overloaded(
                f"This gateway is saturated: its event loop runs {behind * 1000:.0f} ms behind; retry shortly."
            ))(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            tenant = self.gw.auth.cached(request.headers)
            refusal = _refused_unread(request, _held(self.gw, tenant)) if tenant is not None else None
            if refusal is not None:
                raise refusal
            response = await _generate(self.gw, request, parse)
        except GatewayError as exc:
            response = error_response(exc)
        except RedisError as exc:
            response = _redis_unavailable(request, exc)
        except Exception:
            response = _internal_error(request)
        await response(scope, receive, send)


async def _generate(gw: Gateway, request: Request, parse: Callable[[Any], oai.Generation]) -> Response:
    caller = await gw.auth.caller(request.headers)
    tenant = caller.tenant
    held = _held(gw, tenant)
    refusal = _refused_unread(request, held)
    if refusal is not None:
        raise refusal
    body = b""
    try:
        body = await read_body(request, gw.settings.max_body_bytes)
        gen = parse(parse_json(body))
        deadline_s, slo_s = _deadline_s(request), _slo_s(request)
        if held is not None:  # well-formed, and still held
            raise held
        if gen.model in gw.domains:  # ``Instrument`` labels the request with the model it asked for
            request.state.model = gen.model
        life = RequestLife(gw, caller, gen, deadline_s, slo_s)
        await life.start()
    except PayloadTooLarge as exc:
        gw.refusals.charge(tenant.id, exc.read, time.monotonic())
        raise
    except InvalidRequest as exc:
        if exc.code in OVERSIZE_CODES:  # read and (in part) tokenized
            gw.refusals.charge(tenant.id, len(body), time.monotonic())
        raise
    headers = life.headers()
    if gen.stream:
        return StreamingResponse(
            life.chunks(), media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"}
        )
    # the body is awaited in the request's own task; a client that goes away cancels it
    me = asyncio.current_task()
    assert me is not None

    def client_left(_: asyncio.Future[None]) -> None:
        me.cancel()

    gone = asyncio.ensure_future(_disconnected(request))
    gone.add_done_callback(client_left)
    try:
        answer = await life.body()
    except asyncio.CancelledError:
        life.end()  # the client went away, or the server is stopping: cancel its work
        if not gone.done() or gone.cancelled():
            raise  # the server is stopping (``Drain``): not ours to swallow
        me.uncancel()
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    finally:
        gone.remove_done_callback(client_left)
        gone.cancel()
    return ORJSONResponse(answer, headers=headers)


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def chat_completions(request: Request) -> Response:
    return await _generate(request.app.state.gateway, request, oai.parse_chat)


async def completions(request: Request) -> Response:
    return await _generate(request.app.state.gateway, request, oai.parse_completion)


_PARSERS: dict[str, Callable[[Any], oai.Generation]] = {
    "/v1/chat/completions": oai.parse_chat,
    "/v1/completions": oai.parse_completion,
}


async def models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    tenant = await gw.auth.tenant(request.headers)
    served = [m for m, d in gw.domains.items() if d.dispatcher.workers and gw.serves(m, tenant)]
    return ORJSONResponse(oai.models_body(served, gw.started))


async def model(request: Request) -> Response:
    """One model, as OpenAI's ``GET /v1/models/{model}`` answers: 404 ``model_not_found`` for
    one this gateway does not serve or the tenant may not use (the same answer: which models
    exist is not told to a tenant that may not use them)."""
    gw: Gateway = request.app.state.gateway
    tenant = await gw.auth.tenant(request.headers)
    name = request.path_params["model"]
    if not gw.serves(name, tenant):
        raise ModelNotFound(f"The model '{name}' does not exist or you do not have access to it.")
    return ORJSONResponse(oai.model_card(name, gw.started))


async def get_request(request: Request) -> Response:
    """The caller's own request: owner, state, tokens, budget wait; 404 for any other."""
    gw: Gateway = request.app.state.gateway
    tenant = await gw.auth.tenant(request.headers)
    doc = await records.read(gw.client, request.path_params["rid"], [tenant.id])
    for dom in gw.domains.values():  # only the gateway that admitted it knows, in the model's domain
        schedule = dom.dispatcher.shell.explain(doc["id"])
        if schedule is not None:
            doc["schedule"] = schedule
            break
    return ORJSONResponse(doc)


async def healthz(request: Request) -> Response:
    ok: Health = {"status": "ok"}
    return ORJSONResponse(ok)


def _not_ready(reason: str) -> Response:
    body: NotReady = {"ready": False, "reason": reason}
    return ORJSONResponse(body, status_code=503)


async def _unready(gw: Gateway) -> str | None:
    """Why this gateway cannot serve now (None: it can): a dispatch loop stopped, Redis does
    not answer within ``READY_PROBE_S``, or no worker of any model it serves has a live
    heartbeat. ``/readyz`` and ``/health`` both judge by it."""
    for dom in gw.domains.values():
        if dom.dispatcher.failed:
            return f"model {dom.name}: {dom.dispatcher.failed}"
    try:
        async with asyncio.timeout(READY_PROBE_S):
            await gw.batch.call("PING")
    except RedisError as exc:
        return f"redis: {exc}"
    except TimeoutError:
        return f"redis: no answer within {READY_PROBE_S:g} s"
    if not any(dom.dispatcher.alive_pools() for dom in gw.domains.values()):
        return "no worker has a live heartbeat"
    return None


async def readyz(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    reason = await _unready(gw)
    if reason is not None:
        return _not_ready(reason)
    doms = gw.domains.values()
    ready: Ready = {
        "ready": True,
        "pools": sorted(set().union(*(d.dispatcher.alive_pools() for d in doms))),
        "workers": sum(len(d.dispatcher.workers) for d in doms),
        "models": {d.name: {"pools": sorted(d.dispatcher.alive_pools()), "workers": len(d.dispatcher.workers)}
                   for d in doms},
    }
    return ORJSONResponse(ready)


async def health(request: Request) -> Response:
    """vLLM's health check, which clients of vLLM probe first (``guidellm`` among them): 200
    with an empty text/plain body when this gateway can serve, as ``/readyz`` judges; 503
    otherwise, with ``/readyz``'s body (``NotReady``, the reason)."""
    reason = await _unready(request.app.state.gateway)
    return Response(status_code=200, media_type="text/plain") if reason is None else _not_ready(reason)


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    for dom in gw.domains.values():
        dom.metrics.observe_backlog(dom.dispatcher.backlog())
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# -- errors and instrumentation -----------------------------------------------------------


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return error_response(exc)


def _redis_unavailable(request: Request, exc: Exception) -> Response:
    log.warning("Redis failed on %s: %r", request.url.path, exc)
    return error_response(
        Unavailable("The gateway's store (Redis) is not answering; retry shortly.", code="redis_unavailable")
    )


def _internal_error(request: Request) -> Response:
    """A 500 for an exception nothing expected (logged with its traceback)."""
    log.exception("unhandled error on %s", request.url.path)
    return error_response(GatewayError("The server had an error while processing your request."))


async def _redis_error(request: Request, exc: Exception) -> Response:
    return _redis_unavailable(request, exc)


async def _unexpected(request: Request, exc: Exception) -> Response:
    return _internal_error(request)


async def _http_error(request: Request, exc: Exception) -> Response:
    from starlette.exceptions import HTTPException

    assert isinstance(exc, HTTPException)
    err = GatewayError(str(exc.detail), headers=dict(exc.headers or {}))  # a 405 keeps its Allow
    err.status = exc.status_code
    err.type = "invalid_request_error"
    return error_response(err)


class Instrument:
    """Counts requests and observes latency per route, as raw ASGI (no per-request task); a
    generation request is labelled with the model it asked for where it is served, any other
    with ``model=""``."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        self._requests: dict[tuple[str, str, int], Any] = {}
        self._latency: dict[tuple[str, str], Any] = {}

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
            model = scope.get("state", {}).get("model", "")
            requests = self._requests.get((model, route, status))
            if requests is None:  # a labelled child is looked up once per model, route and status
                requests = self._requests[model, route, status] = self.metrics.requests.labels(
                    model, route, str(status))
            requests.inc()
            latency = self._latency.get((model, route))
            if latency is None:
                latency = self._latency[model, route] = self.metrics.latency.labels(model, route)
            latency.observe(time.perf_counter() - start)


_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models"}


def _route_label(path: str) -> str:
    if path in _ROUTES:
        return _ROUTES[path]
    if path.startswith("/v1/requests/"):
        return "requests"
    if path.startswith("/v1/models/"):
        return "models"
    return "admin" if path.startswith("/admin") else "other"


def create_app(gw: Gateway) -> ASGIApp:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for dom in list(gw.domains.values()):
            await dom.dispatcher.start()
        sampler = asyncio.create_task(gw.lag.run(), name="loop-lag")
        publisher = asyncio.create_task(console.publish_loop(gw), name="console")
        usage = asyncio.create_task(gw.usage.run(), name="usage")
        try:
            yield
        finally:
            sampler.cancel()
            publisher.cancel()
            usage.cancel()
            await gw.drain()
            for dom in list(gw.domains.values()):
                await dom.dispatcher.close()

    from starlette.exceptions import HTTPException

    app = Starlette(
        routes=openapi.documented(  # adds GET /openapi.json, describing exactly these routes
            [
                Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
                Route("/v1/models/{model:path}", model, methods=["GET"]),  # ids may hold a '/'
                Route("/v1/requests/{rid}", get_request, methods=["GET"]),
                Mount("/admin", routes=admin.routes()),
                Route("/healthz", healthz, methods=["GET"]),
                Route("/readyz", readyz, methods=["GET"]),
                Route("/health", health, methods=["GET"]),  # vLLM's (issue 38)
                Route("/metrics", metrics, methods=["GET"]),
            ],
            gw.settings,
        ) + console.routes(),
        exception_handlers={
            GatewayError: _gateway_error,
            HTTPException: _http_error,
            RedisError: _redis_error,
            Exception: _unexpected,
        },
        lifespan=lifespan,
    )
    app.state.gateway = gw
    return Instrument(GenerationRoute(AdminGuard(app, gw.settings.admin_token), gw), gw.metrics)
