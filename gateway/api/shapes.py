"""What the gateway answers: the response bodies and the headers, declared once.

The handlers build these shapes (``gateway.api.openai_protocol``'s builders are typed with
them, so mypy checks every body against its declaration) and the OpenAPI document
(``gateway.http.openapi``) publishes them; extra keys are forbidden, so a field added to a
response without its schema also fails the tests that validate real responses against the
document. Header names and their descriptions are here too, with ``contract_headers``, which
writes the latency contract's headers in the order they are declared.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from common.protocol import Heartbeat
from gateway.errors import ErrorResponse
from sched_core import Contract

NonNegative = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0.0)]
FinishReason = Literal["stop", "length", "cancelled"]
_FORBID = ConfigDict(extra="forbid")


# -- response bodies -------------------------------------------------------------------------
# What the handlers build (``oai.completion_body`` and friends, ``tenants.to_doc``, ...).
# Extra keys are forbidden, so a field added to a response without its schema fails the
# tests that validate real responses against this document.


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
    """``{tg}:req:{rid}`` as ``gateway.dispatch.records`` reads it; ``schedule`` while this gateway's
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
    slo_met: NonNegative  # settled requests with an SLO that met it
    slo_missed: NonNegative
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
class TenantUsage(TypedDict):
    tenant: str
    name: str
    minute: UsageTotals  # the current minute so far
    hour: UsageTotals  # the last 60 minutes, the current one included


@with_config(_FORBID)
class UsageOverview(TypedDict):
    """Every tenant's recent usage; ``since``/``until``: the whole minutes of the hour."""

    object: Literal["list"]
    data: list[TenantUsage]
    since: int
    until: int


@with_config(_FORBID)
class GatewayPart(TypedDict):
    gateway: str
    role: Literal["scheduler", "follower"]
    at: float  # unix time it took its counters (it publishes them every second)
    age_s: Seconds  # since then
    in_flight: NonNegative
    started: int
    admitted: NonNegative  # since it started
    refused: NonNegative
    budget_waits: NonNegative


@with_config(_FORBID)
class WorkerView(TypedDict):
    """``gateway.console.status.worker_view``: a heartbeat as the console shows it."""

    worker: str
    pool: str
    engine: str
    model: str
    device: str
    dtype: str
    choice: str
    slots: NonNegative
    free: int
    running: NonNegative
    down: str
    heartbeat_age_s: Seconds | None
    up_s: Seconds
    tokens_per_s: float
    cpu: str
    amx: bool | None
    amx_used: bool | None
    gpu: str
    threads: int | None
    prefill_tokens_per_s: float | None
    decode_step_ms: float | None
    profile_how: str | None  # measured, reused (a re-check confirmed it), re-anchored (a re-check scaled it)
    profile_starved: float | None  # the share of time its threads waited for a CPU while it measured
    cpu_starved: float  # the same since its last heartbeat: another program on its CPUs
    threads_now: int | None  # the engine's threads now (fewer than ``threads`` while starved)


@with_config(_FORBID)
class Cluster(TypedDict):
    """The console's live view (``gateway.console.status.cluster``): counters are totals
    since each live gateway started; ``scheduler`` is the scheduling gateway's queues, paths
    and policy (null while none schedules)."""

    object: Literal["cluster"]
    at: float
    gateway: str  # the gateway that answered
    gateways: list[GatewayPart]
    scheduler: dict[str, Any] | None
    workers: list[WorkerView]
    counters: dict[str, Any]


@with_config(_FORBID)
class WorkerList(TypedDict):
    object: Literal["list"]
    data: list[Heartbeat]


@with_config(_FORBID)
class PoolBacklog(TypedDict):
    """A pool's queued work (docs/operations.md, "Scaling on backlog")."""

    requests: NonNegative
    tokens: NonNegative


@with_config(ConfigDict(extra="allow"))
class SchedulerSnapshot(TypedDict):
    """``Dispatcher.snapshot()``: queues per bucket, fitted cost curves, thresholds,
    per-tenant counters (docs/scheduling.md); its inner shape belongs to ``sched_core``."""

    gateway: str
    role: Literal["scheduler", "follower"]  # a follower forwards its requests to the scheduler
    gateways: int  # live gateway processes
    batches_in_flight: int
    backlog: dict[str, PoolBacklog]


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
    UsageOverview,
    WorkerList,
    SchedulerSnapshot,
    Cluster,
)



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
    "x-tokengate-p99-output-tokens": {"description": "The output length `x-tokengate-p99-ms` assumes: exact with "
                                      "`ignore_eos`, else the 99th percentile of the tenant's recent lengths (at "
                                      "most `max_tokens`).", "schema": _INT},
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
# the latency contract on every admitted generation, in the order ``contract_headers`` writes them
CONTRACT_HEADERS = (
    "x-tokengate-ttft-ms", "x-tokengate-tpot-ms", "x-tokengate-output-tokens", "x-tokengate-latency-ms",
    "x-tokengate-ttft-p99-ms", "x-tokengate-tpot-p99-ms", "x-tokengate-p99-ms", "x-tokengate-p99-output-tokens",
    "x-tokengate-tokens-ahead", "x-tokengate-budget-wait-ms", "x-tokengate-bucket", "x-tokengate-path",
)
# on every admitted generation (streams: before the first event)
ADMITTED_HEADERS = (
    "x-request-id", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
    *CONTRACT_HEADERS,
)
OPTIONAL_ADMITTED_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests")
DEADLINE_HEADER = "x-tokengate-deadline-ms"
DEADLINE_MS_MAX = 86_400_000
# the SLO pair llm-d and the Gateway API Inference Extension send (docs/tenants.md)
SLO_HEADERS = {"x-slo-ttft-ms": 600_000.0, "x-slo-tpot-ms": 60_000.0}  # name -> largest value accepted




def contract_headers(c: Contract | None) -> dict[str, str]:
    """The latency contract (milliseconds from when the gateway received the request); none
    under a baseline policy (``--policy fcfs`` or ``fixed:…``), which promises nothing."""
    if c is None:
        return {}
    return dict(zip(CONTRACT_HEADERS, (
        f"{c.ttft_s * 1000:.1f}", f"{c.tpot_s * 1000:.1f}", str(c.output_tokens), f"{c.total_s * 1000:.1f}",
        f"{c.ttft_p99_s * 1000:.1f}", f"{c.tpot_p99_s * 1000:.1f}", f"{c.p99_s * 1000:.1f}",
        str(c.output_tokens_hi or c.output_tokens), str(c.tokens_ahead), f"{c.budget_wait_s * 1000:.1f}",
        str(c.bucket), c.path,
    ), strict=True))
