"""What the gateway answers: the response bodies and the headers, declared once.

The handlers build these shapes (``gateway.api.openai_protocol``'s builders are typed with
them, so mypy checks every body against its declaration) and the OpenAPI document
(``gateway.http.openapi``) publishes them; extra keys are forbidden, so a field added to a
response without its schema also fails the tests that validate real responses against the
document. The headers are declared beside them, in ``gateway.api.headers``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from common.protocol import Heartbeat
from gateway.errors import ErrorResponse

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
class ModelReady(TypedDict):
    pools: list[str]
    workers: NonNegative


@with_config(_FORBID)
class Ready(TypedDict):
    """Every model's pools and workers together, then each model's (``models``)."""

    ready: Literal[True]
    pools: list[str]
    workers: NonNegative
    models: dict[str, ModelReady]


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
    charged_tokens: int  # what the budget was charged: the tokens at their models' token weights


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
    model: str  # the model it serves (its scheduling domain)
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
class SelfTuning(TypedDict):
    """The scheduler's self-tuning (docs/scheduling.md §16.2): whether its table is re-solved,
    the re-solved table in force (None: the packaged one), what it is doing, and the last
    changes, newest first."""

    enabled: bool  # the policy is the self-tuned table (--policy smdp)
    every_s: float  # between automatic re-solves (0: only when asked)
    in_force: dict[str, Any] | None  # name, since, kind (swap, rollback), why
    status: dict[str, Any]  # solving_since, last (the verdict), judged (the watch's), watch
    changes: list[dict[str, Any]]  # at, kind, from, to, why, figures


@with_config(_FORBID)
class Cluster(TypedDict):
    """The console's live view (``gateway.console.status.cluster``): counters are totals
    since each live gateway started; ``scheduler`` is the scheduling gateway's queues, paths
    and policy (null while none schedules)."""

    object: Literal["cluster"]
    at: float
    gateway: str  # the gateway that answered
    model: str  # the model it serves: the gateways listed are that model's
    gateways: list[GatewayPart]
    scheduler: dict[str, Any] | None
    workers: list[WorkerView]
    counters: dict[str, Any]
    models: list[str]  # every model the answering gateway serves (``?model=`` picks the view)
    tuning: SelfTuning  # the scheduler's table: re-solved or not, in force since when and why


@with_config(_FORBID)
class WorkerList(TypedDict):
    object: Literal["list"]
    data: list[Heartbeat]


@with_config(_FORBID)
class PoolBacklog(TypedDict):
    """A pool's queued work (docs/operations.md, "Scaling on backlog")."""

    requests: NonNegative
    tokens: NonNegative


@with_config(_FORBID)
class TuneAsked(TypedDict):
    """``POST /admin/scheduler/tune``: the scheduling gateway re-solves at its next turn."""

    model: str
    asked: Literal[True]


@with_config(ConfigDict(extra="allow"))
class SchedulerSnapshot(TypedDict):
    """``Dispatcher.snapshot()``: queues per bucket, fitted cost curves, thresholds,
    per-tenant counters (docs/scheduling.md); its inner shape belongs to ``sched_core``."""

    gateway: str
    model: str  # the model this gateway serves: its scheduling domain
    role: Literal["scheduler", "follower"]  # a follower forwards its requests to the scheduler
    gateways: int  # live gateway processes
    batches_in_flight: int
    backlog: dict[str, PoolBacklog]
    tuning: SelfTuning


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
    TuneAsked,
    UsageList,
    UsageOverview,
    WorkerList,
    SchedulerSnapshot,
    Cluster,
)
