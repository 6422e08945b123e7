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
from gateway.tenancy.tenants import (
    DEFAULT_MAX_QUEUE_DELAY_S,
    NAME_PATTERN,
    SLO_MS_MIN,
    Limits,
    Tenant,
    default_burst,
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


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _not_null(v: Any) -> Any:
    if v is None:
        raise ValueError("must not be null")
    return v


class LimitsIn(_Model):
    """Absent fields keep their value on update; null removes a limit."""

    max_prompt_tokens: Count | None = None
    max_output_tokens: Count | None = None
    max_concurrent: Count | None = None
    allowed_models: Models | None = None

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
    name: Name
    rate: Rate
    burst: Burst | None = None  # default: ten seconds of the rate
    priority: Priority = 0
    weight: Rate | None = None  # default: the rate
    max_queue_delay_s: QueueDelay = DEFAULT_MAX_QUEUE_DELAY_S
    slo_ttft_ms: SloTtftMs | None = None  # default: no SLO
    slo_tpot_ms: SloTpotMs | None = None
    max_queue_wait_ms: QueueWaitMs | None = None  # default: the gateway's --max-queue-wait-ms
    limits: LimitsIn = LimitsIn()


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

    name: Name | None = None
    rate: Rate | None = None
    burst: Burst | None = None
    priority: Priority | None = None
    weight: Rate | None = None
    max_queue_delay_s: QueueDelay | None = None
    slo_ttft_ms: SloTtftMs | None = None
    slo_tpot_ms: SloTpotMs | None = None
    max_queue_wait_ms: QueueWaitMs | None = None
    limits: LimitsIn | None = None

    _given = field_validator(
        "name", "rate", "burst", "priority", "weight", "max_queue_delay_s", "limits"
    )(_not_null)


class KeyCreate(_Model):
    name: Annotated[str, Field(max_length=128)] = ""


def parse_create(body: Any, now: float | None = None) -> Tenant:
    req: TenantCreate = validated(TenantCreate, body)
    return Tenant(
        id=new_id(),
        name=req.name,
        rate=req.rate,
        burst=req.burst if req.burst is not None else default_burst(req.rate),
        priority=req.priority,
        weight=req.weight or req.rate,
        max_queue_delay_s=req.max_queue_delay_s,
        slo_ttft_ms=req.slo_ttft_ms,
        slo_tpot_ms=req.slo_tpot_ms,
        max_queue_wait_ms=req.max_queue_wait_ms,
        limits=req.limits.apply(Limits()),
        created=int(time.time() if now is None else now),
    )


def parse_update(body: Any) -> TenantUpdate:
    upd: TenantUpdate = validated(TenantUpdate, body)
    return upd


def apply_update(tenant: Tenant, upd: TenantUpdate) -> Tenant:
    t = with_rate(tenant, upd.rate) if upd.rate is not None else tenant
    given = upd.model_fields_set
    return replace(
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
    )


def parse_key_create(body: Any) -> str:
    req: KeyCreate = validated(KeyCreate, body)
    return req.name
