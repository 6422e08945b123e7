"""What a request may ask for, checked before anything is queued."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest
from gateway.limits import output_tokens
from gateway.openai_protocol import parse_chat, parse_completion
from gateway.tenants import Limits, Tenant

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


def test_an_oversized_request_holds_its_tenant_for_its_size_and_no_other() -> None:
    from gateway.limits import OversizePenalty

    p = OversizePenalty(bytes_per_s=1e6)
    assert p.wait_s("a", 10.0) == 0.0
    p.charge("a", 1_000_000, now=10.0)  # a megabyte refused: one second
    p.charge("a", 500_000, now=10.2)  # a second one (sent anyway) adds half a second
    assert p.wait_s("a", 10.2) == pytest.approx(1.3)
    assert p.wait_s("b", 10.2) == 0.0
    assert p.wait_s("a", 11.5) == 0.0
    p.charge("a", 1_000, now=20.0)  # a debt in the past is not carried over
    assert p.wait_s("a", 20.0) == pytest.approx(0.001)


def test_the_penalty_table_stays_bounded() -> None:
    from gateway.limits import OversizePenalty

    p = OversizePenalty(bytes_per_s=1.0, max_tenants=3)
    for i in range(10):
        p.charge(f"t{i}", 1, now=float(i) * 10)
    assert len(p._until) <= 3
