"""Redis paused and Redis restarted empty under a running worker: it backs off, logs the
outage once, comes back, and serves again; it never exits."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from common import protocol as p
from common import wire
from gateway.cli.embedded_redis import EmbeddedRedis
from tests.integration.helpers import MODEL, collect, running_worker, send
from workers.engine import EchoEngine

pytestmark = [pytest.mark.redis, pytest.mark.slow]

REPLIES = wire.replies_stream(MODEL, "gw-redis-faults")
PAUSE_S = 8.0  # longer than the socket timeout and than the claim idle time
TIMEOUT_S = 0.5  # the worker's Redis socket timeout: a paused Redis shows up as errors quickly


class OwnRedis:
    """A redis-server of one test alone, to pause, kill and restart on the same port."""

    def __init__(self) -> None:
        self.server = EmbeddedRedis().start()
        self.url = self.server.url
        self.pid = int(redis.Redis.from_url(self.url).info("server")["process_id"])

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.server.stop()  # reaps it and removes its directory: its data is gone

    def restart(self) -> None:
        self.server = EmbeddedRedis(port=self.server.port).start()
        self.pid = int(redis.Redis.from_url(self.url).info("server")["process_id"])


@pytest.fixture
def own_redis() -> Iterator[OwnRedis]:
    server = OwnRedis()
    try:
        yield server
    finally:
        os.kill(server.pid, signal.SIGCONT)  # never leave it stopped, even on failure
        server.server.stop()


def _job(rid: str, tokens: int, stream: bool = False) -> p.BatchJob:
    return p.BatchJob(f"b-{rid}", REPLIES, 0, (p.SeqJob(rid, (1, 2, 3), p.SamplingParams(tokens), stream=stream),))


def _records(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name == "tokengate.worker" and r.levelno == level and text in r.getMessage()
    ]


def _wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _check_quiet_outage(caplog: pytest.LogCaptureFixture) -> None:
    """One warning when it started, one line when it ended, no traceback."""
    assert len(_records(caplog, logging.WARNING, "Redis unreachable")) == 1
    assert len(_records(caplog, logging.INFO, "Redis reachable again after")) == 1
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_worker_survives_a_paused_redis_and_finishes_its_stream(
    own_redis: OwnRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "tokengate.worker")
    client = redis.Redis.from_url(own_redis.url)
    tokens = 200
    engine = EchoEngine(tokens=tokens, step_s=0.01)
    # each pause can count one more delivery of the running batch; that is not poison
    with running_worker(own_redis.url, engine, redis_timeout_s=TIMEOUT_S, max_deliveries=10):
        send(client, _job("long", tokens, stream=True))
        _wait_for(lambda: client.xlen(REPLIES) >= 5, 10, "the first deltas")  # serving
        os.kill(own_redis.pid, signal.SIGSTOP)
        time.sleep(PAUSE_S)  # the fault itself lasts this long
        os.kill(own_redis.pid, signal.SIGCONT)
        send(client, _job("after", 3))
        events = collect(client, REPLIES, until_batches=2, timeout_s=30)
    done = {e.rid: e for e in events if isinstance(e, p.Finished)}
    assert set(done) == {"long", "after"}
    # the running stream was abandoned, reclaimed and resumed: no gap, no repeat
    assert "".join(e.text for e in events if isinstance(e, p.Delta) and e.rid == "long") == " echo" * tokens
    assert done["after"].text == " echo" * 3
    _check_quiet_outage(caplog)
    assert client.xpending(wire.jobs_stream(MODEL, "cpu"), wire.GROUP)["pending"] == 0


def test_work_abandoned_in_a_pause_resumes_when_redis_answers_not_after_the_claim_idle_time(
    own_redis: OwnRedis,
) -> None:
    client = redis.Redis.from_url(own_redis.url)
    tokens = 150
    engine = EchoEngine(tokens=tokens, step_s=0.01)
    with running_worker(own_redis.url, engine, redis_timeout_s=TIMEOUT_S, max_deliveries=10) as worker:
        object.__setattr__(worker.settings, "claim_idle_s", 60.0)  # a peer's claim would come far too late
        send(client, _job("long", tokens, stream=True))
        _wait_for(lambda: client.xlen(REPLIES) >= 5, 10, "the first deltas")
        os.kill(own_redis.pid, signal.SIGSTOP)
        time.sleep(2.0)  # the worker's publishes and reads fail: it abandons the running batch
        os.kill(own_redis.pid, signal.SIGCONT)
        resumed = time.monotonic()
        events = collect(client, REPLIES, until_batches=1, timeout_s=20)
        took = time.monotonic() - resumed
    assert any(isinstance(e, p.Finished) and e.rid == "long" for e in events)
    assert "".join(e.text for e in events if isinstance(e, p.Delta) and e.rid == "long") == " echo" * tokens
    assert took < 10.0, took  # released at once when Redis answered, taken back by this worker


def test_worker_recreates_its_group_after_redis_restarts_empty(
    own_redis: OwnRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "tokengate.worker")
    client = redis.Redis.from_url(own_redis.url)
    engine = EchoEngine(tokens=10_000, step_s=0.01)
    with running_worker(own_redis.url, engine, redis_timeout_s=TIMEOUT_S):
        send(client, _job("before", 2))
        collect(client, REPLIES, until_batches=1)
        own_redis.kill()
        _wait_for(lambda: _records(caplog, logging.WARNING, "Redis unreachable"), 10, "the worker to notice")
        time.sleep(1.0)  # refused connections for a while: several attempts, still one warning
        own_redis.restart()
        assert not client.exists(wire.jobs_stream(MODEL, "cpu"))  # no persistence: stream and group are gone
        send(client, _job("after", 2))
        events = collect(client, REPLIES, until_batches=1, timeout_s=30)
        assert [e.rid for e in events if isinstance(e, p.Finished)] == ["after"]
        # the cancel subscription is back: a cancel message alone (no key) stops a stream
        _wait_for(lambda: dict(client.pubsub_numsub(wire.CANCEL_CHANNEL))[wire.CANCEL_CHANNEL.encode()] == 1,
                  10, "the worker to subscribe again")
        client.delete(REPLIES)
        send(client, _job("long", 10_000, stream=True))
        _wait_for(lambda: client.xlen(REPLIES) >= 1, 10, "the long stream to start")
        client.publish(wire.CANCEL_CHANNEL, "long")
        events = collect(client, REPLIES, until_batches=1, timeout_s=30)
    assert [(e.rid, e.finish_reason) for e in events if isinstance(e, p.Finished)] == [("long", "cancelled")]
    assert len(_records(caplog, logging.WARNING, "creating it again")) == 1
    _check_quiet_outage(caplog)
