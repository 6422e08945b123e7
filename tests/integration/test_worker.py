"""A real worker (echo engine) against a real redis-server."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
import redis

from common import protocol as p
from common import wire
from tests.integration.helpers import MODEL, collect, running_worker, send
from workers.engine import EchoEngine

pytestmark = pytest.mark.redis

REPLIES = wire.replies_stream(MODEL, "gw-test")


def _job(batch: str, rids: list[str], stream: bool = False, max_tokens: int = 8) -> p.BatchJob:
    seqs = tuple(p.SeqJob(r, (1, 2, 3), p.SamplingParams(max_tokens), stream=stream) for r in rids)
    return p.BatchJob(batch, REPLIES, 0, seqs)


def test_worker_answers_reports_and_acks(redis_client: redis.Redis, redis_url: str) -> None:
    with running_worker(redis_url, EchoEngine(tokens=3)):
        send(redis_client, _job("b1", ["r1", "r2"]))
        send(redis_client, _job("b2", ["r3"], stream=True))
        events = collect(redis_client, REPLIES, until_batches=2)
    done = {e.rid: e for e in events if isinstance(e, p.Finished)}
    assert set(done) == {"r1", "r2", "r3"}
    assert done["r1"].text == " echo" * 3 and done["r3"].text == ""
    assert "".join(e.text for e in events if isinstance(e, p.Delta) and e.rid == "r3") == " echo" * 3
    reports = {e.batch_id: e for e in events if isinstance(e, p.BatchReport)}
    assert reports["b1"].batch_size == 2 and reports["b1"].output_tokens == (3, 3)
    # every entry acknowledged only after its replies
    assert redis_client.xpending(wire.jobs_stream(MODEL, "cpu"), wire.GROUP)["pending"] == 0


def test_a_finished_sequence_says_how_long_it_decoded_after_its_first_token(
    redis_client: redis.Redis, redis_url: str
) -> None:
    with running_worker(redis_url, EchoEngine(tokens=6, step_s=0.05)):
        send(redis_client, _job("b1", ["plain"]))
        events = collect(redis_client, REPLIES, until_batches=1)
    done = next(e for e in events if isinstance(e, p.Finished))
    assert done.decode_s is not None and 0.2 <= done.decode_s < 0.5, done  # five steps of 50 ms after the first


def test_replies_still_go_out_after_redis_lost_its_scripts(redis_client: redis.Redis, redis_url: str) -> None:
    """The fenced reply is a bare EVALSHA: a Redis restarted without its script cache answers
    NOSCRIPT, and the worker loads the script and sends the same replies again, once."""
    with running_worker(redis_url, EchoEngine(tokens=2)):
        send(redis_client, _job("before", ["r1"]))
        collect(redis_client, REPLIES, until_batches=1)
        redis_client.script_flush()
        send(redis_client, _job("after", ["r2"], stream=True))
        events = collect(redis_client, REPLIES, until_batches=2)  # from the start of the stream
    assert [e.rid for e in events if isinstance(e, p.Finished)] == ["r1", "r2"]
    assert "".join(e.text for e in events if isinstance(e, p.Delta)) == " echo" * 2  # each delta once
    assert redis_client.xpending(wire.jobs_stream(MODEL, "cpu"), wire.GROUP)["pending"] == 0


def test_heartbeat_announces_and_stop_deregisters(redis_client: redis.Redis, redis_url: str) -> None:
    with running_worker(redis_url, EchoEngine(), worker_id="w-hb"):
        deadline = time.monotonic() + 10
        raw = None
        while raw is None and time.monotonic() < deadline:
            raw = redis_client.get(wire.worker_key("w-hb"))
            time.sleep(0.05)
        assert raw is not None
        hb = p.decode_heartbeat(raw)
        assert (hb.pool, hb.engine, hb.slots) == ("cpu", "echo", 256)
        assert redis_client.zscore(wire.WORKERS_ZSET, "w-hb") is not None
        assert 0 < redis_client.pttl(wire.worker_key("w-hb")) <= 5000
    assert redis_client.get(wire.worker_key("w-hb")) is None
    assert redis_client.zscore(wire.WORKERS_ZSET, "w-hb") is None


def test_unreadable_job_is_dropped_not_fatal(redis_client: redis.Redis, redis_url: str) -> None:
    with running_worker(redis_url, EchoEngine(tokens=1)):
        redis_client.xadd(wire.jobs_stream(MODEL, "cpu"), {"v": str(p.VERSION), "m": b"{broken"})
        send(redis_client, _job("b-ok", ["ok"]))
        events = collect(redis_client, REPLIES, until_batches=1)
    assert [e.rid for e in events if isinstance(e, p.Finished)] == ["ok"]


def test_two_workers_share_a_pool(redis_client: redis.Redis, redis_url: str) -> None:
    with running_worker(redis_url, EchoEngine(tokens=1), worker_id="wa") as a, running_worker(
        redis_url, EchoEngine(tokens=1), worker_id="wb"
    ) as b:
        for i in range(40):
            send(redis_client, _job(f"b{i}", [f"r{i}"]))
        events = collect(redis_client, REPLIES, until_batches=40)
    workers = {e.worker for e in events if isinstance(e, p.BatchReport)}
    assert {e.rid for e in events if isinstance(e, p.Finished)} == {f"r{i}" for i in range(40)}
    assert workers <= {a.settings.worker_id, b.settings.worker_id} and len(workers) >= 1


def _wait_for(condition: Callable[[], object], timeout_s: float = 10, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_job_of_a_gone_gateway_is_acked_and_dropped(
    redis_client: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "tokengate.worker")
    dead = wire.replies_stream(MODEL, "gw-dead")
    redis_client.set(wire.gone_key(dead), 1, ex=60)
    doomed = p.BatchJob("b-gone", dead, 0, (p.SeqJob("r-gone", (1, 2), p.SamplingParams(4), stream=True),))
    redis_client.set(wire.progress_key(MODEL, "r-gone"), "x")
    with running_worker(redis_url, EchoEngine(tokens=2)):
        send(redis_client, doomed)
        send(redis_client, _job("b-live", ["r-live"]))
        events = collect(redis_client, REPLIES, until_batches=1)
        jobs = wire.jobs_stream(MODEL, "cpu")
        _wait_for(lambda: redis_client.xpending(jobs, wire.GROUP)["pending"] == 0, what="acks")
    assert [e.rid for e in events if isinstance(e, p.Finished)] == ["r-live"]
    assert not redis_client.exists(dead)  # nothing generated for it
    assert not redis_client.exists(wire.progress_key(MODEL, "r-gone"))
    assert any("b-gone" in r.getMessage() and "gone" in r.getMessage() for r in caplog.records)


def test_reclaimed_job_of_a_gone_gateway_is_dropped(redis_client: redis.Redis, redis_url: str) -> None:
    dead = wire.replies_stream(MODEL, "gw-dead")
    stream = wire.jobs_stream(MODEL, "cpu")
    redis_client.xgroup_create(stream, wire.GROUP, id="0", mkstream=True)
    send(redis_client, p.BatchJob("b-gone", dead, 0, (p.SeqJob("r-gone", (1,), p.SamplingParams(4)),)))
    # a worker took it and died; its gateway died too and was settled by a survivor
    assert redis_client.xreadgroup(wire.GROUP, "w-dead", {stream: ">"}, count=1)
    redis_client.set(wire.gone_key(dead), 1, ex=60)
    with running_worker(redis_url, EchoEngine(tokens=2)):
        _wait_for(lambda: redis_client.xpending(stream, wire.GROUP)["pending"] == 0, what="the reclaimed entry's ack")
    assert not redis_client.exists(dead)


def test_reply_stream_expires_after_the_last_publish(redis_client: redis.Redis, redis_url: str) -> None:
    with running_worker(redis_url, EchoEngine(tokens=2)):
        send(redis_client, _job("b-ttl", ["r-ttl"], stream=True))
        collect(redis_client, REPLIES, until_batches=1)
    assert 0 < redis_client.pttl(REPLIES) <= wire.REPLIES_TTL_MS


def test_heartbeat_names_running_sequences_and_held_batches(redis_client: redis.Redis, redis_url: str) -> None:
    n = p.HEARTBEAT_MAX_BATCHES + 6
    with running_worker(redis_url, EchoEngine(tokens=10_000, step_s=0.01), worker_id="w-busy") as worker:
        for i in range(n):
            send(redis_client, _job(f"b{i}", [f"r{i}", f"s{i}"], stream=True, max_tokens=10_000))

        def beat() -> p.Heartbeat | None:
            raw = redis_client.get(wire.worker_key("w-busy"))
            return p.decode_heartbeat(raw) if raw else None

        _wait_for(lambda: (hb := beat()) is not None and hb.running == 2 * n, what="a heartbeat with every batch")
        hb = beat()
        assert hb is not None
        assert len(hb.batches) == p.HEARTBEAT_MAX_BATCHES and set(hb.batches) < {f"b{i}" for i in range(n)}
        worker.request_stop()  # the second stop (on leaving) exits without draining


def test_one_read_takes_as_many_jobs_as_free_slots(redis_client: redis.Redis, redis_url: str) -> None:
    from workers.settings import WorkerSettings, connect
    from workers.worker import Worker

    for i in range(5):
        send(redis_client, _job(f"b{i}", [f"r{i}"], max_tokens=1000))
    settings = WorkerSettings(redis_url=redis_url, worker_id="w-read", block_ms=50)
    engine = EchoEngine(tokens=1000, slots=3, step_s=1e-4)
    worker = Worker(settings, engine, connect(settings), model=MODEL)
    calls: list[int] = []
    read = worker.client.xreadgroup

    def counting(*args: object, **kw: object) -> object:
        calls.append(int(kw["count"]))  # type: ignore[call-overload]
        return read(*args, **kw)  # type: ignore[arg-type]

    worker.client.xreadgroup = counting  # type: ignore[method-assign]
    assert worker.tick()
    assert calls == [3] and engine.running == 3 and engine.free_slots == 0
    assert redis_client.xpending(wire.jobs_stream(MODEL, "cpu"), wire.GROUP)["pending"] == 3
    assert worker.tick() and calls == [3]  # no free slot: no read at all
    for rid in ("r0", "r1"):
        engine.cancel(rid)
    assert worker.tick() and calls == [3, 2]  # two slots freed: two jobs in one read
    # the cancelled batches were answered and acked in the same turn
    assert redis_client.xpending(wire.jobs_stream(MODEL, "cpu"), wire.GROUP)["pending"] == 3


def test_a_worker_warms_up_at_start_and_publishes_the_steps_as_telemetry(
    redis_client: redis.Redis, redis_url: str
) -> None:
    from workers.startup import WARM_UP_PROMPT

    with running_worker(redis_url, EchoEngine(slots=8, step_s=0.01), worker_id="w-warm", warm_up_tokens=5):
        _wait_for(lambda: redis_client.xlen(wire.telemetry_stream(MODEL)) > 0, what="the warm-up's telemetry")
        ((_first, fields),) = redis_client.xrange(wire.telemetry_stream(MODEL), count=1)
        warm = p.decode_telemetry(fields)
        _wait_for(lambda: redis_client.zscore(wire.WORKERS_ZSET, "w-warm") is not None, what="the first heartbeat")
    assert warm.worker == "w-warm" and (warm.running, warm.free) == (0, 8)  # nothing left running
    assert sum(s.prefill_tokens for s in warm.steps) == len(WARM_UP_PROMPT)
    assert sum(s.decode_seqs for s in warm.steps) == 5 - 1  # the first token comes with the prefill
    assert all(s.ms >= 10 for s in warm.steps if s.decode_seqs)


def test_a_busy_worker_publishes_step_telemetry_every_quarter_second_and_after_each_prefill(
    redis_client: redis.Redis, redis_url: str
) -> None:
    tokens, n = 120, 6
    with running_worker(redis_url, EchoEngine(tokens=tokens, slots=8, step_s=0.01), worker_id="w-tel",
                        warm_up_tokens=0):  # its entry would come long before the jobs (tested below)
        for i in range(n):
            send(redis_client, _job(f"b{i}", [f"r{i}"], max_tokens=tokens))
        collect(redis_client, REPLIES, until_batches=n)

        def published() -> list[tuple[bytes, p.Telemetry]]:
            return [(i, p.decode_telemetry(f)) for i, f in redis_client.xrange(wire.telemetry_stream(MODEL))]

        _wait_for(lambda: (got := published()) and got[-1][1].running == 0, what="the entry of the idle worker")
        entries = published()
    stamps = [int(i.split(b"-")[0]) for i, _ in entries]  # Redis's clock, milliseconds
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert len(entries) >= 4 and max(gaps[:-1]) <= 250 + 100, gaps  # scheduling slack on a busy host
    records = [s for _, t in entries for s in t.steps]
    assert all(t.worker == "w-tel" and t.slots == 8 and t.step_tokens == 0 and t.dropped == 0 for _, t in entries)
    assert sum(s.prefill_tokens for s in records) == 3 * n  # every prompt is 3 tokens
    # a step that prefilled goes out at once: it ends its entry (gateways count unprefilled tokens)
    assert all(sum(s.prefill_tokens > 0 for s in t.steps) <= (t.steps[-1].prefill_tokens > 0) for _, t in entries)
    assert sum(s.decode_seqs for s in records) == n * (tokens - 1)  # the first token comes with prefill
    assert all(s.ms >= 10 for s in records if s.decode_seqs)
    assert max(s.kv_tokens for s in records) <= n * (3 + tokens)
    last = entries[-1][1]
    assert (last.free, last.running, last.queued_prefill) == (8, 0, 0)
