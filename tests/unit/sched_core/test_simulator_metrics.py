"""Metrics and targets of simulator runs, on hand-made outcomes."""

from __future__ import annotations

import math

import pytest

from sched_core.simulate.engine import Outcome, Result
from sched_core.simulate.experiment import sustained, targets
from sched_core.simulate.metrics import Slo, fairness, jain, percentile, summarize
from sched_core.simulate.workload import Arrival


def outcome(i: int, t: float, ttft: float, e2e: float, tokens: int, tenant: str = "a") -> Outcome:
    a = Arrival(f"r{i}", t, tenant, 100, tokens, tokens)
    return Outcome(a, path="gpu", dispatched=t, first_token=t + ttft, finished=t + e2e,
                   tokens=tokens)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_jain_index() -> None:
    assert jain([1.0, 1.0, 1.0]) == 1.0
    assert jain([1.0, 0.0]) == 0.5
    assert jain([3.0, 1.0]) == pytest.approx(16 / 20)


def test_slo_needs_both_ttft_and_time_per_token() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    assert slo.met(outcome(0, 0.0, 0.5, 1.4, 10))  # 0.9 s over 9 tokens
    assert not slo.met(outcome(1, 0.0, 0.5, 1.5, 10))  # 1.0 s over 9 tokens
    assert not slo.met(outcome(2, 0.0, 1.1, 1.1, 1))
    rejected = outcome(3, 0.0, 0.1, 0.1, 1)
    rejected.rejected = "queue_full"
    assert not slo.met(rejected)


def test_summary_of_a_run() -> None:
    outs = [outcome(i, float(i), 0.1 * (i + 1), 0.2 * (i + 1), 2) for i in range(4)]
    row = summarize(Result(outs, {"a": []}, {"a": []}, {"a": 1.0}), Slo(0.25, 1.0))
    assert row["completed"] == 4 and row["slo_attainment"] == 0.5
    # three of the four finish while requests still arrive (0 s to 3 s)
    assert row["throughput_rps"] == pytest.approx(1.0)
    assert row["goodput_rps"] == pytest.approx(2 / 3)
    assert row["p50_ms"] == pytest.approx(500.0)
    # first tokens at 0.1-0.4 s: numpy's interpolated 99th and 99.9th percentiles
    assert row["ttft_p99_ms"] == pytest.approx(397.0) and row["ttft_p999_ms"] == pytest.approx(399.7)
    assert row["jain"] is None  # one tenant


def test_fairness_counts_only_tenants_backlogged_through_a_window() -> None:
    outs = [outcome(0, 0.0, 1, 1, 1), outcome(1, 10.0, 1, 1, 1)]
    budgets = {"a": 1.0, "b": 2.0, "c": 1.0}
    # a and b wait throughout; c only during the first half
    backlog = {"a": [(0.0, 1), (20.0, -1)], "b": [(0.0, 1), (20.0, -1)],
               "c": [(0.0, 1), (4.0, -1)]}
    # per window of 5 s: a gets 10 tokens, b 20 (same per budget), c 100
    service = {t: [(w * 5.0 + 1.0, n, 0) for w in range(2)]
               for t, n in (("a", 10), ("b", 20), ("c", 100))}
    index, windows = fairness(Result(outs, backlog, service, budgets), windows=2)
    assert windows == 2 and index == pytest.approx(1.0)


def row(policy: str, rate: float, att: float, p99: float = 100.0, thr: float = 1.0,
        **more: object) -> dict[str, object]:
    return {"policy": policy, "rate_rps": rate, "slo_attainment": att, "p99_ms": p99,
            "throughput_rps": thr, "drain_tokens_per_s": thr * 1000, "mape": None,
            "within_p99_bound": None, "within_ttft_bound": None, "raw_mape": None, "raw_mape_ttft": None,
            "refused_slo": 0, "jain": None, "jain_windows": 0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0,
            "mape_ttft": None, **more}


def test_sustained_load_interpolates_at_ninety_percent() -> None:
    rows = [row("x", 1.0, 1.0), row("x", 2.0, 0.95), row("x", 3.0, 0.85), row("x", 4.0, 0.95)]
    assert sustained(rows) == pytest.approx(2.5)
    assert sustained([row("x", 1.0, 0.5)]) is None
    assert sustained([row("x", 1.0, 0.95), row("x", 2.0, 0.91)]) == 2.0


def test_targets_compare_at_the_baseline_load() -> None:
    rows = [row("fcfs", 1.0, 0.95), row("fcfs", 2.0, 0.5),
            row("window", 1.0, 0.99, p99=400.0), row("window", 2.0, 0.92, p99=800.0),
            row("fixed", 1.0, 0.9, p99=900.0), row("fixed", 2.0, 0.3),
            row("tokengate", 1.0, 1.0, p99=100.0, mape=0.05, within_p99_bound=1.0, mape_ttft=0.04,
                within_ttft_bound=0.995),
            row("tokengate", 2.0, 0.97, p99=300.0, mape=0.3, within_p99_bound=0.9, mape_ttft=0.2,
                within_ttft_bound=0.9)]
    t = targets(rows)
    first = t["p99_at_baseline_load"]
    assert (first["baseline"], first["rate_rps"]) == ("window", 2.0)
    # a sweep's setting that meets 90% at a higher load, or with a lower p99, is the one
    rows[3]["sweep"] = [{"setting": "a", "slo_attainment": 0.92, "p99_ms": 800.0,
                         "throughput_rps": 1.0},
                        {"setting": "b", "slo_attainment": 0.91, "p99_ms": 500.0,
                         "throughput_rps": 1.0}]
    again = targets(rows)["p99_at_baseline_load"]
    assert (again["setting"], again["baseline_p99_ms"]) == ("b", 500.0)
    assert first["p99_ratio"] == pytest.approx(300 / 800) and first["met"]
    # contracts count the loads up to FCFS's 90% load (about 1.1 here): 2.0's misses do not
    contracts = t["contracts"]
    assert contracts["met"] and contracts["max_mape"] == 0.05 and contracts["min_within_bounds"] == 0.995
    vs_fcfs = t["load_vs_fcfs"]  # 2.0 (the top of the sweep) against 1 + 0.05/0.45
    assert vs_fcfs["ratio"] == pytest.approx(2.0 / (1 + 0.05 / 0.45)) and not vs_fcfs["met"]


def test_the_best_fixed_knob_setting_sustains_the_highest_load() -> None:
    from sched_core.simulate.experiment import Setup, best_fixed_knob

    setup = Setup((), fixed_sizes=(4, 8), windows_s=(0.01,))

    def settings(att: dict[str, float]) -> list[dict[str, object]]:
        return [{"setting": k, "slo_attainment": v, "p99_ms": 1.0} for k, v in att.items()]

    rows = [row("fixed", 1.0, 1.0, sweep=settings({"4, gpu": 1.0, "8, gpu": 1.0})),
            row("fixed", 2.0, 0.8, sweep=settings({"4, gpu": 0.5, "8, gpu": 0.8})),
            row("window", 1.0, 0.95, sweep=settings({"10 ms, gpu": 0.95, "10 ms, gpu+cpu": 0.9})),
            row("window", 2.0, 0.5, sweep=settings({"10 ms, gpu": 0.5, "10 ms, gpu+cpu": 0.4}))]
    name, knob, load = best_fixed_knob(rows, setup)  # type: ignore[misc]
    assert (name, knob.value, knob.paths) == ("fixed", 8.0, ("gpu",))
    assert load == pytest.approx(1.0 + 0.1 / 0.2)
