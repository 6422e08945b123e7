"""completed(), cancel(), snapshot() and explain()."""

from __future__ import annotations

import json

import pytest

from sched_core import BatchTimings, Dispatch

from .conftest import Factory
from .support import req, timings


def test_completed_returns_slots_and_ignores_unknown_batches(make: Factory) -> None:
    s = make()
    s.worker_capacity("cpu", 2, 0.0)
    for rid in "abc":
        s.arrive(req(rid, prompt=3000), 0.0)
    (d,) = s.tick(0.0)
    assert isinstance(d, Dispatch) and len(d.request_ids) == 2
    s.completed(BatchTimings(999, "cpu", 1, 1, 0.1, 1, 0.1, (1,)), 0.5)
    assert s.snapshot()["paths"]["cpu"]["in_flight"] == 2
    s.completed(timings(d), 1.0)
    s.completed(timings(d), 1.0)  # a repeated report changes nothing
    assert s.snapshot()["paths"]["cpu"]["in_flight"] == 0
    (d2,) = s.tick(1.0)
    assert isinstance(d2, Dispatch) and d2.request_ids == ("c",)


def test_failed_batch_returns_slots_without_refitting(make: Factory) -> None:
    s = make()
    s.worker_capacity("gpu", 4, 0.0)
    s.arrive(req("a"), 0.0)
    (d,) = s.tick(0.0)
    before = s.snapshot()["paths"]["gpu"]
    s.completed(BatchTimings(d.batch_id, "gpu", 0, 0, 0.0, 0, 0.0, ()), 1.0)  # type: ignore[union-attr]
    after = s.snapshot()["paths"]["gpu"]
    assert after["in_flight"] == 0 and after["prefill"] == before["prefill"]


def test_refit_follows_reported_timings_and_moves_the_thresholds(make: Factory) -> None:
    s = make(prior_weight=0.01, fit_forgetting=1.0)
    s.worker_capacity("gpu", 64, 0.0)
    true_a, true_b, true_c, true_d = 0.2, 3e-6, 0.02, 5e-4
    b1_before = s.snapshot()["buckets"][4]["b1"]
    for i in range(30):
        size, length = 1 + (9 * i) % 64, 100 + 263 * i  # batches over the whole range
        outs = tuple(5 + (j * 3 + i) % 11 for j in range(size))
        s.arrive(req(f"r{i}"), float(i))
        (d,) = s.tick(float(i))
        assert isinstance(d, Dispatch)
        s.completed(BatchTimings(
            d.batch_id, "gpu", size, length, true_a + true_b * size * length, max(outs),
            true_c * max(outs) + true_d * sum(outs), outs), float(i) + 0.5)
    fit = s.snapshot()["paths"]["gpu"]
    assert fit["fitted_batches"] == 30
    close = pytest.approx
    assert fit["prefill"] == {"a": close(true_a, rel=1e-2), "b": close(true_b, rel=1e-2)}
    assert fit["decode"] == {"c": close(true_c, rel=1e-2), "d": close(true_d, rel=1e-2)}
    # A slower gpu launch moves the cpu/gpu crossover up.
    assert s.snapshot()["buckets"][4]["b1"] > b1_before


def test_cancel(make: Factory) -> None:
    s = make()
    s.arrive(req("a"), 0.0)
    s.arrive(req("b"), 0.0)
    assert s.cancel("a", 0.1) is True
    assert s.cancel("a", 0.2) is False
    assert s.cancel("never", 0.2) is False
    assert s.queued == 1 and s.explain("a") is None
    s.worker_capacity("cpu", 8, 0.3)
    (d,) = s.tick(0.3)
    assert isinstance(d, Dispatch) and d.request_ids == ("b",)
    assert s.cancel("b", 0.4) is False  # running: the gateway cancels it at the worker


def test_snapshot_is_json_and_reports_fits_thresholds_and_tenants(make: Factory) -> None:
    s = make()
    s.worker_capacity("cpu", 8, 0.0)
    s.worker_capacity("gpu", 64, 0.0)
    s.arrive(req("a", tenant="x"), 0.0)
    snap = json.loads(json.dumps(s.snapshot()))
    assert snap["queued"] == 1 and snap["buckets"][1]["queued"] == 1
    assert set(snap["paths"]) == {"cpu", "gpu"}
    assert snap["paths"]["gpu"]["capacity"] == 64
    assert set(snap["buckets"][0]) >= {"b1", "b2", "b_star", "arrival_rate", "max_prompt"}
    assert snap["fairness"]["tenants"]["x"]["queued"] == 1
    assert snap["tail_cut"]["t_cut_s"] is not None


def test_thresholds_follow_from_the_fitted_curves(make: Factory) -> None:
    snap = make().snapshot()
    cpu, gpu = snap["paths"]["cpu"], snap["paths"]["gpu"]
    bucket = snap["buckets"][2]
    n, length = bucket["mean_output"], bucket["max_prompt"]
    f_cpu = cpu["prefill"]["a"] + cpu["decode"]["c"] * n
    m_cpu = cpu["prefill"]["b"] * length + cpu["decode"]["d"] * n
    f_gpu = gpu["prefill"]["a"] + gpu["decode"]["c"] * n
    m_gpu = gpu["prefill"]["b"] * length + gpu["decode"]["d"] * n
    assert bucket["b1"] == pytest.approx((f_gpu - f_cpu) / (m_cpu - m_gpu))
    assert bucket["b2"] == pytest.approx(f_gpu / m_gpu)


def test_explain(make: Factory) -> None:
    s = make()
    assert s.explain("nobody") is None
    s.arrive(req("cheap", out=8), 0.0)
    s.arrive(req("dear", out=60), 0.0)
    e = s.explain("dear")
    assert e is not None and json.loads(json.dumps(e)) == e
    assert (e["state"], e["bucket"], e["requests_ahead"], e["tokens_ahead"]) == (
        "queued", 1, 1, 108)
    assert e["reason"] == "no worker offers capacity on any path"
    assert e["estimate"]["ttft_s"] < e["estimate"]["total_s"] <= e["estimate"]["p99_s"]
    s.worker_capacity("gpu", 1, 0.0)
    assert s.explain("dear")["reason"] == "it leaves for gpu at the next tick"  # type: ignore[index]
    (d,) = s.tick(0.0)
    assert s.explain("dear")["reason"] == "gpu is busy: it leaves when slots come back"  # type: ignore[index]
    assert s.explain("cheap") == {"request_id": "cheap", "state": "dispatched", "bucket": 1,
                                  "batch_id": d.batch_id, "path": "gpu"}  # type: ignore[union-attr]
