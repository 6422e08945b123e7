"""A per-model token weight (issue 39): a token of a model of weight W costs a tenant's budget
W tokens. The burst rule and the per-request check price the largest request at its model's
weight, so a tenant's default burst still holds one request of the heaviest model."""

from __future__ import annotations

import pytest

from gateway.api.openai_protocol import parse_chat
from gateway.cli.flags import token_weight
from gateway.errors import InvalidRequest
from gateway.settings import GatewaySettings
from gateway.tenancy import admin_protocol as ap
from gateway.tenancy.limits import output_tokens
from gateway.tenancy.tenants import Limits, Tenant, burst_shortfall, largest_request

SMALL, LARGE = (2048, 0.5), (8192, 3.0)  # (context, token weight) of two served models


def test_the_largest_request_is_the_heaviest_model_s_at_its_weight() -> None:
    assert largest_request(Limits(), [SMALL, LARGE]) == 8192 * 3
    assert largest_request(Limits(), [SMALL]) == 1024
    # the tenant's own limits bind within each model's context, then its weight applies
    capped = Limits(max_prompt_tokens=700, max_output_tokens=300)
    assert largest_request(capped, [SMALL, LARGE]) == 3000
    assert largest_request(capped, 8192) == 1000  # one model of weight 1: as before


def test_a_default_burst_holds_one_request_of_the_heaviest_model_and_a_small_one_is_refused() -> None:
    t = ap.parse_create({"name": "t", "rate": 10}, context=[SMALL, LARGE])
    assert t.burst == 8192 * 3 and burst_shortfall(t, [SMALL, LARGE]) is None
    with pytest.raises(InvalidRequest) as refused:
        ap.parse_create({"name": "t", "rate": 10, "burst": 10_000}, context=[SMALL, LARGE])
    message = str(refused.value)
    assert "at least 24576" in message and "token weight 3" in message
    assert "to at most 3333 in all" in message  # what the burst holds of the heavy model


def test_a_request_is_priced_at_its_model_s_weight() -> None:
    tenant = Tenant("tn_1", "t", rate=100.0, burst=3000)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    # no max_tokens: the default is trimmed to what the burst holds at the weight (3000 / 3 - 100)
    assert output_tokens(chat, 100, 8192, 4096, tenant, weight=3.0) == 900
    assert output_tokens(chat, 100, 8192, 4096, tenant) == 2900
    asked = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 950})
    with pytest.raises(InvalidRequest) as refused:
        output_tokens(asked, 100, 8192, 4096, tenant, weight=3.0)
    assert refused.value.code == "budget_exceeded" and "3150 tokens" in str(refused.value)
    assert "token weight 3" in str(refused.value)


def test_the_flag_and_its_range() -> None:
    assert token_weight("org/model:7b=2.5") == ("org/model:7b", 2.5)
    for bad in ("model", "=2", "model=x"):
        with pytest.raises(Exception, match="MODEL=WEIGHT"):
            token_weight(bad)
    settings = GatewaySettings(redis_url="redis://x", model_name="a", token_weights=(("b", 4.0),))
    assert (settings.token_weight("a"), settings.token_weight("b")) == (1.0, 4.0)
    for weight in (0.0, -1.0, 1001.0):
        with pytest.raises(ValueError, match="token weight"):
            GatewaySettings(redis_url="redis://x", model_name="a", token_weights=(("b", weight),))
