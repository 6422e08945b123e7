"""finished(), completed(), observe_steps(), cancel(), snapshot() and explain()."""

from __future__ import annotations

import json

import pytest

from sched_core import BatchTimings, Contract, Dispatch, PathConfig, SchedulerConfig

from .conftest import Factory
from .support import batch_line, req, timings

COEFFICIENTS = ("decode_launch", "decode_seq", "kv_token", "prefill_launch", "prefill_token")
QUICK_CPU = PathConfig(0.002, 0.004, 0.0, 0.002, 0.0, max_batch=32, step_tokens=128)
LAUNCH_GPU = PathConfig(0.01, 0.0002, 0.0, 0.01, 0.0, max_batch=64, step_tokens=512)


def prior(c: PathConfig) -> dict[str, float]:
    return {name: getattr(c, name) for name in (*COEFFICIENTS, "prefill_attention")}


def reported(path: dict[str, object]) -> PathConfig:
    """A path of a snapshot as the PathConfig of its current step model."""
    return PathConfig(**path["step_model"], max_batch=path["max_batch"],  # type: ignore[arg-type]
                      step_tokens=path["step_tokens"])  # type: ignore[arg-type]


def test_finished_returns_its_slot_at_once_and_completed_only_the_rest(make: Factory) -> None:
    s = make(default_output_tokens=50)
    s.worker_capacity("gpu", 2, 0.0)
    for rid in "abc":
        s.arrive(req(rid, prompt=100, out=32), 0.0)
    (d,) = s.tick(0.0)
    assert isinstance(d, Dispatch) and len(d.request_ids) == 2
    x, y = d.request_ids
    (third,) = set("abc") - {x, y}
    gpu = s.snapshot()["paths"]["gpu"]
    assert (gpu["in_flight"], gpu["kv_tokens"]) == (2, 2 * (100 + 32 // 2))
    assert s.finished(x, 10, 0.5) is True
    assert s.finished(x, 10, 0.5) is False  # already finished
    assert s.finished("never", 10, 0.5) is False
    gpu = s.snapshot()["paths"]["gpu"]
    assert (gpu["in_flight"], gpu["kv_tokens"]) == (1, 100 + 32 // 2)
    (d2,) = s.tick(0.5)  # x's slot is free now, not when its batch ends
    assert isinstance(d2, Dispatch) and d2.request_ids == (third,)
    s.completed(BatchTimings(999, "gpu", 1, 1, 0.1, 1, 0.1, (1,)), 0.6)  # unknown: ignored
    assert s.snapshot()["paths"]["gpu"]["in_flight"] == 2
    # The batch report returns y's slot only, and learns y's output only: x's 99 is stale.
    s.completed(timings(d, outputs=(99, 14)), 1.0)
    s.completed(timings(d, outputs=(99, 14)), 1.0)  # a repeated report changes nothing
    assert s.snapshot()["paths"]["gpu"]["in_flight"] == 1
    assert s.finished(y, 14, 1.0) is False  # its batch already reported
    s.arrive(req("next", out=0, max_tokens=200, arrival=1.0), 1.0)
    # The tenant's first observation (10) seeds its estimate, the second (14) is smoothed in.
    assert s.snapshot()["buckets"][1]["mean_output"] == round(10 + 0.1 * (14 - 10))


def test_failed_batch_returns_slots_and_learns_nothing(make: Factory) -> None:
    s = make(default_output_tokens=50)
    s.worker_capacity("gpu", 4, 0.0)
    s.arrive(req("a", prompt=100, out=32), 0.0)
    (d,) = s.tick(0.0)
    s.completed(BatchTimings(d.batch_id, "gpu", 0, 0, 0.0, 0, 0.0, ()), 1.0)  # type: ignore[union-attr]
    gpu = s.snapshot()["paths"]["gpu"]
    assert (gpu["in_flight"], gpu["kv_tokens"], gpu["step_s"]) == (0, 0, 0.0)
    assert gpu["step_model"] == prior(SchedulerConfig().gpu) and gpu["fitted_steps"] == 0
    s.arrive(req("b", out=0, max_tokens=200, arrival=1.0), 1.0)
    assert s.snapshot()["buckets"][1]["mean_output"] == 50


def test_batch_reports_do_not_refit_step_records_do(make: Factory) -> None:
    s = make()
    s.worker_capacity("gpu", 8, 0.0)
    for rid in "ab":
        s.arrive(req(rid, prompt=100, out=32), 0.0)
    (d,) = s.tick(0.0)
    s.completed(timings(d, outputs=(32, 32), prefill_s=5.0, decode_s=50.0), 1.0)  # type: ignore[arg-type]
    assert s.snapshot()["paths"]["gpu"]["step_model"] == prior(SchedulerConfig().gpu)
    # Steps of a gpu twice as slow as its prior; how the fit moves is test_costmodel's
    # business, here: the records reach the gpu's model and no other.
    g = SchedulerConfig().gpu
    records = [(p, n, kv, 2 * (g.decode_launch + g.decode_seq * n + g.kv_token * kv
                             + (g.prefill_launch + g.prefill_token * p if p else 0.0)))
               for p, n, kv in [(0, 4, 500), (512, 4, 500), (0, 32, 8000), (256, 16, 3000)] * 8]
    s.observe_steps("gpu", records, 2.0)
    cpu = s.snapshot()["paths"]["cpu"]
    assert cpu["step_model"] == prior(SchedulerConfig().cpu) and cpu["fitted_steps"] == 0
    with pytest.raises(ValueError):
        s.observe_steps("tpu", records, 2.0)
    # Whatever the fit says, the reported step time is that model's step of what runs.
    s.arrive(req("c", prompt=100, out=32, arrival=2.0), 2.0)
    s.tick(2.0)
    gpu = s.snapshot()["paths"]["gpu"]
    m = gpu["step_model"]
    assert gpu["step_s"] == pytest.approx(
        m["decode_launch"] + m["decode_seq"] * 1 + m["kv_token"] * (100 + 16))


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


def test_snapshot_is_json_and_reports_the_step_model_and_capacity(make: Factory) -> None:
    s = make()
    s.worker_capacity("cpu", 8, 0.0)
    s.worker_capacity("gpu", 64, 0.0, workers=2, step_tokens=256)
    s.arrive(req("a", tenant="x", prompt=100, out=32), 0.0)
    snap = json.loads(json.dumps(s.snapshot()))
    assert snap["queued"] == 1 and snap["buckets"][1]["queued"] == 1
    assert set(snap["buckets"][0]) >= {"b1", "b2", "arrival_rate", "max_prompt", "mean_output"}
    assert "b_star" not in snap["buckets"][0]
    assert snap["fairness"]["tenants"]["x"]["queued"] == 1
    assert set(snap["tail_cut"]) == {"t_cut_s", "mu_cpu", "lambda_cpu", "ttft_p99_slo_s"}
    gpu = snap["paths"]["gpu"]
    assert gpu == {"capacity": 64, "in_flight": 0, "kv_tokens": 0, "workers": 2,
                   "step_tokens": 256, "pending_prefill": 0.0, "slot_limit": 64, "max_batch": 64, "fitted_steps": 0,
                   "step_model": prior(SchedulerConfig().gpu), "step_s": 0.0, "drift": 1.0}
    assert snap["paths"]["cpu"]["step_tokens"] == SchedulerConfig().cpu.step_tokens
    s.tick(0.0)
    gpu = json.loads(json.dumps(s.snapshot()))["paths"]["gpu"]
    # One sequence of 100 + 32/2 KV tokens, spread over two workers.
    g = SchedulerConfig().gpu
    assert (gpu["in_flight"], gpu["kv_tokens"]) == (1, 116)
    assert gpu["step_s"] == pytest.approx(
        g.decode_launch + g.decode_seq * 0.5 + g.kv_token * 58)


def test_thresholds_follow_from_the_batch_lines_and_the_tpot_slo(make: Factory) -> None:
    s = make(cpu=QUICK_CPU, gpu=LAUNCH_GPU, tpot_slo_s=0.05)
    s.worker_capacity("cpu", 32, 0.0)
    s.worker_capacity("gpu", 64, 0.0)

    def expected(bucket: dict[str, float], gpu_running: float, gpu_kv: float) -> tuple[float, float]:
        snap = s.snapshot()
        cpu, gpu = reported(snap["paths"]["cpu"]), reported(snap["paths"]["gpu"])
        n, length = bucket["mean_output"], int(bucket["max_prompt"])
        f_cpu, m_cpu = batch_line(cpu, length, n)
        f_gpu, m_gpu = batch_line(gpu, length, n, gpu_running, gpu_kv)
        b2 = (0.05 - gpu.decode_launch) / (gpu.decode_seq + gpu.kv_token * (length + 0.5 * n))
        return (f_gpu - f_cpu) / (m_cpu - m_gpu), b2

    idle = s.snapshot()["buckets"][2]
    b1, b2 = expected(idle, 0.0, 0.0)
    assert 1.0 < b1 < 64.0 and (idle["b1"], idle["b2"]) == (pytest.approx(b1), pytest.approx(b2))
    assert b2 == pytest.approx((0.05 - 0.01) / 0.0002)  # no KV cost: 200 sequences
    for i in range(3):  # past B1 of bucket 1: they run on the gpu
        s.arrive(req(f"r{i}", prompt=100, out=10), 0.0)
    (d,) = s.tick(0.0)
    assert isinstance(d, Dispatch) and d.path == "gpu"
    busy = s.snapshot()["buckets"][2]
    b1_busy, b2_busy = expected(busy, 3.0, 3 * (100 + 5))
    # The running sequences slow every gpu step: the crossover moves up (compared at the
    # same mean output, which the arrivals moved); B2, one worker's decode limit, does not.
    assert busy["b1"] == pytest.approx(b1_busy) and b1_busy > expected(busy, 0.0, 0.0)[0]
    assert busy["b2"] == pytest.approx(b2_busy) == b2


def test_explain(make: Factory) -> None:
    s = make()
    assert s.explain("nobody") is None
    s.arrive(req("early", out=8), 0.0)
    s.arrive(req("later", out=60, arrival=1.0), 1.0)  # a second less slack than early
    e = s.explain("later")
    assert e is not None and json.loads(json.dumps(e)) == e
    assert (e["state"], e["bucket"], e["requests_ahead"], e["tokens_ahead"]) == (
        "queued", 1, 1, 100 + 8)
    assert e["reason"] == "no worker offers capacity on any path"
    assert e["estimate"]["ttft_s"] < e["estimate"]["total_s"] <= e["estimate"]["p99_s"]
    assert e["thresholds"] == {k: s.snapshot()["buckets"][1][k] for k in ("b1", "b2")}
    s.worker_capacity("gpu", 1, 1.0)
    assert s.explain("later")["reason"] == "it leaves for gpu at the next tick"  # type: ignore[index]
    (d,) = s.tick(1.0)
    assert s.explain("later")["reason"] == "gpu is busy: it leaves when slots come back"  # type: ignore[index]
    assert s.explain("early") == {"request_id": "early", "state": "dispatched", "bucket": 1,
                                  "batch_id": d.batch_id, "path": "gpu"}  # type: ignore[union-attr]


def test_explain_says_when_the_per_token_slo_holds_a_request(make: Factory) -> None:
    s = make(gpu=PathConfig(0.05, 0.01, 0.0, 0.05, 0.0, max_batch=64, step_tokens=512),
             tpot_slo_s=0.095)
    s.worker_capacity("gpu", 8, 0.0)
    for i in range(4):  # 0.09 s steps; a fifth sequence would make them 0.1 s
        s.arrive(req(f"run{i}"), 0.0)
    s.tick(0.0)
    s.arrive(req("late", arrival=0.1), 0.1)
    assert s.tick(0.1) == []
    e = s.explain("late")
    assert e is not None and e["path"] == "gpu"
    assert e["reason"] == (
        "held: starting it now would push gpu's running sequences past the 95 ms per-token "
        "SLO; it leaves when they finish or its own time-to-first-token slack runs out")


def test_a_measured_prior_reseeds_the_path_in_both_builds(make: Factory) -> None:
    s = make()
    measured = PathConfig(decode_launch=0.02, decode_seq=8e-5, kv_token=6e-8, prefill_launch=0.03,
                          prefill_token=2e-6, max_batch=8, step_tokens=64, prefill_attention=1e-9)
    s.set_prior("cpu", measured)
    cpu = s.snapshot()["paths"]["cpu"]
    assert tuple(cpu["step_model"].values()) == pytest.approx((0.02, 8e-5, 6e-8, 0.03, 2e-6, 1e-9))
    assert s.prefill_alone_s("cpu", 1000) == pytest.approx(0.03 + 2e-6 * 1000 + 1e-9 * 1000**2)
    # an idle worker's first token is promised the measured curve, attention's growth in
    for prompt in (250, 2000, 4000):
        s = make()
        s.set_prior("cpu", measured)
        s.worker_capacity("cpu", 8, 0.0)
        c = s.arrive(req(f"r{prompt}", prompt=prompt, max_tokens=1, out=1), 0.0)
        assert isinstance(c, Contract)
        assert c.ttft_s == pytest.approx(0.03 + 2e-6 * prompt + 1e-9 * prompt**2)
