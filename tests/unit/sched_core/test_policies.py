"""The one policy factory: each name means one thing, for the gateway and the simulator."""

from __future__ import annotations

import pytest

from sched_core import IMPLEMENTATIONS, ReferenceScheduler, Scheduler
from sched_core.driver import Driver
from sched_core.policies import FifoPolicy, FixedBatch, TimeWindow, make_policy
from sched_core.types import SchedulerConfig

CONFIG = SchedulerConfig()
MAX_BATCH = {"cpu": 8, "gpu": 32}


def test_fixed_without_a_window_is_a_batch_of_exactly_b() -> None:
    policy = make_policy("fixed:batch=4", CONFIG, max_batch=MAX_BATCH)
    assert type(policy) is FixedBatch and policy.size == 4 and policy.paths == ("gpu", "cpu")


def test_fixed_with_a_window_is_the_dynamic_batcher_capped_at_b() -> None:
    policy = make_policy("fixed:batch=4,window_ms=10", CONFIG, max_batch=MAX_BATCH)
    assert type(policy) is TimeWindow and policy.delay_s == pytest.approx(0.010)
    assert policy.max_batch == {"cpu": 4, "gpu": 4}
    alone = make_policy("fixed:window_ms=2,paths=gpu", CONFIG, max_batch=MAX_BATCH)
    assert type(alone) is TimeWindow and alone.max_batch == MAX_BATCH and alone.paths == ("gpu",)


def test_the_other_names() -> None:
    assert type(make_policy("tokengate", CONFIG)) is Scheduler
    assert type(make_policy("tokengate", CONFIG, implementation="reference")) is ReferenceScheduler
    fcfs, gpu = make_policy("fcfs", CONFIG), make_policy("gpu-only", CONFIG)
    assert type(fcfs) is FifoPolicy and fcfs.paths == ("gpu", "cpu")
    assert type(gpu) is FifoPolicy and gpu.paths == ("gpu",)


@pytest.mark.parametrize("spec", ["fifo", "fcfs:batch=2", "fixed", "fixed:batch=0", "fixed:window_ms=-1",
                                  "fixed:batch=4,size=2", "fixed:window_ms=5,paths=tpu", "three-regime",
                                  "tokengate:x=1"])
def test_anything_else_is_refused_naming_the_forms(spec: str) -> None:
    with pytest.raises(ValueError, match="fixed:batch=B,window_ms=W"):
        make_policy(spec, CONFIG)



@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("spec", ["tokengate", "smdp", "fcfs", "gpu-only", "fixed:batch=4", "fixed:window_ms=5"])
def test_what_the_driver_may_ask_of_each_policy_is_declared(spec: str, implementation: str) -> None:
    """The driver asks the scheduler for its pricing and a baseline for its queue through the
    interfaces ``sched_core.driver`` declares, never by probing for a method: each policy the
    factory makes is exactly one of the two."""
    driver = Driver(make_policy(spec, SchedulerConfig(), implementation=implementation))
    scheduler = spec in ("tokengate", "smdp")
    assert (driver.pricing is not None) == scheduler
    assert (driver.queues is not None) == (not scheduler)
    assert driver.prior("cpu", SchedulerConfig().cpu) == scheduler
    assert driver.explain("nobody") is None
