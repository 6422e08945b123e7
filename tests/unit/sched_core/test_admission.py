"""arrive(): buckets, contracts and immediate rejections, on both implementations."""

from __future__ import annotations

import math

import pytest

from sched_core import Contract, Reject, Request, SchedulerConfig
from sched_core.types import LN100

from .conftest import Factory
from .support import req


def test_contract_fields_and_bucket(make: Factory) -> None:
    s = make()
    s.worker_capacity("cpu", 8, 0.0)
    c = s.arrive(req("a", prompt=100, budget_wait=0.25, arrival=1.0), 1.0)
    assert isinstance(c, Contract)
    assert (c.request_id, c.bucket, c.path, c.tokens_ahead, c.budget_wait_s) == (
        "a", 1, "cpu", 0, 0.25)
    assert 0.25 < c.ttft_s < c.total_s <= c.p99_s
    assert s.queued == len(s) == 1


def test_contract_of_a_lone_request_follows_the_step_model(make: Factory) -> None:
    s = make(tpot_slo_s=0.1)
    s.worker_capacity("gpu", 64, 0.0)
    c = s.arrive(req("a", prompt=100, out=32, budget_wait=0.25, arrival=1.0), 1.0)
    assert isinstance(c, Contract) and c.path == "gpu"
    g = SchedulerConfig().gpu
    # Nothing ahead, nothing running: no wait; its 100-token prompt prefills in one chunk,
    # then 32 decode steps of one sequence holding its bucket's 128 KV tokens.
    prefill = g.prefill_launch + g.prefill_token * 100
    step = g.decode_launch + g.decode_seq * 1 + g.kv_token * 128
    assert c.ttft_s == pytest.approx(0.25 + prefill)
    assert c.total_s == pytest.approx(0.25 + prefill + 32 * step)
    assert (c.tpot_s, c.output_tokens) == (pytest.approx(step), 32)
    assert c.ttft_p99_s == pytest.approx(0.25 + LN100 * prefill)
    # p99 (no cpu, so no tail cut): the exponential tail ln(100)·(wait + prefill), and the
    # decode bounded by a full worker, 64 sequences of 128 + 32 tokens.
    full = g.decode_launch + g.decode_seq * 64 + g.kv_token * 64 * (128 + 32)
    assert c.p99_s == pytest.approx(0.25 + LN100 * prefill + 32 * full)


def test_bucket_bounds_are_inclusive_and_longer_prompts_rejected(make: Factory) -> None:
    s = make(bucket_bounds=(10, 20))
    assert isinstance(c := s.arrive(req("a", prompt=10), 0.0), Contract) and c.bucket == 0
    assert isinstance(c := s.arrive(req("b", prompt=11), 0.0), Contract) and c.bucket == 1
    r = s.arrive(req("c", prompt=21), 0.0)
    assert isinstance(r, Reject) and r.reason == "too_long"


def test_tokens_ahead_counts_its_bucket_and_the_shorter_ones(make: Factory) -> None:
    s = make()
    s.arrive(req("a", prompt=100, out=20), 0.0)
    s.arrive(req("b", prompt=110, out=30), 0.0)
    s.arrive(req("longer-bucket", prompt=1000, out=30), 0.0)
    s.arrive(req("shorter-bucket", prompt=40, out=10), 0.0)
    c = s.arrive(req("c", prompt=120, out=8), 0.0)
    assert isinstance(c, Contract) and c.tokens_ahead == 100 + 20 + 110 + 30 + 40 + 10


def test_duplicate_id_is_rejected_while_known(make: Factory) -> None:
    s = make()
    s.worker_capacity("cpu", 8, 0.0)
    assert isinstance(s.arrive(req("a"), 0.0), Contract)
    r = s.arrive(req("a"), 0.0)
    assert isinstance(r, Reject) and r.reason == "duplicate"
    (d,) = s.tick(0.0)
    assert isinstance(s.arrive(req("a"), 0.1), Reject)  # still running
    assert s.cancel("a", 0.1) is False
    from .support import timings
    s.completed(timings(d), 0.2)  # type: ignore[arg-type]
    assert isinstance(s.arrive(req("a", arrival=0.3), 0.3), Contract)


def test_queue_limit(make: Factory) -> None:
    s = make(max_queued=2)
    s.arrive(req("a"), 0.0)
    s.arrive(req("b"), 0.0)
    r = s.arrive(req("c"), 0.0)
    assert isinstance(r, Reject) and r.reason == "queue_full"
    assert r.estimate_s > 0.0 and r.retry_after_s >= 0.0
    assert s.queued == 2


def test_deadline_that_cannot_be_met_is_rejected_with_the_estimate(make: Factory) -> None:
    s = make()
    s.worker_capacity("cpu", 8, 0.0)
    ok = s.arrive(req("a", arrival=5.0), 5.0)
    assert isinstance(ok, Contract)
    r = s.arrive(req("b", arrival=5.0, deadline=5.0 + ok.total_s / 2), 5.0)
    assert isinstance(r, Reject) and r.reason == "deadline"
    assert r.estimate_s > ok.total_s / 2
    met = s.arrive(req("c", arrival=5.0, deadline=5.0 + 10 * ok.total_s), 5.0)
    assert isinstance(met, Contract)


def test_expected_output_is_estimated_from_observations(make: Factory) -> None:
    from .support import timings

    s = make(default_output_tokens=50)
    s.worker_capacity("cpu", 8, 0.0)
    s.arrive(req("a", out=0, max_tokens=200), 0.0)
    assert s.snapshot()["buckets"][1]["mean_output"] == 50.0
    s.arrive(req("b", out=0, max_tokens=20), 0.0)  # capped by its own max_tokens
    assert s.snapshot()["buckets"][1]["mean_output"] == (50 + 20) / 2
    (d,) = s.tick(0.0)
    s.completed(timings(d, outputs=(10, 14)), 1.0)  # type: ignore[arg-type]
    s.arrive(req("c", out=0, max_tokens=200), 1.0)
    # The tenant's first observation seeds its estimate, the second is smoothed in.
    first = 10 + 0.1 * (14 - 10)
    assert s.snapshot()["buckets"][1]["mean_output"] == round(first)


def test_request_and_config_are_validated() -> None:
    from sched_core import PathConfig

    with pytest.raises(ValueError):
        Request("a", "t", 0.0, 10, 10, 0.0)
    with pytest.raises(ValueError):
        Request("", "t", 1.0, 10, 10, 0.0)
    with pytest.raises(ValueError):
        Request("a", "t", 1.0, 0, 10, 0.0)
    with pytest.raises(ValueError):
        SchedulerConfig(bucket_bounds=(64, 64))
    with pytest.raises(ValueError):
        SchedulerConfig(ttft_p99_slo_s=0.0)
    with pytest.raises(ValueError):
        SchedulerConfig(tpot_slo_s=0.0)
    with pytest.raises(ValueError):
        SchedulerConfig(tpot_slo_s=math.inf)
    for steps in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="prefill_queue_steps"):
            SchedulerConfig(prefill_queue_steps=steps)
    assert SchedulerConfig(prefill_queue_steps=math.inf).prefill_queue_steps == math.inf  # no limit
    gpu = PathConfig(0.01, 1e-4, 1e-8, 0.02, 1e-6, max_batch=8, step_tokens=64)
    cfg = SchedulerConfig(gpu=gpu)
    assert (cfg.path(0), cfg.path(1)) == (SchedulerConfig().cpu, gpu)


def test_arrive_takes_requests_only(make: Factory) -> None:
    s = make()
    with pytest.raises((TypeError, AttributeError)):
        s.arrive({"id": "a"}, 0.0)  # type: ignore[arg-type]
