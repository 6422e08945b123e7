"""sched_core.overtake: the prefill load of the shorter buckets that will overtake a request."""

from __future__ import annotations

import math

import pytest

from sched_core.overtake import OVERTAKE_MAX, Overtaking


def test_only_the_shorter_buckets_overtake() -> None:
    o = Overtaking(tau_s=1.0)
    o.admitted("cpu", 1, 0.3, 0.0)
    assert o.load("cpu", 0, 1, 0.0) == 0.0  # nothing is shorter than the shortest bucket
    assert o.load("cpu", 1, 1, 0.0) == 0.0  # its own bucket is served in order, not before it
    assert o.load("cpu", 2, 1, 0.0) == pytest.approx(0.3)
    assert o.load("gpu", 2, 1, 0.0) == 0.0  # another path's arrivals are not its queue


def test_the_load_is_the_arrivals_work_per_second_per_worker_and_it_decays() -> None:
    o = Overtaking(tau_s=2.0)
    for _ in range(4):
        o.admitted("cpu", 0, 0.25, 0.0)
    assert o.load("cpu", 3, 1, 0.0) == pytest.approx(1.0 / 2.0)  # 1 s of prefill over the 2 s time constant
    assert o.load("cpu", 3, 2, 0.0) == pytest.approx(1.0 / 4.0)  # two workers share it
    assert o.load("cpu", 3, 1, 2.0) == pytest.approx(0.5 * math.exp(-1.0))


def test_a_steady_stream_reads_as_its_utilisation() -> None:
    """λ arrivals a second of s seconds of prefill each: σ → λ·s (Little's law over the decay)."""
    o = Overtaking(tau_s=1.0)
    lam, s = 20.0, 0.02
    for i in range(400):
        o.admitted("cpu", 0, s, i / lam)
    assert o.load("cpu", 1, 1, 399 / lam) == pytest.approx(lam * s, rel=0.06)


def test_the_factor_is_cobhams_and_capped() -> None:
    o = Overtaking(tau_s=1.0)
    assert o.factor("cpu", 1, 1, 0.0) == 1.0
    o.admitted("cpu", 0, 0.5, 0.0)
    assert o.factor("cpu", 1, 1, 0.0) == pytest.approx(2.0)  # 1 / (1 − 0.5)
    o.admitted("cpu", 0, 10.0, 0.0)
    assert o.load("cpu", 1, 1, 0.0) == OVERTAKE_MAX
    assert o.factor("cpu", 1, 1, 0.0) == pytest.approx(1.0 / (1.0 - OVERTAKE_MAX))


def test_the_time_constant_is_validated() -> None:
    with pytest.raises(ValueError):
        Overtaking(tau_s=0.0)
