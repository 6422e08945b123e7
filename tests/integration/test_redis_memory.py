"""What the workers trim or let expire, so Redis does not grow with traffic."""

from __future__ import annotations

import time

import pytest
import redis

from common import protocol as p
from common import wire
from tests.integration.helpers import MODEL, collect, running_worker, send
from workers.engine import EchoEngine
from workers.fencing import Fence
from workers.trim import trim_jobs_stream

pytestmark = pytest.mark.redis

STREAM = wire.jobs_stream(MODEL, "cpu")
REPLIES = wire.replies_stream(MODEL, "gw-memory")


def _job(i: int) -> p.BatchJob:
    return p.BatchJob(f"b{i}", REPLIES, 0, (p.SeqJob(f"r{i}", (1, 2, 3), p.SamplingParams(4)),))


def test_trim_keeps_pending_and_undelivered_entries(redis_client: redis.Redis) -> None:
    redis_client.xgroup_create(STREAM, wire.GROUP, id="0", mkstream=True)
    ids = [redis_client.xadd(STREAM, {"n": i}) for i in range(1000)]
    assert trim_jobs_stream(redis_client, STREAM) is None  # nothing delivered: nothing goes
    read = redis_client.xreadgroup(wire.GROUP, "w", {STREAM: ">"}, count=400)[0][1]
    assert [entry_id for entry_id, _ in read] == ids[:400]
    redis_client.xack(STREAM, wire.GROUP, *ids[:300])  # 300..399 stay pending, 400.. undelivered
    assert trim_jobs_stream(redis_client, STREAM) == ids[300].decode()
    left = [entry_id for entry_id, _ in redis_client.xrange(STREAM)]
    assert left[-700:] == ids[300:]  # every pending and undelivered entry is still there
    assert len(left) < 800  # and most acknowledged ones are gone (XTRIM ~ cuts whole nodes only)
    redis_client.xack(STREAM, wire.GROUP, *ids[300:400])
    assert trim_jobs_stream(redis_client, STREAM) == ids[399].decode()
    assert [entry_id for entry_id, _ in redis_client.xrange(STREAM)][-601:] == ids[399:]


def test_the_jobs_stream_stays_small_under_traffic(redis_client: redis.Redis, redis_url: str) -> None:
    n = 400
    with running_worker(redis_url, EchoEngine(tokens=1), trim_every_s=0.2):
        for i in range(n):
            send(redis_client, _job(i))
        collect(redis_client, REPLIES, until_batches=n)
        deadline = time.monotonic() + 10
        while redis_client.xlen(STREAM) >= 100:  # below one full stream node
            assert time.monotonic() < deadline, f"jobs stream still holds {redis_client.xlen(STREAM)} of {n}"
            time.sleep(0.05)
    assert redis_client.xpending(STREAM, wire.GROUP)["pending"] == 0


def test_dead_letters_are_capped_and_tell_clients_on_an_expiring_stream(redis_client: redis.Redis) -> None:
    n = 300
    redis_client.xgroup_create(STREAM, wire.GROUP, id="0", mkstream=True)
    for i in range(n):
        send(redis_client, _job(i))
    redis_client.xadd(STREAM, {"v": str(p.VERSION), "m": b"{unreadable"})
    entries = redis_client.xreadgroup(wire.GROUP, "w", {STREAM: ">"}, count=n + 1)[0][1]
    fence = Fence(redis_client, MODEL, "cpu", "w")
    for entry_id, fields in entries[:n]:
        assert fence.dead_letter(entry_id, fields[b"m"], p.decode_job(fields), 4, maxlen=10)
    unreadable_id, unreadable = entries[n]
    assert fence.dead_letter(unreadable_id, unreadable[b"m"], None, 4, maxlen=10)
    assert redis_client.xpending(STREAM, wire.GROUP)["pending"] == 0
    assert 10 <= redis_client.xlen(wire.dead_letter_stream(MODEL)) < 100  # capped (approximately) at maxlen
    assert redis_client.pttl(wire.dead_letter_stream(MODEL)) == -1  # kept, never expires
    assert redis_client.xlen(REPLIES) == n  # every client told
    assert 0 < redis_client.pttl(REPLIES) <= wire.REPLIES_TTL_MS
    assert redis_client.xrevrange(wire.dead_letter_stream(MODEL), count=1)[0][1][b"entry"] == unreadable_id
