"""How many tokens a request may ask for: the model's context and the tenant's limits.
Pure; every refusal is a 400 naming the field, raised before anything is queued."""

from __future__ import annotations

from gateway.errors import InvalidRequest
from gateway.openai_protocol import Generation
from gateway.tenants import Tenant


def output_tokens(gen: Generation, prompt: int, context: int, default: int, tenant: Tenant) -> int:
    """The request's ``max_tokens``: as given, else the gateway's default trimmed to what the
    context, the tenant's output limit and its burst leave. Checked in this order: the
    tenant's prompt limit, the context, the tenant's output limit, the burst."""
    prompt_param = "messages" if gen.kind == "chat" else "prompt"
    lim = tenant.limits
    if lim.max_prompt_tokens is not None and prompt > lim.max_prompt_tokens:
        raise InvalidRequest(
            f"The prompt has {prompt} tokens; your limit is {lim.max_prompt_tokens}.",
            param=prompt_param,
            code="prompt_too_long",
        )
    room = context - prompt
    max_tokens = gen.max_tokens
    if max_tokens is None:
        caps = (default, lim.max_output_tokens or default, tenant.burst - prompt)
        max_tokens = max(1, min(room, *caps))
    if prompt + max_tokens > context:
        raise InvalidRequest(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt + max_tokens} tokens ({prompt} in the prompt, {max_tokens} for the "
            "completion).",
            param="max_tokens" if gen.max_tokens and room > 0 else prompt_param,
            code="context_length_exceeded",
        )
    if lim.max_output_tokens is not None and max_tokens > lim.max_output_tokens:
        raise InvalidRequest(
            f"max_tokens is {max_tokens}; your limit is {lim.max_output_tokens}.",
            param="max_tokens",
            code="max_tokens_exceeded",
        )
    if prompt + max_tokens > tenant.burst:
        raise over_burst(
            tenant, prompt + max_tokens, "max_tokens" if gen.max_tokens else prompt_param
        )
    return max_tokens


def prompt_limit(context: int, tenant: Tenant) -> int:
    """The most prompt tokens a request may have: the context less one output token, and
    the tenant's prompt limit."""
    cap = tenant.limits.max_prompt_tokens
    return context - 1 if cap is None else min(context - 1, cap)


def prompt_too_long(gen: Generation, tokens: int, exact: bool, context: int, tenant: Tenant) -> InvalidRequest:
    """The 400 for a prompt over ``prompt_limit``: the tenant's limit where that is the
    tighter one, else the context."""
    param = "messages" if gen.kind == "chat" else "prompt"
    has = f"{tokens}" if exact else f"at least {tokens}"
    cap = tenant.limits.max_prompt_tokens
    if cap is not None and cap < context - 1:
        return InvalidRequest(f"The prompt has {has} tokens; your limit is {cap}.", param=param, code="prompt_too_long")
    return InvalidRequest(
        f"This model's maximum context length is {context} tokens. However, your prompt has {has} tokens, "
        "which leaves no room for the completion.",
        param=param,
        code="context_length_exceeded",
    )


def over_burst(tenant: Tenant, cost: int, param: str = "max_tokens") -> InvalidRequest:
    """A request larger than the burst could never be admitted: 400, not 429."""
    return InvalidRequest(
        f"This request needs {cost} tokens (prompt plus max_tokens), more than the "
        f"{tenant.burst} tokens your budget can ever hold at once; lower max_tokens or "
        "shorten the prompt.",
        param=param,
        code="budget_exceeded",
    )


class OversizePenalty:
    """Refusing a request for its size is itself work (reading, parsing and measuring up to
    a megabyte), which a sender could repeat for free. So a tenant whose request was refused
    for its size waits ``bytes / bytes_per_s`` seconds, accumulated, before the gateway reads
    another of its requests: its next ones get a 429 with ``Retry-After`` at once, before
    their bodies are read. Other tenants are not affected. Pure: ``now`` is an argument."""

    def __init__(self, bytes_per_s: float = 2e6, max_tenants: int = 10_000) -> None:
        self.bytes_per_s = bytes_per_s
        self.max_tenants = max_tenants
        self._until: dict[str, float] = {}

    def charge(self, tenant_id: str, size: int, now: float) -> None:
        if len(self._until) >= self.max_tenants:
            self._until = {t: u for t, u in self._until.items() if u > now}
        self._until[tenant_id] = max(self._until.get(tenant_id, now), now) + size / self.bytes_per_s

    def wait_s(self, tenant_id: str, now: float) -> float:
        """How long the tenant must still wait (0: its request may be read)."""
        return max(0.0, self._until.get(tenant_id, now) - now)
