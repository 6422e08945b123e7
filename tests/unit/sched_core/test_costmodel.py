"""The online least-squares fit behind each path's cost curves."""

from __future__ import annotations

import pytest

from sched_core.costmodel import LinearFit2


def test_prior_alone_is_recovered() -> None:
    fit = LinearFit2((0.5, 2.0), ((1.0, 0.0), (1.0, 10.0)), weight=1.0, forgetting=0.9)
    assert fit.theta == pytest.approx((0.5, 2.0))
    assert fit.observations == 0


def test_data_outweighs_the_prior() -> None:
    fit = LinearFit2((0.5, 2.0), ((1.0, 0.0), (1.0, 10.0)), weight=0.1, forgetting=1.0)
    for x in range(1, 40):
        fit.add(1.0, float(x), 3.0 + 0.25 * x)
    assert fit.theta == pytest.approx((3.0, 0.25), rel=2e-2)
    assert fit.observations == 39


def test_forgetting_follows_a_drifting_worker() -> None:
    fit = LinearFit2((0.1, 1.0), ((1.0, 0.0), (1.0, 10.0)), weight=0.1, forgetting=0.8)
    for x in range(50):
        fit.add(1.0, float(x % 10), 0.1 + 1.0 * (x % 10))
    for x in range(50):
        fit.add(1.0, float(x % 10), 0.1 + 2.0 * (x % 10))
    assert fit.theta[1] == pytest.approx(2.0, rel=0.05)


def test_coefficients_stay_non_negative() -> None:
    fit = LinearFit2((0.1, 1.0), ((1.0, 0.0), (1.0, 10.0)), weight=0.01, forgetting=1.0)
    for x in range(1, 30):
        fit.add(1.0, float(x), 10.0 - 0.3 * x)  # a falling line: the slope clamps at 0
    a, b = fit.theta
    assert b == 0.0 and a > 0.0
