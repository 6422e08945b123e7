"""Latency contracts in the request path: headers, deadlines, the request's own record."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common import protocol as p
from common import wire
from gateway.dispatch import saved_model
from gateway.dispatch.dispatcher import Dispatcher, Pending
from gateway.dispatch.scheduling import Origin
from gateway.settings import GatewaySettings
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
    # not streamed: its total is judged, and its first token too (its end less the decode time
    # its worker measured)
    outcomes = _samples(metrics, "tokengate_contract_outcomes_total")
    assert sum(v for labels, v in outcomes if labels["component"] == "total") == 1, outcomes
    assert sum(v for labels, v in outcomes if labels["component"] == "ttft") == 1, outcomes
    assert 0 < doc["ttft_s"] <= doc["total_s"], doc


# -- calibrated contracts and SLOs ---------------------------------------------------------------

CALIBRATED = (
    "x-tokengate-ttft-ms",
    "x-tokengate-ttft-p99-ms",
    "x-tokengate-tpot-ms",
    "x-tokengate-tpot-p99-ms",
    "x-tokengate-latency-ms",
    "x-tokengate-p99-ms",
    "x-tokengate-output-tokens",
    "x-tokengate-p99-output-tokens",
)


async def _post(harness: Harness, key: str, headers: dict[str, str], **body: Any) -> httpx.Response:
    doc = {"model": harness.model, "prompt": [1, 2, 3, 4, 5], "max_tokens": 10, **body}
    return await harness.http.post("/v1/completions", json=doc, headers={"authorization": f"Bearer {key}", **headers})


async def _remaining_is_burst(harness: Harness, tenant: dict[str, Any]) -> None:
    state = (await harness.admin("GET", f"/tenants/{tenant['id']}")).json()
    assert state["state"]["remaining_tokens"] == tenant["burst"] and state["state"]["in_flight"] == 0


@pytest.mark.parametrize("max_tokens", [1, 3, 10])
async def test_every_response_carries_the_calibrated_contract(harness: Harness, max_tokens: int) -> None:
    _, key = await harness.tenant("k1")
    for stream in (False, True):
        r = await harness.complete(key, stream=stream, max_tokens=max_tokens)
        assert r.status_code == 200, r.text
        h = r.headers
        missing = [name for name in CONTRACT + CALIBRATED if name not in h]
        assert not missing, missing
        ttft, ttft_hi, tpot, tpot_hi, total, total_hi = (float(h[n]) for n in CALIBRATED[:6])
        assert 0 < ttft <= ttft_hi and 0 < tpot <= tpot_hi and ttft <= total <= total_hi
        assert ttft_hi <= total_hi
        # the bound's output length: at most max_tokens, at least the estimate
        assert int(h["x-tokengate-output-tokens"]) <= int(h["x-tokengate-p99-output-tokens"]) <= max_tokens
        assert 1 <= int(h["x-tokengate-output-tokens"]) <= max_tokens


async def test_an_slo_that_cannot_be_met_is_refused_at_once_and_not_charged(
    harness: Harness, record_property: Callable[[str, object], None]
) -> None:
    tenant, key = await harness.tenant("k2")
    for header in ("x-slo-ttft-ms", "x-slo-tpot-ms"):
        started = time.perf_counter()
        r = await _post(harness, key, {header: "0.001"})
        elapsed = time.perf_counter() - started
        record_property(f"refused_ms[{header}]", round(elapsed * 1000, 2))  # in the JUnit report
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "slo_unattainable", err
        assert int(r.headers["retry-after"]) >= 1
        assert err["best_ttft_p99_ms"] > 0.001 and err["best_p99_ms"] >= err["best_ttft_p99_ms"]
        assert err["estimate_ms"] > 0
        assert float(r.headers["x-tokengate-ttft-p99-ms"]) == err["best_ttft_p99_ms"]
        assert float(r.headers["x-tokengate-p99-ms"]) == err["best_p99_ms"]
        assert "x-tokengate-latency-ms" not in r.headers  # no contract was made
        assert elapsed < 0.5
        await _remaining_is_burst(harness, tenant)
    assert harness.gw.domain().dispatcher.shell.driver.queued == 0 and not harness.gw.domain().dispatcher.pending


async def test_a_tenant_default_slo_applies_to_requests_without_one(harness: Harness) -> None:
    tenant, key = await harness.tenant("k3", slo_ttft_ms=0.001)
    assert tenant["slo_ttft_ms"] == 0.001
    r = await _post(harness, key, {})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "slo_unattainable" and err["best_ttft_p99_ms"] > 0.001
    assert int(r.headers["retry-after"]) >= 1
    await _remaining_is_burst(harness, tenant)
    # the client's own SLO takes the place of its tenant's
    r = await _post(harness, key, {"x-slo-ttft-ms": "600000"})
    assert r.status_code == 200, r.text
    _, key = await harness.tenant("k3-tpot", slo_tpot_ms=0.001)
    r = await _post(harness, key, {})
    assert r.status_code == 503 and r.json()["error"]["code"] == "slo_unattainable", r.text


async def test_a_generous_slo_is_served(harness: Harness) -> None:
    _, key = await harness.tenant("k4")
    for stream in (False, True):
        r = await _post(harness, key, {"x-slo-ttft-ms": "600000", "x-slo-tpot-ms": "60000"}, stream=stream)
        assert r.status_code == 200, r.text
        assert float(r.headers["x-tokengate-ttft-p99-ms"]) <= 600000
        assert float(r.headers["x-tokengate-tpot-p99-ms"]) <= 60000


@pytest.mark.parametrize("header", ["x-slo-ttft-ms", "x-slo-tpot-ms"])
@pytest.mark.parametrize("value", ["soon", "-5", "0", "5e-324", "1e12", "nan", "inf"])  # 5e-324 ms rounds to 0 s
async def test_a_malformed_slo_is_a_400_naming_the_header(harness: Harness, header: str, value: str) -> None:
    tenant, key = await harness.tenant("k5")
    r = await _post(harness, key, {header: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == header and header in err["message"]
    await _remaining_is_burst(harness, tenant)


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]


async def test_served_requests_report_contract_accuracy(harness: Harness) -> None:
    _, key = await harness.tenant("k6")
    n = 4
    for _ in range(n):  # streamed: the gateway sees the first token
        r = await harness.complete(key, stream=True)
        assert r.status_code == 200, r.text
    text = (await harness.http.get("/metrics")).text
    errors = {(s["path"], s["component"], s["prediction"]): v
              for s, v in _samples(text, "tokengate_contract_error_ratio_count")}
    for component in ("ttft", "total"):
        for prediction in ("raw", "calibrated"):
            assert errors.get(("cpu", component, prediction)) == n, errors
    outcomes = _samples(text, "tokengate_contract_outcomes_total")
    for component in ("ttft", "total"):
        assert sum(v for s, v in outcomes if s["component"] == component and s["path"] == "cpu") == n, outcomes


async def test_the_model_and_calibration_are_saved_and_a_new_dispatcher_starts_from_them(
    harness: Harness, redis_url: str
) -> None:
    _, key = await harness.tenant("k7")
    for _ in range(4):
        r = await harness.complete(key, stream=True)
        assert r.status_code == 200, r.text
    dispatcher = harness.gw.domain().dispatcher
    deadline = time.monotonic() + 10  # the worker's step telemetry comes on its own stream
    while "cpu" not in (dispatcher.shell.model_state() or {}).get("step_model", {}):
        assert time.monotonic() < deadline, "no step telemetry was fitted"
        await asyncio.sleep(0.05)
    learnt = dispatcher.shell.driver.contracts.state()
    assert learnt["ratios"] and learnt["outputs"]  # the streamed requests' outcomes
    await saved_model.save(dispatcher.client, dispatcher.settings.model_name, dispatcher.shell)
    raw = await dispatcher.client.get(wire.model_key(harness.model))
    assert raw is not None
    saved = orjson.loads(raw)
    assert saved["contracts"] == learnt
    fresh = Dispatcher(GatewaySettings(redis_url=redis_url, model_name=harness.model), dispatcher.client)
    assert fresh.shell.driver.contracts.state() == {"ratios": [], "outputs": []}
    await saved_model.load(fresh.client, fresh.settings.model_name, fresh.shell)
    assert fresh.shell.driver.contracts.state() == {"ratios": [], "outputs": []}  # not before its workers show
    await fresh.refresh_workers()  # the same worker, the same profile: restored
    assert fresh.shell.snapshot()["saved_state"] == {"cpu": "restored", "outputs": "restored"}
    assert fresh.shell.driver.contracts.state() == learnt
    # the fitted step-time coefficients are the cpu path's prior
    coef = saved["step_model"]["cpu"]
    model = fresh.shell.snapshot()["paths"]["cpu"]["step_model"]  # type: ignore[index]
    assert model == pytest.approx(coef)


async def test_what_came_before_the_scheduler_is_not_learnt_as_its_error(
    harness: Harness,
) -> None:
    """A request that reached the scheduler a second after it arrived (a failover's wait for a
    scheduler): the calibration learns from the rest (bench.failover's saved windows held
    first-token ratios of 325-2,334 before)."""
    d = harness.gw.domain().dispatcher
    received = time.monotonic() - 1.0
    pending = await d.submit(p.SeqJob("late", (1, 2, 3), p.SamplingParams(4), stream=True), Origin("t", 1000.0),
                             received)
    promised = d.shell.driver.promised("late")  # as the scheduler made it, from its decision
    assert isinstance(pending, Pending) and promised is not None and 1.0 <= pending.before < 1.1
    while not isinstance(ev := await asyncio.wait_for(pending.events.get(), 5), p.Delta):
        assert not isinstance(ev, p.Failed), ev
    d.first_token("late", time.monotonic() - received)  # as the client saw it
    ratios = [v for c_, _p, _lv, _k, values in d.shell.driver.contracts.state()["ratios"] if c_ == "ttft"
              for v in values]
    assert ratios and max(ratios) < 0.25 / promised.ttft_s  # not the second over the raw milliseconds
    d.end("late", None, None, 0)
