"""The backoff policy, the outage log and the worker's main loop under Redis errors:
no Redis, no sleeping (the clock and the sleep are injected)."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest
import redis

from common import wire
from common.retry import Outage, Retrier, backoff_policy, is_nogroup
from workers.engine import EchoEngine
from workers.settings import WorkerSettings
from workers.worker import Worker

NOGROUP = redis.ResponseError("NOGROUP No such key '{tg}:jobs:cpu' or consumer group 'workers' in XREADGROUP")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tokengate.worker" and r.levelno == level]


def test_backoff_doubles_from_base_up_to_the_cap() -> None:
    policy = backoff_policy(base_s=0.05, cap_s=2.0)
    assert [policy.compute(n) for n in range(1, 8)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]


def test_nogroup_is_told_from_other_errors() -> None:
    assert is_nogroup(NOGROUP)
    assert not is_nogroup(redis.ResponseError("BUSYGROUP Consumer Group name already exists"))
    assert not is_nogroup(redis.ConnectionError("NOGROUP in a connection error is not a reply"))


def test_one_outage_logs_one_warning_and_one_recovery(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "tokengate.worker")
    clock = FakeClock()
    outage = Outage(clock)
    retry = Retrier(backoff_policy(0.05, 2.0), outage, clock.sleep)
    other = Retrier(backoff_policy(0.05, 2.0), outage, clock.sleep)  # another thread's loop
    assert outage.recovered(clock()) is None  # nothing to recover from
    for _ in range(5):
        retry.failed(redis.ConnectionError("refused"))
        other.failed(redis.TimeoutError("timed out"))
    assert outage.down and retry.failures == 5
    assert clock.slept == [0.1, 0.1, 0.2, 0.2, 0.4, 0.4, 0.8, 0.8, 1.6, 1.6]
    other.succeeded(clock())
    assert not outage.down and other.failures == 0
    retry.succeeded(clock())  # the outage already ended: no second line
    assert _messages(caplog, logging.WARNING) == ["Redis unreachable (ConnectionError: refused): retrying with backoff"]
    assert _messages(caplog, logging.INFO) == ["Redis reachable again after 6.2 s"]


def test_a_call_begun_before_the_outage_does_not_end_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "tokengate.worker")
    clock = FakeClock()
    outage = Outage(clock)
    begun = clock()  # one thread's call leaves...
    clock.now = 1.0
    outage.failed(redis.ConnectionError("reset by peer"))  # ...another thread sees Redis die...
    assert outage.recovered(begun) is None and outage.down  # ...then the first call's answer lands
    clock.now = 3.5
    assert outage.recovered(3.0) == 2.5 and not outage.down
    assert _messages(caplog, logging.INFO) == ["Redis reachable again after 2.5 s"]


def test_reset_forgets_failures_without_ending_the_outage() -> None:
    clock = FakeClock()
    outage = Outage(clock)
    retry = Retrier(backoff_policy(0.05, 2.0), outage, clock.sleep)
    retry.failed(redis.ConnectionError())
    retry.failed(redis.ConnectionError())
    retry.reset()
    assert retry.failures == 0 and outage.down
    assert retry.failed(redis.ConnectionError()) == 0.1


class FlakyRedis:
    """Just the calls of an idle worker's main loop; each XREADGROUP takes the next
    scripted outcome (an exception to raise, or None: no entry)."""

    def __init__(self, reads: list[Exception | None]) -> None:
        self.reads = reads
        self.calls: list[str] = []

    def register_script(self, script: str) -> Any:
        return lambda **kw: 0

    def xgroup_create(self, name: str, groupname: str, id: str = "$", mkstream: bool = False) -> bool:
        self.calls.append(f"xgroup_create {name} {groupname} {id} mkstream={mkstream}")
        return True

    def xautoclaim(self, *args: Any, **kw: Any) -> tuple[bytes, list[Any], list[Any]]:
        return b"0-0", [], []

    def xpending_range(self, *args: Any, **kw: Any) -> list[Any]:  # a draining worker's jobs not started
        return []

    def xreadgroup(self, *args: Any, **kw: Any) -> None:
        self.calls.append("xreadgroup")
        outcome = self.reads.pop(0) if self.reads else None
        if outcome is not None:
            raise outcome
        return None


def _worker(client: FlakyRedis, clock: FakeClock) -> Worker:
    settings = WorkerSettings(redis_url="redis://unused", engine="echo", retry_base_s=0.05, retry_cap_s=2.0)
    return Worker(settings, EchoEngine(), cast(redis.Redis, client), "m", clock=clock, sleep=clock.sleep)


@pytest.mark.parametrize(
    "error",
    [
        redis.ConnectionError("Connection refused"),
        redis.TimeoutError("Timeout reading from socket"),
        redis.BusyLoadingError("Redis is loading the dataset in memory"),
        redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'"),
    ],
)
def test_the_main_loop_backs_off_and_never_raises(error: redis.RedisError, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "tokengate.worker")
    clock = FakeClock()
    client = FlakyRedis([error, error, error, None])
    worker = _worker(client, clock)
    for _ in range(5):
        assert worker.tick()
    assert clock.slept == [0.1, 0.2, 0.4]
    assert client.calls.count("xreadgroup") == 5
    assert len(_messages(caplog, logging.WARNING)) == 1
    assert _messages(caplog, logging.INFO) == ["Redis reachable again after 0.7 s"]


def test_the_group_is_created_first_and_retried_when_redis_is_down() -> None:
    clock = FakeClock()
    client = FlakyRedis([])
    calls = 0

    def create(*args: Any, **kw: Any) -> bool:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise redis.ConnectionError("Connection refused")
        return True

    client.xgroup_create = create  # type: ignore[method-assign]
    worker = _worker(client, clock)
    for _ in range(4):
        worker.tick()
    assert calls == 4 and clock.slept == [0.1, 0.2]  # the jobs stream's group failed twice; then the doorbell's
    assert client.calls.count("xreadgroup") == 2  # only once the groups exist


def test_a_lost_group_is_created_again_at_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "tokengate.worker")
    clock = FakeClock()
    client = FlakyRedis([None, NOGROUP, None])
    worker = _worker(client, clock)
    for _ in range(3):
        assert worker.tick()
    create = [f"xgroup_create {wire.jobs_stream('m', 'cpu')} workers 0 mkstream=True",
              f"xgroup_create {worker.bell} workers $ mkstream=True"]
    assert client.calls == [*create, "xreadgroup", "xreadgroup", *create, "xreadgroup"]
    assert clock.slept == []  # Redis answered: nothing to wait for
    gone = f"consumer group workers of {wire.jobs_stream('m', 'cpu')} is gone: creating it again"
    assert _messages(caplog, logging.WARNING) == [gone]


def test_a_drain_ends_the_loop_once_the_engine_is_idle() -> None:
    clock = FakeClock()
    worker = _worker(FlakyRedis([]), clock)
    assert worker.tick()
    worker.request_stop()
    assert not worker.tick()


def test_an_asyncio_loop_counts_and_waits_itself() -> None:
    """``count`` is ``failed`` without the sleep: the same delays, one warning per outage."""
    outage = Outage()
    retry = Retrier(backoff_policy(0.05, 2.0), outage)
    delays = [retry.count(ConnectionError("down")) for _ in range(3)]
    assert delays == [0.1, 0.2, 0.4] and outage.down
    retry.succeeded(float("inf"))
    assert retry.failures == 0 and not outage.down
