"""The event loop's lag: one slow callback or a pause is not saturation; late on every sample is."""

from __future__ import annotations

import pytest

from gateway.http.saturation import LoopLag


def test_one_slow_callback_among_samples_on_time_is_not_saturation() -> None:
    lag = LoopLag(interval_s=0.01, window_s=0.25)
    now = 0.0
    for i in range(30):
        now += 0.01
        lag.record(0.2 if i == 20 else 0.001, now)
    assert lag.behind_s(now) == pytest.approx(0.001)


def test_a_loop_late_on_every_sample_is_behind_by_its_least_lag() -> None:
    lag = LoopLag(interval_s=0.01, window_s=0.25)
    now = 0.0
    for _ in range(10):  # on time
        now += 0.01
        lag.record(0.0, now)
    for late in (0.08, 0.05, 0.09, 0.06, 0.07):  # saturated: every turn is late
        now += 0.01 + late
        lag.record(late, now)
    assert lag.behind_s(now) == pytest.approx(0.05)
    for _ in range(30):  # and back on time: within the window it is forgotten
        now += 0.01
        lag.record(0.0, now)
    assert lag.behind_s(now) == 0.0


def test_the_latest_sample_stands_when_the_loop_is_slower_than_the_window() -> None:
    lag = LoopLag(interval_s=0.01, window_s=0.25)
    lag.record(0.5, 1.0)
    lag.record(0.4, 1.41)
    assert lag.behind_s(1.41) == pytest.approx(0.4)
    assert lag.behind_s(5.0) == pytest.approx(0.4)  # nothing newer: the last word stands
    assert LoopLag().behind_s(0.0) == 0.0


def test_a_process_paused_and_woken_is_not_saturated_by_its_pause() -> None:
    """SIGSTOP for 3 s (what ``bench.role_changes`` does to the scheduler): the one sample
    after the pause is 3 s late, alone in the window; the requests that waited through the
    pause are not to be refused for it. A loop that stays behind after it is saturated."""
    lag = LoopLag(interval_s=0.01, window_s=0.25)
    now = 0.0
    for _ in range(30):
        now += 0.01
        lag.record(0.001, now)
    now += 3.0
    lag.record(2.99, now)
    assert lag.behind_s(now) == pytest.approx(0.001)
    for _ in range(30):  # woken to a backlog: every turn late
        now += 0.01 + 0.05
        lag.record(0.05, now)
    assert lag.behind_s(now) == pytest.approx(0.05)
