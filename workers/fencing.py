"""Exactly-once effects over at-least-once delivery, as Redis Lua scripts.

The consumer group's pending-entries list (PEL) is the request state: an entry belongs to
the consumer the PEL names. XAUTOCLAIM moves it atomically to a peer, so a worker may
write replies for an entry only while the PEL still names it, and that check and the
write happen in one script. A worker that was paused (SIGSTOP) and wakes after a peer
reclaimed its entry finds another owner and its late output is discarded.

Streaming sequences also record their progress (generated ids, characters delivered) in
the same script, so the peer that takes over resumes exactly where the client stands.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Any

import redis

from common import protocol as p
from common import wire

# Every key is the model's (``wire.model_slot``: one cluster slot).
# KEYS: 1 jobs stream, 2 reply stream, then n_prog progress keys to write, n_del keys to
#       delete, n_h KV keys and n_h target job streams for hand-overs
# ARGV: 1 group, 2 consumer, 3 entry id, 4 version, 5 reply payload ('' = none), 6 reply
#       maxlen, 7 ack (0/1), 8 ttl ms, 9 n_prog, 10 n_del, 11 n_h, 12 reply stream ttl ms,
#       13 the model's cancel key prefix, then n_prog pairs (ids blob, chars), n_h KV blobs,
#       n_h job payloads, then rids to check for a cancel
_PUBLISH = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p[1] == nil or p[1][2] ~= ARGV[2] then
  return -1
end
local n_prog, n_del, n_h = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
if ARGV[5] ~= '' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'v', ARGV[4], 'm', ARGV[5])
  redis.call('PEXPIRE', KEYS[2], ARGV[12])
end
local k, a = 3, 14
for i = 1, n_prog do
  redis.call('HSET', KEYS[k], 'ids', ARGV[a], 'chars', ARGV[a + 1])
  redis.call('PEXPIRE', KEYS[k], ARGV[8])
  k, a = k + 1, a + 2
end
for i = 1, n_del do
  redis.call('DEL', KEYS[k])
  k = k + 1
end
for i = 1, n_h do
  redis.call('SET', KEYS[k], ARGV[a], 'PX', ARGV[8])
  redis.call('XADD', KEYS[k + n_h], '*', 'v', ARGV[4], 'm', ARGV[a + n_h])
  k, a = k + 1, a + 1
end
a = a + n_h
if ARGV[7] == '1' then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
end
local cancelled = {}
for i = a, #ARGV do
  if redis.call('EXISTS', ARGV[13] .. ARGV[i]) == 1 then
    cancelled[#cancelled + 1] = ARGV[i]
  end
end
return cancelled
"""

# Set the idle time of entries this consumer still owns: 0 keeps a long batch from being
# stolen (touch); the claim idle time hands an abandoned one to the next XAUTOCLAIM (release).
# KEYS: 1 jobs stream; ARGV: 1 group, 2 consumer, 3 idle ms, 4.. entry ids
_TOUCH = """
local kept = 0
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] ~= nil and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
    kept = kept + 1
  end
end
return kept
"""

# Move a poison entry to the dead-letter stream, tell its clients, ack it: all or nothing.
# KEYS: 1 jobs stream, 2 dead-letter stream, 3 reply stream
# ARGV: 1 group, 2 consumer, 3 entry id, 4 version, 5 job payload, 6 error payload ('' =
#       none: the job named no reply stream), 7 reason, 8 dead-letter maxlen, 9 reply
#       stream ttl ms
_DEAD_LETTER = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p[1] == nil or p[1][2] ~= ARGV[2] then
  return 0
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*', 'v', ARGV[4], 'm', ARGV[5], 'entry', ARGV[3],
           'reason', ARGV[7])
if ARGV[6] ~= '' then
  redis.call('XADD', KEYS[3], '*', 'v', ARGV[4], 'm', ARGV[6])
  redis.call('PEXPIRE', KEYS[3], ARGV[9])
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


@dataclass(frozen=True, slots=True)
class Publish:
    keys: list[str]
    args: list[bytes | str | int]


@dataclass(frozen=True, slots=True)
class HandoffWrite:
    rid: str
    kv_key: str
    kv: bytes  # safetensors
    stream: str  # the target pool's jobs stream
    job: bytes  # the encoded job document ("m")


DEAD_LETTER_MAXLEN = 10_000  # approximate cap of the dead-letter stream (XADD MAXLEN ~)


def pack_ids(ids: tuple[int, ...]) -> bytes:
    return array.array("I", ids).tobytes()


def unpack_ids(blob: bytes) -> tuple[int, ...]:
    out = array.array("I")
    out.frombytes(blob)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Progress:
    ids: tuple[int, ...]
    chars: int


class Fence:
    """The scripts bound to one worker's identity (its model and pool's stream, group, consumer)."""

    def __init__(self, client: redis.Redis, model: str, pool: str, consumer: str, progress_ttl_s: float = 3600) -> None:
        self.client = client
        self.model = model
        self.stream = wire.jobs_stream(model, pool)
        self.dead_letters = wire.dead_letter_stream(model)
        self.consumer = consumer
        self.progress_ttl_ms = int(progress_ttl_s * 1000)
        self._publish = client.register_script(_PUBLISH)
        self._touch = client.register_script(_TOUCH)
        self._dead = client.register_script(_DEAD_LETTER)

    def publish(
        self,
        entry_id: bytes,
        reply_to: str,
        events: list[p.Event],
        ack: bool,
        progress: dict[str, tuple[tuple[int, ...], int]],
        delete: list[str],
        handoffs: list[HandoffWrite],
        check_cancel: list[str],
        maxlen: int,
    ) -> Publish:
        """One fenced publish, for ``run``; its result is -1 (no longer ours) or the list of
        ``check_cancel`` ids that have a cancel request."""
        payload = p.encode_events(events)["m"] if events else b""
        writes = list(progress.items())
        keys = [self.stream, reply_to]
        keys += [wire.progress_key(self.model, rid) for rid, _ in writes]
        keys += delete
        keys += [h.kv_key for h in handoffs] + [h.stream for h in handoffs]
        args: list[bytes | str | int] = [
            wire.GROUP, self.consumer, entry_id, p.VERSION, payload, maxlen, int(ack), self.progress_ttl_ms,
            len(writes), len(delete), len(handoffs), wire.REPLIES_TTL_MS, wire.cancel_prefix(self.model),
        ]
        for _rid, (ids, chars) in writes:
            args += [pack_ids(ids), chars]
        args += [h.kv for h in handoffs] + [h.job for h in handoffs]
        args += check_cancel
        return Publish(keys, args)

    def run(self, publishes: list[Publish]) -> list[Any]:
        """Run publishes in one pipeline of EVALSHA, their results in order. (redis-py's
        ``Script`` in a pipeline sends SCRIPT EXISTS first: a round trip more on every reply.)
        A Redis that lost its scripts (restarted) answers NOSCRIPT and ran none of them: the
        script is loaded and the same publishes run again, once."""
        try:
            return self._run(publishes)
        except redis.exceptions.NoScriptError:
            self.client.script_load(_PUBLISH)
            return self._run(publishes)

    def _run(self, publishes: list[Publish]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for call in publishes:
            pipe.evalsha(self._publish.sha, len(call.keys), *call.keys, *call.args)
        return list(pipe.execute())

    def touch(self, entry_ids: list[bytes], idle_ms: int = 0) -> int:
        """Mark entries this worker still owns as idle for ``idle_ms`` (0: busy now); how many
        it still owns."""
        if not entry_ids:
            return 0
        return int(self._touch(keys=[self.stream], args=[wire.GROUP, self.consumer, idle_ms, *entry_ids]))

    def release(self, entry_ids: list[bytes], claim_idle_ms: int) -> int:
        """Hand abandoned entries to the next XAUTOCLAIM (a peer's, or this worker's) now,
        instead of after the claim idle time; their delivery count is not changed."""
        return self.touch(entry_ids, claim_idle_ms)

    def dead_letter(
        self,
        entry_id: bytes,
        job_payload: bytes,
        job: p.BatchJob | None,
        deliveries: int,
        maxlen: int = DEAD_LETTER_MAXLEN,
    ) -> bool:
        reason = f"failed {deliveries} deliveries"
        errors: list[p.Event] = [
            p.Failed(
                s.rid, "poison", f"request {s.rid} {reason}; moved to the dead-letter stream {self.dead_letters}"
            )
            for s in (job.seqs if job else ())
        ]
        # an unreadable job names no reply stream: the third key is then a placeholder
        reply_to = job.reply_to if job else self.dead_letters
        payload = p.encode_events(errors)["m"] if job else b""
        return bool(
            self._dead(
                keys=[self.stream, self.dead_letters, reply_to],
                args=[
                    wire.GROUP, self.consumer, entry_id, p.VERSION, job_payload, payload, reason, maxlen,
                    wire.REPLIES_TTL_MS,
                ],
            )
        )

    def progress(self, rids: list[str]) -> dict[str, Progress]:
        pipe = self.client.pipeline(transaction=False)
        for rid in rids:
            pipe.hmget(wire.progress_key(self.model, rid), "ids", "chars")
        out: dict[str, Progress] = {}
        for rid, (ids, chars) in zip(rids, pipe.execute(), strict=True):
            if ids is not None and chars is not None:
                out[rid] = Progress(unpack_ids(ids), int(chars))
        return out
