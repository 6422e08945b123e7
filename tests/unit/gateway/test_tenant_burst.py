"""No tenant is locked out by its own settings: its burst holds one request within its limits
(issue 38). The largest request a tenant may send reserves prompt + max_tokens at admission,
at most the model's context, or the tenant's max_prompt_tokens + max_output_tokens where both
are set and smaller; a burst defaults to hold one, and one given that cannot is a 400."""

from __future__ import annotations

import pytest

from gateway.api.openai_protocol import parse_chat
from gateway.errors import InvalidRequest
from gateway.tenancy import admin_protocol as ap
from gateway.tenancy.limits import output_tokens
from gateway.tenancy.tenants import Limits, burst_shortfall, default_burst, largest_request

CONTEXT = 8192


@pytest.mark.parametrize(
    ("limits", "largest"),
    [
        (Limits(), CONTEXT),  # one request may fill the context
        (Limits(max_prompt_tokens=1000), CONTEXT),  # max_tokens up to the context's rest
        (Limits(max_output_tokens=100), CONTEXT),  # a prompt up to the context's rest
        (Limits(max_prompt_tokens=700, max_output_tokens=192), 892),
        (Limits(max_prompt_tokens=8000, max_output_tokens=8000), CONTEXT),  # the context binds first
    ],
)
def test_the_largest_request_within_a_tenants_limits(limits: Limits, largest: int) -> None:
    assert largest_request(limits, CONTEXT) == largest


def test_without_a_context_only_the_tenants_own_limits_count() -> None:
    assert largest_request(Limits(), None) is None
    assert largest_request(Limits(max_prompt_tokens=5), None) is None
    assert largest_request(Limits(max_prompt_tokens=5, max_output_tokens=6), None) == 11


def test_the_default_burst_is_ten_seconds_of_rate_and_holds_one_request() -> None:
    assert default_burst(63.0) == 630
    assert default_burst(63.0, CONTEXT) == CONTEXT  # issue 38: 630 locked out every 892-token request
    assert default_burst(2000.0, CONTEXT) == 20_000
    t = ap.parse_create({"name": "noisy", "rate": 63}, context=CONTEXT)
    assert t.burst == CONTEXT and burst_shortfall(t, CONTEXT) is None
    capped = ap.parse_create(
        {"name": "capped", "rate": 63, "limits": {"max_prompt_tokens": 700, "max_output_tokens": 192}},
        context=CONTEXT,
    )
    assert capped.burst == 892


def test_a_default_burst_admits_the_largest_request_within_the_limits() -> None:
    """The rule agrees with the per-request check: the largest request is not budget_exceeded."""
    for body in ({"rate": 1}, {"rate": 1, "limits": {"max_prompt_tokens": 50, "max_output_tokens": 20}}):
        t = ap.parse_create({"name": "t", **body}, context=CONTEXT)
        largest = largest_request(t.limits, CONTEXT)
        assert largest is not None
        prompt = min(t.limits.max_prompt_tokens or CONTEXT - 1, CONTEXT - 1)
        chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                           "max_tokens": largest - prompt})
        assert output_tokens(chat, prompt, CONTEXT, 256, t) == largest - prompt


def test_a_burst_that_cannot_hold_one_request_is_refused_at_create_naming_the_fix() -> None:
    with pytest.raises(InvalidRequest) as info:
        ap.parse_create({"name": "noisy", "rate": 63, "burst": 630}, context=CONTEXT)
    err = info.value
    assert (err.status, err.param, err.code) == (400, "burst", "burst_too_small")
    assert err.message.startswith("burst 630 cannot hold one request of up to 8192 tokens (the model's context")
    assert "raise burst (--burst) to at least 8192 or leave it out" in err.message
    assert "set limits.max_prompt_tokens + limits.max_output_tokens" in err.message
    assert "to at most 630 in all" in err.message
    with pytest.raises(InvalidRequest) as info:
        ap.parse_create({"name": "capped", "rate": 63, "burst": 630,
                         "limits": {"max_prompt_tokens": 700, "max_output_tokens": 192}}, context=CONTEXT)
    assert "up to 892 tokens (max_prompt_tokens 700 + max_output_tokens 192)" in info.value.message
    assert "at least 892" in info.value.message and "lower limits.max_prompt_tokens" in info.value.message


def test_a_burst_that_holds_one_request_is_accepted() -> None:
    assert ap.parse_create({"name": "a", "rate": 1, "burst": CONTEXT}, context=CONTEXT).burst == CONTEXT
    small = {"name": "a", "rate": 1, "burst": 20, "limits": {"max_prompt_tokens": 5, "max_output_tokens": 15}}
    assert ap.parse_create(small, context=CONTEXT).burst == 20
    # the model's context unknown (a pure caller): the tenant's own limits alone are checked
    assert ap.parse_create({"name": "a", "rate": 1, "burst": 20}).burst == 20
    with pytest.raises(InvalidRequest):
        ap.parse_create({**small, "limits": {"max_prompt_tokens": 6, "max_output_tokens": 15}})


def test_an_update_that_leaves_the_burst_too_small_is_refused_whichever_field_did_it() -> None:
    t = ap.parse_create({"name": "a", "rate": 10, "burst": 100,
                         "limits": {"max_prompt_tokens": 60, "max_output_tokens": 40}}, context=CONTEXT)
    for change in ({"burst": 99}, {"limits": {"max_output_tokens": 41}}, {"limits": {"max_prompt_tokens": None}}):
        with pytest.raises(InvalidRequest) as info:
            ap.apply_update(t, ap.parse_update(change), CONTEXT)
        assert info.value.param == "burst" and info.value.code == "burst_too_small"
        assert "raise burst (--burst) to at least" in info.value.message
        assert "leave it out" not in info.value.message  # an update keeps the stored burst
    raised = ap.apply_update(t, ap.parse_update({"burst": CONTEXT, "limits": {"max_prompt_tokens": None}}), CONTEXT)
    assert raised.burst == CONTEXT and raised.limits.max_prompt_tokens is None
    assert ap.apply_update(t, ap.parse_update({"priority": 3}), CONTEXT).priority == 3


def test_a_burst_of_one_cannot_be_fixed_by_limits_and_does_not_say_so() -> None:
    with pytest.raises(InvalidRequest) as info:
        ap.parse_create({"name": "a", "rate": 1, "burst": 1}, context=CONTEXT)
    assert "at most" not in info.value.message and "at least 8192" in info.value.message
