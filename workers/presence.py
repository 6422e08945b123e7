"""What a worker tells the others about itself: its step records as telemetry (the gateways
refit their step-time models and see its slots from them, docs/scheduling.md §6), and a
heartbeat (its state, its measured profile) from a thread that also keeps the entries it
holds from being claimed by peers and trims its pool's jobs stream."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import orjson
import redis
from redis.backoff import AbstractBackoff

from common import protocol as p
from common import wire
from common.retry import Outage, Retrier, is_nogroup
from workers.cpu import Starvation, ThreadGovernor
from workers.engine import Engine
from workers.fencing import Fence
from workers.settings import WorkerSettings
from workers.trim import trim_jobs_stream

log = logging.getLogger("tokengate.worker")


class Held(Protocol):
    """A batch the worker holds, as its heartbeat shows it."""

    entry_id: bytes
    job: p.BatchJob
    pending: set[str]


class Presence:
    def __init__(self, settings: WorkerSettings, engine: Engine, client: redis.Redis, fence: Fence, model: str,
                 held: Callable[[], Sequence[Held]], backoff: AbstractBackoff, outage: Outage,
                 clock: Callable[[], float], tokenizer: tuple[str, bytes] | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.fence = fence
        self.model = model
        self.held = held  # a copy of the batches held now (the heartbeat thread calls it)
        self.stream = wire.jobs_stream(model, settings.pool)
        self.stop = threading.Event()
        self.tokens = 0  # generated since the start, for tokens_per_s
        self.profile: dict[str, Any] = {}  # the engine's measured profile, published with each heartbeat
        self._profile_stored = False  # kept in wire.PROFILES_HASH yet
        # the model's tokenizer files (common/tokenizer_bundle.py: digest, bytes), stored once with
        # the first heartbeat that names them; None: this worker has none to publish
        self.tokenizer = tokenizer
        self._tokenizer_stored = False
        self._started = time.time()
        self._backoff = backoff
        self._outage = outage
        self._clock = clock
        self.draining = False  # asked to stop: it takes no job any more
        self._starvation = Starvation()  # since the last heartbeat
        self.starved = 0.0  # the share of thread time spent waiting for a CPU over the last heartbeat
        # the engine's intra-op threads, fewer while a neighbour keeps the CPUs busy (None: fixed);
        # the worker's loop feeds it between steps and applies it
        self.governor = ThreadGovernor(engine.max_threads) if engine.max_threads > 1 and not settings.threads else None
        self._steps: deque[p.StepRecord] = deque()  # not yet in a telemetry entry
        self._dropped = 0  # step records left out since the last entry
        self._telemetry_at = float("-inf")  # when the last entry went out

    # -- telemetry ------------------------------------------------------------------------

    def record(self, records: Iterable[p.StepRecord]) -> None:
        """Buffer step records for the next entry, at most ``TELEMETRY_MAX_STEPS``."""
        for record in records:
            self._steps.append(record)
            if len(self._steps) > p.TELEMETRY_MAX_STEPS:
                self._steps.popleft()
                self._dropped += 1

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

    def publish_telemetry(self) -> None:
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
            wire.telemetry_stream(self.model),
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
        held = self.held()
        return p.Heartbeat(
            worker=self.settings.worker_id,
            pool=self.settings.pool,
            device=self.engine.device,
            dtype=self.engine.dtype,
            engine=self.engine.name,
            model=self.model,
            slots=self.engine.slots,
            free=self.engine.free_slots,
            tokens_per_s=self.tokens / elapsed,
            started=self._started,
            choice=self.engine.choice,
            running=sum(len(b.pending) for b in held),
            batches=tuple(b.job.batch_id for b in held[: p.HEARTBEAT_MAX_BATCHES]),
            down="draining: it finishes what it runs and stops" if self.draining else self.engine.down,
            upstream=dict(self.engine.metrics),
            profile=self.profile,
            cpu_starved=self._starved(),
            threads=self.governor.threads if self.governor is not None else self.engine.max_threads,
            context=self.engine.context_tokens,
            prefix_cache=self.engine.prefix_cache_tokens,
            tokenizer=self.tokenizer[0] if self.tokenizer is not None else "",
        )

    def _starved(self) -> float:
        """The share of this process's thread time spent waiting for a CPU since the last
        heartbeat (another program on the machine's CPUs: it slows every step)."""
        ran, waited = self._starvation.since()
        self._starvation = Starvation()
        self.starved = round(waited / (ran + waited), 3) if ran + waited > 0 else 0.0
        return self.starved

    def loop(self) -> None:
        """Beat, keep owned entries from being claimed, and trim the jobs stream, until ``stop``."""
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        key = wire.worker_key(self.settings.worker_id)
        touch_every = self.settings.claim_idle_s / 3
        last_touch = last_trim = self._clock()
        retry = Retrier(self._backoff, self._outage, self.stop.wait)
        while not self.stop.is_set():
            started = self._clock()
            try:
                pipe = self.client.pipeline(transaction=False)
                if self.tokenizer is not None and not self._tokenizer_stored:  # before the heartbeat naming it
                    pipe.set(wire.tokenizer_key(self.tokenizer[0]), self.tokenizer[1], nx=True)
                pipe.set(key, p.encode_heartbeat(self.heartbeat()), px=ttl_ms)
                pipe.zadd(wire.WORKERS_ZSET, {self.settings.worker_id: time.time()})
                if self.profile and not self._profile_stored:
                    pipe.hset(wire.PROFILES_HASH, self.profile["fingerprint"], orjson.dumps(self.profile))
                pipe.execute()
                self._profile_stored = self._tokenizer_stored = True
                retry.succeeded(started)
                if self._clock() - last_touch >= touch_every:
                    last_touch = self._clock()
                    self.fence.touch([b.entry_id for b in self.held()])
                if self._clock() - last_trim >= self.settings.trim_every_s:
                    last_trim = self._clock()
                    trim_jobs_stream(self.client, self.stream)
            except redis.RedisError as exc:
                if is_nogroup(exc):
                    log.debug("no consumer group yet (the main loop creates it): %s", exc)
                else:
                    retry.failed(exc)
                    continue
            self.stop.wait(self.settings.heartbeat_s)

    def deregister(self) -> None:
        try:  # one round trip: with Redis down, an exit waits one timeout, not two
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(wire.worker_key(self.settings.worker_id))
            pipe.delete(wire.bell_stream(self.model, self.settings.worker_id))  # (the model's slot)
            pipe.zrem(wire.WORKERS_ZSET, self.settings.worker_id)
            pipe.execute()
        except redis.RedisError:
            pass
