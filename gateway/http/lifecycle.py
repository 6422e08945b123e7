"""One generation request's life, from admission to settlement, in one owner object.

``RequestLife`` admits a request (capacity check, bounded tokenizing, budget, scheduler),
relays its events to the client (a JSON body or an SSE stream) and ends it exactly once
on every path: answered, failed, timed out, client gone, gateway shutting down. Ending
does three things, in this order, each once:

1. the dispatcher stops routing the request's events (and its batch's lease learns it);
2. work that may still run is cancelled (a request still queued is dropped for free; one
   already on a worker is told to stop, and its last word is awaited briefly, so that the
   tenant pays what was really generated);
3. the budget is settled (``settled``: its own task, so a handler cancelled by a
   disconnect cannot stop it half-way; a settlement Redis fails is tried again).

The handlers in ``gateway.http.app`` only parse, call ``start`` and pick the response shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import orjson
from redis.exceptions import RedisError

from common import protocol as p
from common.retry import Retrier
from gateway.api import openai_protocol as oai
from gateway.api.headers import contract_headers
from gateway.dispatch import fleet
from gateway.dispatch.dispatcher import BACKOFF, Pending
from gateway.dispatch.meter import Meter
from gateway.dispatch.prompts import LARGE_PROMPT_CHARS, PromptBuilder, PromptTooLong
from gateway.dispatch.scheduling import Origin
from gateway.errors import (
    ErrorExtra,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    Timeout,
    Unavailable,
    UpstreamFailed,
    WorkerFailed,
    error_body,
)
from gateway.http.services import CANCEL_DRAIN_S
from gateway.tenancy import limits, usage
from gateway.tenancy.budget import Admission
from sched_core import Reject

if TYPE_CHECKING:
    from gateway.http.services import Domain, Gateway
    from gateway.tenancy.auth import Caller
    from gateway.tenancy.tenants import Tenant

log = logging.getLogger("tokengate.requests")



def _ms(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def failure(ev: p.Failed) -> GatewayError:
    """A worker's or the dispatcher's error event, as the error the client gets."""
    if ev.code in ("no_worker", "redis", "lost", "shutdown", "gateway_error"):
        return Unavailable(f"Request {ev.rid}: {ev.message}", code=ev.code)
    if ev.code == "deadline":  # the scheduler dropped it from the queue: it could no longer make it
        return Unavailable(f"Request {ev.rid} cannot finish before its deadline: {ev.message}", code="deadline_unmet")
    if ev.code == "unencodable":
        return InvalidRequest(f"Request {ev.rid}: {ev.message}", code="invalid_request")
    if ev.code == "upstream_rejected":  # the upstream server refused the request itself (a 4xx)
        return InvalidRequest(f"Request {ev.rid}: {ev.message}", code=ev.code)
    if ev.code == "upstream_error":
        return UpstreamFailed(f"Request {ev.rid} failed upstream: {ev.message}")
    return WorkerFailed(f"Request {ev.rid} failed: {ev.message}", code=ev.code)


def refused(rid: str, reject: Reject, bounds: tuple[str, str] = ("", "")) -> GatewayError:
    """The scheduler will not run the request: say why, with its estimate; ``bounds`` names the
    limits it was held to: the SLO's source and the queue-wait bound's (``RequestLife._bounds``)."""
    slo, wait = (f" ({b})" if b else "" for b in bounds)
    estimate: ErrorExtra = {"estimate_ms": round(reject.estimate_s * 1000, 1)} if reject.estimate_s else {}
    headers = {"retry-after": str(max(1, math.ceil(reject.retry_after_s)))} if reject.retry_after_s else {}
    if estimate:
        headers["x-tokengate-estimate-ms"] = str(estimate["estimate_ms"])
    if reject.reason == "too_long":
        return InvalidRequest(f"Request {rid}: {reject.message}", param="messages", code="prompt_too_long")
    if reject.reason == "slo":
        best_ttft, best = round(reject.ttft_p99_s * 1000, 1), round(reject.p99_s * 1000, 1)
        headers["x-tokengate-ttft-p99-ms"] = str(best_ttft)
        headers["x-tokengate-p99-ms"] = str(best)
        return Unavailable(f"Request {rid} cannot meet its SLO{slo} now: {reject.message}; retry later, relax the "
                           "SLO or go elsewhere.", code="slo_unattainable", headers=headers,
                           extra={**estimate, "best_ttft_p99_ms": best_ttft, "best_p99_ms": best})
    if reject.reason == "wait":
        return Unavailable(f"Request {rid} would wait too long: {reject.message}{wait}; retry after the Retry-After "
                           "seconds, or send x-slo-ttft-ms to set your own bound.", code="overloaded",
                           headers=headers, extra=estimate)
    code = "deadline_unmet" if reject.reason == "deadline" else reject.reason
    return Unavailable(f"Request {rid} cannot be served in time: {reject.message}", code=code, headers=headers,
                       extra=estimate)


def _sse(doc: Mapping[str, object]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


class RequestLife:
    def __init__(self, gw: Gateway, caller: Caller, gen: oai.Generation, deadline_s: float | None,
                 slo_s: tuple[float | None, float | None] = (None, None)) -> None:
        self.gw = gw
        self.caller = caller
        self.gen = gen
        self.deadline_s = deadline_s
        tenant = caller.tenant  # the client's SLO, else its tenant's default (docs/tenants.md)
        self.slo_ttft_s = slo_s[0] if slo_s[0] is not None else _ms(tenant.slo_ttft_ms)
        self.slo_tpot_s = slo_s[1] if slo_s[1] is not None else _ms(tenant.slo_tpot_ms)
        wait_ms = tenant.max_queue_wait_ms if tenant.max_queue_wait_ms is not None else gw.settings.max_queue_wait_ms
        self.max_wait_s = wait_ms / 1000 if wait_ms > 0.0 else None
        self.meter = Meter(0)
        self.dom: Domain | None = None  # the model's, once it is known to be served
        self.rid = ""
        self.admission: Admission | None = None
        self.pending: Pending | None = None
        self.timeout_at = 0.0
        self._counted = False  # holds one of the gateway's in-flight places
        self._ended = False

    # -- admission --------------------------------------------------------------------------

    async def start(self) -> None:
        """Admit the request, or raise the error that refuses it (after ending it here)."""
        gw, tenant = self.gw, self.caller.tenant
        if gw.in_flight >= gw.settings.max_in_flight:
            raise Overloaded(
                f"This gateway is at its limit of {gw.settings.max_in_flight} requests in flight; retry shortly."
            )
        gw.in_flight += 1
        self._counted = True
        try:
            if not gw.serves(self.gen.model, tenant):
                mine = " or is not among your tenant's allowed_models" if tenant.limits.allowed_models else ""
                raise ModelNotFound(f"The model '{self.gen.model}' does not exist{mine}.", param="model")
            dom = self.dom = gw.domain(self.gen.model)
            context = fleet.served_context(dom.dispatcher.workers, dom.prompts.context_tokens)
            ids = await self._token_ids(dom, context)
            max_tokens = limits.output_tokens(
                self.gen, len(ids), context, gw.settings.default_max_tokens, tenant, own=dom.prompts.context_tokens,
                weight=dom.budget.weight,
            )
            if not dom.dispatcher.alive_pools():
                down = dom.dispatcher.down_reasons()
                why = f" (workers are down: {'; '.join(down)})" if down else ""
                raise Unavailable(f"No worker serving the model '{dom.name}' is alive{why}; try again shortly.",
                                  code="no_worker")
            sampling = self.gen.sampling(max_tokens, dom.sampling)
            seq = p.SeqJob(secrets.token_hex(12), tuple(ids), sampling, self.gen.stream, **self.gen.source())
            self.rid = seq.rid
            self.meter.prompt_tokens = len(ids)
            # a budget wait past the first-token SLO would miss it: refused now, not after the wait
            wait_limit = min((s for s in (self.deadline_s, self.slo_ttft_s) if s is not None), default=None)
            admit = asyncio.ensure_future(
                dom.budget.admit(tenant, seq.rid, len(ids), max_tokens, key=self.caller.key, deadline_s=wait_limit)
            )
            try:
                self.admission = await asyncio.shield(admit)
            except asyncio.CancelledError:  # shutdown: whatever the script reserved is given back
                admit.add_done_callback(self._settle_orphan)
                raise
            except RedisError:  # the script may have run without its reply reaching us
                refund_if_admitted(gw, dom, tenant, seq.rid, dom.budget.charge(len(ids) + max_tokens))
                raise
            if self.admission.wait_s > 0.0:
                dom.metrics.budget_wait.observe(self.admission.wait_s)
                await asyncio.sleep(self.admission.wait_s)
            who = Origin(
                tenant=tenant.id,
                weight=tenant.weight,
                priority=tenant.priority,
                budget_wait_s=self.admission.wait_s,
                deadline_s=None if self.deadline_s is None else self.deadline_s - self.meter.age(),
                slo_ttft_s=self.slo_ttft_s,
                slo_tpot_s=self.slo_tpot_s,
                max_wait_s=self.max_wait_s,
            )
            decision = await dom.dispatcher.submit(seq, who, self.meter.received)
            if isinstance(decision, Reject):
                raise refused(seq.rid, decision, self._bounds())
        except BaseException:
            self.end()
            if self.meter.settling is not None:  # settled before the error goes out: the refund is visible
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.meter.settling)
            raise
        self.pending = decision
        self.meter.started = True
        self.meter.contract = decision.contract
        self.timeout_at = decision.created + gw.settings.request_timeout_s
        dom.metrics.admitted.inc()
        dom.metrics.in_flight.inc()

    def _bounds(self) -> tuple[str, str]:
        """The limits a scheduler's refusal held the request to, named for its message: where
        its SLO came from (its headers or its tenant's default), and its queue-wait bound's."""
        tenant = self.caller.tenant
        own = (self.slo_ttft_s, self.slo_tpot_s) != (_ms(tenant.slo_ttft_ms), _ms(tenant.slo_tpot_ms))
        slo = "its x-slo-ttft-ms/x-slo-tpot-ms headers" if own else "its tenant's slo_ttft_ms/slo_tpot_ms"
        wait = ("its tenant's max_queue_wait_ms" if tenant.max_queue_wait_ms is not None
                else "the gateway's --max-queue-wait-ms")
        return slo, wait

    async def _token_ids(self, dom: Domain, context: int) -> tuple[int, ...]:
        """The prompt's token ids, bounded by what the tenant may send and ``context``, the
        smallest its workers' engines serve (``fleet.served_context``; ``gateway.dispatch.prompts``).
        A long prompt is tokenized on the gateway's tokenizing thread, in one of its tenant's
        few places there (``LongPrompts``), so one sender of huge prompts slows only itself."""
        gw, tenant = self.gw, self.caller.tenant
        limit = limits.prompt_limit(context, tenant)
        try:
            if PromptBuilder.chars(self.gen) <= LARGE_PROMPT_CHARS:
                return dom.prompts.token_ids(self.gen, limit)
            with gw.long_prompts.held(tenant):
                return await gw.long_prompts.run(dom.prompts, self.gen, limit)
        except PromptTooLong as exc:
            raise limits.prompt_too_long(self.gen, exc.tokens, exc.exact, context, tenant,
                                         own=dom.prompts.context_tokens) from None

    def headers(self) -> dict[str, str]:
        assert self.admission is not None and self.pending is not None
        return {"x-request-id": self.rid, **self.admission.headers, **contract_headers(self.pending.contract)}

    # -- events -----------------------------------------------------------------------------

    async def _next(self) -> p.Event:
        assert self.pending is not None and self.dom is not None
        events = self.pending.events
        if not events.empty():
            ev = events.get_nowait()
        else:
            try:
                async with asyncio.timeout(self.timeout_at - time.monotonic()):
                    ev = await events.get()
            except TimeoutError:
                self.meter.fail()
                raise Timeout(
                    f"Request {self.rid} timed out after {self.gw.settings.request_timeout_s:g} s."
                ) from None
        first = self.meter.first_token_s is None
        self.meter.observe(ev)
        if first and self.meter.first_token_s is not None:  # a stream's first token: the contract learns now
            self.dom.dispatcher.first_token(self.rid, self.meter.first_token_s)
        if isinstance(ev, p.Finished):
            self.dom.metrics.tokens(ev.prompt_tokens, ev.completion_tokens)
        return ev

    async def body(self) -> Mapping[str, object]:
        """The whole completion (non-streaming); raises the request's error. Ends the
        request when its last event arrived; a caller that gives up calls ``end``."""
        parts: list[str] = []
        try:
            while True:
                ev = await self._next()
                if isinstance(ev, p.Delta):
                    parts.append(ev.text)
                elif isinstance(ev, p.Finished):
                    parts.append(ev.text)
                    self.end(over=True)
                    await asyncio.shield(self.settled())
                    return oai.completion_body(
                        self.gen, self.rid, "".join(parts), ev.finish_reason, ev.prompt_tokens, ev.completion_tokens
                    )
                elif isinstance(ev, p.Failed):
                    self.end(over=True)
                    raise failure(ev)
        except Timeout:
            self.end()
            raise

    async def chunks(self) -> AsyncIterator[bytes]:
        """The SSE stream; an error after the stream began arrives as a final error event.
        However the stream stops (done, error, client gone, shutdown), the request ends."""
        gen, rid, dom = self.gen, self.rid, self.dom
        assert dom is not None
        created = int(time.time())
        route = "chat" if gen.kind == "chat" else "completions"
        try:
            if gen.kind == "chat":
                yield _sse(oai.chunk_body(gen, rid, created, "", first=True))
            first = True
            while True:
                try:
                    ev = await self._next()
                except Timeout as exc:
                    yield _sse(error_body(exc))
                    return
                if isinstance(ev, p.Delta):
                    if first:
                        dom.metrics.ttft(route, self.meter.age())
                        first = False
                    yield _sse(oai.chunk_body(gen, rid, created, ev.text))
                elif isinstance(ev, p.Finished):
                    if ev.text:
                        yield _sse(oai.chunk_body(gen, rid, created, ev.text))
                    yield _sse(oai.chunk_body(gen, rid, created, None, ev.finish_reason))
                    if gen.include_usage:
                        yield _sse(oai.usage_chunk(gen, rid, created, ev.prompt_tokens, ev.completion_tokens))
                    self.end(over=True)
                    await self.settled()  # before [DONE]: a client may reuse its concurrency slot at once
                    yield b"data: [DONE]\n\n"
                    return
                elif isinstance(ev, p.Failed):
                    self.end(over=True)
                    yield _sse(error_body(failure(ev)))
                    return
        finally:
            self.end()

    # -- the end ----------------------------------------------------------------------------

    def end(self, *, over: bool = False) -> None:
        """The request is over for its client; idempotent. ``over``: its last event arrived,
        so nothing runs any more. Otherwise (client gone, timed out, shutdown, refused before
        it was queued) whatever may still run is cancelled before settling."""
        if self._ended:
            return
        self._ended = True
        gw, dom = self.gw, self.dom
        if self._counted:
            gw.in_flight -= 1
        if self.admission is None or dom is None:
            return  # nothing reserved, nothing to settle
        if self.pending is not None:
            dom.metrics.in_flight.dec()
        if self.pending is None or over:
            self.settled()
        elif dom.dispatcher.cancel(self.rid):  # still queued: it will never run and costs nothing
            self.meter.started = False
            self.settled()
        else:
            gw.tasks.spawn(self._drain_then_settle())

    async def _drain_then_settle(self) -> None:
        """A dispatched request whose client left: wait (briefly) for the worker's final
        event, so the tenant is charged what was really generated, then settle."""
        assert self.pending is not None and self.admission is not None
        try:
            async with asyncio.timeout(CANCEL_DRAIN_S):
                while True:
                    ev = await self.pending.events.get()
                    if isinstance(ev, p.Delta):
                        self.meter.completion_tokens = ev.tokens
                    elif isinstance(ev, p.Finished):
                        self.meter.completion_tokens = max(self.meter.completion_tokens, ev.completion_tokens)
                        break
                    elif isinstance(ev, p.Failed):
                        break
        except TimeoutError:
            pass
        finally:
            await self.settled()

    def _settle_orphan(self, admit: asyncio.Future[Admission]) -> None:
        if not admit.cancelled() and admit.exception() is None:
            self.admission = admit.result()
            self.meter.started = False
            self.settled()

    def settled(self) -> asyncio.Future[bool]:
        """Settles the request's budget once; later calls return the same future. It runs as
        its own task, so a handler cancelled by a disconnect cannot stop it half-way."""
        assert self.admission is not None and self.dom is not None
        if self.meter.settling is not None:
            return self.meter.settling
        admission, meter, gw, dom = self.admission, self.meter, self.gw, self.dom
        prompt, completion = meter.charge()
        state, record = meter.outcome, meter.record()
        slo = usage.slo_verdict(state, meter.first_token_s, meter.total_s, meter.completion_tokens,
                                self.slo_ttft_s, self.slo_tpot_s)

        async def settle() -> bool:
            dom.metrics.observe_contract(dom.dispatcher.end(admission.rid, record.get("ttft_s"),
                                                            record.get("total_s"), completion))
            return await until_settled(gw, dom, admission.rid,
                                       lambda: dom.budget.settle(admission, state, prompt, completion, record, slo))

        settling = meter.settling = gw.tasks.spawn(settle())
        return settling


def refund_if_admitted(gw: Gateway, dom: Domain, tenant: Tenant, rid: str, reserved: int) -> None:
    """An admission whose reply was lost (Redis failed mid-call) may or may not have run:
    settling it as failed refunds it if it did, and does nothing if it did not."""
    gw.tasks.spawn(until_settled(gw, dom, rid, lambda: dom.budget.settle_raw(tenant, rid, -reserved, "failed", 0, 0)))


async def until_settled(gw: Gateway, dom: Domain, rid: str, attempt: Callable[[], Awaitable[bool]]) -> bool:
    """Settling is idempotent (only the call that ends the lease changes anything), so a
    settlement that Redis failed is tried again, with backoff, for as long as its lease
    can last; a refund is never silently lost to a Redis hiccup."""
    give_up = time.monotonic() + gw.settings.request_timeout_s + 30.0
    retry = Retrier(BACKOFF, dom.dispatcher.outage)
    while True:
        started = time.monotonic()
        try:
            settled = await attempt()
        except RedisError as exc:
            delay = retry.count(exc)
            if time.monotonic() + delay > give_up:
                log.error("settling request %s failed for good: %s", rid, exc)
                return False
            await asyncio.sleep(delay)
        else:
            retry.succeeded(started)
            return settled
