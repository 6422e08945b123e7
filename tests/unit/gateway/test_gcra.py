"""The budget's specification (gateway.tenancy.gcra): decisions, the bound, the header arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.tenancy import gcra
from gateway.tenancy.gcra import BucketModel

T0 = 1_000.0


def admit(
    b: BucketModel,
    now: float,
    cost: int,
    *,
    rate: float = 10.0,
    burst: int = 100,
    max_wait: float = 0.0,
    max_concurrent: int = 0,
    rid: str = "r",
) -> gcra.Verdict:
    return b.admit(now, rate, burst, cost, max_wait, max_concurrent, rid, lease_s=60.0)


def test_a_full_bucket_admits_the_burst_at_once_then_refuses() -> None:
    b = BucketModel()
    v = admit(b, T0, 100, rid="a")
    assert v.status == "ok" and v.wait == 0.0 and v.tat == T0 + 10.0
    assert gcra.remaining_tokens(v.tat, v.now, 10.0, 100) == 0
    refused = admit(b, T0, 5, rid="b")
    assert refused.status == "budget" and refused.wait == pytest.approx(0.5)
    assert b.tat == T0 + 10.0 and "b" not in b.leases  # a refusal changes nothing


def test_tokens_come_back_at_the_rate() -> None:
    b = BucketModel()
    admit(b, T0, 100, rid="a")
    assert admit(b, T0 + 0.5, 5, rid="b").status == "ok"
    assert admit(b, T0 + 0.5, 1, rid="c").status == "budget"


def test_a_request_may_wait_for_its_budget_up_to_max_wait() -> None:
    b = BucketModel()
    admit(b, T0, 100, rid="a")
    v = admit(b, T0, 20, max_wait=2.0, rid="b")
    assert v.status == "ok" and v.wait == pytest.approx(2.0)
    # the waiting reservation counts: the next one waits behind it
    assert admit(b, T0, 1, max_wait=2.0, rid="c").status == "budget"


def test_more_than_the_burst_is_never_admitted() -> None:
    v = admit(BucketModel(), T0, 101, max_wait=1e9)
    assert v.status == "too_large"


def test_settling_refunds_unused_tokens_once() -> None:
    b = BucketModel()
    admit(b, T0, 100, rid="a")
    assert b.settle(T0, 10.0, "a", -60)
    assert b.tat == pytest.approx(T0 + 4.0)
    assert not b.settle(T0, 10.0, "a", -60)  # idempotent
    assert b.tat == pytest.approx(T0 + 4.0)


def test_a_refund_never_fills_past_the_burst() -> None:
    b = BucketModel()
    admit(b, T0, 50, rid="a")
    b.settle(T0 + 100.0, 10.0, "a", -50)
    assert b.tat is None
    assert admit(b, T0 + 100.0, 100, rid="b").status == "ok"
    assert admit(b, T0 + 100.0, 1, rid="c").status == "budget"


def test_overuse_is_charged() -> None:
    b = BucketModel()
    admit(b, T0, 10, rid="a")
    b.settle(T0, 10.0, "a", 20)
    assert b.tat == pytest.approx(T0 + 3.0)


def test_concurrency_leases_end_by_settling_or_expiring() -> None:
    b = BucketModel()
    assert admit(b, T0, 1, max_concurrent=1, rid="a").in_flight == 1
    assert admit(b, T0, 1, max_concurrent=1, rid="b").status == "concurrency"
    b.settle(T0, 10.0, "a", 0)
    assert admit(b, T0, 1, max_concurrent=1, rid="c").status == "ok"
    assert admit(b, T0 + 59.0, 1, max_concurrent=1, rid="d").status == "concurrency"
    assert admit(b, T0 + 60.0, 1, max_concurrent=1, rid="e").status == "ok"  # c's lease ran out


@given(
    rate=st.sampled_from([1.0, 7.5, 100.0]),
    burst=st.integers(1, 500),
    max_wait=st.sampled_from([0.0, 0.3, 5.0]),
    arrivals=st.lists(st.tuples(st.floats(0.0, 3.0), st.integers(1, 500)), max_size=60),
)
def test_tokens_started_by_any_time_stay_within_rate_times_elapsed_plus_burst(
    rate: float, burst: int, max_wait: float, arrivals: list[tuple[float, int]]
) -> None:
    b = BucketModel()
    now = T0
    starts: list[tuple[float, int]] = []
    for i, (dt, cost) in enumerate(arrivals):
        now += dt
        v = admit(b, now, cost, rate=rate, burst=burst, max_wait=max_wait, rid=str(i))
        if v.status == "ok":
            starts.append((now + v.wait, cost))
    for t, _ in starts:
        started = sum(c for s, c in starts if s <= t)
        assert started <= rate * (t - T0) + burst + 1e-6 * burst


def test_headers_arithmetic() -> None:
    assert gcra.remaining_tokens(T0 + 2.0, T0, 10.0, 100) == 80
    assert gcra.remaining_tokens(T0 - 5.0, T0, 10.0, 100) == 100
    assert gcra.reset_s(T0 + 2.5, T0) == 2.5
    assert gcra.retry_after_s(0.2, 0.0) == 1 and gcra.retry_after_s(3.01, 1.0) == 3


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (0.25, "250ms"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (60.0, "1m0s"),
        (3723.5, "1h2m3.5s"),
    ],
)
def test_durations_read_like_openai(seconds: float, text: str) -> None:
    assert gcra.duration(seconds) == text
