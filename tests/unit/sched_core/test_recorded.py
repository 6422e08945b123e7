"""The traffic a scheduler saw (``sched_core.recorded``), and the driver that records it."""

from __future__ import annotations

from sched_core import SchedulerConfig
from sched_core.driver import Driver
from sched_core.policies import make_policy
from sched_core.recorded import Traffic

from .support import req


def test_a_row_opens_at_arrival_and_closes_at_its_end_finished_or_not() -> None:
    t = Traffic()
    t.arrived("a", "acme", 100, 64, 1.0)
    t.arrived("b", "beta", 50, 16, 2.0)
    t.arrived("c", "acme", 10, 8, 3.0)
    assert t.take() == []  # nothing ended yet
    t.finished("b", 12)
    t.ended("a")
    t.finished("c", -1)  # failed: generated nothing that counts
    t.ended("b")  # (over where it was sent from: already closed)
    rows = t.take()
    assert [(r.arrival, r.prompt_tokens, r.tenant, r.output_tokens, r.finished) for r in rows] == [
        (2.0, 50, "beta", 12, True), (1.0, 100, "acme", -1, False), (3.0, 10, "acme", -1, False)]
    assert t.take() == []


def test_the_window_is_bounded_open_and_closed() -> None:
    t = Traffic(capacity=3)
    for i in range(5):
        t.arrived(f"r{i}", "t", i, 8, float(i))
    t.ended("r0")  # dropped: the oldest open rows go first beyond the window
    t.ended("r1")
    for i in range(2, 5):
        t.finished(f"r{i}", 1)
    assert [r.prompt_tokens for r in t.take()] == [2, 3, 4]
    for i in range(5):
        t.arrived(f"s{i}", "t", i, 8, float(i))
        t.finished(f"s{i}", 1)
    assert [r.prompt_tokens for r in t.take()] == [2, 3, 4]  # the last three closed


def test_the_driver_records_every_request_it_saw() -> None:
    d = Driver(make_policy("fcfs", SchedulerConfig()))
    d.capacity("cpu", 1, 0.0)
    d.arrive(req("a", tenant="acme", prompt=7, max_tokens=20), 0.0)
    d.arrive(req("b", tenant="beta", prompt=9, max_tokens=30), 0.1)
    (batch,) = d.tick(0.2)
    d.finished(batch.request_ids[0], 5, 1.0)
    d.cancel("b", 1.1)  # the other one never ran
    assert [(r.prompt_tokens, r.tenant, r.output_tokens, r.max_tokens) for r in d.traffic.take()] == [
        (7, "acme", 5, 20), (9, "beta", -1, 30)]
