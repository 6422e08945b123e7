"""What the workers trim or let expire, so Redis does not grow with traffic."""

from __future__ import annotations

import pytest
import redis

from tests.integration.helpers import send
from workers import protocol as p
from workers import wire
from workers.fencing import Fence

pytestmark = pytest.mark.redis

STREAM = wire.jobs_stream("cpu")
REPLIES = wire.replies_stream("gw-memory")


def _job(i: int) -> p.BatchJob:
    return p.BatchJob(f"b{i}", REPLIES, 0, (p.SeqJob(f"r{i}", (1, 2, 3), p.SamplingParams(4)),))


def test_dead_letters_are_capped_and_tell_clients_on_an_expiring_stream(redis_client: redis.Redis) -> None:
    n = 300
    redis_client.xgroup_create(STREAM, wire.GROUP, id="0", mkstream=True)
    for i in range(n):
        send(redis_client, _job(i))
    redis_client.xadd(STREAM, {"v": "1", "m": b"{unreadable"})
    entries = redis_client.xreadgroup(wire.GROUP, "w", {STREAM: ">"}, count=n + 1)[0][1]
    fence = Fence(redis_client, STREAM, "w")
    for entry_id, fields in entries[:n]:
        assert fence.dead_letter(entry_id, fields[b"m"], p.decode_job(fields), 4, maxlen=10)
    unreadable_id, unreadable = entries[n]
    assert fence.dead_letter(unreadable_id, unreadable[b"m"], None, 4, maxlen=10)
    assert redis_client.xpending(STREAM, wire.GROUP)["pending"] == 0
    assert 10 <= redis_client.xlen(wire.DEAD_LETTER_STREAM) < 100  # capped (approximately) at maxlen
    assert redis_client.pttl(wire.DEAD_LETTER_STREAM) == -1  # kept, never expires
    assert redis_client.xlen(REPLIES) == n  # every client told
    assert 0 < redis_client.pttl(REPLIES) <= wire.REPLIES_TTL_MS
    assert redis_client.xrevrange(wire.DEAD_LETTER_STREAM, count=1)[0][1][b"entry"] == unreadable_id
