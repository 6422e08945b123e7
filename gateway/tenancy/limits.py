"""How many tokens a request may ask for: the context its workers serve and the tenant's limits.
Pure; every refusal is a 400 naming the field, raised before anything is queued.

``context`` is the context a request must fit in (prompt plus completion tokens): the
smallest its workers' engines serve (``gateway.dispatch.fleet.served_context``: an upstream
started with a smaller context than the model's says so), ``own`` the model's own; a refusal
for a context smaller than the model's says whose it is."""

from __future__ import annotations

import math

from gateway.api.openai_protocol import Generation
from gateway.errors import InvalidRequest
from gateway.tenancy.tenants import Tenant, weighted


def _context_length(context: int, own: int | None) -> str:
    served = f" (as its engines serve it; the model's own is {own})" if own is not None and own != context else ""
    return f"This model's maximum context length is {context} tokens{served}."


def output_tokens(gen: Generation, prompt: int, context: int, default: int, tenant: Tenant,
                  own: int | None = None, weight: float = 1.0) -> int:
    """The request's ``max_tokens``: as given, else the gateway's default trimmed to what the
    context, the tenant's output limit and its burst leave. Checked in this order: the
    tenant's prompt limit, the context, the tenant's output limit, the burst (which holds
    ``burst / weight`` tokens of a model of token weight ``weight``)."""
    prompt_param = "messages" if gen.kind == "chat" else "prompt"
    lim = tenant.limits
    if lim.max_prompt_tokens is not None and prompt > lim.max_prompt_tokens:
        raise InvalidRequest(
            f"The prompt has {prompt} tokens; your limit is {lim.max_prompt_tokens} (your tenant's "
            "max_prompt_tokens).",
            param=prompt_param,
            code="prompt_too_long",
        )
    room = context - prompt
    max_tokens = gen.max_tokens
    if max_tokens is None:
        caps = (default, lim.max_output_tokens or default, math.floor(tenant.burst / weight) - prompt)
        max_tokens = max(1, min(room, *caps))
    if prompt + max_tokens > context:
        raise InvalidRequest(
            f"{_context_length(context, own)} However, you requested "
            f"{prompt + max_tokens} tokens ({prompt} in the prompt, {max_tokens} for the "
            "completion).",
            param="max_tokens" if gen.max_tokens and room > 0 else prompt_param,
            code="context_length_exceeded",
        )
    if lim.max_output_tokens is not None and max_tokens > lim.max_output_tokens:
        raise InvalidRequest(
            f"max_tokens is {max_tokens}; your limit is {lim.max_output_tokens} (your tenant's "
            "max_output_tokens).",
            param="max_tokens",
            code="max_tokens_exceeded",
        )
    cost = weighted(prompt + max_tokens, weight)
    if cost > tenant.burst:
        raise over_burst(tenant, cost, "max_tokens" if gen.max_tokens else prompt_param, weight)
    return max_tokens


def prompt_limit(context: int, tenant: Tenant) -> int:
    """The most prompt tokens a request may have: the context less one output token, and
    the tenant's prompt limit."""
    cap = tenant.limits.max_prompt_tokens
    return context - 1 if cap is None else min(context - 1, cap)


def prompt_too_long(gen: Generation, tokens: int, exact: bool, context: int, tenant: Tenant,
                    own: int | None = None) -> InvalidRequest:
    """The 400 for a prompt over ``prompt_limit``: the tenant's limit where that is the
    tighter one, else the context."""
    param = "messages" if gen.kind == "chat" else "prompt"
    has = f"{tokens}" if exact else f"at least {tokens}"
    cap = tenant.limits.max_prompt_tokens
    if cap is not None and cap < context - 1:
        return InvalidRequest(f"The prompt has {has} tokens; your limit is {cap} (your tenant's max_prompt_tokens).",
                              param=param, code="prompt_too_long")
    return InvalidRequest(
        f"{_context_length(context, own)} However, your prompt has {has} tokens, "
        "which leaves no room for the completion.",
        param=param,
        code="context_length_exceeded",
    )


def over_burst(tenant: Tenant, cost: int, param: str = "max_tokens", weight: float = 1.0) -> InvalidRequest:
    """A request larger than the burst could never be admitted: 400, not 429. The admin API
    refuses a burst that cannot hold one request within the tenant's limits, so this one
    meets tenants stored before that rule, or a larger context than the one they were checked
    against (docs/tenants.md, "The burst holds one request")."""
    return InvalidRequest(
        f"This request needs {cost} tokens (prompt plus max_tokens"
        f"{'' if weight == 1.0 else f', at the model token weight {weight:g}'}), more than your tenant's burst "
        f"of {tenant.burst} tokens, the most its budget can ever hold at once; lower max_tokens or "
        f"shorten the prompt, or have an admin raise the burst to at least {cost} "
        f"(tokengate tenants update {tenant.name} --burst {cost}).",
        param=param,
        code="budget_exceeded",
    )


REFUSAL_BURST_BYTES = 64 << 20  # refused bytes a tenant may send at once before it is held
REFUSAL_BYTES_PER_S = 2e6  # ... and the rate at which that allowance refills
REFUSAL_OVERHEAD_BYTES = 16 << 10  # what answering one refusal from its headers costs, as bytes


class RefusalBucket:
    """Refusing a request for its size is itself work, which a sender could repeat for free.
    So each such refusal is charged to its tenant: the body bytes the gateway really read
    (and tokenized) before refusing, plus ``overhead`` for answering at all; a request refused
    from its headers (a declared ``Content-Length`` over the limit) is charged the overhead
    alone, never what it declared. A tenant's charges fill a bucket of ``burst`` bytes that
    drains at ``bytes_per_s``; only while charges overflow it is the tenant held (its next
    requests get a 429 with ``Retry-After`` before their bodies are read). One charge never
    exceeds the burst, so no single request, and no few, holds a tenant: only a tenant that
    keeps sending oversized requests faster than the refill is held back, to the refill rate.
    Other tenants are not affected. Pure: ``now`` is an argument (docs/api.md: "Oversized
    requests")."""

    def __init__(self, burst: int = REFUSAL_BURST_BYTES, bytes_per_s: float = REFUSAL_BYTES_PER_S,
                 overhead: int = REFUSAL_OVERHEAD_BYTES, max_tenants: int = 10_000) -> None:
        self.burst = burst
        self.bytes_per_s = bytes_per_s
        self.overhead = overhead
        self.max_tenants = max_tenants
        self._full: dict[str, tuple[float, float]] = {}  # tenant id -> (bytes in the bucket, as of)

    def level(self, tenant_id: str, now: float) -> float:
        """The bytes in the tenant's bucket now (what it was charged, less what has drained)."""
        level, at = self._full.get(tenant_id, (0.0, now))
        return max(0.0, level - (now - at) * self.bytes_per_s)

    def charge(self, tenant_id: str, read_bytes: int, now: float) -> None:
        """A refusal for size after reading ``read_bytes`` of the tenant's request."""
        if tenant_id not in self._full and len(self._full) >= self.max_tenants:
            self._full = {t: (lv, at) for t, (lv, at) in self._full.items() if self.level(t, now) > 0.0}
        cost = min(float(self.burst), self.overhead + max(0, read_bytes))
        self._full[tenant_id] = (self.level(tenant_id, now) + cost, now)

    def wait_s(self, tenant_id: str, now: float) -> float:
        """How long the tenant must still wait (0: its requests are read as usual)."""
        over = self.level(tenant_id, now) - self.burst
        return over / self.bytes_per_s if over > 0.0 else 0.0
