"""A pool worker: XREADGROUP batches, run them through an engine, publish replies, XACK.

Delivery is at least once, effects exactly once (see ``workers/fencing.py``):
- replies and the XACK of a finished batch are written by one fenced script, only while
  the group's pending list still names this worker as the entry's owner;
- a worker that dies leaves its entries pending; peers XAUTOCLAIM entries idle longer
  than ``claim_idle_s`` and resume streaming sequences from their recorded progress;
- a live worker keeps its long batches from being claimed by touching them (heartbeat
  thread), so only a dead or stopped worker loses its entries;
- an entry delivered more than ``max_deliveries`` times goes to the dead-letter stream
  and its clients get an error naming their request id;
- a job whose gateway is gone (``wire.gone_key``) is acked and dropped, not generated.
- a job that was in an engine step that failed is marked a suspect (``wire.suspect_key``);
  whoever reclaims it runs it alone on an idle engine, reading nothing new meanwhile, so a
  poison job reaches dead letter without taking the jobs it was read with along.

Redis faults never end a worker (``common/retry.py``): every loop backs off and tries
again; batches whose replies cannot be written are abandoned to redelivery; a consumer
group lost with Redis's data is created again.

Shutdown follows uvicorn: the first signal drains (no new batches, finish the running
ones, ack, exit), the second exits at once, leaving unacked entries to peers.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from common import protocol as p
from common import wire
from common.pools import POOLS
from common.retry import Outage, Retrier, backoff_policy, is_nogroup
from workers import selfprofile
from workers.devices import DTYPES
from workers.engine import Engine, Handoff, StepResult
from workers.fencing import Fence, HandoffWrite, Progress, Publish
from workers.trim import trim_jobs_stream

log = logging.getLogger("tokengate.worker")

SUSPECT_TTL_S = 3600  # a suspect mark outlives any redelivery cycle of its entry
CANCEL_POLL_S = 0.1  # the cancel thread checks for a stop this often (the exit joins it)
WARM_UP_PROMPT = tuple(range(100, 132))  # 32 token ids, valid in any vocabulary of a real model
WARM_UP_TEXT = "Count from one to twenty in words: one, two, three,"  # the same, for an upstream engine

ENGINES = ("hf", "echo", "upstream")


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    redis_url: str
    pool: str = "cpu"
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    engine: str = "hf"  # "hf" | "echo" | "upstream"
    model: str | None = None
    model_name: str | None = None
    cache_dir: Path | None = None
    slots: int = 32
    step_tokens: int = 64  # per-step token budget, decode plus prefill (0: none); see docs/benchmarks.md
    echo_tokens: int = 16
    echo_step_s: float = 0.0
    threads: int | None = None
    dtype: str = "auto"  # a CPU worker's dtype (workers.devices.DTYPES)
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    block_ms: int = 100  # an idle read's block: a stop signal is noticed within it (it cannot cut it short)
    reply_maxlen: int = 100_000
    claim_idle_s: float = 15.0  # a pending entry idle this long belongs to a dead worker
    claim_every_s: float = 1.0
    max_deliveries: int = 3
    redis_timeout_s: float = 5.0  # socket connect and read timeout of every Redis call
    retry_base_s: float = 0.05  # backoff after a failed Redis call: base·2^failures seconds,
    retry_cap_s: float = 2.0  # at most this
    trim_every_s: float = 5.0  # how often the heartbeat thread trims the jobs stream
    telemetry_every_s: float = 0.25  # step records go out at least this often while busy
    warm_up_tokens: int = 16  # a greedy sequence of this many tokens runs before the first heartbeat (0: none)
    profile_s: float = 10.0  # the self-profile's time budget at start (0: none; workers/selfprofile.py)
    profile_dir: Path | None = None  # profiles kept per machine fingerprint (default ~/.cache/tokengate/profiles)
    upstream_url: str | None = None  # engine "upstream": the OpenAI-compatible server it fronts
    upstream_model: str | None = None  # the model name sent upstream (default: the first of its /v1/models)
    upstream_timeout_s: float = 60.0  # longest wait for the upstream's next chunk before it counts as down

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, not {self.pool!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, not {self.dtype!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, not {self.engine!r}")
        if (self.engine == "upstream") != (self.upstream_url is not None):
            raise ValueError("the upstream engine needs an upstream URL, and only it takes one")
        if self.upstream_timeout_s <= 0:
            raise ValueError("the upstream timeout must be positive")
        if self.slots < 1:
            raise ValueError("slots must be at least 1")
        if self.step_tokens < 0:
            raise ValueError("step tokens must be 0 (no budget) or more")
        if self.claim_idle_s <= 3 * self.heartbeat_s:
            raise ValueError("claim idle time must exceed three heartbeat intervals")
        if self.heartbeat_ttl_s <= self.heartbeat_s:
            raise ValueError("heartbeat TTL must exceed the heartbeat interval")
        if self.max_deliveries < 1:
            raise ValueError("max deliveries must be at least 1")
        if self.redis_timeout_s * 1000 <= self.block_ms:
            raise ValueError("the Redis timeout must exceed the blocking read time")
        if not 0 < self.retry_base_s <= self.retry_cap_s:
            raise ValueError("retry backoff needs 0 < base <= cap")
        if not 0 <= self.profile_s < math.inf:
            raise ValueError("the self-profile budget must be 0 (none) or a number of seconds")


def connect(settings: WorkerSettings) -> redis.Redis:
    """The worker's Redis client. redis-py retries nothing itself: a pipeline re-sent after
    a timeout could run a fenced publish twice (the same reply written twice); the
    worker's loops retry instead, each with its own backoff (``common/retry.py``)."""
    return redis.Redis.from_url(
        settings.redis_url,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


@dataclass(slots=True)
class _Batch:
    entry_id: bytes
    job: p.BatchJob
    pending: set[str]
    prefill_s: float = 0.0
    padded_tokens: int = 0
    decode_steps: int = 0
    decode_s: float = 0.0
    running: int = 0  # sum over its decode steps of the sequences each step advanced
    output_tokens: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Admission:
    """A job read from the stream (fresh or reclaimed), before it enters the engine."""

    entry_id: bytes
    job: p.BatchJob
    progress: dict[str, Progress]


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        client: redis.Redis,
        model: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.model = model
        self.stream = wire.jobs_stream(settings.pool)
        self.fence = Fence(client, self.stream, settings.worker_id)
        self._batches: dict[str, _Batch] = {}  # batch_id -> state
        self._batch_of: dict[str, str] = {}  # rid -> batch_id
        self._lock = threading.Lock()  # guards _batches for the heartbeat thread
        self._cancels: deque[str] = deque()  # from the pub/sub thread
        self._recent_cancels: dict[str, float] = {}
        self._signals = 0
        self._stop_threads = threading.Event()
        self._tokens = 0
        self._started = time.time()
        self._clock = clock
        self._sleep = sleep
        self._next_claim = 0.0
        self._group_ready = False
        # after a Redis failure: a read Redis may have delivered unseen (re-read from this
        # consumer's own pending entries), and abandoned entries not yet handed back
        self._reread_own = False
        self._unreleased: list[bytes] = []
        self._first_token_at: dict[str, float] = {}  # rid -> when the step that sampled its first token ended
        self._backoff = backoff_policy(settings.retry_base_s, settings.retry_cap_s)
        self._outage = Outage(clock)
        self._retry = Retrier(self._backoff, self._outage, sleep)  # the main loop's
        self._isolated: deque[_Admission] = deque()  # reclaimed suspects, to run one at a time
        self._alone: str | None = None  # the batch id of the suspect running alone
        self._steps: deque[p.StepRecord] = deque()  # not yet in a telemetry entry
        self._dropped = 0  # step records left out since the last entry
        self._telemetry_at = float("-inf")  # when the last entry went out
        self.profile: dict[str, Any] = {}  # the engine's measured profile, published with each heartbeat
        self._profile_stored = False  # kept in wire.PROFILES_HASH yet

    # -- lifecycle ------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("draining: no new batches; finishing %d running", len(self._batches))
        else:
            log.info("second signal: exiting now; unacked entries go to peers")

    def warm_up(self) -> None:
        """One short greedy sequence before the first heartbeat: the engine's first-call
        costs are paid here, not by a client, and its steps go out as telemetry at once, so
        that a gateway's first contracts price this machine as it runs now, not only the
        packaged profile."""
        tokens = self.settings.warm_up_tokens
        if tokens <= 0:
            return
        params = p.SamplingParams(tokens, 0.0, ignore_eos=True)
        self.engine.add(p.SeqJob("warm-up", WARM_UP_PROMPT, params, text=WARM_UP_TEXT))
        while self.engine.busy:
            self._steps.extend(self.engine.step().records())
        self.engine.reset()
        self._publish_telemetry()

    def measure_engine(self) -> None:
        """The engine's step-time profile, measured (or a stored one re-checked) before the
        first heartbeat, which publishes it (``workers/selfprofile.py``). An upstream
        server's steps are not this worker's to time: gateways fit those online only."""
        if self.engine.name == "upstream":
            return
        s = self.settings
        setup = {"model": self.model, "slots": self.engine.slots, "step_tokens": self.engine.step_tokens,
                 "echo_step_s": s.echo_step_s if self.engine.name == "echo" else 0.0}
        self.profile = selfprofile.obtain(
            self.engine, pool=s.pool, model=self.model, setup=setup, budget_s=s.profile_s,
            slots=self.engine.slots, directory=s.profile_dir) or {}

    def run(self) -> None:
        self.warm_up()
        self.measure_engine()
        threads = [
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True),
            threading.Thread(target=self._cancel_loop, name="cancels", daemon=True),
        ]
        for t in threads:
            t.start()
        log.info(
            "worker %s serving pool %s (%s on %s/%s, %d slots; %s)",
            self.settings.worker_id,
            self.settings.pool,
            self.engine.name,
            self.engine.device,
            self.engine.dtype,
            self.engine.slots,
            self.engine.choice,
        )
        try:
            while self._signals < 2 and self.tick():
                pass
        finally:
            self._stop_threads.set()
            for t in threads:
                t.join(timeout=2)
            self._deregister()
        log.info("worker %s stopped", self.settings.worker_id)

    def tick(self) -> bool:
        """One turn of the main loop; False once a drain has finished. A Redis error never
        escapes: the loop waits per its backoff policy and the next turn tries again."""
        started = self._clock()
        try:
            if not self._group_ready:
                self._ensure_group()
            if self._signals == 0 and self.engine.down and not self.engine.busy:
                self._sleep(self.settings.block_ms / 1000)  # no job is read while the engine is down
            elif self._signals == 0:
                self._release_abandoned()
                self._reclaim()
                if self._isolated or self._alone is not None:
                    self._run_alone()
                else:
                    self._read(0 if self.engine.busy else self.settings.block_ms)
            elif not self.engine.busy:
                return False
            self._apply_cancels()
            if self.engine.busy:
                self._step()
            self._publish_telemetry()
        except redis.RedisError as exc:
            if is_nogroup(exc):
                # Redis came back without its data: no group, no stream, no pending entries
                log.warning("consumer group %s of %s is gone: creating it again", wire.GROUP, self.stream)
                self._group_ready = False
            else:
                self._retry.failed(exc)
            self._reread_own = True  # a read that timed out may have been delivered all the same
            return True
        # every turn after a failed one makes a Redis call (read, reclaim or group), so
        # reaching here after a failure means Redis answered
        self._retry.succeeded(started)
        return True

    def _ensure_group(self) -> None:
        try:
            self.client.xgroup_create(self.stream, wire.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    # -- jobs in ----------------------------------------------------------------------------

    def _read(self, block_ms: int) -> None:
        """As many jobs as the engine has free slots, in one XREADGROUP. After a Redis failure,
        first this consumer's own pending entries that it does not hold: a read that timed out
        here may have been delivered by Redis all the same, and would otherwise wait for the
        claim idle time."""
        free = self.engine.free_slots
        if free <= 0:
            return
        reread = self._reread_own
        held = {b.entry_id for b in self._batches.values()} if reread else set()
        reply = self.client.xreadgroup(
            wire.GROUP, self.settings.worker_id, {self.stream: "0" if reread else ">"}, count=free + len(held),
            block=None if reread else block_ms or None,
        )
        # RESP2: [[stream, [(id, fields), ...]]], or None when the block timed out
        entries = [entry for _stream, got in reply for entry in got] if isinstance(reply, list) else []
        if reread:
            self._reread_own = False
            entries = [(entry_id, fields) for entry_id, fields in entries if entry_id not in held and fields][:free]
            if entries:
                log.info("re-reading %d jobs delivered while Redis failed", len(entries))
        readable = [self._decode(entry_id, fields) for entry_id, fields in entries]
        self._admit([_Admission(entry_id, job, {}) for entry_id, job in readable if job is not None])

    def _release_abandoned(self) -> None:
        """Entries abandoned while Redis failed go to the next XAUTOCLAIM (this worker's, at
        once) instead of waiting out the claim idle time."""
        if self._unreleased:
            self.fence.release(self._unreleased, int(self.settings.claim_idle_s * 1000))
            self._unreleased = []
            self._next_claim = 0.0

    def _reclaim(self) -> None:
        now = self._clock()
        if now < self._next_claim or self.engine.free_slots <= 0:
            return
        self._next_claim = now + self.settings.claim_every_s
        _next, entries, _deleted = self.client.xautoclaim(
            self.stream,
            wire.GROUP,
            self.settings.worker_id,
            min_idle_time=int(self.settings.claim_idle_s * 1000),
            start_id="0-0",
            count=max(1, min(self.engine.free_slots, 16)),
        )
        admitted: list[_Admission] = []
        if entries:
            pipe = self.client.pipeline(transaction=False)
            for entry_id, _fields in entries:
                pipe.exists(wire.suspect_key(wire.text(entry_id)))
            suspect = {entry_id for (entry_id, _), flag in zip(entries, pipe.execute(), strict=True) if flag}
        for entry_id, fields in entries:
            if not fields:  # trimmed away while pending
                self.client.xack(self.stream, wire.GROUP, entry_id)
                continue
            info = self.client.xpending_range(self.stream, wire.GROUP, min=entry_id, max=entry_id, count=1)
            deliveries = int(info[0]["times_delivered"]) if info else 1
            log.warning("reclaimed %s from a silent worker (delivery %d)", entry_id.decode(), deliveries)
            if deliveries > self.settings.max_deliveries:
                self._dead_letter(entry_id, fields, deliveries)
                continue
            _, job = self._decode(entry_id, fields)
            if job is not None:
                a = _Admission(entry_id, job, self.fence.progress([s.rid for s in job.seqs]))
                (self._isolated if entry_id in suspect else admitted).append(a)
        self._admit(admitted)

    def _run_alone(self) -> None:
        """Suspects (jobs that were in a step that failed) run one at a time on an idle
        engine, and no new job is read meanwhile: a job that makes the model fail cannot take
        healthy jobs down with it twice (they would share its fate and its way to dead
        letter)."""
        if self._alone is not None and self._alone not in self._batches:
            self._alone = None  # it finished, or failed and was abandoned again
        if self._alone is None and self._isolated and not self.engine.busy:
            a = self._isolated.popleft()
            log.warning("running suspect entry %s alone", a.entry_id.decode())
            self._alone = a.job.batch_id
            self._admit([a])

    def _dead_letter(self, entry_id: bytes, fields: dict[bytes, bytes], deliveries: int) -> None:
        try:
            job: p.BatchJob | None = p.decode_job(fields)
        except p.ProtocolError:
            job = None
        if self.fence.dead_letter(entry_id, fields.get(b"m", b""), job, deliveries):
            log.error(
                "entry %s failed %d deliveries: moved to %s", entry_id.decode(), deliveries, wire.DEAD_LETTER_STREAM
            )

    def _decode(self, entry_id: bytes, fields: dict[bytes, bytes]) -> tuple[bytes, p.BatchJob | None]:
        """The entry's job; an unreadable one is acked and dropped (None)."""
        try:
            return entry_id, p.decode_job(fields)
        except p.ProtocolError as exc:
            log.error("dropping unreadable entry %s: %s", entry_id, exc)
            self.client.xack(self.stream, wire.GROUP, entry_id)
            return entry_id, None

    def _admit(self, admissions: list[_Admission]) -> None:
        """Run the jobs, then screen them in one round trip (gateway gone? sequence
        cancelled?) and drop or cancel what the screening finds, before any engine step: an
        engine that starts work on ``add`` (an upstream request) starts it a round trip
        sooner, and nothing is generated for a gone job by an engine that works in steps.
        A failed screening leaves the jobs running (their publishes still check for
        cancels); the KV caches of handed-over prefills are read before anything is added."""
        if not admissions:
            return
        kv = {s.rid: self._load_kv(s) for a in admissions for s in a.job.seqs if s.kv_key is not None}
        for a in admissions:
            self._accept(a, {s.rid for s in a.job.seqs if s.rid in self._recent_cancels}, kv)
        pipe = self.client.pipeline(transaction=False)
        for a in admissions:
            pipe.exists(wire.gone_key(a.job.reply_to))
            for s in a.job.seqs:  # cancels sent before this worker subscribed (or while it was down)
                pipe.exists(wire.cancel_key(s.rid))
        flags = iter(pipe.execute())
        gone: list[_Admission] = []
        for a in admissions:
            if next(flags):
                gone.append(a)
            for s in a.job.seqs:
                if next(flags):
                    self.engine.cancel(s.rid)
        if gone:
            self._abandon([s.rid for a in gone for s in a.job.seqs])
            self._drop_gone(gone)

    def _drop_gone(self, gone: list[_Admission]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for a in gone:
            pipe.xack(self.stream, wire.GROUP, a.entry_id)
            pipe.delete(*[wire.progress_key(s.rid) for s in a.job.seqs], *[wire.kv_key(s.rid) for s in a.job.seqs])
        pipe.execute()
        for a in gone:
            log.info("dropped batch %s: its gateway is gone (%s)", a.job.batch_id, a.job.reply_to)

    def _accept(self, a: _Admission, cancelled: set[str], kv: dict[str, dict[str, object] | None]) -> None:
        with self._lock:
            self._batches[a.job.batch_id] = _Batch(a.entry_id, a.job, {s.rid for s in a.job.seqs})
        for seq in a.job.seqs:
            self._batch_of[seq.rid] = a.job.batch_id
            done = a.progress.get(seq.rid)
            if done is not None:
                seq = replace(seq, resume_ids=done.ids, resume_chars=done.chars)
            self.engine.add(seq, kv.get(seq.rid))
            if seq.rid in cancelled:
                self.engine.cancel(seq.rid)

    def _load_kv(self, seq: p.SeqJob) -> dict[str, object] | None:
        """A handed-over prefill; if it expired, the engine recomputes it (same tokens)."""
        if seq.kv_key is None:
            return None
        blob = self.client.get(seq.kv_key)
        if not isinstance(blob, bytes):
            log.warning("KV cache of %s is gone; recomputing its prefill", seq.rid)
            return None
        from safetensors.torch import load

        return dict(load(blob))

    # -- cancellation ---------------------------------------------------------------------

    def _cancel_loop(self) -> None:
        """Subscribed until stopped; a lost connection is subscribed again after a backoff.
        Cancels published meanwhile are not lost: their keys are checked when a job is
        admitted and at every publish (``check_cancel``)."""
        retry = Retrier(self._backoff, self._outage, self._stop_threads.wait)
        while not self._stop_threads.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(wire.CANCEL_CHANNEL)
                while not self._stop_threads.is_set():
                    msg = pubsub.get_message(timeout=CANCEL_POLL_S)
                    retry.reset()  # subscribed; whether Redis answers, the other loops tell
                    if msg is not None:
                        self._cancels.append(wire.text(msg["data"]))
            except redis.RedisError as exc:
                log.debug("cancel subscription lost (%s): subscribing again after a backoff", exc)
                retry.failed(exc)
            finally:
                pubsub.close()

    def _apply_cancels(self) -> None:
        now = time.monotonic()
        while self._cancels:
            rid = self._cancels.popleft()
            self._recent_cancels[rid] = now
            if rid in self._batch_of and self.engine.cancel(rid):
                log.info("cancelled %s", rid)
        if len(self._recent_cancels) > 10_000:
            horizon = now - 600
            self._recent_cancels = {r: t for r, t in self._recent_cancels.items() if t > horizon}

    # -- stepping and replies -------------------------------------------------------------

    def _step(self) -> None:
        try:
            result = self.engine.step()
        except Exception:
            log.exception("engine step failed; abandoning its batches to redelivery, each to run alone")
            suspects = [b.entry_id for b in self._batches.values()]
            self.engine.reset()
            self._abandon(list(self._batch_of))
            pipe = self.client.pipeline(transaction=False)
            for entry_id in suspects:
                pipe.set(wire.suspect_key(wire.text(entry_id)), 1, ex=SUSPECT_TTL_S)
            pipe.execute()
            return
        if result.failed:
            log.error("%s failed in the engine; their batches go back for redelivery", ", ".join(result.failed))
            self.fence.release(self._abandon(result.failed), int(self.settings.claim_idle_s * 1000))
        for record in result.records():
            self._steps.append(record)
            if len(self._steps) > p.TELEMETRY_MAX_STEPS:
                self._steps.popleft()
                self._dropped += 1
        try:
            self._publish(result)
        except redis.RedisError as exc:
            log.warning(
                "publishing replies failed (%s); abandoning %d running batches to redelivery", exc, len(self._batches)
            )
            self.engine.reset()
            self._unreleased.extend(self._abandon(list(self._batch_of)))  # handed back once Redis answers
            raise  # the main loop backs off (or creates a lost group again)

    def _abandon(self, rids: list[str]) -> list[bytes]:
        """Forget batches without acking them: after the claim idle time a peer (or this
        worker) takes them over, and their delivery count moves them toward dead letter.
        Their entry ids, for ``Fence.release`` to hand them over at once."""
        entries: list[bytes] = []
        for bid in {self._batch_of.pop(r) for r in rids if r in self._batch_of}:
            with self._lock:
                batch = self._batches.pop(bid, None)
            if batch is None:
                continue
            entries.append(batch.entry_id)
            for rid in batch.pending:
                self._batch_of.pop(rid, None)
                self._first_token_at.pop(rid, None)
                self.engine.cancel(rid)
        return entries

    def _publish(self, result: StepResult) -> None:
        self._account(result)
        now = time.monotonic()
        for pre in result.prefills:  # a chunked prompt's last chunk is the one that samples its first token
            self._first_token_at.update(dict.fromkeys(pre.rids, now))
        events: dict[str, list[p.Event]] = {}
        for ev in result.events:
            if isinstance(ev, p.Finished | p.Failed):
                first = self._first_token_at.pop(ev.rid, None)
                if isinstance(ev, p.Finished) and first is not None and ev.decode_s is None:
                    ev = replace(ev, decode_s=round(now - first, 6))
            bid = self._batch_of.get(ev.rid)
            if bid is not None:
                events.setdefault(bid, []).append(ev)
        handoffs: dict[str, list[HandoffWrite]] = {}
        for h in result.handoffs:
            bid = self._batch_of.get(h.seq.rid)
            if bid is not None:
                handoffs.setdefault(bid, []).append(self._handoff_write(self._batches[bid], h))
                events.setdefault(bid, [])
        if not events:
            return
        publishes: list[Publish] = []
        order: list[tuple[_Batch, bool]] = []
        for bid, evs in events.items():
            b = self._batches[bid]
            finished = [ev.rid for ev in evs if isinstance(ev, p.Finished | p.Failed)]
            moved = handoffs.get(bid, [])
            b.pending.difference_update(finished)
            b.pending.difference_update(h.rid for h in moved)
            done = not b.pending
            if done:
                evs.append(self._report(b))
            streamed = {ev.rid for ev in evs if isinstance(ev, p.Delta)}
            progress = {rid: result.progress[rid] for rid in streamed if rid in result.progress}
            delete = [wire.progress_key(r) for r in finished] + [wire.kv_key(r) for r in finished]
            publishes.append(self.fence.publish(
                b.entry_id, b.job.reply_to, evs, done, progress, delete, moved,
                check_cancel=list(b.pending), maxlen=self.settings.reply_maxlen,
            ))
            order.append((b, done))
        for (b, done), outcome in zip(order, self.fence.run(publishes), strict=True):
            if outcome == -1:
                log.warning("batch %s now belongs to a peer: dropping this worker's copy", b.job.batch_id)
                self._abandon(list(b.pending) or [s.rid for s in b.job.seqs])
                continue
            for rid in outcome or []:
                self.engine.cancel(rid.decode() if isinstance(rid, bytes) else rid)
            if done:
                with self._lock:
                    self._batches.pop(b.job.batch_id, None)
                for s in b.job.seqs:
                    self._batch_of.pop(s.rid, None)

    def _handoff_write(self, b: _Batch, h: Handoff) -> HandoffWrite:
        """Prefill ran here; decoding continues on the handoff pool with this KV cache."""
        from safetensors.torch import save

        target = b.job.handoff_pool(h.seq.rid)
        b.output_tokens[h.seq.rid] = len(h.seq.resume_ids)
        key = wire.kv_key(h.seq.rid)
        job = p.BatchJob(f"{b.job.batch_id}/{h.seq.rid}", b.job.reply_to, b.job.bucket, (replace(h.seq, kv_key=key),))
        return HandoffWrite(h.seq.rid, key, save(h.kv), wire.jobs_stream(target), p.encode_job(job)["m"])

    def _account(self, result: StepResult) -> None:
        for pre in result.prefills:
            # a prefill pass may hold sequences of several batches: each pays its share
            mine: dict[str, int] = {}
            for r in pre.rids:
                if r in self._batch_of:
                    mine[self._batch_of[r]] = mine.get(self._batch_of[r], 0) + 1
            for bid, n in mine.items():
                b = self._batches[bid]
                b.prefill_s += pre.seconds * n / len(pre.rids)
                b.padded_tokens = max(b.padded_tokens, pre.padded_tokens)
        running = len(result.decode_rids)
        for bid in {self._batch_of[r] for r in result.decode_rids if r in self._batch_of}:
            b = self._batches[bid]
            b.decode_steps += 1
            b.decode_s += result.decode_s
            b.running += running
        for ev in result.events:
            if isinstance(ev, p.Finished) and ev.rid in self._batch_of:
                self._tokens += ev.completion_tokens
                self._batches[self._batch_of[ev.rid]].output_tokens[ev.rid] = ev.completion_tokens

    def _report(self, b: _Batch) -> p.BatchReport:
        return p.BatchReport(
            batch_id=b.job.batch_id,
            pool=self.settings.pool,
            worker=self.settings.worker_id,
            batch_size=len(b.job.seqs),
            prompt_tokens=b.padded_tokens,
            prefill_s=b.prefill_s,
            decode_steps=b.decode_steps,
            decode_s=b.decode_s,
            output_tokens=tuple(b.output_tokens.get(s.rid, 0) for s in b.job.seqs),
            mean_running=b.running / b.decode_steps if b.decode_steps else 0.0,
        )

    # -- telemetry ------------------------------------------------------------------------

    def telemetry(self) -> p.Telemetry:
        return p.Telemetry(
            worker=self.settings.worker_id,
            pool=self.settings.pool,
            slots=self.engine.slots,
            free=self.engine.free_slots,
            running=self.engine.running,
            queued_prefill=self.engine.queued_prefill,
            step_tokens=self.engine.step_tokens,
            steps=tuple(self._steps),
            dropped=self._dropped,
        )

    def _publish_telemetry(self) -> None:
        """XADD the buffered step records once ``telemetry_every_s`` passed since the last
        entry, at once after a step that prefilled prompt tokens (gateways count the prompt
        tokens they sent that are not prefilled yet, docs/scheduling.md §6), and at once
        when the engine falls idle. A failed XADD raises to the main loop, which backs off
        like after any Redis error; the records wait, capped, for the next entry
        (``dropped`` counts those the cap pushed out)."""
        if not self._steps:
            return
        now = self._clock()
        prefilled = self._steps[-1].prefill_tokens > 0
        if self.engine.busy and not prefilled and now - self._telemetry_at < self.settings.telemetry_every_s:
            return
        self.client.xadd(
            wire.TELEMETRY_STREAM,
            p.encode_telemetry(self.telemetry()),  # type: ignore[arg-type]  # redis-py types the dict invariantly
            maxlen=wire.TELEMETRY_MAXLEN,
            approximate=True,
        )
        self._steps.clear()
        self._dropped = 0
        self._telemetry_at = now

    # -- heartbeat ------------------------------------------------------------------------

    def heartbeat(self) -> p.Heartbeat:
        elapsed = max(time.time() - self._started, 1e-9)
        with self._lock:
            held = list(self._batches.values())
        return p.Heartbeat(
            worker=self.settings.worker_id,
            pool=self.settings.pool,
            device=self.engine.device,
            dtype=self.engine.dtype,
            engine=self.engine.name,
            model=self.model,
            slots=self.engine.slots,
            free=self.engine.free_slots,
            tokens_per_s=self._tokens / elapsed,
            started=self._started,
            choice=self.engine.choice,
            running=sum(len(b.pending) for b in held),
            batches=tuple(b.job.batch_id for b in held[: p.HEARTBEAT_MAX_BATCHES]),
            down=self.engine.down,
            upstream=dict(self.engine.metrics),
            profile=self.profile,
        )

    def _heartbeat_loop(self) -> None:
        """Beat, keep owned entries from being claimed, and trim the jobs stream."""
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        key = wire.worker_key(self.settings.worker_id)
        touch_every = self.settings.claim_idle_s / 3
        last_touch = last_trim = self._clock()
        retry = Retrier(self._backoff, self._outage, self._stop_threads.wait)
        while not self._stop_threads.is_set():
            started = self._clock()
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.set(key, p.encode_heartbeat(self.heartbeat()), px=ttl_ms)
                pipe.zadd(wire.WORKERS_ZSET, {self.settings.worker_id: time.time()})
                if self.profile and not self._profile_stored:
                    pipe.hset(wire.PROFILES_HASH, self.profile["fingerprint"], orjson.dumps(self.profile))
                pipe.execute()
                self._profile_stored = True
                retry.succeeded(started)
                if self._clock() - last_touch >= touch_every:
                    last_touch = self._clock()
                    with self._lock:
                        owned = [b.entry_id for b in self._batches.values()]
                    self.fence.touch(owned)
                if self._clock() - last_trim >= self.settings.trim_every_s:
                    last_trim = self._clock()
                    trim_jobs_stream(self.client, self.stream)
            except redis.RedisError as exc:
                if is_nogroup(exc):
                    log.debug("no consumer group yet (the main loop creates it): %s", exc)
                else:
                    retry.failed(exc)
                    continue
            self._stop_threads.wait(self.settings.heartbeat_s)

    def _deregister(self) -> None:
        try:  # one round trip: with Redis down, an exit waits one timeout, not two
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(wire.worker_key(self.settings.worker_id))
            pipe.zrem(wire.WORKERS_ZSET, self.settings.worker_id)
            pipe.execute()
        except redis.RedisError:
            pass
