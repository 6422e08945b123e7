"""The OpenAPI 3.1 document of the HTTP surface, served at ``GET /openapi.json``.

Built once, when the app is made, from the app's own route table (``documented``): every
(method, path) of the routes, the ``/admin`` mount included, must have exactly one entry in
``OPERATIONS`` and the other way round, or start-up fails naming the difference, so the
table and the document cannot drift. Request bodies are the JSON schemas of the pydantic
models that validate them (``gateway.http.openai_protocol``, ``gateway.tenancy.admin_protocol``);
response bodies are the typed dicts below, the shapes the handlers build, and tests check
real responses against the document (``tests/integration/gateway/test_openapi.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, NotRequired

import orjson
from pydantic import ConfigDict, Field, TypeAdapter, with_config
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from common.protocol import Heartbeat
from gateway.http import openai_protocol as oai
from gateway.settings import GatewaySettings
from gateway.tenancy import admin
from gateway.tenancy import admin_protocol as ap
from gateway.tenancy.tenants import SLO_MS_MIN

OPENAPI_PATH = "/openapi.json"
REF = "#/components/schemas/{model}"

NonNegative = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0.0)]
FinishReason = Literal["stop", "length", "cancelled"]
_FORBID = ConfigDict(extra="forbid")


# -- response bodies -------------------------------------------------------------------------
# What the handlers build (``oai.completion_body`` and friends, ``tenants.to_doc``, ...).
# Extra keys are forbidden, so a field added to a response without its schema fails the
# tests that validate real responses against this document.


@with_config(_FORBID)
class ErrorObject(TypedDict):
    """OpenAI's error object; ``budget_wait_s`` on a 429 over the token budget, ``estimate_ms``
    on a 503 whose deadline or SLO cannot be met, and on the latter the best bounds the
    gateway could promise (``best_ttft_p99_ms``, ``best_p99_ms``)."""

    message: str
    type: Literal["invalid_request_error", "server_error", "requests", "tokens"]
    param: str | None
    code: str | None
    budget_wait_s: NotRequired[float]
    estimate_ms: NotRequired[float]
    best_ttft_p99_ms: NotRequired[float]
    best_p99_ms: NotRequired[float]


@with_config(_FORBID)
class ErrorResponse(TypedDict):
    error: ErrorObject


@with_config(_FORBID)
class Usage(TypedDict):
    prompt_tokens: NonNegative
    completion_tokens: NonNegative
    total_tokens: NonNegative


@with_config(_FORBID)
class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str


@with_config(_FORBID)
class ChatChoice(TypedDict):
    index: Literal[0]
    message: AssistantMessage
    logprobs: None
    finish_reason: FinishReason


@with_config(_FORBID)
class ChatCompletion(TypedDict):
    id: Annotated[str, Field(pattern=r"^chatcmpl-[0-9a-f]+$")]
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: Annotated[list[ChatChoice], Field(min_length=1, max_length=1)]
    usage: Usage


@with_config(_FORBID)
class ChatDelta(TypedDict):
    role: NotRequired[Literal["assistant"]]
    content: NotRequired[str]


@with_config(_FORBID)
class ChatChunkChoice(TypedDict):
    index: Literal[0]
    delta: ChatDelta
    logprobs: None
    finish_reason: FinishReason | None


@with_config(_FORBID)
class ChatCompletionChunk(TypedDict):
    """One ``data:`` event of a chat stream; with ``stream_options.include_usage``, every
    chunk has ``usage: null`` and one last chunk has no choices and the usage."""

    id: Annotated[str, Field(pattern=r"^chatcmpl-[0-9a-f]+$")]
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: Annotated[list[ChatChunkChoice], Field(max_length=1)]
    usage: NotRequired[Usage | None]


@with_config(_FORBID)
class TextChoice(TypedDict):
    index: Literal[0]
    text: str
    logprobs: None
    finish_reason: FinishReason


@with_config(_FORBID)
class TextCompletion(TypedDict):
    id: Annotated[str, Field(pattern=r"^cmpl-[0-9a-f]+$")]
    object: Literal["text_completion"]
    created: int
    model: str
    choices: Annotated[list[TextChoice], Field(min_length=1, max_length=1)]
    usage: Usage


@with_config(_FORBID)
class TextChunkChoice(TypedDict):
    index: Literal[0]
    text: str
    logprobs: None
    finish_reason: FinishReason | None


@with_config(_FORBID)
class TextCompletionChunk(TypedDict):
    """One ``data:`` event of a completions stream (``usage`` as in chat chunks)."""

    id: Annotated[str, Field(pattern=r"^cmpl-[0-9a-f]+$")]
    object: Literal["text_completion"]
    created: int
    model: str
    choices: Annotated[list[TextChunkChoice], Field(max_length=1)]
    usage: NotRequired[Usage | None]


@with_config(_FORBID)
class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


@with_config(_FORBID)
class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


@with_config(_FORBID)
class RequestRecord(TypedDict):
    """``tg:req:{rid}`` as ``gateway.dispatch.records`` reads it; ``schedule`` while this gateway's
    scheduler still holds the request."""

    id: str
    object: Literal["request"]
    tenant: str
    state: Literal["admitted", "done", "cancelled", "failed"]
    admitted_at: float
    prompt_tokens: NonNegative
    reserved_tokens: NonNegative
    budget_wait_s: Seconds
    finished_at: NotRequired[float]
    charged_tokens: NotRequired[NonNegative]
    contract_ttft_s: NotRequired[float]
    contract_total_s: NotRequired[float]
    contract_p99_s: NotRequired[float]
    contract_ttft_p99_s: NotRequired[float]
    ttft_s: NotRequired[float]
    total_s: NotRequired[float]
    schedule: NotRequired[dict[str, Any]]


@with_config(_FORBID)
class Health(TypedDict):
    status: Literal["ok"]


@with_config(_FORBID)
class Ready(TypedDict):
    ready: Literal[True]
    pools: list[str]
    workers: NonNegative


@with_config(_FORBID)
class NotReady(TypedDict):
    """``/readyz``'s 503: a probe's answer, not an OpenAI error."""

    ready: Literal[False]
    reason: str


@with_config(_FORBID)
class TenantLimits(TypedDict):
    max_prompt_tokens: int | None
    max_output_tokens: int | None
    max_concurrent: int | None
    allowed_models: list[str]


@with_config(_FORBID)
class TenantDoc(TypedDict):
    """``gateway.tenancy.tenants.to_doc``: what the admin API returns and Redis stores."""

    id: Annotated[str, Field(pattern=r"^tn_[0-9a-f]{16}$")]
    object: Literal["tenant"]
    name: str
    rate: float
    burst: int
    priority: int
    weight: float
    max_queue_delay_s: float
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    max_queue_wait_ms: float | None
    limits: TenantLimits
    created: int


@with_config(_FORBID)
class BudgetState(TypedDict):
    remaining_tokens: NonNegative
    reset_s: Seconds
    in_flight: NonNegative


@with_config(_FORBID)
class TenantWithState(TenantDoc):
    state: BudgetState


@with_config(_FORBID)
class TenantList(TypedDict):
    object: Literal["list"]
    data: list[TenantDoc]


@with_config(_FORBID)
class TenantDeleted(TypedDict):
    id: str
    object: Literal["tenant"]
    name: str
    deleted: Literal[True]


@with_config(_FORBID)
class ApiKeyDoc(TypedDict):
    object: Literal["api_key"]
    prefix: Annotated[str, Field(pattern=r"^[0-9a-f]{8}$")]
    tenant: str
    name: str
    created: int


@with_config(_FORBID)
class IssuedKey(ApiKeyDoc):
    """The only reply that shows ``key``."""

    key: Annotated[str, Field(pattern=r"^tg-[0-9a-f]{8}-[A-Za-z0-9_-]{43}$")]


@with_config(_FORBID)
class ApiKeyList(TypedDict):
    object: Literal["list"]
    data: list[ApiKeyDoc]


@with_config(_FORBID)
class KeyRevoked(TypedDict):
    prefix: str
    object: Literal["api_key"]
    deleted: Literal[True]


@with_config(_FORBID)
class UsageTotals(TypedDict):
    requests: NonNegative
    rate_limited: NonNegative
    prompt_tokens: NonNegative
    completion_tokens: NonNegative
    total_tokens: NonNegative


@with_config(_FORBID)
class UsageMinute(UsageTotals):
    minute: int


@with_config(_FORBID)
class UsageList(TypedDict):
    """Minutes with traffic only; ``since``/``until`` are the whole minutes covered."""

    object: Literal["list"]
    data: list[UsageMinute]
    tenant: str
    since: int
    until: int
    totals: UsageTotals


@with_config(_FORBID)
class WorkerList(TypedDict):
    object: Literal["list"]
    data: list[Heartbeat]


@with_config(ConfigDict(extra="allow"))
class SchedulerSnapshot(TypedDict):
    """``Dispatcher.snapshot()``: queues per bucket, fitted cost curves, thresholds,
    per-tenant counters (docs/scheduling.md); its inner shape belongs to ``sched_core``."""

    gateway: str
    gateways_sharing_capacity: int
    batches_in_flight: int


REQUEST_MODELS: tuple[type[Any], ...] = (
    oai.ChatCompletionRequest,
    oai.CompletionRequest,
    ap.TenantCreate,
    ap.TenantUpdate,
    ap.KeyCreate,
)
RESPONSE_TYPES: tuple[type[Any], ...] = (
    ErrorResponse,
    ChatCompletion,
    ChatCompletionChunk,
    TextCompletion,
    TextCompletionChunk,
    ModelCard,
    ModelList,
    RequestRecord,
    Health,
    Ready,
    NotReady,
    TenantDoc,
    TenantWithState,
    TenantList,
    TenantDeleted,
    IssuedKey,
    ApiKeyList,
    KeyRevoked,
    UsageList,
    WorkerList,
    SchedulerSnapshot,
)


def schemas() -> dict[str, Any]:
    """``components/schemas``: the request models as they validate (``mode="validation"``)
    and the response shapes, with their shared parts once each."""
    inputs = [(t.__name__, "validation", TypeAdapter(t)) for t in REQUEST_MODELS]
    inputs += [(t.__name__, "serialization", TypeAdapter(t)) for t in RESPONSE_TYPES]
    _, defs = TypeAdapter.json_schemas(inputs, ref_template=REF)  # type: ignore[arg-type]
    found: dict[str, Any] = defs["$defs"]
    missing = [t.__name__ for t in (*REQUEST_MODELS, *RESPONSE_TYPES) if t.__name__ not in found]
    if missing:  # a name clash made pydantic qualify a name
        raise RuntimeError(f"schemas missing from the OpenAPI components: {missing}")
    return dict(sorted(found.items()))


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


# -- headers -----------------------------------------------------------------------------------

_INT = {"type": "integer", "minimum": 0}
_MS = {"type": "number", "minimum": 0}
HEADERS: dict[str, dict[str, Any]] = {
    "x-request-id": {
        "description": "The request's id, for `GET /v1/requests/{rid}`.",
        "schema": {"type": "string", "pattern": "^[0-9a-f]{24}$"},
    },
    "x-ratelimit-limit-tokens": {"description": "The tenant's burst (tokens).", "schema": _INT},
    "x-ratelimit-remaining-tokens": {
        "description": "Tokens the tenant's budget holds after this request's reservation.",
        "schema": _INT,
    },
    "x-ratelimit-reset-tokens": {
        "description": "Time until the budget is full again, OpenAI's format (`250ms`, `1.5s`, `6m0s`).",
        "schema": {"type": "string", "pattern": r"^([0-9]+h)?([0-9]+m)?[0-9]+(\.[0-9]+)?(ms|s)$"},
    },
    "x-ratelimit-limit-requests": {
        "description": "The tenant's `limits.max_concurrent` (only when set).",
        "schema": _INT,
    },
    "x-ratelimit-remaining-requests": {
        "description": "Requests the tenant may still start now (only when `max_concurrent` is set).",
        "schema": _INT,
    },
    "x-tokengate-ttft-ms": {"description": "Predicted time to the first token (ms since arrival).", "schema": _MS},
    "x-tokengate-tpot-ms": {"description": "Predicted time per output token after the first (ms).", "schema": _MS},
    "x-tokengate-output-tokens": {"description": "The output length the predicted latency assumes.",
                                  "schema": _INT},
    "x-tokengate-latency-ms": {"description": "Predicted time to the last token (ms since arrival).", "schema": _MS},
    "x-tokengate-ttft-p99-ms": {"description": "The bound the first token should come within 99 times in 100 "
                                "(ms since arrival); on a 503 `slo_unattainable`, the best the gateway could "
                                "promise.", "schema": _MS},
    "x-tokengate-tpot-p99-ms": {"description": "The bound on the time per output token, 99 times in 100 (ms).",
                                "schema": _MS},
    "x-tokengate-p99-ms": {"description": "The bound the request should finish within 99 times in 100 (ms since "
                           "arrival); on a 503 `slo_unattainable`, the best the gateway could promise.",
                           "schema": _MS},
    "x-tokengate-tokens-ahead": {"description": "Tokens queued ahead of it in its bucket.", "schema": _INT},
    "x-tokengate-budget-wait-ms": {"description": "How long the budget limiter held it.", "schema": _MS},
    "x-tokengate-bucket": {"description": "Its prompt-length bucket (0 = shortest).", "schema": _INT},
    "x-tokengate-path": {"description": "The worker pool it is headed for.",
                         "schema": {"type": "string", "enum": ["cpu", "gpu"]}},
    "x-tokengate-estimate-ms": {
        "description": "On a 503 `deadline_unmet`: the scheduler's estimate of the latency (ms).",
        "schema": _MS,
    },
    "retry-after": {"description": "Whole seconds to wait before retrying.",
                    "schema": {"type": "integer", "minimum": 1}},
}
# on every admitted generation (streams: before the first event)
ADMITTED_HEADERS = (
    "x-request-id", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
    "x-tokengate-ttft-ms", "x-tokengate-tpot-ms", "x-tokengate-output-tokens", "x-tokengate-latency-ms",
    "x-tokengate-ttft-p99-ms", "x-tokengate-tpot-p99-ms", "x-tokengate-p99-ms", "x-tokengate-tokens-ahead",
    "x-tokengate-budget-wait-ms", "x-tokengate-bucket", "x-tokengate-path",
)
OPTIONAL_ADMITTED_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests")
DEADLINE_HEADER = "x-tokengate-deadline-ms"
DEADLINE_MS_MAX = 86_400_000
# the SLO pair llm-d and the Gateway API Inference Extension send (docs/tenants.md)
SLO_HEADERS = {"x-slo-ttft-ms": 600_000.0, "x-slo-tpot-ms": 60_000.0}  # name -> largest value accepted


def _headers(required: Sequence[str], optional: Sequence[str] = ()) -> dict[str, Any]:
    # inline, not $ref: OpenAPI 3.1 allows no "required" beside a reference
    out = {h: {**HEADERS[h], "required": True} for h in required}
    return out | {h: HEADERS[h] for h in optional}


# -- operations --------------------------------------------------------------------------------

Security = Literal["ApiKey", "AdminToken"] | None


@dataclass(frozen=True)
class Operation:
    """One (method, path) of the route table, as the document describes it."""

    summary: str
    tag: str
    security: Security
    ok: tuple[int, str]  # status, response schema ("": text)
    errors: dict[int, str] = field(default_factory=dict)  # status -> when
    body: str | None = None  # request schema name
    body_required: bool = True
    parameters: tuple[dict[str, Any], ...] = ()
    ok_headers: tuple[Sequence[str], Sequence[str]] = ((), ())  # required, optional
    streams: str | None = None  # the chunk schema of a text/event-stream 200


def _path_param(name: str, description: str) -> dict[str, Any]:
    # any string: one that names nothing is a 404
    return {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": "string"}}


def _query_seconds(name: str, default: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": f"Unix seconds; default {default}.",
        "schema": {"type": "number", "minimum": 0, "exclusiveMaximum": 1e11},
    }


DEADLINE_PARAM = {
    "name": DEADLINE_HEADER,
    "in": "header",
    "required": False,
    "description": "The client's deadline in milliseconds from now (0 < N < 86,400,000). A request the "
    "scheduler cannot serve in time is refused at once (429 or 503 `deadline_unmet`).",
    "schema": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": DEADLINE_MS_MAX},
}

SLO_PARAMS = tuple(
    {
        "name": name,
        "in": "header",
        "required": False,
        "description": f"The client's SLO on its {what} in milliseconds ({SLO_MS_MIN:g} ≤ N ≤ {top:,.0f}); "
        "without it, the tenant's default SLO applies. A request whose calibrated p99 bound cannot meet it is "
        "refused at once (503 `slo_unattainable`, with `Retry-After` and the best bounds).",
        "schema": {"type": "number", "minimum": SLO_MS_MIN, "maximum": top},
    }
    for (name, top), what in zip(SLO_HEADERS.items(), ("first token", "time per output token"), strict=True)
)

REDIS_DOWN = "`redis_unavailable`: the gateway's store is not answering."
BAD_JSON = "The body is not a JSON object, or a field is invalid (`param` names it)."
NOT_JSON = "`unsupported_media_type`: the body is declared as something other than JSON."
SLOW_BODY = "`body_timeout`: the body did not arrive within the server's body deadline; the connection closes."


def _generation(summary: str, body: str, chunk: str, ok: str) -> Operation:
    return Operation(
        summary=summary,
        tag="openai",
        security="ApiKey",
        ok=(200, ok),
        body=body,
        parameters=(DEADLINE_PARAM, *SLO_PARAMS),
        ok_headers=(ADMITTED_HEADERS, OPTIONAL_ADMITTED_HEADERS),
        streams=chunk,
        errors={
            400: BAD_JSON + " Also `context_length_exceeded`, `prompt_too_long`, `max_tokens_exceeded`, "
            "`budget_exceeded` (more than the burst), a bad `x-tokengate-deadline-ms`, `x-slo-ttft-ms` or "
            "`x-slo-tpot-ms`.",
            401: "`invalid_api_key`: no, a malformed, an unknown or a revoked key.",
            404: "`model_not_found`: not a model this gateway serves, or not one the tenant may use.",
            413: "`payload_too_large`: the body is over the gateway's `--max-body-bytes`.",
            408: SLOW_BODY,
            415: NOT_JSON,
            429: "`rate_limit_exceeded`: over the tenant's token budget (`type` `tokens`, with "
            "`budget_wait_s`) or its `max_concurrent` (`type` `requests`), or too many long prompts "
            "being tokenized for the tenant; `oversize_held`: the tenant keeps sending requests refused "
            "for their size, past its allowance (docs/api.md, \"Oversized requests\").",
            500: "`worker_error`: the model worker failed on this request.",
            503: "`no_worker`, `overloaded`, `timeout`, `deadline_unmet` (with `estimate_ms`), "
            "`slo_unattainable` (with `estimate_ms`, `best_ttft_p99_ms` and `best_p99_ms`), `lost`, "
            "`shutdown`, " + REDIS_DOWN,
        },
    )


ADMIN_TOO_LARGE = f"`payload_too_large`: the body is over {admin._ADMIN_BODY_LIMIT // 1024} KiB."
_TENANT = _path_param("tenant", "The tenant's id (`tn_…`) or its name.")
_NO_TENANT = "`not_found`: no such tenant."
_ADMIN_401 = "`invalid_admin_token`, or `admin_disabled` when the gateway has no admin token."

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): _generation(
        "Create a chat completion", "ChatCompletionRequest", "ChatCompletionChunk", "ChatCompletion"
    ),
    ("POST", "/v1/completions"): _generation(
        "Create a completion", "CompletionRequest", "TextCompletionChunk", "TextCompletion"
    ),
    ("GET", "/v1/models"): Operation(
        "The models the key's tenant may use", "openai", "ApiKey", (200, "ModelList"),
        {401: "`invalid_api_key`.", 503: REDIS_DOWN},
    ),
    ("GET", "/v1/models/{model}"): Operation(
        "One model, if the key's tenant may use it", "openai", "ApiKey", (200, "ModelCard"),
        {401: "`invalid_api_key`.",
         404: "`model_not_found`: not a model this gateway serves, or not one the tenant may use.",
         503: REDIS_DOWN},
        parameters=(_path_param("model", "The model's id, as `GET /v1/models` lists it (a `/` in it may be "
                                "sent as `%2F`)."),),
    ),
    ("GET", "/v1/requests/{rid}"): Operation(
        "One of the caller's own requests: state, tokens, budget wait, schedule", "openai", "ApiKey",
        (200, "RequestRecord"),
        {401: "`invalid_api_key`.", 404: "`not_found`: unknown, expired, or another tenant's request.",
         503: REDIS_DOWN},
        parameters=(_path_param("rid", "The `x-request-id`, or the response's `chatcmpl-…`/`cmpl-…` id."),),
    ),
    ("POST", "/admin/tenants"): Operation(
        "Create a tenant", "admin", "AdminToken", (201, "TenantDoc"),
        {400: BAD_JSON + " Unknown fields are refused.", 401: _ADMIN_401,
         409: "`conflict`: a tenant with this name exists.", 413: ADMIN_TOO_LARGE,
         408: SLOW_BODY, 415: NOT_JSON, 503: REDIS_DOWN},
        body="TenantCreate",
    ),
    ("GET", "/admin/tenants"): Operation(
        "List tenants", "admin", "AdminToken", (200, "TenantList"), {401: _ADMIN_401, 503: REDIS_DOWN},
    ),
    ("GET", "/admin/tenants/{tenant}"): Operation(
        "A tenant and its budget now", "admin", "AdminToken", (200, "TenantWithState"),
        {401: _ADMIN_401, 404: _NO_TENANT, 503: REDIS_DOWN}, parameters=(_TENANT,),
    ),
    ("PATCH", "/admin/tenants/{tenant}"): Operation(
        "Change a tenant (only the fields given; in `limits`, null removes a limit)", "admin", "AdminToken",
        (200, "TenantDoc"),
        {400: BAD_JSON + " Unknown fields and nulls (outside `limits`) are refused.", 401: _ADMIN_401,
         404: _NO_TENANT, 409: "`conflict`: the new name is taken, or the tenant kept changing under us.",
         413: ADMIN_TOO_LARGE, 408: SLOW_BODY, 415: NOT_JSON, 503: REDIS_DOWN},
        body="TenantUpdate", body_required=False, parameters=(_TENANT,),
    ),
    ("DELETE", "/admin/tenants/{tenant}"): Operation(
        "Delete a tenant; its keys stop working at once", "admin", "AdminToken", (200, "TenantDeleted"),
        {401: _ADMIN_401, 404: _NO_TENANT, 503: REDIS_DOWN}, parameters=(_TENANT,),
    ),
    ("GET", "/admin/tenants/{tenant}/usage"): Operation(
        "A tenant's usage per minute", "admin", "AdminToken", (200, "UsageList"),
        {400: "`since`/`until` are not unix seconds, `since` is after `until`, or the window is over 7 days.",
         401: _ADMIN_401, 404: _NO_TENANT, 503: REDIS_DOWN},
        parameters=(_TENANT, _query_seconds("since", "an hour before `until`"), _query_seconds("until", "now")),
    ),
    ("POST", "/admin/tenants/{tenant}/keys"): Operation(
        "Issue an API key (shown once)", "admin", "AdminToken", (201, "IssuedKey"),
        {400: BAD_JSON, 401: _ADMIN_401, 404: _NO_TENANT, 409: "`conflict`: no free key prefix (never in practice).",
         413: ADMIN_TOO_LARGE, 408: SLOW_BODY, 415: NOT_JSON, 503: REDIS_DOWN},
        body="KeyCreate", body_required=False, parameters=(_TENANT,),
    ),
    ("GET", "/admin/tenants/{tenant}/keys"): Operation(
        "A tenant's keys, by prefix, without secrets", "admin", "AdminToken", (200, "ApiKeyList"),
        {401: _ADMIN_401, 404: _NO_TENANT, 503: REDIS_DOWN}, parameters=(_TENANT,),
    ),
    ("DELETE", "/admin/keys/{prefix}"): Operation(
        "Revoke an API key", "admin", "AdminToken", (200, "KeyRevoked"),
        {401: _ADMIN_401, 404: "`not_found`: no key with this prefix.", 503: REDIS_DOWN},
        parameters=(_path_param("prefix", "The key's prefix: 8 hex digits (`tg-<prefix>-…`)."),),
    ),
    ("GET", "/admin/workers"): Operation(
        "Live worker heartbeats", "admin", "AdminToken", (200, "WorkerList"), {401: _ADMIN_401},
    ),
    ("GET", "/admin/scheduler"): Operation(
        "This gateway's scheduler: queues, cost curves, thresholds, tenants", "admin", "AdminToken",
        (200, "SchedulerSnapshot"), {401: _ADMIN_401},
    ),
    ("GET", "/healthz"): Operation("The process is up", "ops", None, (200, "Health")),
    ("GET", "/readyz"): Operation(
        "Ready: Redis answers and a worker has a live heartbeat", "ops", None, (200, "Ready"),
        {503: "Not ready; the body says why (`NotReady`, not an OpenAI error)."},
    ),
    ("GET", "/metrics"): Operation("Prometheus metrics", "ops", None, (200, "")),
    ("GET", OPENAPI_PATH): Operation("This document", "ops", None, (200, "")),
}

_STATUS_TEXT = {
    200: "OK", 201: "Created", 400: "Bad request", 401: "Unauthorized", 404: "Not found", 408: "Request timeout",
    409: "Conflict",
    413: "Payload too large", 415: "Unsupported media type", 429: "Too many requests",
    500: "Server error", 503: "Unavailable",
}
# headers every error of this status carries (required) and may carry (optional)
_ERROR_HEADERS: dict[int, tuple[Sequence[str], Sequence[str]]] = {
    429: (("retry-after",), ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
                             *OPTIONAL_ADMITTED_HEADERS)),
    503: (("retry-after",), ("x-tokengate-estimate-ms", "x-tokengate-ttft-p99-ms", "x-tokengate-p99-ms")),
}


def route_table(routes: Sequence[BaseRoute], prefix: str = "") -> Iterator[tuple[str, str]]:
    """Every (method, OpenAPI path) the routes answer, mounts flattened; HEAD (which
    Starlette adds to every GET) left out."""
    for r in routes:
        if isinstance(r, Mount):
            yield from route_table(r.routes, prefix + r.path)
        elif isinstance(r, Route):
            path = re.sub(r"{(\w+)(:\w+)?}", r"{\1}", prefix + r.path)
            for method in sorted(r.methods or ()):
                if method != "HEAD":
                    yield method, path


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _example(body: str, model: str) -> dict[str, Any]:
    examples: dict[str, dict[str, Any]] = {
        "ChatCompletionRequest": {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                                  "max_tokens": 16},
        "CompletionRequest": {"model": model, "prompt": "Once upon a time", "max_tokens": 16},
        "TenantCreate": {"name": "acme", "rate": 2000, "slo_ttft_ms": 800, "limits": {"max_concurrent": 16}},
        "TenantUpdate": {"rate": 4000, "slo_ttft_ms": None, "limits": {"max_concurrent": None}},
        "KeyCreate": {"name": "laptop"},
    }
    return examples[body]


def _event(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream (what OpenAPI 3.2 calls the ``itemSchema``; 3.1 has
    none, and tools that read SSE, schemathesis among them, take ``schema`` per event)."""
    return {
        "description": "One event. Its `data` is a chunk; an error after the stream began is a last "
        "`{\"error\": …}` event; a stream that ends well ends with `data: [DONE]`.",
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"oneOf": [ref(chunk), ref("ErrorResponse")]},
                    },
                ]
            },
        },
    }


def _operation(method: str, path: str, op: Operation, settings: GatewaySettings) -> dict[str, Any]:
    status, schema = op.ok
    ok: dict[str, Any] = {"description": _STATUS_TEXT[status]}
    if schema == "":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
        if path == OPENAPI_PATH:
            ok["content"] = _json({"type": "object"})
    else:
        ok["content"] = _json(ref(schema))
    if op.streams:
        ok["description"] = "The completion (JSON), or with `stream: true` a server-sent event stream."
        ok["content"]["text/event-stream"] = {"schema": _event(op.streams)}
    required, optional = op.ok_headers
    if required or optional:
        ok["headers"] = _headers(required, optional)
    responses: dict[str, Any] = {str(status): ok}
    for code, when in sorted(op.errors.items()):
        if code == 413 and op.tag == "openai":
            when = f"`payload_too_large`: the body is over {settings.max_body_bytes} bytes (`--max-body-bytes`)."
        err: dict[str, Any] = {"description": f"{_STATUS_TEXT[code]}: {when}"}
        err["content"] = _json(ref("NotReady" if path == "/readyz" else "ErrorResponse"))
        if code in _ERROR_HEADERS:
            err["headers"] = _headers(*_ERROR_HEADERS[code])
        responses[str(code)] = err
    out: dict[str, Any] = {
        "operationId": f"{method.lower()}{re.sub(r'[^A-Za-z0-9]+', '_', path)}".rstrip("_"),
        "summary": op.summary,
        "tags": [op.tag],
        "security": [{op.security: []}] if op.security else [],
        "responses": responses,
    }
    if op.parameters:
        out["parameters"] = list(op.parameters)
    if op.body:
        body = _json(ref(op.body))
        body["application/json"]["example"] = _example(op.body, settings.model_name)
        out["requestBody"] = {"required": op.body_required, "content": body}
    return out


def document(routes: Sequence[BaseRoute], settings: GatewaySettings) -> dict[str, Any]:
    """The OpenAPI 3.1 document of exactly these routes; ValueError when a route has no entry
    in ``OPERATIONS`` or an entry has no route."""
    table = list(route_table(routes))
    undocumented = [f"{m} {p}" for m, p in table if (m, p) not in OPERATIONS]
    unrouted = [f"{m} {p}" for m, p in OPERATIONS if (m, p) not in table]
    if undocumented or unrouted:
        raise ValueError(f"OpenAPI operations and routes differ: undocumented {undocumented}, unrouted {unrouted}")
    paths: dict[str, dict[str, Any]] = {}
    for method, path in table:
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, OPERATIONS[method, path], settings)
    components: dict[str, Any] = {
        "schemas": schemas(),
        "securitySchemes": {
            "ApiKey": {
                "type": "http",
                "scheme": "bearer",
                "description": "A tenant's API key, `tg-<prefix>-<secret>` (the openai client's `api_key`).",
            },
            "AdminToken": {
                "type": "http",
                "scheme": "bearer",
                "description": "The gateway's admin token (`--admin-token`, `TOKENGATE_ADMIN_TOKEN`).",
            },
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tokengate",
            "version": "1",
            "description": "A multi-tenant, token-budget LLM gateway speaking OpenAI's REST API. "
            f"Serves the model `{settings.model_name}`. Errors are OpenAI error objects. See docs/api.md.",
        },
        "paths": paths,
        "components": components,
    }


class _Served:
    def __init__(self) -> None:
        self.body = b""

    async def respond(self, request: Request) -> Response:
        return Response(self.body, media_type="application/json")


def documented(routes: list[BaseRoute], settings: GatewaySettings) -> list[BaseRoute]:
    """``routes`` plus ``GET /openapi.json``, whose document (describing all of them, itself
    too) is built here, once."""
    served = _Served()
    every = [*routes, Route(OPENAPI_PATH, served.respond, methods=["GET"])]
    served.body = orjson.dumps(document(every, settings))
    return every
