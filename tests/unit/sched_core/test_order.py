"""Order within a bucket (shortest prompt with aging, priority, ties) and fair share across tenants."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sched_core import Dispatch, SchedulerConfig

from .conftest import Factory
from .support import req, timings

GPU = SchedulerConfig().gpu


def one_at_a_time(s: object, now: float) -> list[str]:
    """Drain a gpu path of one slot, one request per tick, completing each at once."""
    order: list[str] = []
    while s.queued:  # type: ignore[attr-defined]
        (d,) = s.tick(now)  # type: ignore[attr-defined]
        assert isinstance(d, Dispatch)
        order += d.request_ids
        s.completed(timings(d), now)  # type: ignore[attr-defined]
    return order


def one_slot(make: Factory, **fields: object) -> object:
    """A gpu-only scheduler of one slot whose batches hold one request."""
    s = make(gpu=replace(GPU, max_batch=1), **fields)
    s.worker_capacity("gpu", 1, 0.0)
    return s


@pytest.mark.parametrize(("short_at", "passes"), [(1.0, True), (1.89, True), (1.91, False)])
def test_shorter_prompts_first_until_aging_lets_a_long_one_pass(make: Factory, short_at: float,
                                                                 passes: bool) -> None:
    # key = prompt + aging·arrival: a 100-token prompt arriving t s after a 2000-token one
    # goes first while 100 + 1000·t < 2000, i.e. for t < 1.9 s; later ones wait their turn.
    s = one_slot(make, aging_tokens_per_s=1000.0)
    s.arrive(req("long", prompt=2000, arrival=0.0), 0.0)  # type: ignore[attr-defined]
    s.arrive(req("short", prompt=100, arrival=short_at), short_at)  # type: ignore[attr-defined]
    order = one_at_a_time(s, 5.0)
    assert order == (["short", "long"] if passes else ["long", "short"])


def test_ties_break_by_arrival_then_id(make: Factory) -> None:
    s = one_slot(make)
    # equal prompts: the earlier arrival first (a budget wait does not move a request's
    # place: x arrived first), equal arrivals by id
    for r in (req("b", arrival=0.5), req("x", arrival=0.0, budget_wait=0.5),
              req("a", arrival=0.5), req("y", arrival=0.2)):
        s.arrive(r, 0.5)  # type: ignore[attr-defined]
    assert one_at_a_time(s, 1.0) == ["x", "y", "a", "b"]


@pytest.mark.parametrize(("later", "first"), [(4.0, "interactive"), (4.2, "batch-job")])
def test_priority_class_counts_as_a_later_arrival(make: Factory, later: float, first: str) -> None:
    # priority_tokens / aging_tokens_per_s: priority 1 waits as if it arrived 4.096 s later.
    s = one_slot(make, priority_tokens=4096.0, aging_tokens_per_s=1000.0)
    s.arrive(req("batch-job", priority=1), 0.0)  # type: ignore[attr-defined]
    s.arrive(req("interactive", arrival=later), later)  # type: ignore[attr-defined]
    assert one_at_a_time(s, 5.0)[0] == first


def test_identical_requests_of_one_bucket_leave_in_arrival_order(make: Factory) -> None:
    s = make()
    s.worker_capacity("cpu", 1, 0.0)
    s.arrive(req("first", arrival=0.0), 0.0)
    s.arrive(req("second", arrival=0.1), 0.1)
    (d,) = s.tick(1.0)
    assert isinstance(d, Dispatch) and d.request_ids == ("first",)


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
