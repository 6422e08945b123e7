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
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import redis

from common import protocol as p
from common import wire
from common.retry import Outage, Retrier, backoff_policy, is_nogroup
from workers import startup
from workers.batches import Admission, Batch, account, handoff_write, leftovers, report
from workers.cancels import Cancels
from workers.cpu import EngineThreads
from workers.engine import Engine, StepResult
from workers.fencing import Fence, HandoffWrite, Publish
from workers.presence import Presence
from workers.settings import WorkerSettings

log = logging.getLogger("tokengate.worker")

SUSPECT_TTL_S = 3600  # a suspect mark outlives any redelivery cycle of its entry
HANDBACK_S = 0.5  # draining, the jobs delivered here but not started are handed back this often

class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        client: redis.Redis,
        model: str,
        *,
        tokenizer: tuple[str, bytes] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.model = model
        self.fence = Fence(client, model, settings.pool, settings.worker_id)
        self.stream = self.fence.stream  # its pool's jobs stream
        self.bell = wire.bell_stream(model, settings.worker_id)
        self._batches: dict[str, Batch] = {}  # batch_id -> state
        self._batch_of: dict[str, str] = {}  # rid -> batch_id
        self._lock = threading.Lock()  # guards _batches for the heartbeat thread
        self._signals = 0
        self._clock = clock
        self._sleep = sleep
        self._next_claim = 0.0
        self._group_ready = False
        # after a Redis failure: a read Redis may have delivered unseen (re-read from this
        # consumer's own pending entries), and abandoned entries not yet handed back
        self._reread_own = False
        self._rings: list[bytes] = []  # doorbell entries read, acknowledged with the next screening
        self._unreleased: list[bytes] = []
        self._first_token_at: dict[str, float] = {}  # rid -> when the step that sampled its first token ended
        self._backoff = backoff_policy(settings.retry_base_s, settings.retry_cap_s)
        self._outage = Outage(clock)
        self._retry = Retrier(self._backoff, self._outage, sleep)  # the main loop's
        self._isolated: deque[Admission] = deque()  # reclaimed suspects, to run one at a time
        self._alone: str | None = None  # the batch id of the suspect running alone
        self.presence = Presence(settings, engine, client, self.fence, model, self._held, self._backoff,
                                 self._outage, clock, tokenizer)
        self._stop_threads = self.presence.stop
        self.cancels = Cancels(client, self._backoff, self._outage, self._stop_threads)
        self.threads = EngineThreads(self.presence.governor, engine.max_threads, engine.set_threads, clock)
        self._next_handback = 0.0  # draining: when the jobs not started are handed back next

    def _held(self) -> list[Batch]:
        with self._lock:
            return list(self._batches.values())

    # -- lifecycle ------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._signals += 1
        self.presence.draining = True  # heartbeats say so: no scheduler places a job here any more
        if self._signals == 1:
            log.info("draining: no new batches; finishing %d running", len(self._batches))
        else:
            log.info("second signal: exiting now; unacked entries go to peers")

    def run(self) -> None:
        startup.warm_up(self.engine, self.settings.warm_up_tokens, self.threads.between_steps, self.presence)
        startup.settle(self.engine, self.threads, self.settings)
        self.presence.profile = startup.measure(self.engine, self.settings, self.model)
        threads = [
            threading.Thread(target=self.presence.loop, name="heartbeat", daemon=True),
            threading.Thread(target=self.cancels.loop, name="cancels", daemon=True),
        ]
        for t in threads:
            t.start()
        s, e = self.settings, self.engine
        log.info("worker %s serving pool %s (%s on %s/%s, %d slots; %s)", s.worker_id, s.pool, e.name, e.device,
                 e.dtype, e.slots, e.choice)
        try:
            while self._signals < 2 and self.tick():
                pass
        finally:
            self._stop_threads.set()
            for t in threads:
                t.join(timeout=2)
            self.presence.deregister()
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
            else:
                self._hand_back_unstarted()
                if not self.engine.busy:
                    return False
            self.cancels.apply(lambda rid: rid in self._batch_of and self.engine.cancel(rid))
            if self.engine.busy:
                self.threads.between_steps()
                self._step()
            self.presence.publish_telemetry()
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
        try:
            self.client.xgroup_create(self.bell, wire.GROUP, id="$", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    # -- jobs in ----------------------------------------------------------------------------

    def _read(self, block_ms: int) -> None:
        """As many jobs as the engine has free slots, in one XREADGROUP that also watches
        this worker's doorbell: the scheduler delivers a job it chose this worker for
        straight into this consumer's pending entries and rings (docs/scheduling.md §15),
        and a ring reads them. After a Redis failure, first this consumer's own pending
        entries that it does not hold: a read that timed out here may have been delivered by
        Redis all the same, and would otherwise wait for the claim idle time."""
        free = self.engine.free_slots
        if free <= 0:
            return
        reread = self._reread_own
        held = {b.entry_id for b in self._batches.values()} if reread else set()
        reply = self.client.xreadgroup(
            wire.GROUP, self.settings.worker_id, {self.stream: "0" if reread else ">", self.bell: ">"},
            count=free + len(held), block=None if reread else block_ms or None,
        )
        # RESP2: [[stream, [(id, fields), ...]]], or None when the block timed out
        entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        delivered: list[tuple[bytes, dict[bytes, bytes]]] = []
        for stream, got in reply if isinstance(reply, list) else []:
            if wire.text(stream) != self.bell:
                entries += got
                continue
            for ring_id, fields in got:  # a ring carries the job and its entry id in the pool's stream
                self._rings.append(ring_id)
                if fields and b"j" in fields:
                    delivered.append((fields[b"j"], {k: v for k, v in fields.items() if k != b"j"}))
        if reread:
            self._reread_own = False
            entries = [(entry_id, fields) for entry_id, fields in entries if entry_id not in held and fields][:free]
            if entries:
                log.info("re-reading %d jobs delivered while Redis failed", len(entries))
        if delivered:
            running = {b.entry_id for b in self._batches.values()} | {entry_id for entry_id, _ in entries}
            entries += [(entry_id, fields) for entry_id, fields in delivered if entry_id not in running]
        readable = [self._decode(entry_id, fields) for entry_id, fields in entries]
        self._admit([Admission(entry_id, job, {}) for entry_id, job in readable if job is not None])
        if self._rings:  # nothing was admitted to acknowledge them with
            self.client.xack(self.bell, wire.GROUP, *self._rings)
            self._rings.clear()

    def _hand_back_unstarted(self) -> None:
        """Draining: the jobs delivered to this worker that it has not started (the scheduler
        placed them before its heartbeat said it drains) go to the next reclaim of a peer at
        once, instead of waiting out the claim idle time (15 s) with no one to run them."""
        now = self._clock()
        if now < self._next_handback:
            return
        self._next_handback = now + HANDBACK_S
        pending = self.client.xpending_range(self.stream, wire.GROUP, min="-", max="+", count=1000,
                                             consumername=self.settings.worker_id)
        with self._lock:
            held = {b.entry_id for b in self._batches.values()}
        loose = [e["message_id"] for e in pending if isinstance(e["message_id"], bytes) and e["message_id"] not in held]
        if loose:
            self.fence.release(loose, int(self.settings.claim_idle_s * 1000))
            log.info("draining: %d jobs not started here go to the other workers", len(loose))

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
        admitted: list[Admission] = []
        if entries:
            pipe = self.client.pipeline(transaction=False)
            for entry_id, _fields in entries:
                pipe.exists(wire.suspect_key(self.model, wire.text(entry_id)))
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
                a = Admission(entry_id, job, self.fence.progress([s.rid for s in job.seqs]))
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
                "entry %s failed %d deliveries: moved to %s", entry_id.decode(), deliveries, self.fence.dead_letters
            )

    def _decode(self, entry_id: bytes, fields: dict[bytes, bytes]) -> tuple[bytes, p.BatchJob | None]:
        """The entry's job; an unreadable one is acked and dropped (None)."""
        try:
            return entry_id, p.decode_job(fields)
        except p.ProtocolError as exc:
            log.error("dropping unreadable entry %s: %s", entry_id, exc)
            self.client.xack(self.stream, wire.GROUP, entry_id)
            return entry_id, None

    def _admit(self, admissions: list[Admission]) -> None:
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
            self._accept(a, {s.rid for s in a.job.seqs if self.cancels.recent(s.rid)}, kv)
        pipe = self.client.pipeline(transaction=False)
        rings, self._rings = self._rings, []
        if rings:
            pipe.xack(self.bell, wire.GROUP, *rings)
        # one MGET of every marker (strings, or nothing): the gateway gone, and the cancels sent
        # before this worker subscribed (or while it was down): all in the model's slot
        pipe.mget([key for a in admissions for key in (wire.gone_key(a.job.reply_to),
                                                       *(wire.cancel_key(self.model, s.rid) for s in a.job.seqs))])
        flags = iter(pipe.execute()[-1])
        gone: list[Admission] = []
        for a in admissions:
            if next(flags):
                gone.append(a)
            for s in a.job.seqs:
                if next(flags):
                    self.engine.cancel(s.rid)
        if gone:
            self._abandon([s.rid for a in gone for s in a.job.seqs])
            self._drop_gone(gone)

    def _drop_gone(self, gone: list[Admission]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for a in gone:
            pipe.xack(self.stream, wire.GROUP, a.entry_id)
            if keys := leftovers(a.job, [s.rid for s in a.job.seqs], self.model):
                pipe.delete(*keys)
        pipe.execute()
        for a in gone:
            log.info("dropped batch %s: its gateway is gone (%s)", a.job.batch_id, a.job.reply_to)

    def _accept(self, a: Admission, cancelled: set[str], kv: dict[str, dict[str, object] | None]) -> None:
        with self._lock:
            self._batches[a.job.batch_id] = Batch(a.entry_id, a.job, {s.rid for s in a.job.seqs})
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
                pipe.set(wire.suspect_key(self.model, wire.text(entry_id)), 1, ex=SUSPECT_TTL_S)
            pipe.execute()
            return
        if result.failed:
            log.error("%s failed in the engine; their batches go back for redelivery", ", ".join(result.failed))
            self.fence.release(self._abandon(result.failed), int(self.settings.claim_idle_s * 1000))
        self.presence.record(result.records())
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
        self.presence.tokens += account(result, self._batches, self._batch_of)
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
                handoffs.setdefault(bid, []).append(handoff_write(self._batches[bid], h, self.model))
                events.setdefault(bid, [])
        if not events:
            return
        publishes: list[Publish] = []
        order: list[tuple[Batch, bool]] = []
        for bid, evs in events.items():
            b = self._batches[bid]
            finished = [ev.rid for ev in evs if isinstance(ev, p.Finished | p.Failed)]
            moved = handoffs.get(bid, [])
            b.pending.difference_update(finished)
            b.pending.difference_update(h.rid for h in moved)
            done = not b.pending
            if done:
                evs.append(report(b, self.settings.pool, self.settings.worker_id))
            streamed = {ev.rid for ev in evs if isinstance(ev, p.Delta)}
            progress = {rid: result.progress[rid] for rid in streamed if rid in result.progress}
            delete = leftovers(b.job, finished, self.model)
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
