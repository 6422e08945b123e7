"""workers.cpu: the share of thread time spent waiting for a CPU (measured, against a real
spinning neighbour), and the thread governor's decisions (pure: time is an argument)."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from workers.cpu import (
    BACKOFF_MAX_S,
    BACKOFF_S,
    GIVE_UP,
    EngineThreads,
    Idle,
    Starvation,
    ThreadGovernor,
    cpu_times,
    idle_cpus,
    wait_for_idle,
)


def _spin(until: float) -> None:
    while time.monotonic() < until:
        pass


def _busy_share(seconds: float) -> float:
    starvation = Starvation()
    _spin(time.monotonic() + seconds)
    return starvation.share()


def test_the_share_of_time_waiting_for_a_cpu_is_measured() -> None:
    """Two more programs spinning on every core: this process's thread waits for a CPU a good
    share of the time it wants one, and far more than just before without them (whatever else
    runs on the machine: a build beside the tests makes "alone" itself a share of a half)."""
    if cpu_times() == (0.0, 0.0):
        pytest.skip("no schedstat on this system")
    alone = _busy_share(0.3)
    cores = len(os.sched_getaffinity(0))
    hogs = [multiprocessing.Process(target=_spin, args=(time.monotonic() + 1.5,)) for _ in range(2 * cores)]
    for hog in hogs:
        hog.start()
    try:
        starved = _busy_share(1.0)
    finally:
        for hog in hogs:
            hog.join()
    assert starved > 0.3, starved  # three runnable threads per core, quiet: about two thirds
    assert starved > alone + 0.1, (starved, alone)


def test_a_starved_engine_gives_up_a_thread_and_tries_it_back_later() -> None:
    g = ThreadGovernor(maximum=2)
    assert g.threads == 2
    assert g.observe(0.05, 0.04, now=0.0) == 2  # next to idle: nothing learnt
    assert g.observe(1.0, 1.0, now=1.0) == 1  # half its time waiting: a thread given up
    assert g.observe(1.0, 1.0, now=2.0) == 1  # never below one
    assert g.observe(1.0, 0.01, now=3.0) == 1  # quiet, but not for long enough yet
    assert g.observe(1.0, 0.01, now=1.0 + BACKOFF_S) == 2  # tried back
    assert g.observe(1.0, 1.0, now=2.0 + BACKOFF_S) == 1  # starved at once: the neighbour is still there
    assert g.backoff == 2 * BACKOFF_S  # so the next try waits twice as long
    assert g.observe(1.0, 0.01, now=3.0 + 2 * BACKOFF_S) == 1
    assert g.observe(1.0, 0.01, now=2.0 + 3 * BACKOFF_S) == 2
    assert g.observe(1.0, 0.01, now=1000.0) == 2  # the neighbour left: it stays
    assert g.observe(1.0, 1.0, now=1100.0) == 1 and g.backoff == BACKOFF_S  # a new neighbour, long after


def test_the_backoff_is_bounded_and_a_mild_wait_changes_nothing() -> None:
    g = ThreadGovernor(maximum=4)
    now = 0.0
    for _ in range(20):  # a neighbour that never leaves: tries ever further apart, up to the cap
        now += g.backoff
        g.observe(1.0, 0.0, now)
        g.observe(1.0, 1.0, now + 1.0)
    assert g.backoff == BACKOFF_MAX_S
    g = ThreadGovernor(maximum=4)
    assert g.observe(1.0, 0.8 * GIVE_UP, now=5.0) == 4


def test_a_thread_is_tried_back_only_with_a_core_idle() -> None:
    """The neighbour still keeps a core busy (no idle core): trying a thread back would stall
    the next steps for seconds, so the worker waits for an idle core, however long."""
    g = ThreadGovernor(maximum=2)
    assert g.observe(1.0, 1.0, now=0.0) == 1
    assert g.observe(1.0, 0.01, now=1000.0, idle_cores=0.1) == 1
    assert g.observe(1.0, 0.01, now=1001.0, idle_cores=0.9) == 2
    assert g.observe(0.02, 0.5, now=1002.0) == 1  # a stalled step: little run, much wait, judged


def test_the_idle_cores_are_read_from_the_machine() -> None:
    if idle_cpus() == (0.0, 0.0):
        pytest.skip("no /proc/stat here")
    idle = Idle()
    time.sleep(0.3)
    quiet = idle.cores()
    assert 0.0 <= quiet <= len(os.sched_getaffinity(0)) + 0.5
    hogs = [multiprocessing.Process(target=_spin, args=(time.monotonic() + 1.0,)) for _ in range(os.cpu_count() or 1)]
    for hog in hogs:
        hog.start()
    time.sleep(0.2)
    idle.cores()
    time.sleep(0.5)
    busy = idle.cores()
    for hog in hogs:
        hog.join()
    assert busy < 0.5 < quiet or quiet < 0.5  # a quiet machine may be busy elsewhere; a hogged one is not idle


def test_the_wait_for_idle_cpus_ends_at_the_first_quiet_look_or_at_its_limit() -> None:
    looks = iter([0.0, 0.3, 1.0, 1.8, 1.9])  # the first call only starts the look
    slept: list[float] = []
    quiet, waited = wait_for_idle(1.5, 5.0, lambda: next(looks), slept.append, look_s=0.25)
    assert quiet and waited == pytest.approx(0.75) and slept == [0.25] * 3
    quiet, waited = wait_for_idle(1.5, 1.0, lambda: 0.4, lambda _s: None, look_s=0.25)
    assert not quiet and waited == pytest.approx(1.0)  # a neighbour that stays: measured beside it


def test_settling_runs_every_thread_again_once_the_cpus_are_idle() -> None:
    governor = ThreadGovernor(maximum=2)
    set_to: list[int] = []
    threads = EngineThreads(governor, 2, set_to.append, time.monotonic)
    governor.observe(1.0, 1.0, now=0.0)  # a neighbour busy for a moment took a thread
    threads.between_steps()
    assert set_to == [1]
    quiet, _ = threads.settle(max_s=1.0, sleep=lambda _s: None, look=lambda: 2.0)  # the neighbour is gone
    assert quiet and set_to == [1, 2] and threads.threads == governor.threads == 2
    governor.observe(1.0, 1.0, now=1.0)
    threads.between_steps()
    # still busy after the wait: the engine is measured as it will run beside the neighbour
    quiet, _ = threads.settle(max_s=0.5, sleep=lambda _s: None, look=lambda: 0.2)
    assert not quiet and threads.threads == 1
