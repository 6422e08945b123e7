"""Each refusal for a per-tenant limit names the limit that refused it (issue 38), so a client
(and its operator) can tell which one to change."""

from __future__ import annotations

import pytest

from gateway.api.openai_protocol import Generation, parse_chat
from gateway.errors import InvalidRequest
from gateway.http.lifecycle import refused
from gateway.tenancy.limits import output_tokens, over_burst, prompt_too_long
from gateway.tenancy.tenants import Limits, Tenant
from sched_core import Reject

CONTEXT = 8192


def tenant(burst: int = 100_000, **limits: int) -> Tenant:
    return Tenant("tn_0000000000000000", "acme", 100.0, burst, limits=Limits(**limits))  # type: ignore[arg-type]


def chat(max_tokens: int | None = None) -> Generation:
    body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return parse_chat(body)


def test_the_prompt_and_output_limits_are_named() -> None:
    with pytest.raises(InvalidRequest) as info:
        output_tokens(chat(), 50, CONTEXT, 256, tenant(max_prompt_tokens=40))
    assert info.value.code == "prompt_too_long" and "your tenant's max_prompt_tokens" in info.value.message
    err = prompt_too_long(chat(), 50, False, CONTEXT, tenant(max_prompt_tokens=40))
    assert err.code == "prompt_too_long" and "(your tenant's max_prompt_tokens)" in err.message
    with pytest.raises(InvalidRequest) as info:
        output_tokens(chat(30), 5, CONTEXT, 256, tenant(max_output_tokens=20))
    assert info.value.code == "max_tokens_exceeded" and "your tenant's max_output_tokens" in info.value.message


def test_a_request_over_the_burst_names_the_burst_and_the_fix() -> None:
    err = over_burst(tenant(burst=630), 908)
    assert err.code == "budget_exceeded" and err.status == 400
    assert "more than your tenant's burst of 630 tokens" in err.message
    assert "tokengate tenants update acme --burst 908" in err.message


def test_the_schedulers_refusals_name_the_bound_they_were_held_to() -> None:
    wait = Reject("r1", "wait", "the workers are busy: its first token would wait about 7.9 s, more than the "
                  "5 s a request without an SLO is kept waiting", 3.0, 9.1)
    err = refused("r1", wait, ("its tenant's slo_ttft_ms/slo_tpot_ms", "its tenant's max_queue_wait_ms"))
    assert err.code == "overloaded" and "kept waiting (its tenant's max_queue_wait_ms); retry" in err.message
    slo = Reject("r2", "slo", "its first token could be promised within 4097 ms (p99), not the 500 ms asked",
                 4.0, 7.0, 4.1, 20.9)
    err = refused("r2", slo, ("its tenant's slo_ttft_ms/slo_tpot_ms", "the gateway's --max-queue-wait-ms"))
    assert err.code == "slo_unattainable"
    assert err.message.startswith("Request r2 cannot meet its SLO (its tenant's slo_ttft_ms/slo_tpot_ms) now")
    assert refused("r3", slo).message.startswith("Request r3 cannot meet its SLO now")  # none named: as before
