"""Admin API JSON in, tenants out: the one place that validates what an operator sends.

Unknown fields are refused (a typo in a limit must not pass silently); every error is a
400 naming the field in ``param``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.api.openai_protocol import validated
from gateway.errors import InvalidRequest
from gateway.tenancy.tenants import (
    DEFAULT_MAX_QUEUE_DELAY_S,
    NAME_PATTERN,
    SLO_MS_MIN,
    Limits,
    Served,
    Tenant,
    burst_shortfall,
    default_burst,
    largest_request,
    new_id,
    with_rate,
)

Name = Annotated[str, Field(pattern=NAME_PATTERN)]
Rate = Annotated[float, Field(gt=0.0, le=1e9, allow_inf_nan=False)]
Burst = Annotated[int, Field(ge=1, le=10**12)]
Priority = Annotated[int, Field(ge=0, le=9)]
QueueDelay = Annotated[float, Field(ge=0.0, le=300.0, allow_inf_nan=False)]
SloTtftMs = Annotated[float, Field(ge=SLO_MS_MIN, le=600_000.0, allow_inf_nan=False)]
SloTpotMs = Annotated[float, Field(ge=SLO_MS_MIN, le=60_000.0, allow_inf_nan=False)]
QueueWaitMs = Annotated[float, Field(ge=SLO_MS_MIN, le=600_000.0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1, le=10**9)]
Models = Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=64)]


#: the tenant's fields as the admin API's schema describes them (``gateway.http.openapi``):
#: what each means and, for a limit, what a request over it gets (docs/tenants.md)
DESCRIPTIONS = {
    "name": "Unique; letters, digits, '.' and '-' (no '_', so a name never looks like an id).",
    "rate": "The token budget, tokens per second (prompt + completion tokens). A request its budget would "
    "hold longer than `max_queue_delay_s` (or its deadline or first-token SLO): 429 `rate_limit_exceeded`, "
    "type `tokens`.",
    "burst": "Tokens spendable at once, the budget's depth. It must hold one request within the tenant's "
    "limits: admission reserves prompt + `max_tokens`, so at least `limits.max_prompt_tokens` + "
    "`limits.max_output_tokens`, or the model's context where either is unset; a smaller one is refused "
    "(400 `burst_too_small`, naming the fix). Default: ten seconds of `rate`, or one such request where "
    "that is more. A request larger than the burst: 400 `budget_exceeded`.",
    "priority": "The scheduler's class, 0 (the most urgent) to 9.",
    "weight": "Share under overload, tokens/s (default: the rate, and it follows the rate). A tenant over "
    "its share is held to half its first-token SLO and refused first (503 `slo_unattainable`, `overloaded`).",
    "max_queue_delay_s": "Seconds a request may wait for its budget; longer: 429 `rate_limit_exceeded`.",
    "slo_ttft_ms": "Default SLO of requests without `x-slo-ttft-ms`: p99 time to first token, ms (null: none). "
    "One the gateway cannot promise now: 503 `slo_unattainable`.",
    "slo_tpot_ms": "Default SLO of requests without `x-slo-tpot-ms`: time per output token, ms (null: none). "
    "One the gateway cannot promise now: 503 `slo_unattainable`.",
    "max_queue_wait_ms": "The longest predicted wait, ms, of a request without a first-token SLO (null: the "
    "gateway's `--max-queue-wait-ms`); longer: 503 `overloaded`.",
    "limits": "Per-request and per-tenant limits; in an update, a limit left out is kept and null removes it.",
    "max_prompt_tokens": "Prompt tokens a request may have (null: the context's); over it: 400 `prompt_too_long`.",
    "max_output_tokens": "`max_tokens` a request may ask for, and the cap of its default (null: the "
    "context's); over it: 400 `max_tokens_exceeded`.",
    "max_concurrent": "Requests in flight at once, across all gateways (null: no limit); beyond: 429 "
    "`rate_limit_exceeded`, type `requests`. Apart from it, every tenant may have two prompts over 4,096 "
    "characters tokenized at once (429 `rate_limit_exceeded`, type `requests`, beyond).",
    "allowed_models": "Models the tenant may use ([] or null: all); another: 404 `model_not_found`, and "
    "hidden from `/v1/models`.",
}


def _described(name: str, default: Any = None) -> Any:
    return Field(default, description=DESCRIPTIONS[name])


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _not_null(v: Any) -> Any:
    if v is None:
        raise ValueError("must not be null")
    return v


class LimitsIn(_Model):
    """Absent fields keep their value on update; null removes a limit."""

    max_prompt_tokens: Count | None = _described("max_prompt_tokens")
    max_output_tokens: Count | None = _described("max_output_tokens")
    max_concurrent: Count | None = _described("max_concurrent")
    allowed_models: Models | None = _described("allowed_models")

    def apply(self, base: Limits) -> Limits:
        given = self.model_fields_set
        models = base.allowed_models
        if "allowed_models" in given:
            models = tuple(dict.fromkeys(self.allowed_models or ()))
        return Limits(
            max_prompt_tokens=self.max_prompt_tokens
            if "max_prompt_tokens" in given
            else base.max_prompt_tokens,
            max_output_tokens=self.max_output_tokens
            if "max_output_tokens" in given
            else base.max_output_tokens,
            max_concurrent=self.max_concurrent
            if "max_concurrent" in given
            else base.max_concurrent,
            allowed_models=models,
        )


class TenantCreate(_Model):
    name: Name = Field(description=DESCRIPTIONS["name"])
    rate: Rate = Field(description=DESCRIPTIONS["rate"])
    burst: Burst | None = _described("burst")  # default: ten seconds of the rate, at least one request
    priority: Priority = _described("priority", 0)
    weight: Rate | None = _described("weight")  # default: the rate
    max_queue_delay_s: QueueDelay = _described("max_queue_delay_s", DEFAULT_MAX_QUEUE_DELAY_S)
    slo_ttft_ms: SloTtftMs | None = _described("slo_ttft_ms")  # default: no SLO
    slo_tpot_ms: SloTpotMs | None = _described("slo_tpot_ms")
    max_queue_wait_ms: QueueWaitMs | None = _described("max_queue_wait_ms")  # default: the gateway's
    limits: LimitsIn = _described("limits", LimitsIn())


#: TenantUpdate's fields where null removes the value (elsewhere null is refused)
_NULL_REMOVES = ("slo_ttft_ms", "slo_tpot_ms", "max_queue_wait_ms")


def _schema_without_nulls(schema: dict[str, Any]) -> None:
    """TenantUpdate's JSON schema (``gateway.http.openapi``): a field may be left out, but null is
    refused (``_not_null``), so the schema admits no null, except in the fields where null
    removes the value (``_NULL_REMOVES``); validation is unchanged."""
    for name, prop in schema["properties"].items():
        prop.pop("default", None)
        if name in _NULL_REMOVES:
            continue
        branches = [b for b in prop.pop("anyOf", ()) if b != {"type": "null"}]
        if len(branches) == 1:
            prop.update(branches[0])
        elif branches:
            prop["anyOf"] = branches


class TenantUpdate(_Model):
    """Every field optional; only the given ones change. Null is refused, except in the SLO
    fields, where it removes the tenant's default SLO (absent keeps it, as in ``LimitsIn``)."""

    model_config = ConfigDict(json_schema_extra=_schema_without_nulls)

    name: Name | None = _described("name")
    rate: Rate | None = _described("rate")
    burst: Burst | None = _described("burst")
    priority: Priority | None = _described("priority")
    weight: Rate | None = _described("weight")
    max_queue_delay_s: QueueDelay | None = _described("max_queue_delay_s")
    slo_ttft_ms: SloTtftMs | None = _described("slo_ttft_ms")
    slo_tpot_ms: SloTpotMs | None = _described("slo_tpot_ms")
    max_queue_wait_ms: QueueWaitMs | None = _described("max_queue_wait_ms")
    limits: LimitsIn | None = _described("limits")

    _given = field_validator(
        "name", "rate", "burst", "priority", "weight", "max_queue_delay_s", "limits"
    )(_not_null)


class KeyCreate(_Model):
    name: Annotated[str, Field(max_length=128)] = ""


def holding_one_request(tenant: Tenant, context: Served, creating: bool = False) -> Tenant:
    """``tenant``, or the 400 (``param`` ``burst``, code ``burst_too_small``) when its burst
    cannot hold one request within its limits (``tenants.burst_shortfall``): such a tenant's
    every request of that size would be refused, forever. ``context``: the model's, in tokens,
    or each served model's (context, token weight) (None: unknown, and only the tenant's own
    prompt and output limits count)."""
    why = burst_shortfall(tenant, context, creating)
    if why is not None:
        raise InvalidRequest(why, param="burst", code="burst_too_small")
    return tenant


def parse_create(body: Any, now: float | None = None, context: Served = None) -> Tenant:
    """The new tenant, its burst defaulting to ten seconds of its rate and at least one
    largest request within its limits (``tenants.default_burst``); a burst given that cannot
    hold one such request is refused."""
    req: TenantCreate = validated(TenantCreate, body)
    limits = req.limits.apply(Limits())
    tenant = Tenant(
        id=new_id(),
        name=req.name,
        rate=req.rate,
        burst=req.burst if req.burst is not None else default_burst(req.rate, largest_request(limits, context)),
        priority=req.priority,
        weight=req.weight or req.rate,
        max_queue_delay_s=req.max_queue_delay_s,
        slo_ttft_ms=req.slo_ttft_ms,
        slo_tpot_ms=req.slo_tpot_ms,
        max_queue_wait_ms=req.max_queue_wait_ms,
        limits=limits,
        created=int(time.time() if now is None else now),
    )
    return holding_one_request(tenant, context, creating=True)


def parse_update(body: Any) -> TenantUpdate:
    upd: TenantUpdate = validated(TenantUpdate, body)
    return upd


def apply_update(tenant: Tenant, upd: TenantUpdate, context: Served = None) -> Tenant:
    """``tenant`` with the update's fields; refused (400) where the result's burst could not
    hold one request within its limits, whichever field made it so (``holding_one_request``)."""
    t = with_rate(tenant, upd.rate) if upd.rate is not None else tenant
    given = upd.model_fields_set
    return holding_one_request(replace(
        t,
        name=upd.name if upd.name is not None else t.name,
        burst=upd.burst if upd.burst is not None else t.burst,
        priority=upd.priority if upd.priority is not None else t.priority,
        weight=upd.weight if upd.weight is not None else t.weight,
        max_queue_delay_s=upd.max_queue_delay_s
        if upd.max_queue_delay_s is not None
        else t.max_queue_delay_s,
        slo_ttft_ms=upd.slo_ttft_ms if "slo_ttft_ms" in given else t.slo_ttft_ms,
        slo_tpot_ms=upd.slo_tpot_ms if "slo_tpot_ms" in given else t.slo_tpot_ms,
        max_queue_wait_ms=upd.max_queue_wait_ms if "max_queue_wait_ms" in given else t.max_queue_wait_ms,
        limits=upd.limits.apply(t.limits) if upd.limits is not None else t.limits,
    ), context)


def parse_key_create(body: Any) -> str:
    req: KeyCreate = validated(KeyCreate, body)
    return req.name
