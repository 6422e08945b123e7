"""What a request may ask for, checked before anything is queued."""

from __future__ import annotations

import pytest

from gateway.api.openai_protocol import parse_chat, parse_completion
from gateway.errors import InvalidRequest
from gateway.tenancy.limits import output_tokens
from gateway.tenancy.tenants import Limits, Tenant

CONTEXT = 2048


def tenant(burst: int = 100_000, **limits: int) -> Tenant:
    return Tenant("tn_0000000000000000", "t", 100.0, burst, limits=Limits(**limits))  # type: ignore[arg-type]


def chat(max_tokens: int | None = None) -> object:
    body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return parse_chat(body)


def test_the_default_is_trimmed_to_the_context_the_output_limit_and_the_burst() -> None:
    assert output_tokens(chat(), 10, CONTEXT, 256, tenant()) == 256  # type: ignore[arg-type]
    assert output_tokens(chat(), 2000, CONTEXT, 256, tenant()) == 48  # type: ignore[arg-type]
    assert output_tokens(chat(), 10, CONTEXT, 256, tenant(max_output_tokens=20)) == 20  # type: ignore[arg-type]
    assert output_tokens(chat(), 10, CONTEXT, 256, tenant(burst=60)) == 50  # type: ignore[arg-type]


def test_an_explicit_max_tokens_is_never_trimmed() -> None:
    assert output_tokens(chat(300), 10, CONTEXT, 256, tenant()) == 300  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("max_tokens", "prompt", "t", "param", "code"),
    [
        (None, 50, tenant(max_prompt_tokens=49), "messages", "prompt_too_long"),
        (2000, 100, tenant(), "max_tokens", "context_length_exceeded"),
        (None, 3000, tenant(), "messages", "context_length_exceeded"),
        (21, 10, tenant(max_output_tokens=20), "max_tokens", "max_tokens_exceeded"),
        (60, 50, tenant(burst=100), "max_tokens", "budget_exceeded"),
        (None, 150, tenant(burst=100), "messages", "budget_exceeded"),
    ],
)
def test_refusals_are_400_naming_the_field(
    max_tokens: int | None, prompt: int, t: Tenant, param: str, code: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        output_tokens(chat(max_tokens), prompt, CONTEXT, 256, t)  # type: ignore[arg-type]
    assert (info.value.param, info.value.code) == (param, code)


def test_completions_name_the_prompt() -> None:
    gen = parse_completion({"model": "m", "prompt": "x", "max_tokens": None})
    with pytest.raises(InvalidRequest) as info:
        output_tokens(gen, 50, CONTEXT, 16, tenant(max_prompt_tokens=10))
    assert info.value.param == "prompt"


def test_refusals_hold_a_tenant_only_past_the_burst_and_no_other() -> None:
    from gateway.tenancy.limits import RefusalBucket

    b = RefusalBucket(burst=10_000_000, bytes_per_s=1e6, overhead=1_000)
    assert b.wait_s("a", 10.0) == 0.0
    for _ in range(9):  # nine refused megabytes at once: within the burst, nobody waits
        b.charge("a", 1_000_000, now=10.0)
    assert b.level("a", 10.0) == pytest.approx(9_009_000)
    assert b.wait_s("a", 10.0) == 0.0
    b.charge("a", 1_000_000, now=10.0)
    b.charge("a", 1_000_000, now=10.0)  # two more overflow it: held until it drains to the burst
    assert b.wait_s("a", 10.0) == pytest.approx(1.011)
    assert b.wait_s("a", 10.5) == pytest.approx(0.511)
    assert b.wait_s("a", 11.1) == 0.0
    assert b.wait_s("b", 10.0) == 0.0
    assert b.level("a", 30.0) == 0.0  # drained: a debt in the past is not carried over


def test_a_refusal_from_the_headers_costs_the_overhead_and_no_charge_exceeds_the_burst() -> None:
    from gateway.tenancy.limits import RefusalBucket

    b = RefusalBucket(burst=64 << 20, bytes_per_s=2e6, overhead=16 << 10)
    b.charge("a", 0, now=0.0)  # declared 10**12 bytes, read nothing
    assert b.level("a", 0.0) == 16 << 10
    b.charge("b", 10**12, now=0.0)  # whatever a charge says, it is capped at the burst
    assert b.level("b", 0.0) == 64 << 20
    assert b.wait_s("b", 0.0) == 0.0


def test_a_flood_is_held_to_the_refill_rate() -> None:
    from gateway.tenancy.limits import RefusalBucket

    b = RefusalBucket(burst=4_000_000, bytes_per_s=1e6, overhead=0)
    now, served = 0.0, 0
    while now < 100.0:  # a megabyte refused whenever the tenant is not held, polled every 10 ms
        if b.wait_s("a", now) == 0.0:
            b.charge("a", 1_000_000, now)
            served += 1
        now += 0.01
    assert 100 + 4 <= served <= 100 + 6  # the burst, then one a second: the refill rate


def test_the_bucket_table_stays_bounded() -> None:
    from gateway.tenancy.limits import RefusalBucket

    b = RefusalBucket(burst=100, bytes_per_s=1.0, overhead=1, max_tenants=3)
    for i in range(10):
        b.charge(f"t{i}", 1, now=float(i) * 10)
    assert len(b._full) <= 3
