"""The watch after a table swap (``sched_core.rollback``): a real drop in SLO attainment or in
contract accuracy rolls the swap back, noise of the same size as the samples' does not."""

from __future__ import annotations

import random

import pytest

from sched_core.rollback import SwapWatch, drop_z


def feed(watch: SwapWatch, n: int, met: float, inside: float, rng: random.Random):  # noqa: ANN201
    judged = None
    for _ in range(n):
        j = watch.observe(rng.random() < met, rng.random() < inside)
        judged = j or judged
    return judged


def test_the_drop_is_counted_in_standard_errors_of_the_difference() -> None:
    assert drop_z(90, 100, 90, 100) == 0.0
    # 0.9 -> 0.8 over 100 each: pooled 0.85, se sqrt(0.85 * 0.15 * 0.02) = 0.0505
    assert drop_z(90, 100, 80, 100) == pytest.approx(-0.1 / 0.0505, rel=1e-3)
    assert drop_z(100, 100, 100, 100) == 0.0  # neither varies: no evidence either way


def test_a_swap_that_loses_attainment_is_rolled_back_and_one_that_holds_is_kept() -> None:
    rng = random.Random(5)
    watch = SwapWatch(baseline=400, after=200)
    assert feed(watch, 400, 0.9, 0.99, rng) is None and not watch.watching  # no swap: nothing judged
    watch.swapped()
    assert watch.state()["watching"] and watch.state()["baseline"]["requests"] == 400
    judged = feed(watch, 200, 0.75, 0.99, rng)
    assert judged is not None and judged.rollback and "SLO attainment" in judged.why
    assert judged.after.n == 200 and not watch.watching
    watch.swapped()
    judged = feed(watch, 200, 0.9, 0.99, rng)
    assert judged is not None and not judged.rollback and judged.why.startswith("kept")


def test_contracts_that_stop_holding_roll_a_swap_back_though_attainment_holds() -> None:
    rng = random.Random(6)
    watch = SwapWatch()
    feed(watch, 400, 0.9, 0.99, rng)
    watch.swapped()
    judged = feed(watch, 200, 0.9, 0.9, rng)
    assert judged is not None and judged.rollback and "inside the p99 bounds" in judged.why


def test_a_table_that_serves_as_well_is_rarely_rolled_back() -> None:
    rng = random.Random(7)
    rolled = 0
    for _ in range(200):
        watch = SwapWatch()
        feed(watch, 400, 0.9, 0.98, rng)
        watch.swapped()
        judged = feed(watch, 200, 0.9, 0.98, rng)
        assert judged is not None
        rolled += judged.rollback
    assert rolled <= 8  # ~2 % expected (two one-sided 1 % tests); 8 of 200 is far out in the binomial tail


def test_without_a_baseline_a_swap_is_kept_and_says_why() -> None:
    watch = SwapWatch(after=50)
    watch.swapped()  # just started: nothing before
    judged = feed(watch, 50, 0.1, 0.1, random.Random(1))
    assert judged is not None and not judged.rollback and "only 0 outcomes before" in judged.why
    watch.swapped()
    watch.cancel()
    assert feed(watch, 60, 0.9, 0.9, random.Random(2)) is None
