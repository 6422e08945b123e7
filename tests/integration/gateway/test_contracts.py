"""Latency contracts in the request path: headers, deadlines, the request's own record."""

from __future__ import annotations

import pytest

from tests.integration.gateway.conftest import Harness

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

CONTRACT = (
    "x-tokengate-ttft-ms",
    "x-tokengate-latency-ms",
    "x-tokengate-p99-ms",
    "x-tokengate-tokens-ahead",
    "x-tokengate-budget-wait-ms",
    "x-tokengate-bucket",
    "x-tokengate-path",
)


async def test_every_response_carries_its_contract(harness: Harness) -> None:
    _, key = await harness.tenant("c1")
    for stream in (False, True):
        r = await harness.complete(key, stream=stream)
        assert r.status_code == 200, r.text
        h = r.headers
        assert all(name in h for name in CONTRACT)
        ttft, total, p99 = (float(h[n]) for n in CONTRACT[:3])
        assert 0 < ttft <= total <= p99
        assert int(h["x-tokengate-tokens-ahead"]) >= 0 and float(h["x-tokengate-budget-wait-ms"]) == 0
        assert h["x-tokengate-path"] == "cpu"  # the only pool alive
        assert int(h["x-tokengate-bucket"]) == 0  # a five-token prompt is in the first bucket


async def test_a_deadline_the_contract_cannot_meet_is_refused_at_once(harness: Harness) -> None:
    tenant, key = await harness.tenant("c2")
    r = await harness.http.post(
        "/v1/completions",
        json={"model": harness.model, "prompt": list(range(1, 600)), "max_tokens": 400},
        headers={"authorization": f"Bearer {key}", "x-tokengate-deadline-ms": "1"},
    )
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "deadline_unmet" and err["estimate_ms"] > 1
    assert float(r.headers["x-tokengate-estimate-ms"]) == err["estimate_ms"]
    # nothing was queued and nothing is charged: the full budget is there again
    state = (await harness.admin("GET", f"/tenants/{tenant['id']}")).json()
    assert state["state"]["remaining_tokens"] == tenant["burst"] and state["state"]["in_flight"] == 0


async def test_a_deadline_that_can_be_met_is_served(harness: Harness) -> None:
    _, key = await harness.tenant("c3")
    r = await harness.http.post(
        "/v1/completions",
        json={"model": harness.model, "prompt": [1, 2, 3], "max_tokens": 4},
        headers={"authorization": f"Bearer {key}", "x-tokengate-deadline-ms": "60000"},
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["soon", "-5", "0", "1e12"])
async def test_a_malformed_deadline_is_a_400_naming_the_header(harness: Harness, value: str) -> None:
    _, key = await harness.tenant("c4")
    r = await harness.http.post(
        "/v1/completions",
        json={"model": harness.model, "prompt": [1, 2, 3]},
        headers={"authorization": f"Bearer {key}", "x-tokengate-deadline-ms": value},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-tokengate-deadline-ms"


async def test_the_request_record_keeps_contract_and_outcome(harness: Harness) -> None:
    _, key = await harness.tenant("c5")
    r = await harness.complete(key)
    rid = r.headers["x-request-id"]
    doc = (await harness.http.get(f"/v1/requests/{rid}", headers={"authorization": f"Bearer {key}"})).json()
    assert doc["state"] == "done"
    assert doc["contract_total_s"] == pytest.approx(float(r.headers["x-tokengate-latency-ms"]) / 1000, abs=1e-3)
    assert 0 < doc["total_s"] and doc["contract_p99_s"] >= doc["contract_total_s"]
    metrics = (await harness.http.get("/metrics")).text
    assert "tokengate_contract_outcomes_total" in metrics
