"""Workers as real processes, killed, paused and fed poison: nothing lost, nothing twice."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common import protocol as p
from common import wire
from workers.model_store import DEFAULT_MODEL_NAME

JOBS = wire.jobs_stream(DEFAULT_MODEL_NAME, "cpu")  # the default model's, which echo workers stand in for

pytestmark = [pytest.mark.redis, pytest.mark.slow]

REPLIES = wire.replies_stream(DEFAULT_MODEL_NAME, "gw-faults")
PIECE = " echo"


class Workers:
    """Start, kill, pause worker processes of the echo engine (or the model)."""

    def __init__(self, redis_url: str, tmp: Path, *extra: str) -> None:
        self.redis_url = redis_url
        self.tmp = tmp
        self.extra = extra
        self.procs: list[subprocess.Popen[bytes]] = []
        self._n = 0

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        self._n += 1
        log = open(self.tmp / f"worker-{self._n}.log", "wb")  # noqa: SIM115 - lives with the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers", "--redis-url", self.redis_url, "--worker-id", f"w{self._n}",
             "--claim-idle", "1.5", "--heartbeat", "0.3", *self.extra, *extra],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.procs.append(proc)
        return proc

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [w for w in self.procs if w.poll() is None]

    def stop_all(self) -> None:
        for w in self.alive():
            os.kill(w.pid, signal.SIGCONT)
            w.kill()
            w.wait()


@pytest.fixture
def workers(redis_url: str, tmp_path: Path) -> Iterator[Workers]:
    ws = Workers(redis_url, tmp_path, "--engine", "echo", "--echo-step-ms", "20", "--echo-tokens", "12")
    yield ws
    ws.stop_all()


def _job(rid: str, stream: bool, max_tokens: int = 100, prompt: tuple[int, ...] = (1, 2, 3)) -> p.BatchJob:
    return p.BatchJob(f"b-{rid}", REPLIES, 0, (p.SeqJob(rid, prompt, p.SamplingParams(max_tokens), stream=stream),))


def _read_all(client: redis.Redis, expect_done: set[str], timeout_s: float) -> list[p.Event]:
    events: list[p.Event] = []
    last = b"0-0"
    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not expect_done <= done and time.monotonic() < deadline:
        for _s, entries in client.xread({REPLIES: last}, block=200, count=1000) or []:
            for entry_id, fields in entries:
                last = entry_id
                for ev in p.decode_events(fields):
                    events.append(ev)
                    if isinstance(ev, p.Finished | p.Failed):
                        done.add(ev.rid)
    return events


def _check_exactly_once(events: list[p.Event], rids: dict[str, bool], tokens: int) -> None:
    finals: dict[str, list[p.Event]] = {}
    streamed: dict[str, str] = {}
    for ev in events:
        if isinstance(ev, p.Finished | p.Failed):
            finals.setdefault(ev.rid, []).append(ev)
        elif isinstance(ev, p.Delta):
            streamed[ev.rid] = streamed.get(ev.rid, "") + ev.text
    lost = [r for r in rids if r not in finals]
    twice = [r for r, f in finals.items() if len(f) > 1]
    assert not lost, f"{len(lost)} requests lost"
    assert not twice, f"{len(twice)} requests delivered twice"
    for rid, stream in rids.items():
        final = finals[rid][0]
        assert isinstance(final, p.Finished) and final.completion_tokens == tokens
        text = streamed.get(rid, "") if stream else final.text
        assert text == PIECE * tokens, f"{rid}: {text!r}"


def test_random_kill_9_loses_nothing_and_delivers_nothing_twice(
    redis_client: redis.Redis, workers: Workers
) -> None:
    # Kills every 0.3-0.8 s can catch one request's worker again and again; at the default
    # --max-deliveries 3 that request would (rightly) be dead-lettered as poison, which is
    # another test's subject. Here every request must finish.
    workers.extra = (*workers.extra, "--max-deliveries", "50")
    for _ in range(3):
        workers.start()
    rng = random.Random(7)
    rids = {f"r{i}": i % 2 == 0 for i in range(200)}
    stop = threading.Event()
    kills = 0

    def killer() -> None:
        nonlocal kills
        while not stop.wait(rng.uniform(0.3, 0.8)):
            alive = workers.alive()
            if len(alive) >= 2:
                rng.choice(alive).kill()
                kills += 1
            workers.start()

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        for rid, stream in rids.items():
            redis_client.xadd(JOBS, p.encode_job(_job(rid, stream)))
            time.sleep(0.01)
        events = _read_all(redis_client, set(rids), timeout_s=120)
    finally:
        stop.set()
        thread.join()
    assert kills >= 3
    _check_exactly_once(events, rids, tokens=12)
    assert redis_client.xpending(JOBS, wire.GROUP)["pending"] == 0


def test_paused_worker_late_result_is_discarded(redis_client: redis.Redis, workers: Workers) -> None:
    slow = workers.start()
    redis_client.xadd(JOBS, p.encode_job(_job("paused-s", True)))
    redis_client.xadd(JOBS, p.encode_job(_job("paused-n", False)))
    # let it stream a few tokens, then freeze it mid-batch
    deadline = time.monotonic() + 20
    while redis_client.xlen(REPLIES) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(slow.pid, signal.SIGSTOP)
    workers.start()  # a peer reclaims after the idle time and finishes both
    events = _read_all(redis_client, {"paused-s", "paused-n"}, timeout_s=30)
    os.kill(slow.pid, signal.SIGCONT)  # the paused worker wakes and tries to finish too
    time.sleep(1.5)
    events += _read_all(redis_client, set(), timeout_s=0.5)
    # re-read everything: the woken worker must have added nothing
    all_events = _read_all(redis_client, {"paused-s", "paused-n"}, timeout_s=5)
    _check_exactly_once(all_events, {"paused-s": True, "paused-n": False}, tokens=12)
    workers_seen = {e.worker for e in all_events if isinstance(e, p.BatchReport)}
    assert workers_seen == {"w2"}


def test_cancel_while_queued_and_mid_stream(redis_client: redis.Redis, workers: Workers) -> None:
    workers.start("--slots", "1")
    redis_client.xadd(JOBS, p.encode_job(_job("running", True, max_tokens=12)))
    redis_client.xadd(JOBS, p.encode_job(_job("queued", False)))
    time.sleep(0.1)
    # cancel the queued one the way the gateway does: key + message
    redis_client.set(wire.cancel_key(DEFAULT_MODEL_NAME, "queued"), 1, ex=60)
    redis_client.publish(wire.CANCEL_CHANNEL, "queued")
    events = _read_all(redis_client, {"running", "queued"}, timeout_s=20)
    queued = [e for e in events if isinstance(e, p.Finished) and e.rid == "queued"]
    assert queued and queued[0].finish_reason == "cancelled" and queued[0].completion_tokens == 0

    workers.procs[0].kill()
    workers.start("--echo-tokens", "1000")
    redis_client.xadd(JOBS, p.encode_job(_job("long", True, max_tokens=1000)))
    deadline = time.monotonic() + 20
    while redis_client.xlen(REPLIES) < 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    redis_client.set(wire.cancel_key(DEFAULT_MODEL_NAME, "long"), 1, ex=60)
    redis_client.publish(wire.CANCEL_CHANNEL, "long")
    events = _read_all(redis_client, {"long"}, timeout_s=20)
    final = [e for e in events if isinstance(e, p.Finished) and e.rid == "long"][0]
    assert final.finish_reason == "cancelled" and final.completion_tokens < 100
    # repeated and late cancels are harmless
    redis_client.publish(wire.CANCEL_CHANNEL, "long")
    redis_client.publish(wire.CANCEL_CHANNEL, "never-existed")
    redis_client.xadd(JOBS, p.encode_job(_job("after", False, max_tokens=3)))
    events = _read_all(redis_client, {"after"}, timeout_s=20)
    assert [e.text for e in events if isinstance(e, p.Finished) and e.rid == "after"] == [PIECE * 3]


@pytest.mark.model
def test_poison_entry_goes_to_dead_letter_and_its_client_is_told(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path, model_spec: object
) -> None:
    ws = Workers(redis_url, tmp_path, "--max-deliveries", "2", "--model", str(model_spec.path))  # type: ignore[attr-defined]
    try:
        ws.start()
        # a token id far outside the vocabulary makes the model's embedding lookup fail
        redis_client.xadd(JOBS, p.encode_job(_job("poison", False, 4, prompt=(1, 10**9))))
        redis_client.xadd(JOBS, p.encode_job(_job("healthy", False, 4)))
        events = _read_all(redis_client, {"poison", "healthy"}, timeout_s=120)
    finally:
        ws.stop_all()
    failed = [e for e in events if isinstance(e, p.Failed)]
    assert [(e.rid, e.code) for e in failed] == [("poison", "poison")]
    assert "poison" in failed[0].message and wire.dead_letter_stream(DEFAULT_MODEL_NAME) in failed[0].message
    assert [e.rid for e in events if isinstance(e, p.Finished)] == ["healthy"]
    dead = redis_client.xrange(wire.dead_letter_stream(DEFAULT_MODEL_NAME))
    assert len(dead) == 1 and dead[0][1][b"reason"] == b"failed 3 deliveries"
    assert redis_client.xpending(JOBS, wire.GROUP)["pending"] == 0


def test_sigterm_drains_running_work_then_exits(redis_client: redis.Redis, workers: Workers) -> None:
    proc = workers.start()
    rids = {f"d{i}": i % 2 == 0 for i in range(3)}
    for rid, stream in rids.items():
        redis_client.xadd(JOBS, p.encode_job(_job(rid, stream)))
    deadline = time.monotonic() + 20
    while redis_client.xlen(REPLIES) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    # what it had taken it finished and acked; what it had not read waits for a peer
    assert redis_client.xpending(JOBS, wire.GROUP)["pending"] == 0
    assert redis_client.get(wire.worker_key("w1")) is None  # deregistered on the way out
    workers.start()
    events = _read_all(redis_client, set(rids), timeout_s=20)
    _check_exactly_once(events, rids, tokens=12)


def test_a_draining_worker_hands_the_jobs_placed_on_it_to_its_peers_at_once(
        redis_client: redis.Redis, workers: Workers) -> None:
    """The scheduler places a job on a worker (into its pending entries) just as the worker is
    told to stop: the worker says it drains (its heartbeat is down), finishes what it runs, and
    hands the job it never started to the next reclaim of a peer, instead of leaving it for
    the claim idle time (30 s here) with no one to run it."""
    draining = workers.start("--claim-idle", "30", "--slots", "1", "--echo-step-ms", "250")
    stream = JOBS
    redis_client.xadd(stream, p.encode_job(_job("running", True)))  # 12 tokens of 250 ms: 3 s
    deadline = time.monotonic() + 20
    while redis_client.xlen(REPLIES) < 1 and time.monotonic() < deadline:  # its first token: it runs
        time.sleep(0.01)
    placed = redis_client.xadd(stream, p.encode_job(_job("placed", False)))
    redis_client.xreadgroup(wire.GROUP, "w1", {stream: ">"}, count=1)  # as the scheduler's DISPATCH does
    draining.send_signal(signal.SIGTERM)  # three seconds of "running" left
    started = time.monotonic()
    beat = None
    while time.monotonic() < started + 2 and (beat is None or not beat.down):
        raw = redis_client.get(wire.worker_key("w1"))
        beat = p.decode_heartbeat(raw) if raw else beat
        time.sleep(0.05)
    assert beat is not None and beat.down.startswith("draining")  # no scheduler places more here
    peer = workers.start("--claim-idle", "30")
    events = _read_all(redis_client, {"running", "placed"}, timeout_s=15)
    assert time.monotonic() - started < 10, "the placed job waited for the claim idle time"
    _check_exactly_once(events, {"running": True, "placed": False}, tokens=12)
    reports = {e.batch_id: e.worker for e in events if isinstance(e, p.BatchReport)}
    assert reports == {"b-running": "w1", "b-placed": "w2"}
    assert draining.wait(timeout=20) == 0 and peer.poll() is None
    assert not redis_client.xpending_range(stream, wire.GROUP, min=placed, max=placed, count=1)


def test_a_silent_worker_drops_out_of_the_gateway_view(
    redis_client: redis.Redis, redis_url: str, workers: Workers
) -> None:
    import asyncio

    import redis.asyncio as aioredis

    from gateway.dispatch.dispatcher import Dispatcher
    from gateway.settings import GatewaySettings

    proc = workers.start("--heartbeat-ttl", "1")

    async def view() -> set[str]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            d = Dispatcher(GatewaySettings(redis_url=redis_url, model_name=DEFAULT_MODEL_NAME), client)
            await d.refresh_workers()
            return set(d.workers)
        finally:
            await client.aclose()

    deadline = time.monotonic() + 20
    while "w1" not in asyncio.run(view()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "w1" in asyncio.run(view())
    proc.kill()
    killed = time.monotonic()
    while "w1" in asyncio.run(view()):
        time.sleep(0.05)
        assert time.monotonic() - killed < 10
    assert redis_client.zscore(wire.WORKERS_ZSET, "w1") is None
