"""What the gateway answers in headers, declared once: each header's description and schema
(the OpenAPI document publishes them), which ones an admitted generation carries, the ones a
client may send (a deadline, the SLO pair), and ``contract_headers``, which writes the latency
contract's headers in the order they are declared."""

from __future__ import annotations

from typing import Any

from sched_core import Contract

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
