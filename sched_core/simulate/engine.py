"""The discrete-event simulator: a policy (the real scheduler or a baseline) and simulated workers.

The gateway side is ``sched_core.driver.Driver``, the very driver ``gateway/dispatch/dispatcher.py`` uses:
``arrive`` then a tick on every request, ``finished`` then a tick on every finished request,
``completed`` then a tick on every batch report, worker telemetry into ``steps``, and a tick
whenever the driver asks for one (``next_tick``). Dispatched batches reach a pool's stream
after ``hop_s``; replies, finishes and telemetry reach the gateway after another.

Workers copy ``workers/worker.py`` with the HF engine: a worker takes as many jobs from its
pool's stream as it has free slots; each step decodes the running sequences (one token each)
and prefills at most the step budget's rest (``step_tokens`` less the decode tokens, at least a
quarter of it) of waiting prompts, whole prompts batched and a long one in chunks over several
steps; a sequence whose prefill completes gets its first token in that step. Step times come
from the pool's ``CostProfile`` with lognormal noise. Each finished sequence is reported at
once; a batch's report follows its last sequence; step records (prefill tokens, decode
sequences, KV tokens, seconds) are flushed to the gateway every ``telemetry_s`` while busy
and at once after a step that prefilled.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast, runtime_checkable

from common.pools import POOLS
from common.steps import prefill_room
from sched_core.contracts import Accuracy
from sched_core.driver import TICK_S, Driver, Policy
from sched_core.saved import Learnt, learnt, restore
from sched_core.simulate.profile import CostProfile
from sched_core.simulate.workload import Arrival, Workload
from sched_core.types import BatchTimings, Contract, Dispatch, Reject, Request

__all__ = ["Outcome", "Policy", "Pool", "Result", "SimConfig", "Simulation", "simulate"]


@runtime_checkable
class Drains(Protocol):
    """A baseline that must be told that no more requests will come (a fixed batch size)."""

    def end_of_arrivals(self, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class Pool:
    path: str  # "cpu" or "gpu"
    workers: int
    slots: int  # sequences per worker
    profile: CostProfile
    step_tokens: int = 256  # tokens per step: decode tokens plus the prefill chunk

    def __post_init__(self) -> None:
        if self.path not in POOLS or self.workers < 0 or self.slots < 1:
            raise ValueError(f"pool {self.path!r}: unknown path, or workers < 0, or slots < 1")


@dataclass(frozen=True, slots=True)
class SimConfig:
    pools: tuple[Pool, ...]
    hop_s: float = 0.0005  # one Redis stream hop (XADD to a blocked reader ~0.15-0.5 ms)
    tick_s: float = TICK_S  # the gateway's
    seed: int = 0
    known_output: bool = False  # tell the scheduler each request's exact output length
    # jobs a worker takes from its stream per loop while it has a free slot; 0: as many as
    # fit its free slots (workers/worker.py reads count = free slots)
    jobs_per_read: int = 0
    telemetry_s: float = 0.25  # a busy worker flushes its step records this often
    # the SLO every request carries to admission (TTFT, TPOT seconds): the driver refuses
    # those its calibrated bounds say would miss it; None: no SLO, every request is admitted
    admission_slo: tuple[float, float] | None = None
    # a request without that SLO is refused when its predicted first token waits longer than
    # this (the gateway's --max-queue-wait-ms, the driver's ``wait`` refusal); None: no bound
    max_wait_s: float | None = None

    def pool(self, path: str) -> Pool | None:
        return next((p for p in self.pools if p.path == path), None)


@dataclass(slots=True)
class Outcome:
    """What happened to one request; times are absolute simulated seconds (nan: never)."""

    arrival: Arrival
    contract: Contract | None = None
    accuracy: Accuracy | None = None
    rejected: str | None = None
    path: str | None = None
    dispatched: float = math.nan
    first_token: float = math.nan
    finished: float = math.nan
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival.time

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival.time


@dataclass(slots=True)
class Result:
    outcomes: list[Outcome]
    # per tenant: (time, +1/-1) as requests start and stop waiting for their prefill
    backlog: dict[str, list[tuple[float, int]]]
    # per tenant: (time, prompt tokens, output tokens) served, one entry per step and tenant
    service: dict[str, list[tuple[float, int, int]]]
    budgets: dict[str, float]
    batches: int = 0
    steps: int = 0
    end: float = 0.0
    learnt: Learnt | None = None  # what the scheduler learnt, to start another run from (None: a baseline)


# -- workers -------------------------------------------------------------------------------

ARRIVE, JOB, STEP, REPORT, TICK, FINISH, STEPS = range(7)


@dataclass(slots=True)
class _Seq:
    outcome: Outcome
    batch: int
    target: int  # tokens to generate
    generated: int = 0
    prefilled: int = 0  # prompt tokens prefilled so far (chunked prefill)


@dataclass(slots=True)
class _Batch:
    path: str
    size: int
    pending: int
    prefill_s: float = 0.0
    padded: int = 0
    steps: int = 0
    decode_s: float = 0.0
    running: int = 0
    outputs: dict[str, int] = field(default_factory=dict)
    order: tuple[str, ...] = ()


@dataclass(slots=True)
class _Worker:
    pool: Pool
    index: int
    waiting: deque[_Seq] = field(default_factory=deque)
    running: list[_Seq] = field(default_factory=list)
    stepping: bool = False
    idle_since: float = 0.0
    records: list[tuple[int, int, int, float]] = field(default_factory=list)
    flushed: float = 0.0

    @property
    def free_slots(self) -> int:
        return self.pool.slots - len(self.running) - len(self.waiting)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)


@dataclass(slots=True)
class _Step:
    decoded: list[_Seq]
    admitted: list[_Seq]  # prefill completed in this step: first token
    decode_s: float
    prefill_s: float
    padded: int
    prefill_tokens: int
    kv_tokens: int


class Simulation:
    """One run of ``policy`` on ``workload``; ``run()`` returns what happened to each request."""

    def __init__(self, policy: Policy, workload: Workload, config: SimConfig, start: Learnt | None = None) -> None:
        self.policy = policy
        self.driver = Driver(policy, config.tick_s)
        self.start = start  # what an earlier run learnt: this one is a restart on saved state
        self.workload = workload
        self.config = config
        self._rng = random.Random(config.seed ^ 0x5EED)
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._tick_at = math.inf
        self._budget = {t.name: t.budget for t in workload.tenants}
        self._outcomes = {a.id: Outcome(a) for a in workload.arrivals}
        self._batches: dict[int, _Batch] = {}
        self._seqs: dict[int, list[_Seq]] = {}
        self._streams: dict[str, deque[int]] = {p: deque() for p in POOLS}
        self._workers: dict[str, list[_Worker]] = {p: [] for p in POOLS}
        for pool in config.pools:
            self._workers[pool.path] = [_Worker(pool, i) for i in range(pool.workers)]
        self._backlog: dict[str, list[tuple[float, int]]] = {t: [] for t in self._budget}
        self._service: dict[str, list[tuple[float, int, int]]] = {t: [] for t in self._budget}
        self._steps = 0

    # -- the event loop ------------------------------------------------------------------

    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, payload))
        self._seq += 1

    def run(self) -> Result:
        for pool in self.config.pools:
            self.driver.capacity(pool.path, pool.workers * pool.slots, 0.0, pool.workers,
                                 pool.step_tokens)
            if self.start is not None:
                restore(self.driver, pool.path, self.start[0].get(pool.path), self.start[1])
        if self.start is not None:
            self.driver.contracts.load({"outputs": self.start[1].get("outputs", ())})
        arrivals = self.workload.arrivals
        if arrivals:
            self._push(arrivals[0].time, ARRIVE, 0)
        now = 0.0
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == ARRIVE:
                i = int(payload)  # type: ignore[call-overload]
                self._arrive(arrivals[i], now)
                if i + 1 < len(arrivals):
                    self._push(arrivals[i + 1].time, ARRIVE, i + 1)
                elif isinstance(self.policy, Drains):
                    self.policy.end_of_arrivals(now)
                self._tick(now)
            elif kind == JOB:
                self._job(payload, now)  # type: ignore[arg-type]
            elif kind == STEP:
                self._step_end(payload, now)  # type: ignore[arg-type]
            elif kind == REPORT:
                self.driver.completed(cast(BatchTimings, payload), now)
                self._tick(now)
            elif kind == FINISH:
                rid, tokens = cast(tuple[str, int], payload)
                o = self._outcomes[rid]
                if o.contract is not None:  # what the gateway sees: the last token, and its time
                    o.accuracy = self.driver.outcome(rid, o.ttft, o.e2e, tokens, now)
                if self.driver.finished(rid, tokens, now):
                    self._tick(now)
            elif kind == STEPS:
                path, records = cast(tuple[str, list[tuple[int, int, int, float]]], payload)
                self.driver.steps(path, records, now)
            elif kind == TICK and now == self._tick_at:
                self._tick_at = math.inf
                self._tick(now)
        outcomes = [self._outcomes[a.id] for a in arrivals]
        return Result(outcomes, self._backlog, self._service, self._budget,
                      batches=len(self._batches), steps=self._steps, end=now,
                      learnt=learnt(self.driver, POOLS))

    def _arrive(self, a: Arrival, now: float) -> None:
        slo = self.config.admission_slo
        req = Request(
            id=a.id, tenant=a.tenant, weight=self._budget[a.tenant],
            prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens, arrival=now,
            expected_output_tokens=a.output_tokens if self.config.known_output else 0,
            slo_ttft_s=slo[0] if slo else None, slo_tpot_s=slo[1] if slo else None,
            max_wait_s=None if slo else self.config.max_wait_s,
        )
        decision = self.driver.arrive(req, now)
        out = self._outcomes[a.id]
        if isinstance(decision, Reject):
            out.rejected = decision.reason
            return
        out.contract = decision if isinstance(decision, Contract) else None
        self._backlog[a.tenant].append((now, 1))

    def _tick(self, now: float) -> None:
        for d in self.driver.tick(now):
            if isinstance(d, Reject):
                out = self._outcomes[d.request_id]
                out.rejected = d.reason
                self._backlog[out.arrival.tenant].append((now, -1))
                continue
            self._dispatch(d, now)
        wake = self.driver.next_tick(now)
        if now < wake < self._tick_at:
            self._tick_at = wake
            self._push(wake, TICK, None)

    def _dispatch(self, d: Dispatch, now: float) -> None:
        seqs = []
        for rid in d.request_ids:
            out = self._outcomes[rid]
            out.path, out.dispatched = d.path, now
            seqs.append(_Seq(out, d.batch_id, out.arrival.output_tokens))
        self._batches[d.batch_id] = _Batch(d.path, len(seqs), len(seqs), order=d.request_ids)
        self._seqs[d.batch_id] = seqs
        self._push(now + self.config.hop_s, JOB, (d.path, d.batch_id))

    # -- workers -------------------------------------------------------------------------

    def _job(self, job: tuple[str, int], now: float) -> None:
        path, batch_id = job
        if not self._workers[path]:
            raise ValueError(f"a batch was sent to {path}, which has no workers")
        self._streams[path].append(batch_id)
        # blocked readers are served longest-waiting first
        idle = sorted((w for w in self._workers[path] if not w.stepping),
                      key=lambda w: (w.idle_since, w.index))
        for w in idle:
            if not self._streams[path]:
                break
            self._loop(w, now)

    def _loop(self, w: _Worker, now: float) -> None:
        """One iteration of the worker's loop: read jobs while a slot is free, then step."""
        stream = self._streams[w.pool.path]
        reads = self.config.jobs_per_read or w.pool.slots
        while stream and w.free_slots > 0 and reads > 0:
            w.waiting.extend(self._seqs.pop(stream.popleft()))
            reads -= 1
        if not w.busy:
            w.stepping = False
            w.idle_since = now
            self._flush(w, now)
            return
        w.stepping = True
        self._steps += 1
        profile = w.pool.profile
        decoded = list(w.running)
        decode_s = 0.0
        kv = 0
        if decoded:
            width = max(s.outcome.arrival.prompt_tokens + s.generated for s in decoded)
            kv = sum(s.outcome.arrival.prompt_tokens + s.generated for s in decoded)
            decode_s = self._noisy(profile.decode_step_s(len(decoded), width), profile)
        budget = w.pool.step_tokens
        room = prefill_room(budget, len(decoded))
        parts, longest, tokens, admitted = self._admit(w, room, len(decoded))
        prefill_s = self._noisy(profile.prefill_s(parts, longest), profile) if parts else 0.0
        step = _Step(decoded, admitted, decode_s, prefill_s, longest, tokens, kv)
        self._push(now + decode_s + prefill_s, STEP, (w, step))

    @staticmethod
    def _admit(w: _Worker, room: int, decoding: int) -> tuple[int, int, int, list[_Seq]]:
        """One prefill forward, as ``HFEngine._prefill_step`` takes it: the next chunk of a
        prompt being prefilled in chunks, or else the waiting prompts (in order) that fit
        ``room`` together once padded to the longest, or else the first chunk of the first
        prompt. Returns (prompts in the pass, padded length, prompt tokens, sequences whose
        prefill completes) and takes those off ``w.waiting``."""
        admitted: list[_Seq] = []
        first = w.waiting[0] if w.waiting else None
        if first is None or decoding >= w.pool.slots:
            return 0, 0, 0, admitted
        if first.prefilled > 0 or first.outcome.arrival.prompt_tokens > room:  # a chunk
            take = min(first.outcome.arrival.prompt_tokens - first.prefilled, room)
            first.prefilled += take
            if first.prefilled == first.outcome.arrival.prompt_tokens:
                admitted.append(w.waiting.popleft())
            return 1, take, take, admitted
        longest = tokens = 0
        for s in w.waiting:
            n = s.outcome.arrival.prompt_tokens
            if decoding + len(admitted) >= w.pool.slots or max(longest, n) * (len(admitted) + 1) > room:
                break
            longest = max(longest, n)
            tokens += n
            s.prefilled = n
            admitted.append(s)
        for _ in admitted:
            w.waiting.popleft()
        return len(admitted), longest, tokens, admitted

    def _flush(self, w: _Worker, now: float) -> None:
        """Send the worker's step records to the gateway (every telemetry_s, after a step
        that prefilled, and when idle)."""
        if w.records:
            self._push(now + self.config.hop_s, STEPS, (w.pool.path, w.records))
            w.records = []
        w.flushed = now

    def _noisy(self, seconds: float, profile: CostProfile) -> float:
        cv = profile.noise_cv
        if cv <= 0.0:
            return seconds
        sigma2 = math.log1p(cv * cv)
        return seconds * math.exp(self._rng.gauss(-0.5 * sigma2, math.sqrt(sigma2)))

    def _step_end(self, item: tuple[_Worker, _Step], now: float) -> None:
        w, step = item
        seen = now + self.config.hop_s  # when the client sees this step's tokens
        w.records.append((step.prefill_tokens, len(step.decoded), step.kv_tokens,
                          step.decode_s + step.prefill_s))
        if step.prefill_tokens > 0 or now - w.flushed >= self.config.telemetry_s:
            self._flush(w, now)  # a prefill at once: gateways count prompt tokens not yet prefilled
        served: dict[str, list[int]] = {}
        touched: dict[int, _Batch] = {}
        for s in step.decoded:
            b = touched.setdefault(s.batch, self._batches[s.batch])
            s.generated += 1
            served.setdefault(s.outcome.arrival.tenant, [0, 0])[1] += 1
        for b in touched.values():
            b.steps += 1
            b.decode_s += step.decode_s
            b.running += len(step.decoded)
        for s in step.admitted:
            b = self._batches[s.batch]
            b.prefill_s += step.prefill_s / len(step.admitted)
            b.padded = max(b.padded, step.padded)
            s.generated = 1
            s.outcome.first_token = seen
            if s.outcome.contract is not None:  # what the gateway sees of a stream
                self.driver.first_token(s.outcome.arrival.id, s.outcome.ttft, now)
            tenant = s.outcome.arrival.tenant
            self._backlog[tenant].append((now - step.decode_s - step.prefill_s, -1))
            counts = served.setdefault(tenant, [0, 0])
            counts[0] += s.outcome.arrival.prompt_tokens
            counts[1] += 1
        for tenant, (p, o) in served.items():
            self._service[tenant].append((now, p, o))
        running = []
        for s in step.decoded + step.admitted:
            if s.generated < s.target:
                running.append(s)
                continue
            s.outcome.finished = seen
            s.outcome.tokens = s.generated
            self._push(seen, FINISH, (s.outcome.arrival.id, s.generated))
            b = self._batches[s.batch]
            b.outputs[s.outcome.arrival.id] = s.generated
            b.pending -= 1
            if b.pending == 0:
                self._push(seen, REPORT, self._report(s.batch, b))
        w.running = running
        self._loop(w, now)

    @staticmethod
    def _report(batch_id: int, b: _Batch) -> BatchTimings:
        return BatchTimings(
            batch_id=batch_id, path=b.path, batch_size=b.size, prompt_tokens=b.padded,
            prefill_s=b.prefill_s, decode_steps=b.steps, decode_s=b.decode_s,
            output_tokens=tuple(b.outputs[r] for r in b.order),
            mean_running=b.running / b.steps if b.steps else 0.0,
        )


def simulate(policy: Policy, workload: Workload, config: SimConfig, start: Learnt | None = None) -> Result:
    """``policy`` on ``workload``; from what an earlier run learnt (``Result.learnt``) if ``start``."""
    return Simulation(policy, workload, config, start).run()


def pools_capacity(pools: Sequence[Pool]) -> dict[str, int]:
    return {p.path: p.workers * p.slots for p in pools}
