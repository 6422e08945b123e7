"""The restart policy (pure) and the supervisor's decisions, with fake processes and a hand clock."""

from __future__ import annotations

import logging

import pytest
from redis.backoff import ExponentialBackoff

from gateway.cli.supervisor import Child, RestartPolicy, Supervisor


class FakeProc:
    pids = iter(range(100, 10_000))

    def __init__(self) -> None:
        self.pid = next(self.pids)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_exits_in_a_row_back_off_exponentially_up_to_the_cap() -> None:
    policy = RestartPolicy(ExponentialBackoff(cap=4.0, base=0.25), stable_s=60.0)
    exits, delays = 0, []
    for _ in range(7):
        exits, delay = policy.after_exit(exits, ran_s=1.0)
        delays.append(delay)
    assert exits == 7
    assert delays == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_child_that_ran_long_enough_starts_a_new_count() -> None:
    policy = RestartPolicy(ExponentialBackoff(cap=30.0, base=0.25), stable_s=60.0)
    assert policy.after_exit(5, ran_s=60.0) == (1, 0.25)
    assert policy.after_exit(5, ran_s=59.0) == (6, 8.0)


def _supervised(clock: Clock) -> tuple[Supervisor, list[FakeProc]]:
    started: list[FakeProc] = []

    def start() -> FakeProc:
        started.append(FakeProc())
        return started[-1]

    child = Child("worker (pool cpu)", start)  # type: ignore[arg-type]
    sup = Supervisor([child], policy=RestartPolicy(ExponentialBackoff(cap=30.0, base=0.5), 60.0), clock=clock)
    sup.start()
    return sup, started


def test_a_dead_worker_is_started_again_after_its_backoff(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    sup, started = _supervised(clock)
    assert len(started) == 1
    clock.now += 5
    sup.check()
    assert len(started) == 1  # alive: nothing to do

    started[0].returncode = -9
    with caplog.at_level(logging.WARNING, "tokengate.serve"):
        sup.check()
    assert "worker (pool cpu) exited with signal 9" in caplog.text
    assert len(started) == 1  # waits 0.5 s first
    clock.now += 0.4
    sup.check()
    assert len(started) == 1
    clock.now += 0.1
    sup.check()
    assert len(started) == 2 and sup.children[0].proc is started[1]

    started[1].returncode = 1  # dies again at once: twice the wait
    sup.check()
    clock.now += 0.9
    sup.check()
    assert len(started) == 2
    clock.now += 0.1
    sup.check()
    assert len(started) == 3
    assert not sup.workers_exited()


def test_workers_exited_only_when_all_are_gone() -> None:
    clock = Clock()
    sup, started = _supervised(clock)
    assert not sup.workers_exited()
    started[0].returncode = 0
    assert sup.workers_exited()
