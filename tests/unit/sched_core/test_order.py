"""Order within a bucket (cost, aging, priority, ties) and fair share across tenants."""

from __future__ import annotations

import pytest

from sched_core import Dispatch

from .conftest import Factory
from .support import req, timings


def one_at_a_time(s: object, now: float) -> list[str]:
    """Drain a gpu path of one slot, one request per tick, completing each at once."""
    order: list[str] = []
    while s.queued:  # type: ignore[attr-defined]
        (d,) = s.tick(now)  # type: ignore[attr-defined]
        assert isinstance(d, Dispatch)
        order += d.request_ids
        s.completed(timings(d), now)  # type: ignore[attr-defined]
    return order


def test_cheaper_first_then_arrival_then_id(make: Factory) -> None:
    s = make()
    s.worker_capacity("gpu", 1, 0.0)
    s.arrive(req("long", out=60), 0.0)
    s.arrive(req("b-short", out=10), 0.0)
    s.arrive(req("a-short", out=10), 0.0)  # same cost and arrival: id breaks the tie
    s.arrive(req("later-short", out=10, arrival=0.001), 0.001)
    assert one_at_a_time(s, 1.0) == ["a-short", "b-short", "later-short", "long"]


def test_aging_lets_an_old_costly_request_pass_new_cheap_ones(make: Factory) -> None:
    s = make(aging_tokens_per_s=1000.0)
    s.worker_capacity("gpu", 1, 0.0)
    # Cost 180 at t=0 against cost 110 arriving at t: the old one wins once
    # 110 + 1000·t > 180, i.e. for t > 0.07 s.
    s.arrive(req("old", prompt=120, out=60), 0.0)
    for i in range(1, 11):
        t = i * 0.02
        s.arrive(req(f"new{i}", prompt=100, out=10, arrival=t), t)
    order = one_at_a_time(s, 1.0)
    assert order.index("old") == 3  # after new1..new3 (t <= 0.06), before new4 (t = 0.08)


def test_priority_class_counts_as_extra_cost(make: Factory) -> None:
    s = make(priority_tokens=4096.0)
    s.worker_capacity("gpu", 1, 0.0)
    s.arrive(req("batch-job", out=1, priority=1), 0.0)
    s.arrive(req("interactive", out=60, arrival=1.0), 1.0)
    assert one_at_a_time(s, 2.0) == ["interactive", "batch-job"]


def test_backlogged_tenants_share_by_budget(make: Factory) -> None:
    slack = 1000.0
    s = make(fair_slack_tokens=slack)
    s.worker_capacity("gpu", 4, 0.0)
    weights = {"small": 1000.0, "big": 3000.0}
    for i in range(300):
        for tenant, w in weights.items():
            s.arrive(req(f"{tenant}{i}", tenant=tenant, weight=w, prompt=100, out=30), 0.0)
    served = dict.fromkeys(weights, 0)
    for _ in range(60):
        for d in s.tick(1.0):
            assert isinstance(d, Dispatch)
            for rid in d.request_ids:
                served[rid.rstrip("0123456789")] += 100 + 2 * 30
            s.completed(timings(d, outputs=(30,) * len(d.request_ids)), 1.0)
    assert served["big"] > 2 * served["small"]
    # |served_f/w_f − served_g/w_g| stays within the slack plus one request of each.
    norm = {t: served[t] / w for t, w in weights.items()}
    bound = slack / 1000.0 + 160 / 1000.0 + 160 / 3000.0
    assert abs(norm["big"] - norm["small"]) <= bound
    counters = {t: v["counter"] for t, v in s.snapshot()["fairness"]["tenants"].items()}
    assert counters == pytest.approx(norm)


def test_returning_tenant_is_lifted_to_the_backlogged_minimum(make: Factory) -> None:
    s = make()
    s.worker_capacity("cpu", 8, 0.0)
    s.arrive(req("a1", tenant="a", weight=100.0), 0.0)
    s.arrive(req("b1", tenant="b", weight=100.0, prompt=3000), 0.0)
    for d in s.tick(0.0):
        assert isinstance(d, Dispatch)
        s.completed(timings(d, outputs=(32,) * len(d.request_ids)), 0.5)
    s.arrive(req("b2", tenant="b", weight=100.0, prompt=3000), 1.0)
    s.arrive(req("c1", tenant="c", weight=100.0), 1.0)  # new: starts at b's counter
    s.arrive(req("a2", tenant="a", weight=100.0), 1.0)  # returns: lifted to b's counter
    tenants = s.snapshot()["fairness"]["tenants"]
    assert tenants["a"]["counter"] == tenants["b"]["counter"] == tenants["c"]["counter"]
    assert tenants["b"]["counter"] == (3000 + 2 * 32) / 100.0


def test_idle_system_keeps_the_last_counter_as_the_floor(make: Factory) -> None:
    s = make()
    s.worker_capacity("cpu", 8, 0.0)
    s.arrive(req("a1", tenant="a", weight=10.0), 0.0)
    (d,) = s.tick(0.0)
    assert isinstance(d, Dispatch)
    s.completed(timings(d, outputs=(32,)), 0.5)
    s.arrive(req("n1", tenant="newcomer", weight=10.0), 1.0)
    tenants = s.snapshot()["fairness"]["tenants"]
    assert tenants["newcomer"]["counter"] == tenants["a"]["counter"] == (100 + 64) / 10.0
