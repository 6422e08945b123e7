"""Tenants as the gateway sees them, and their JSON document. Pure; no I/O.

The document (``to_doc``) is both what the admin API returns and what Redis stores under
``{tg}:tenant:{id}`` (see docs/tenants.md); ``from_doc`` reads it back. Input validation of
the admin API lives in ``gateway.tenancy.admin_protocol``; a ``Tenant`` is always valid.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

#: Tenant names: letters, digits, '.' and '-' (no '_', so a name never looks like an id).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9.-]{0,63}$"
_ID = re.compile(r"tn_[0-9a-f]{16}")

DEFAULT_MAX_QUEUE_DELAY_S = 2.0
SLO_MS_MIN = 0.001  # the smallest SLO in ms, for headers and tenant defaults (a smaller one rounds to 0 s)
#: seconds of the rate a new tenant may spend at once when no burst is given
DEFAULT_BURST_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request and per-tenant limits; None means no limit beyond the model's own."""

    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    max_concurrent: int | None = None
    allowed_models: tuple[str, ...] = ()  # empty: every model the gateway serves


@dataclass(frozen=True, slots=True)
class Tenant:
    """A customer of the gateway.

    ``rate`` is the budget in tokens/s and ``burst`` the tokens it may spend at once (the
    bucket's depth); ``priority`` is the scheduler's class (0 the most urgent); ``weight``
    is its share under overload in tokens/s (the rate unless set apart); a request may
    wait up to ``max_queue_delay_s`` for its budget before it is refused with 429.

    ``slo_ttft_ms`` (p99 time to first token) and ``slo_tpot_ms`` (time per output token),
    both in milliseconds, are the latency SLO its requests are held to when they carry none
    of their own; None: no default. ``max_queue_wait_ms`` bounds the predicted wait of its
    requests without a first-token SLO (None: the gateway's ``--max-queue-wait-ms``).
    """

    id: str
    name: str
    rate: float
    burst: int
    priority: int = 0
    weight: float = 0.0  # 0: the rate
    max_queue_delay_s: float = DEFAULT_MAX_QUEUE_DELAY_S
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    max_queue_wait_ms: float | None = None
    limits: Limits = field(default_factory=Limits)
    created: int = 0

    def __post_init__(self) -> None:
        if self.weight <= 0.0:
            object.__setattr__(self, "weight", self.rate)

    def may_use(self, model: str) -> bool:
        return not self.limits.allowed_models or model in self.limits.allowed_models


def new_id() -> str:
    return "tn_" + secrets.token_hex(8)


def is_id(ref: str) -> bool:
    return _ID.fullmatch(ref) is not None


# what the gateway serves, for the burst rule: a model's context (tokens), or each served model's
# (context, token weight): a token of a model costs its weight in budget tokens (--token-weight)
Served = int | Sequence[tuple[int, float]] | None


def _served(context: Served) -> list[tuple[int, float]]:
    return [(context, 1.0)] if isinstance(context, int) else list(context or [])


def weighted(tokens: int, weight: float) -> int:
    """What ``tokens`` of a model of token weight ``weight`` cost a tenant's budget."""
    return tokens if weight == 1.0 else math.ceil(tokens * weight)


def _heaviest(limits: Limits, context: Served) -> tuple[int | None, float]:
    """(the most budget tokens one request within ``limits`` reserves at admission, the token
    weight of the model it asks for): ``largest_request`` and its weight."""
    p, o = limits.max_prompt_tokens, limits.max_output_tokens
    own = None if p is None or o is None else p + o
    sizes = [(weighted(ctx if own is None else min(ctx, own), w), w) for ctx, w in _served(context)]
    return max(sizes) if sizes else (own, 1.0)


def largest_request(limits: Limits, context: Served) -> int | None:
    """The most budget tokens one request within these limits reserves at admission (prompt +
    ``max_tokens``, ``gateway.tenancy.limits.output_tokens``, times the model's token weight):
    the model's ``context``, or less where both ``max_prompt_tokens`` and ``max_output_tokens``
    are set and sum to less; with several models, the most of any. None where neither bounds it
    (no context given and a limit unset)."""
    return _heaviest(limits, context)[0]


def default_burst(rate: float, largest: int | None = None) -> int:
    """Ten seconds of the rate, and never less than one largest request (``largest_request``),
    so that a tenant created without a burst is never locked out by its own default."""
    return max(1, math.ceil(rate * DEFAULT_BURST_SECONDS), largest or 0)


def burst_shortfall(tenant: Tenant, context: Served, creating: bool = False) -> str | None:
    """Why ``tenant``'s burst cannot hold one request within its limits (every request that
    large would be refused with 400 ``budget_exceeded``, forever), naming the fix; None when
    it can. ``creating``: the burst was given at create, where leaving it out is a fix too."""
    largest, weight = _heaviest(tenant.limits, context)
    if largest is None or tenant.burst >= largest:
        return None
    p, o = tenant.limits.max_prompt_tokens, tenant.limits.max_output_tokens
    if p is not None and o is not None and largest == weighted(p + o, weight):
        what, verb = f"max_prompt_tokens {p} + max_output_tokens {o}", "lower"
    elif p is not None and o is not None:
        what, verb = f"the model's context; max_prompt_tokens {p} + max_output_tokens {o} exceed it", "lower"
    else:
        what, verb = "the model's context, which one request may fill without both max_prompt_tokens and " \
                     "max_output_tokens", "set"
    if weight != 1.0:
        what += f", at the model's token weight {weight:g}"
    fix = f"raise burst (--burst) to at least {largest}"
    if creating:
        fix += " or leave it out (the default burst holds one such request)"
    room = math.floor(tenant.burst / weight)
    if room >= 2:  # a request has at least one prompt and one output token
        fix += (f", or {verb} limits.max_prompt_tokens + limits.max_output_tokens (--max-prompt-tokens, "
                f"--max-output-tokens) to at most {room} in all")
    return (f"burst {tenant.burst} cannot hold one request of up to {largest} tokens ({what}): every "
            f"request that large would be refused with 400 budget_exceeded. To fix it, {fix}.")


def with_rate(tenant: Tenant, rate: float) -> Tenant:
    """A new rate; a weight that followed the rate keeps following it."""
    weight = rate if tenant.weight == tenant.rate else tenant.weight
    return replace(tenant, rate=rate, weight=weight)


def to_doc(t: Tenant) -> dict[str, Any]:
    return {
        "id": t.id,
        "object": "tenant",
        "name": t.name,
        "rate": t.rate,
        "burst": t.burst,
        "priority": t.priority,
        "weight": t.weight,
        "max_queue_delay_s": t.max_queue_delay_s,
        "slo_ttft_ms": t.slo_ttft_ms,
        "slo_tpot_ms": t.slo_tpot_ms,
        "max_queue_wait_ms": t.max_queue_wait_ms,
        "limits": {
            "max_prompt_tokens": t.limits.max_prompt_tokens,
            "max_output_tokens": t.limits.max_output_tokens,
            "max_concurrent": t.limits.max_concurrent,
            "allowed_models": list(t.limits.allowed_models),
        },
        "created": t.created,
    }


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def from_doc(doc: dict[str, Any]) -> Tenant:
    lim = doc["limits"]
    return Tenant(
        id=str(doc["id"]),
        name=str(doc["name"]),
        rate=float(doc["rate"]),
        burst=int(doc["burst"]),
        priority=int(doc["priority"]),
        weight=float(doc["weight"]),
        max_queue_delay_s=float(doc["max_queue_delay_s"]),
        # absent from documents stored before tenants had an SLO
        slo_ttft_ms=_float_or_none(doc.get("slo_ttft_ms")),
        slo_tpot_ms=_float_or_none(doc.get("slo_tpot_ms")),
        max_queue_wait_ms=_float_or_none(doc.get("max_queue_wait_ms")),
        limits=Limits(
            max_prompt_tokens=lim["max_prompt_tokens"],
            max_output_tokens=lim["max_output_tokens"],
            max_concurrent=lim["max_concurrent"],
            allowed_models=tuple(lim["allowed_models"]),
        ),
        created=int(doc["created"]),
    )
