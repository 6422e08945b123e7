"""Driver: calibrated contracts, SLO refusals at admission and outcomes, on both builds."""

from __future__ import annotations

import pytest

from sched_core import Contract, Dispatch, Reject
from sched_core.driver import Driver
from sched_core.shares import Backlogs
from sched_core.types import HOLD_SLACK, SchedulerConfig

from .conftest import Factory
from .support import req


def driver(make: Factory, cpu: int = 8, **config: object) -> Driver:
    d = Driver(make(**config))
    d.capacity("cpu", cpu, 0.0)
    return d


def test_an_slo_the_bounds_cannot_meet_is_refused_and_not_queued(make: Factory) -> None:
    d = driver(make)
    assert isinstance(d.arrive(req("first"), 0.0), Contract)
    queued, promised = d.queued, len(d.contracts)
    for ttft, tpot, why in ((1e-6, None, "first token"), (None, 1e-6, "tokens")):
        r = d.arrive(req("tight", arrival=0.01, slo_ttft_s=ttft, slo_tpot_s=tpot), 0.01)
        assert isinstance(r, Reject) and r.reason == "slo", r
        assert r.request_id == "tight" and r.retry_after_s >= 1.0
        assert 1e-6 < r.ttft_p99_s <= r.p99_s and r.estimate_s > 0.0
        assert why in r.message
        # taken back: not queued, no promise pending, and its id is free again
        assert d.queued == queued and len(d.contracts) == promised
    assert isinstance(d.arrive(req("tight", arrival=0.02), 0.02), Contract)
    assert d.queued == queued + 1


def test_retry_after_is_how_far_the_first_token_bound_is_past_the_slo(make: Factory) -> None:
    d = driver(make, cpu=1)
    d.arrive(req("running", prompt=1000, max_tokens=400, out=400), 0.0)
    d.tick(0.0)
    for i in range(20):  # a deep queue behind a busy slot: the first token is seconds away
        d.arrive(req(f"q{i}", prompt=1000, max_tokens=400, out=400), 0.0)
    r = d.arrive(req("late", slo_ttft_s=0.5), 0.0)
    assert isinstance(r, Reject) and r.reason == "slo"
    assert r.ttft_p99_s > 2.0
    assert r.retry_after_s == pytest.approx(r.ttft_p99_s - 0.5)


def test_a_loose_slo_is_accepted(make: Factory) -> None:
    d = driver(make)
    c = d.arrive(req("a", slo_ttft_s=600.0, slo_tpot_s=60.0), 0.0)
    assert isinstance(c, Contract)
    assert c.ttft_p99_s <= 600.0 and c.tpot_p99_s <= 60.0
    assert d.queued == 1 and len(d.contracts) == 1


def test_without_an_slo_nothing_is_refused(make: Factory) -> None:
    d = driver(make, cpu=1)
    d.arrive(req("running", prompt=1000, max_tokens=400, out=400), 0.0)
    d.tick(0.0)
    for i in range(50):  # however long the wait, a request without an SLO gets a promise
        c = d.arrive(req(f"r{i}", tenant=f"t{i % 3}", prompt=1000, max_tokens=400, out=0), 0.0)
        assert isinstance(c, Contract)
    assert isinstance(c, Contract) and c.ttft_p99_s > 5.0  # the same bound refuses one with an SLO
    assert isinstance(d.arrive(req("slo", prompt=1000, slo_ttft_s=5.0), 0.0), Reject)


def test_a_tenant_over_its_share_of_admitted_work_is_held_to_half_its_ttft_slo(make: Factory) -> None:
    d = driver(make, cpu=64)
    # hog has admitted nine times other's work on the same budget: over its share
    for i in range(9):
        assert isinstance(d.arrive(req(f"h{i}", tenant="hog", prompt=10), 0.0), Contract)
    assert isinstance(d.arrive(req("o0", tenant="other", prompt=10), 0.0), Contract)
    assert d.shares.over("hog", 0.0) and not d.shares.over("other", 0.0)
    policy = d.policy
    probe = d.arrive(req("probe", tenant="hog", prompt=10), 0.0)
    assert isinstance(probe, Contract)
    assert policy.cancel("probe", 0.0)  # type: ignore[attr-defined]
    d.forget("probe")
    slo = 1.5 * probe.ttft_p99_s  # meets the bound, but not half of it
    r = d.arrive(req("h9", tenant="hog", prompt=10, slo_ttft_s=slo), 0.0)
    assert isinstance(r, Reject) and r.reason == "slo" and "fair share" in r.message
    assert HOLD_SLACK * slo < r.ttft_p99_s <= slo
    # the other tenant, within its share, is held to the whole SLO
    c = d.arrive(req("o1", tenant="other", prompt=10, slo_ttft_s=slo), 0.0)
    assert isinstance(c, Contract)
    # twice as loose, half of it is enough
    c = d.arrive(req("h10", tenant="hog", prompt=10, slo_ttft_s=slo / HOLD_SLACK), 0.0)
    assert isinstance(c, Contract)


def test_a_tenant_over_its_share_is_refused_once_the_workers_are_full(make: Factory) -> None:
    d = driver(make, cpu=8)
    for i in range(7):  # 7 of 8 slots' worth queued, all hog's
        assert isinstance(d.arrive(req(f"h{i}", tenant="hog", prompt=10), 0.0), Contract)
    assert isinstance(d.arrive(req("o0", tenant="other", prompt=10), 0.0), Contract)
    # 8 queued on 8 slots: full; hog is refused whatever its SLO, other is not
    r = d.arrive(req("h7", tenant="hog", prompt=10, slo_ttft_s=600.0), 0.0)
    assert isinstance(r, Reject) and r.reason == "slo" and "full" in r.message
    assert isinstance(d.arrive(req("o1", tenant="other", prompt=10, slo_ttft_s=600.0), 0.0), Contract)
    # without an SLO nothing is refused
    assert isinstance(d.arrive(req("h8", tenant="hog", prompt=10), 0.0), Contract)


def test_an_outcome_is_judged_and_calibrates(make: Factory) -> None:
    d = driver(make)
    c = d.arrive(req("a", out=0, max_tokens=64), 0.0)
    assert isinstance(c, Contract) and c.output_tokens == SchedulerConfig().default_output_tokens  # before any outcome
    (batch,) = d.tick(0.0)
    assert isinstance(batch, Dispatch)
    d.finished("a", 5, 1.0)
    acc = d.outcome("a", c.ttft_s * 0.5, c.ttft_s + 1.0, 5, 1.0)
    assert acc is not None and acc.path == c.path == batch.path
    assert acc.ttft_inside and acc.ttft_ape == pytest.approx(1.0)
    assert d.outcome("a", 0.1, 0.2, 5, 1.0) is None  # once only
    assert d.outcome("unknown", 0.1, 0.2, 5, 1.0) is None
    state = d.contracts.state()
    assert {r[0] for r in state["ratios"]} == {"ttft", "tpot", "total"}
    assert all(r[1] == c.path for r in state["ratios"])
    # enough short outcomes for the tenant and the driver asks the core for short outputs
    now = 1.0
    for i in range(20):
        now += 1.0
        ci = d.arrive(req(f"r{i}", out=0, arrival=now), now)
        assert isinstance(ci, Contract)
        for dispatched in d.tick(now):
            assert isinstance(dispatched, Dispatch)
        d.finished(f"r{i}", 5, now + 0.5)
        assert d.outcome(f"r{i}", 0.1, 0.5, 5, now + 0.5) is not None
    c = d.arrive(req("b", out=0, arrival=now + 1), now + 1)
    assert isinstance(c, Contract) and c.output_tokens == 5
    # a known length is taken as it is
    c = d.arrive(req("known", out=17, arrival=now + 1), now + 1)
    assert isinstance(c, Contract) and c.output_tokens == 17


def test_forget_drops_the_pending_promise(make: Factory) -> None:
    d = driver(make)
    assert isinstance(d.arrive(req("a"), 0.0), Contract)
    assert len(d.contracts) == 1
    d.forget("a")
    d.forget("a")  # twice is harmless
    assert len(d.contracts) == 0
    assert d.outcome("a", 0.1, 0.2, 5, 1.0) is None
    assert d.contracts.state() == {"ratios": [], "outputs": []}


def calibrated(d: Driver) -> Driver:
    """First-token predictions that outcomes confirmed: each came as predicted."""
    d.contracts.load({"ratios": [["ttft", "cpu", level, -1, [1.0] * 32] for level in range(5)]})
    return d


def test_a_request_without_an_slo_predicted_to_wait_past_its_bound_is_refused(make: Factory) -> None:
    d = calibrated(driver(make, cpu=1))
    d.arrive(req("running", prompt=1000, max_tokens=400, out=400), 0.0)
    d.tick(0.0)
    queued = d.queued
    for i in range(20):  # a deep queue behind a busy slot: the first token is seconds away
        d.arrive(req(f"q{i}", prompt=1000, max_tokens=400, out=400), 0.0)
    promised = len(d.contracts)
    r = d.arrive(req("bounded", max_wait_s=1.0), 0.0)
    assert isinstance(r, Reject) and r.reason == "wait", r
    assert "wait" in r.message and r.estimate_s > 0.0
    assert d.queued == queued + 20 and len(d.contracts) == promised  # taken back
    c = d.arrive(req("patient"), 0.0)  # the same request with no bound: the same queue, a promise
    assert isinstance(c, Contract) and c.ttft_s > 3.0
    alone = d.policy.prefill_alone_s("cpu", 100)  # type: ignore[attr-defined]
    assert r.retry_after_s == pytest.approx(c.ttft_s - alone - 1.0)  # the wait past the bound
    # a first-token SLO replaces the bound; a bound as long as the queue keeps it
    assert isinstance(d.arrive(req("slo", max_wait_s=1.0, slo_ttft_s=600.0), 0.0), Contract)
    assert isinstance(d.arrive(req("loose", max_wait_s=600.0), 0.0), Contract)


def test_a_request_another_scheduler_promised_is_taken_without_a_refusal(make: Factory) -> None:
    """Taken up after a failover, its client already holds a 200: it is queued, never refused."""
    d = calibrated(driver(make, cpu=1))
    d.arrive(req("running", prompt=1000, max_tokens=400, out=400), 0.0)
    d.tick(0.0)
    for i in range(20):
        d.arrive(req(f"q{i}", prompt=1000, max_tokens=400, out=400), 0.0)
    assert isinstance(d.arrive(req("bounded", max_wait_s=1.0), 0.0), Reject)
    assert isinstance(d.arrive(req("slo", slo_ttft_s=0.001), 0.0), Reject)
    queued = d.queued
    assert isinstance(d.arrive(req("bounded-again", max_wait_s=1.0), 0.0, promised=True), Contract)
    assert isinstance(d.arrive(req("slo-again", slo_ttft_s=0.001), 0.0, promised=True), Contract)
    assert d.queued == queued + 2


def test_the_wait_bound_leaves_out_the_requests_own_prompt(make: Factory) -> None:
    d = calibrated(driver(make, cpu=1))
    alone = d.policy.prefill_alone_s("cpu", 8000)  # type: ignore[attr-defined]
    assert alone > 0.0
    c = d.arrive(req("long", prompt=8000, max_tokens=16, out=16, max_wait_s=0.001), 0.0)
    assert isinstance(c, Contract), c  # nothing ahead: its own prefill is no wait
    assert c.ttft_s >= alone * 0.5


def test_no_request_is_refused_for_its_wait_on_uncalibrated_predictions(make: Factory) -> None:
    d = driver(make, cpu=1)  # the raw model may be far off until outcomes confirm it
    d.arrive(req("running", prompt=1000, max_tokens=400, out=400), 0.0)
    d.tick(0.0)
    for i in range(20):
        d.arrive(req(f"q{i}", prompt=1000, max_tokens=400, out=400), 0.0)
    c = d.arrive(req("bounded", max_wait_s=1.0), 0.0)
    assert isinstance(c, Contract) and c.ttft_s > 3.0
    calibrated(d)
    r = d.arrive(req("bounded-too", max_wait_s=1.0), 0.0)
    assert isinstance(r, Reject) and r.reason == "wait"


def test_with_nothing_queued_ahead_and_a_slot_free_no_request_is_refused_for_its_wait(make: Factory) -> None:
    d = calibrated(driver(make, cpu=8))
    d.contracts.load({"ratios": [["ttft", "cpu", level, -1, [1e6] * 32] for level in range(5)]})  # absurd
    c = d.arrive(req("alone", max_wait_s=0.001), 0.0)  # predicted far past the bound, yet nothing is ahead
    assert isinstance(c, Contract) and c.ttft_s > 1.0


def test_the_wait_bound_falls_on_the_tenant_over_its_share_not_on_the_quiet_one(make: Factory) -> None:
    """One busy slot and a deep queue, all of it noisy's: a quiet tenant far under its share goes
    before that queue under fair share, so its wait bound is not broken by it; noisy's is."""
    d = calibrated(driver(make, cpu=1))
    d.arrive(req("running", tenant="noisy", prompt=1000, max_tokens=400, out=400), 0.0)
    d.tick(0.0)
    for i in range(20):
        d.arrive(req(f"n{i}", tenant="noisy", prompt=1000, max_tokens=400, out=400), 0.0)
    d.arrive(req("q0", tenant="quiet", prompt=10, max_tokens=16, out=16), 0.0)  # quiet's own, tiny, work
    assert d.backlogs.use("quiet") < 0.1 < 1.0 < d.backlogs.use("noisy")  # of the work held now
    r = d.arrive(req("n-bounded", tenant="noisy", max_wait_s=1.0), 0.0)
    assert isinstance(r, Reject) and r.reason == "wait" and "fair share" not in r.message, r
    c = d.arrive(req("q-bounded", tenant="quiet", max_wait_s=1.0), 0.0)
    assert isinstance(c, Contract), c
    assert c.ttft_s > 3.0  # the whole queue's prediction stands in its contract; only the refusal asks whose it is
    # quiet's own queue counts: a burst of its own long requests ahead and it is judged by them
    for i in range(20):
        d.arrive(req(f"q-long{i}", tenant="quiet", prompt=50, max_tokens=400, out=400), 0.0)
    r = d.arrive(req("q-bounded-again", tenant="quiet", max_wait_s=1.0), 0.0)
    assert isinstance(r, Reject) and r.reason == "wait" and "fair share" in r.message, r


def test_a_tenant_alone_is_judged_by_the_whole_queue(make: Factory) -> None:
    d = calibrated(driver(make, cpu=1))
    d.arrive(req("running", tenant="only", prompt=1000, max_tokens=400, out=400), 0.0)
    d.tick(0.0)
    for i in range(20):
        d.arrive(req(f"q{i}", tenant="only", prompt=1000, max_tokens=400, out=400), 0.0)
    assert d.backlogs.use("only") == pytest.approx(1.0)
    assert isinstance(d.arrive(req("bounded", tenant="only", max_wait_s=1.0), 0.0), Reject)


def test_backlogs_hold_each_tenants_queued_and_running_work_until_it_ends() -> None:
    b = Backlogs()
    b.add("a1", "a", 1.0, 100, 20)
    b.add("a2", "a", 1.0, 50, 10)
    b.add("b1", "b", 1.0, 10, 10)
    assert b.work("a") == (150, 30) and b.work("b") == (10, 10)
    assert b.use("a") == pytest.approx((180 / 200) / 0.5) and b.use("b") == pytest.approx(0.2)
    b.remove("a1", running=True)  # dispatched: no longer queued, still held
    assert b.work("a") == (50, 10) and b.use("a") == pytest.approx(1.8)
    b.remove("a2")  # cancelled: gone
    b.done("a1")  # finished: gone
    assert b.work("a") == (0, 0) and b.use("a") == 0.0
    assert b.use("b") == pytest.approx(1.0)  # alone now: just its share
    b.done("a1")
    b.remove("nobody")  # twice, or never seen: nothing changes
    assert b.use("b") == pytest.approx(1.0)
