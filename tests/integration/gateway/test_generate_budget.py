"""The OpenAI routes with tenants (in process, real Redis, echo worker): keys, limits,
budgets, headers, settlement and request ownership."""

from __future__ import annotations

import logging

import orjson
import pytest
import redis

from common import wire
from gateway.tenancy.tenants import Tenant, new_id
from tests.integration.gateway.conftest import ECHO_TOKENS, Harness
from tests.redis_text import everything

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

PROMPT = 5  # the harness sends five token ids


async def test_requests_need_a_valid_key(harness: Harness) -> None:
    _, key = await harness.tenant("acme")
    for bad in (None, "sk-nope", key[:-1] + "#", "tg-0123abcd-" + "A" * 43):
        r = await harness.complete(bad)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (
            await harness.http.get("/v1/models", headers={"authorization": f"Bearer {bad}"})
        ).status_code == 401
    assert (await harness.complete(key)).status_code == 200
    for open_route in ("/healthz", "/readyz", "/metrics"):
        assert (await harness.http.get(open_route)).status_code == 200


async def test_admitted_responses_carry_rate_limit_headers_and_settle(harness: Harness) -> None:
    # a burst of 1000 must hold one request within the limits (docs/tenants.md): 100 + 900 tokens
    t, key = await harness.tenant("acme", rate=0.5, burst=1000,
                                  limits={"max_concurrent": 3, "max_prompt_tokens": 100, "max_output_tokens": 900})
    r = await harness.complete(key, max_tokens=100)
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == PROMPT + ECHO_TOKENS
    h = r.headers
    assert h["x-ratelimit-limit-tokens"] == "1000"
    assert h["x-ratelimit-remaining-tokens"] == str(1000 - PROMPT - 100)  # at admission
    assert h["x-ratelimit-limit-requests"] == "3" and h["x-ratelimit-remaining-requests"] == "2"
    assert h["x-ratelimit-reset-tokens"].endswith("s")
    # settled before the response: 92 unused tokens came back and the lease is gone
    state = (await harness.admin("GET", "/tenants/acme")).json()["state"]
    assert state["in_flight"] == 0
    assert (
        1000 - PROMPT - ECHO_TOKENS <= state["remaining_tokens"] <= 1000 - PROMPT - ECHO_TOKENS + 1
    )


async def test_streams_carry_the_headers_and_settle_too(harness: Harness) -> None:
    _, key = await harness.tenant("acme", rate=0.5, burst=1000,
                                  limits={"max_prompt_tokens": 100, "max_output_tokens": 900})
    r = await harness.complete(key, max_tokens=50, stream=True)
    assert r.status_code == 200 and r.headers["x-ratelimit-remaining-tokens"] == str(
        1000 - PROMPT - 50
    )
    assert r.text.rstrip().endswith("data: [DONE]")
    rid = r.headers["x-request-id"]
    record = (
        await harness.http.get(f"/v1/requests/{rid}", headers={"authorization": f"Bearer {key}"})
    ).json()
    assert record["state"] == "done" and record["charged_tokens"] == PROMPT + ECHO_TOKENS


async def test_over_budget_is_429_with_retry_after(harness: Harness) -> None:
    _, key = await harness.tenant("acme", rate=2, burst=100, max_queue_delay_s=0,
                                  limits={"max_prompt_tokens": 10, "max_output_tokens": 90})
    assert (await harness.complete(key, max_tokens=90)).status_code == 200
    r = await harness.complete(key, max_tokens=90)
    assert r.status_code == 429
    err = r.json()["error"]
    assert (
        err["code"] == "rate_limit_exceeded"
        and err["type"] == "tokens"
        and err["budget_wait_s"] > 0
    )
    assert int(r.headers["retry-after"]) >= 1 and "x-ratelimit-remaining-tokens" in r.headers


async def test_a_request_waits_for_its_budget_when_the_wait_is_short(harness: Harness) -> None:
    _, key = await harness.tenant("acme", rate=100, burst=20, max_queue_delay_s=5,
                                  limits={"max_prompt_tokens": 5, "max_output_tokens": 15})
    first = await harness.complete(key, max_tokens=15)  # cost 20: the whole burst
    second = await harness.complete(key, max_tokens=15)  # needs 7 more tokens back: ~0.07 s
    assert first.status_code == second.status_code == 200
    rid = second.headers["x-request-id"]
    record = (
        await harness.http.get(f"/v1/requests/{rid}", headers={"authorization": f"Bearer {key}"})
    ).json()
    assert 0.0 < record["budget_wait_s"] <= 0.2


async def test_requests_larger_than_the_burst_are_400(harness: Harness) -> None:
    # the admin API refuses a burst that cannot hold one request within the limits, so this
    # is a tenant stored before that rule: written to the store directly
    t = await harness.gw.tenants.create(Tenant(new_id(), "acme", rate=1000.0, burst=50))
    key = (await harness.admin("POST", f"/tenants/{t.id}/keys", {"name": "k"})).json()["key"]
    r = await harness.complete(key, max_tokens=46)
    assert r.status_code == 400 and r.json()["error"]["code"] == "budget_exceeded"
    assert "your tenant's burst of 50 tokens" in r.json()["error"]["message"]


async def test_the_concurrency_limit_is_429(harness: Harness) -> None:
    t, key = await harness.tenant("acme", limits={"max_concurrent": 1})
    tenant = await harness.gw.tenants.get(t["id"])
    held = await harness.gw.domain().budget.admit(tenant, "held", 1, 1)  # a request in flight elsewhere
    r = await harness.complete(key)
    assert r.status_code == 429 and r.json()["error"]["type"] == "requests"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    await harness.gw.domain().budget.settle(held, "done", 1, 1)
    assert (await harness.complete(key)).status_code == 200


async def test_tenant_limits_are_400_before_anything_is_queued(
    harness: Harness, redis_client: redis.Redis
) -> None:
    _, key = await harness.tenant("acme", limits={"max_prompt_tokens": 4, "max_output_tokens": 20})
    r = await harness.complete(key)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
    r = await harness.complete(key, prompt=[1, 2], max_tokens=21)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert not list(redis_client.scan_iter(match=wire.request("*", "*")))


async def test_allowed_models(harness: Harness) -> None:
    _, key = await harness.tenant("acme", limits={"allowed_models": ["another-model"]})
    r = await harness.complete(key)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    models = await harness.http.get("/v1/models", headers={"authorization": f"Bearer {key}"})
    assert models.json()["data"] == []
    one = await harness.http.get(f"/v1/models/{harness.model}", headers={"authorization": f"Bearer {key}"})
    assert one.status_code == 404 and one.json()["error"]["code"] == "model_not_found"  # as for a model not served
    _, other = await harness.tenant("beta")
    models = await harness.http.get("/v1/models", headers={"authorization": f"Bearer {other}"})
    assert [m["id"] for m in models.json()["data"]] == [harness.model]
    one = await harness.http.get(f"/v1/models/{harness.model}", headers={"authorization": f"Bearer {other}"})
    assert one.json() == models.json()["data"][0]


async def test_a_tenant_sees_only_its_own_requests(harness: Harness) -> None:
    _, a = await harness.tenant("acme")
    _, b = await harness.tenant("beta")
    r = await harness.complete(a)
    rid, response_id = r.headers["x-request-id"], r.json()["id"]
    for ref in (rid, response_id):
        own = await harness.http.get(
            f"/v1/requests/{ref}", headers={"authorization": f"Bearer {a}"}
        )
        assert own.status_code == 200 and own.json()["state"] == "done"
    other = await harness.http.get(f"/v1/requests/{rid}", headers={"authorization": f"Bearer {b}"})
    unknown = await harness.http.get(
        "/v1/requests/0123456789ab", headers={"authorization": f"Bearer {b}"}
    )
    assert other.status_code == unknown.status_code == 404
    assert other.json()["error"]["message"].replace(rid, "X") == unknown.json()["error"][
        "message"
    ].replace("0123456789ab", "X")
    assert (await harness.http.get(f"/v1/requests/{rid}")).status_code == 401


async def test_no_key_in_redis_logs_or_metrics(
    harness: Harness, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    _, key = await harness.tenant("acme")
    await harness.complete(key)
    await harness.complete(key[:-2] + "zz")
    secret = key.split("-", 2)[2].encode()
    assert secret not in everything(redis_client)
    assert secret.decode()[:-2] not in caplog.text and key[3:11] in caplog.text
    assert secret not in (await harness.http.get("/metrics")).content
    assert secret[:-2] not in orjson.dumps(
        (await harness.admin("GET", "/tenants/acme/keys")).json()
    )


async def test_a_key_revoked_elsewhere_is_refused_at_once_despite_the_cache(
    harness: Harness,
) -> None:
    _, key = await harness.tenant("acme")
    assert (await harness.complete(key)).status_code == 200  # now cached by this gateway
    await harness.gw.tenants.revoke_key(key[3:11])  # as another replica would
    r = await harness.complete(key)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    models = await harness.http.get("/v1/models", headers={"authorization": f"Bearer {key}"})
    assert models.status_code == 401
