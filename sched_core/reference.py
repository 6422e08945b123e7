"""The scheduler in plain Python: the readable specification of every decision.

The compiled core (``_core.pyx``) makes the same decisions from the same events, down to the
last bit of every float; the property tests hold the two to that. docs/scheduling.md derives
the rules; the comments here say which rule a line implements.

State, per bucket k and tenant t:
  * a heap of t's queued requests in k, keyed by the aging key
    ``prompt + aging·arrival + priority_tokens·priority`` (ties: arrival, then id), whose top
    is always a queued request;
  * in ``_heads[k]`` one valid entry per non-empty (k, t): the key of that top; older
    entries are recognised by a version number and dropped when they surface;
  * ``_fifo[k]``: the requests of k in admission order, for the tail cut;
plus one deadline heap and one heap of backlogged tenants' virtual counters. Entries of
requests that left the queue are dropped lazily when they reach the top of a heap or the
front of a FIFO (a FIFO is compacted when most of it is such entries).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import deque
from dataclasses import replace
from typing import Any

from common.pools import POOLS
from sched_core.costmodel import COEFFICIENTS, StepModel
from sched_core.report import queued_explanation, route_reason, snapshot_dict, thresholds
from sched_core.smdp import N_STATES, PolicyTable, classify, describe, in_force, long_bucket
from sched_core.types import (
    HOLD_SLACK,
    LN100,
    RESCUE_AFTER,
    BatchTimings,
    Contract,
    Dispatch,
    PathConfig,
    Reject,
    Request,
    SchedulerConfig,
)

IMPLEMENTATION = "reference"

CPU, GPU = 0, 1
QUEUED, INFLIGHT, DONE = 0, 1, 2
INF = math.inf

# Heap entry layouts (tuples compare field by field; the last field is never reached):
#   request heaps:  (primary, arrival, id, seq, _Req)
#   _heads[k]:      (aging key, arrival, id, version of (k, t), t)
#   _active:        (virtual counter, t, version of t)
_RequestEntry = tuple[float, float, str, int, "_Req"]
_HeadEntry = tuple[float, float, str, int, int]


class RateMeter:
    """An event rate (events/s), exponentially decayed with time constant ``tau`` seconds."""

    __slots__ = ("count", "last", "tau")

    def __init__(self, tau: float) -> None:
        self.count = 0.0
        self.last = 0.0
        self.tau = tau

    def _decayed(self, now: float) -> float:
        dt = now - self.last
        return self.count * math.exp(-dt / self.tau) if dt > 0.0 else self.count

    def add(self, now: float, events: float) -> None:
        self.count = self._decayed(now) + events
        if now > self.last:
            self.last = now

    def rate(self, now: float) -> float:
        return self._decayed(now) / self.tau


class _Req:
    """A request inside the scheduler, from arrival until its batch completes."""

    __slots__ = (
        "req", "bucket", "tenant", "out", "key", "t_in", "service", "seq", "state", "batch")

    def __init__(self, req: Request, bucket: int, tenant: int, out: int, key: float,
                 service: float, seq: int) -> None:
        self.req = req
        self.bucket = bucket
        self.tenant = tenant
        self.out = out  # expected output tokens
        self.key = key  # aging key: smaller is served first
        self.t_in = req.arrival + req.budget_wait  # when the scheduler's own wait began
        self.service = service  # predicted prefill + decode at admission
        self.seq = seq
        self.state = QUEUED
        self.batch = 0


class _Batch:
    __slots__ = ("path", "reqs", "end", "open")

    def __init__(self, path: int, reqs: list[_Req], end: float) -> None:
        self.path = path
        self.reqs = reqs
        self.end = end  # dispatch time + predicted batch time
        self.open = len(reqs)  # requests not yet finished


class Scheduler:
    """Token-budget scheduler: events in, decisions out; time is always an argument."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        cfg = config if config is not None else SchedulerConfig()
        self.config = cfg
        self._bounds = cfg.bucket_bounds
        nb = len(self._bounds)
        self._models = (StepModel(cfg.cpu, cfg), StepModel(cfg.gpu, cfg))
        self._coef = [m.coefficients() for m in self._models]
        self._quad = [m.attention for m in self._models]  # s per squared prompt token
        self._max_batch = (cfg.cpu.max_batch, cfg.gpu.max_batch)
        self._cap = [0, 0]
        self._used = [0, 0]  # sequences dispatched and not finished
        self._kv = [0, 0]  # KV tokens they hold, mid-life: prompt + half the expected output
        self._workers = [1, 1]
        self._budget = [cfg.cpu.step_tokens, cfg.gpu.step_tokens]  # tokens per worker step
        self._pend = [0.0, 0.0]  # prompt tokens dispatched and not yet seen prefilled
        # The macro-state and the action in force (sched_core.smdp): set at each arrival
        # and tick from the table (the heuristic's when the config has none).
        self._table = in_force(cfg.policy_table, cfg.prefill_queue_steps)
        self._long_k = long_bucket(self._bounds, self._table.long_prompt)
        self._state = 0
        self._visits = [0] * N_STATES
        action = self._table.actions[0]
        self._queue_steps = action.prefill_queue_steps
        self._share = action.slot_share
        self._key_w = action.key_weight
        self._lim = [0, 0]  # slots in use allowed: the share of _cap, at least one of a path's
        self._now = 0.0
        self._seq = 0
        self._next_batch = 1
        self._queued = 0
        self._by_id: dict[str, _Req] = {}
        self._inflight: dict[int, _Batch] = {}
        # Per bucket: live count and token sums of the queue; arrival-rate meters.
        self._n = [0] * nb
        self._tok = [0] * nb
        self._psum = [0] * nb
        self._osum = [0] * nb
        self._arrivals = [RateMeter(cfg.rate_window_s) for _ in range(nb)]
        self._cpu_meter = RateMeter(cfg.rate_window_s)  # λ_a: requests sent to cpu
        self._mix_prompt = float(self._bounds[0])  # EWMA of prompt and output lengths,
        self._mix_out = float(cfg.default_output_tokens)  # the mix μ_a is computed for
        self._fifo: list[deque[_Req]] = [deque() for _ in range(nb)]
        self._heads: list[list[_HeadEntry]] = [[] for _ in range(nb)]
        self._deadlines: list[_RequestEntry] = []
        self._est_bucket = [-1.0] * nb  # EWMA of observed output per bucket (-1: none yet)
        # Per tenant (index t, in order of first appearance).
        self._tenant_ix: dict[str, int] = {}
        self._tenant_names: list[str] = []
        self._counter: list[float] = []  # virtual token counter, seconds of budget
        self._weight: list[float] = []  # budget (tokens/s) of the tenant's latest request
        self._backlog: list[int] = []  # queued requests
        self._tver: list[int] = []
        self._est: list[list[float]] = []  # EWMA of observed output per (tenant, bucket)
        self._rq: list[list[list[_RequestEntry]]] = [[] for _ in range(nb)]  # [k][t]
        self._kver: list[list[int]] = [[] for _ in range(nb)]  # [k][t]
        self._active: list[tuple[float, int, int]] = []
        self._idle_floor = 0.0  # counter of the last tenant to leave an empty backlog

    # ----------------------------------------------------------------- public API

    @property
    def queued(self) -> int:
        return self._queued

    def __len__(self) -> int:
        return self._queued

    def arrive(self, req: Request, now: float) -> Contract | Reject:
        """Admit ``req`` with a latency contract, or reject it at once."""
        self._now = now
        rid = req.id
        if rid in self._by_id:
            return Reject(rid, "duplicate", f"request {rid!r} is already queued or running",
                          0.0, 0.0)
        k = bisect_left(self._bounds, req.prompt_tokens)
        if k == len(self._bounds):
            return Reject(rid, "too_long", f"prompt of {req.prompt_tokens} tokens exceeds the "
                          f"largest bucket ({self._bounds[-1]})", 0.0, 0.0)
        self._apply(self._classify())
        t = self._tenant(req.tenant)
        out = self._expected_output(req, t, k)
        n = self._n[k] + 1
        ahead = sum(self._tok[: k + 1])  # shortest prompt first: shorter buckets go before it
        p, wait, prefill, decode, decode_hi, tail = self._terms(
            k, n, (self._osum[k] + out) / n, (self._psum[k] + req.prompt_tokens) / n,
            sum(self._n[: k + 1]), sum(self._psum[: k + 1]), out, req.prompt_tokens, now)
        bw = req.budget_wait
        ttft = bw + wait + prefill
        total = ttft + decode
        if self._queued >= self.config.max_queued:
            return Reject(rid, "queue_full", f"{self._queued} requests queued, the limit",
                          wait, total)
        if req.deadline is not None and req.arrival + total > req.deadline:
            return Reject(rid, "deadline", f"estimated completion {total:.3f}s after arrival "
                          f"misses the deadline by {req.arrival + total - req.deadline:.3f}s",
                          wait, total)
        self._enqueue(req, t, k, out, prefill + decode, now)
        return Contract(rid, k, POOLS[p], ttft, total, bw + tail + decode_hi, ahead, bw,
                        decode / out, out, bw + tail, decode_hi / out)

    def tick(self, now: float) -> list[Dispatch | Reject]:
        """Decide what to do now: expired deadlines, tail cuts, then batches by urgency."""
        self._now = now
        state = self._classify()
        self._visits[state] += 1
        self._apply(state)
        out: list[Dispatch | Reject] = []
        self._expire(now, out)
        t_cut, _ = self._tail(now)
        if t_cut < INF and self._cap[GPU] > 0:  # the cut moves the gpu queue's tail to the cpu
            self._tail_cut(now, t_cut, out)
        self._rescue(now, t_cut, out)
        for k in self._bucket_order():
            while self._n[k] > 0:
                p = self._plan(k, now, t_cut)
                if p < 0:
                    break
                limit = min(self._n[k], self._free(p), self._max_batch[p], self._room(p, k))
                batch = self._take(k, limit)
                if not batch:
                    break
                self._dispatch(p, k, batch, now, out)
        return out

    def finished(self, request_id: str, output_tokens: int, now: float) -> bool:
        """One dispatched request finished with ``output_tokens``: its slot comes back now,
        not when its whole batch ends. False if it is not running (unknown, or its batch
        already reported)."""
        self._now = now
        r = self._by_id.get(request_id)
        if r is None or r.state != INFLIGHT:
            return False
        batch = self._inflight[r.batch]
        self._finish(r, batch.path, output_tokens)
        batch.open -= 1
        if batch.open == 0:
            del self._inflight[r.batch]
        return True

    def completed(self, timings: BatchTimings, now: float) -> None:
        """A batch ended: the slots of its requests not yet ``finished`` come back, and their
        output lengths are learnt (a failed batch reports none)."""
        self._now = now
        batch = self._inflight.pop(timings.batch_id, None)
        if batch is None:
            return
        outs = timings.output_tokens
        exact = len(outs) == len(batch.reqs)
        for i, r in enumerate(batch.reqs):
            if r.state == INFLIGHT:
                self._finish(r, batch.path, outs[i] if exact else -1)

    def observe_steps(self, path: str, records: list[tuple[int, int, int, float]],
                      now: float) -> None:
        """Refit ``path``'s step-time model from worker step records
        ``(prefill tokens, decode sequences, KV tokens, seconds)``."""
        self._now = now
        p = POOLS.index(path)
        model = self._models[p]
        model.observe_many(records)
        self._coef[p] = model.coefficients()
        self._quad[p] = model.attention
        done = sum(rec[0] for rec in records)
        self._pend[p] = self._pend[p] - done if self._pend[p] > done else 0.0

    def set_table(self, table: PolicyTable) -> None:
        """The SMDP table in force from now on (a re-solved one, ``gateway/dispatch/tuning.py``):
        the next arrival or tick takes its state's action, the current state's slot share
        applies at once. What the scheduler learnt (step times, rates, estimates) stays, and
        queued requests keep the aging keys they arrived with."""
        self.config = replace(self.config, policy_table=table)
        self._table = table
        self._long_k = long_bucket(self._bounds, table.long_prompt)
        self._apply(self._state)
        self._limits()

    def set_prior(self, path: str, prior: PathConfig, trust: float = 1.0) -> None:
        """``path``'s step-time model now starts from ``prior`` (its workers' measured
        profiles), held as firmly as ``trust``; what it fitted stays (``StepModel.reprior``)."""
        p = POOLS.index(path)
        self._models[p].reprior(prior, trust)
        self._coef[p] = self._models[p].coefficients()
        self._quad[p] = self._models[p].attention

    def worker_capacity(self, path: str, slots: int, now: float, workers: int = 1,
                        step_tokens: int = 0) -> None:
        """``path``'s live workers, ``workers`` of them, offer ``slots`` sequence slots in all
        (in use ones included); ``step_tokens`` > 0 is their per-step token budget."""
        if path not in POOLS or slots < 0 or workers < 0 or step_tokens < 0:
            raise ValueError(f"unknown path {path!r}, or negative slots, workers or step tokens")
        self._now = now
        p = POOLS.index(path)
        self._cap[p] = slots
        self._limits()
        self._workers[p] = workers if workers > 0 else 1
        if step_tokens > 0:
            self._budget[p] = step_tokens

    def cancel(self, request_id: str, now: float) -> bool:
        """Remove a queued request; False if it is unknown, running or already gone."""
        self._now = now
        r = self._by_id.get(request_id)
        if r is None or r.state != QUEUED:
            return False
        self._unqueue(r, DONE)
        return True

    @property
    def macro_state(self) -> int:
        """The macro-state of the last arrival or tick (``sched_core.smdp.STATE_NAMES``)."""
        return self._state

    def state_visits(self) -> list[int]:
        """How many ticks found the scheduler in each macro-state."""
        return list(self._visits)

    def admission(self) -> tuple[float, float]:
        """The admission threshold of the state of the last arrival: where between the
        prediction (0) and its 99th-percentile bound (1) the SLO is checked, and the SLO's
        multiple it is checked against."""
        action = self._table.actions[self._state]
        return action.admit_weight, action.admit_slack

    def snapshot(self) -> dict[str, Any]:
        """Queues per bucket, fitted cost curves, thresholds and counters, as JSON data."""
        now = self._now
        t_cut, _ = self._tail(now)
        buckets = []
        for k, bound in enumerate(self._bounds):
            n = self._n[k]
            nbar = self._osum[k] / n if n else self._mix_out
            buckets.append({
                "bucket": k, "max_prompt": bound, "queued": n, "tokens": self._tok[k],
                "arrival_rate": self._arrivals[k].rate(now), "mean_output": nbar,
                **thresholds(self._fm(CPU, k, nbar), self._fm(GPU, k, nbar),
                             self._b2(GPU, k, nbar)),
            })
        paths = []
        for p, model in enumerate(self._models):
            u, kv = self._per_worker(p)
            paths.append({
                "capacity": self._cap[p], "in_flight": self._used[p], "kv_tokens": self._kv[p],
                "workers": self._workers[p], "step_tokens": self._budget[p],
                "pending_prefill": self._pend[p],
                "slot_limit": self._lim[p],
                "max_batch": self._max_batch[p], "fitted_steps": model.observations,
                "step_model": {**dict(zip(COEFFICIENTS, self._coef[p], strict=True)),
                               "prefill_attention": self._quad[p]},
                "drift": model.scale,
                "step_s": self._step_s(p, 0.0, u, kv),
            })
        tenants = {
            name: {"counter": self._counter[t], "queued": self._backlog[t]}
            for t, name in enumerate(self._tenant_names)
        }
        return snapshot_dict(
            now=now, queued=self._queued, buckets=buckets, paths=paths, t_cut=t_cut,
            mu_cpu=self._mu_cpu(), lambda_cpu=self._cpu_meter.rate(now),
            slo=self.config.ttft_p99_slo_s, tenants=tenants, min_counter=self._min_counter(),
            policy=describe(self.config.policy_table, self._state, self._visits))

    def drift(self, path: str) -> float:
        """How much slower than its prior ``path``'s workers run now (the step-time model's
        re-anchoring, ``StepModel.scale``): 1 as measured."""
        return self._models[POOLS.index(path)].scale

    def prefill_alone_s(self, path: str, prompt_tokens: int) -> float:
        """The fitted time to prefill ``prompt_tokens`` on an idle worker of ``path``: the part
        of a first token that no queue adds."""
        p = POOLS.index(path)
        _, _, _, pl, pt = self._coef[p]
        return pl + pt * prompt_tokens + self._quad[p] * prompt_tokens * prompt_tokens

    def explain(self, request_id: str) -> dict[str, Any] | None:
        """Why a request waits, what is ahead of it, where it goes; None if unknown."""
        r = self._by_id.get(request_id)
        if r is None:
            return None
        k, t = r.bucket, r.tenant
        if r.state == INFLIGHT:
            return {"request_id": request_id, "state": "dispatched", "bucket": k,
                    "batch_id": r.batch, "path": POOLS[self._inflight[r.batch].path]}
        now = self._now
        mine = (r.key, r.req.arrival, request_id)
        ahead_n = ahead_tok = ahead_prompt = 0
        for heap in self._rq[k]:
            for e in heap:
                if e[4].state == QUEUED and e[:3] < mine:
                    ahead_n += 1
                    ahead_tok += e[4].req.prompt_tokens + e[4].out
                    ahead_prompt += e[4].req.prompt_tokens
        n = self._n[k]
        nbar = self._osum[k] / n
        p, wait, prefill, decode, decode_hi, tail = self._terms(k, n, nbar, self._psum[k] / n,
                                                                ahead_n, ahead_prompt, r.out,
                                                                r.req.prompt_tokens, now)
        t_cut, _ = self._tail(now)
        lo = self._min_counter()
        path, reason = route_reason(
            target=p, free=(self._free(CPU), self._free(GPU)),
            capacity=(self._cap[CPU], self._cap[GPU]), eligible=self._eligible(t),
            overdue=r.t_in + t_cut <= now, holds=self._tpot_holds(p, k, n, now),
            tpot_slo=self.config.tpot_slo_s)
        since = r.req.budget_wait + (now - r.t_in)
        return queued_explanation(
            request_id=request_id, tenant=self._tenant_names[t], bucket=k,
            max_prompt=self._bounds[k], requests_ahead=ahead_n, tokens_ahead=ahead_tok,
            queued_in_bucket=n, waited_s=now - r.t_in, path=path, reason=reason,
            counter=self._counter[t], min_counter=lo, t_cut=t_cut,
            limits=thresholds(self._fm(CPU, k, nbar), self._fm(GPU, k, nbar),
                              self._b2(GPU, k, nbar)),
            ttft_s=since + wait + prefill, total_s=since + wait + prefill + decode,
            p99_s=since + tail + decode_hi)

    # ------------------------------------------------------------ admission

    def _tenant(self, name: str) -> int:
        t = self._tenant_ix.get(name)
        if t is None:
            t = len(self._tenant_names)
            self._tenant_ix[name] = t
            self._tenant_names.append(name)
            self._counter.append(0.0)
            self._weight.append(1.0)
            self._backlog.append(0)
            self._tver.append(0)
            self._est.append([-1.0] * len(self._bounds))
            for k in range(len(self._bounds)):
                self._rq[k].append([])
                self._kver[k].append(0)
        return t

    def _expected_output(self, req: Request, t: int, k: int) -> int:
        """The caller's estimate, else the tenant's observed mean in this bucket, else the
        bucket's, else the configured default; always within [1, max_tokens]."""
        if req.expected_output_tokens > 0:
            return min(req.expected_output_tokens, req.max_tokens)
        e = self._est[t][k]
        if e < 0.0:
            e = self._est_bucket[k]
        if e < 0.0:
            e = float(self.config.default_output_tokens)
        return max(1, min(req.max_tokens, int(e + 0.5)))

    def _terms(self, k: int, n: int, nbar: float, lbar: float, ahead_n: int, ahead_prompt: int,
               out: int, prompt: int, now: float) -> tuple[int, float, float, float, float, float]:
        """Contract terms for a ``prompt``-token request in bucket k of ``n`` queued (itself
        included) with ``ahead_n`` requests of ``ahead_prompt`` prompt tokens before it:
        (path, wait, prefill, decode, decode bound, p99 of wait + prefill).

        A continuous-batching worker takes a request as soon as a slot is free, so the wait
        is: the slots it waits for (the requests ahead beyond the free slots, at the rate a
        full path finishes requests), plus the prompts prefilled before its own (those sent
        to the workers and not yet prefilled, and those ahead that take free slots), plus
        the step its worker is in; prefill is its own prompt with the bucket's others of a
        batch; the p99 term is the tail-cut bound ``T_cut + ln(100)/(μ_a − λ_a)`` where the
        cut is active, else the exponential tail ``ln(100)·(wait + prefill)``. Prefill is
        chunked next to the worker's running sequences; each decode step runs with them and
        the batch: expected ``out·step(running + batch)``, bounded by the steps of a full
        worker, since a worker never runs more sequences than its share of the slots.
        """
        p = self._target(k, n, nbar)
        cap = max(self._lim[p], 1)
        w = self._workers[p]
        per = min(self._max_batch[p], max(cap // w, 1))
        length = float(self._bounds[k])
        s_full = (self._prefill_s(p, per * length, 0.0, 0.0)
                  + nbar * self._step_s(p, 0.0, float(per), per * (length + 0.5 * nbar)))
        free = max(self._free(p), 0)
        wait = (ahead_n - free + 1) * s_full / (w * per) if ahead_n >= free else 0.0
        t_cut, gap = self._tail(now)
        u, kv = self._per_worker(p)
        if self._used[p] > 0:  # the rest of the step its worker is in: half of one, on average
            wait += 0.5 * self._step_s(p, 0.0, u, kv)
        before = self._pend[p] + (ahead_prompt * free / ahead_n if ahead_n > free else ahead_prompt)
        run = min(n, self._max_batch[p])
        # its prompt is prefilled after those before it, in the same chunked passes
        prefill = (self._prefill_s(p, before / w + prompt + (run - 1) * lbar, u, kv)
                   + self._quad[p] * (prompt * prompt + (run - 1) * lbar * lbar))  # attention's growth
        kv_run = kv + run * length
        decode = out * self._step_s(p, 0.0, u + run, kv_run)
        hi = u + run if u + run > per else float(per)
        kv_hi = hi * (length + out)
        decode_hi = out * self._step_s(p, 0.0, hi, kv_hi if kv_hi > kv_run else kv_run)
        queue = wait + prefill
        tail = max(queue, t_cut + LN100 / gap) if t_cut < INF else LN100 * queue
        return p, wait, prefill, decode, decode_hi, tail

    def _enqueue(self, req: Request, t: int, k: int, out: int, service: float,
                 now: float) -> None:
        cfg = self.config
        prompt = req.prompt_tokens
        cost = prompt + out
        # shortest prompt first, with aging (docs/scheduling.md §2 says why not least slack)
        key = prompt * self._key_w + cfg.aging_tokens_per_s * req.arrival + cfg.priority_tokens * req.priority
        r = _Req(req, k, t, out, key, service, self._seq)
        self._seq += 1
        self._by_id[req.id] = r
        self._weight[t] = req.weight
        if self._backlog[t] == 0:
            # A returning tenant's counter is lifted to the smallest backlogged counter
            # (or, with none backlogged, to that of the last tenant to leave).
            floor = self._min_counter()
            if floor == INF:
                floor = self._idle_floor
            if self._counter[t] < floor:
                self._counter[t] = floor
            self._backlog[t] = 1
            self._touch(t)
        else:
            self._backlog[t] += 1
        self._n[k] += 1
        self._tok[k] += cost
        self._psum[k] += prompt
        self._osum[k] += out
        self._queued += 1
        heap = self._rq[k][t]
        heapq.heappush(heap, (key, req.arrival, req.id, r.seq, r))
        if heap[0][4] is r:
            self._push_head(k, t)
        fifo = self._fifo[k]
        fifo.append(r)
        if len(fifo) > 2 * self._n[k] + 64:
            self._fifo[k] = deque(q for q in fifo if q.state == QUEUED)
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline - r.service, req.arrival, req.id, r.seq, r))
        self._arrivals[k].add(now, 1.0)
        alpha = cfg.ewma_alpha
        self._mix_prompt += alpha * (prompt - self._mix_prompt)
        self._mix_out += alpha * (out - self._mix_out)

    # -------------------------------------------------------------- queues

    def _push_head(self, k: int, t: int) -> None:
        self._kver[k][t] += 1
        key, arrival, rid, _, _ = self._rq[k][t][0]
        heapq.heappush(self._heads[k], (key, arrival, rid, self._kver[k][t], t))

    def _head(self, k: int) -> _HeadEntry:
        """The valid top of ``_heads[k]`` (the bucket must not be empty)."""
        heads = self._heads[k]
        while heads[0][3] != self._kver[k][heads[0][4]]:
            heapq.heappop(heads)
        return heads[0]

    def _fifo_head(self, k: int) -> _Req | None:
        """The earliest admitted request still queued in bucket k."""
        fifo = self._fifo[k]
        while fifo and fifo[0].state != QUEUED:
            fifo.popleft()
        return fifo[0] if fifo else None

    def _unqueue(self, r: _Req, state: int) -> None:
        """Take a queued request out of every count; entries in other heaps go lazily."""
        r.state = state
        k, t = r.bucket, r.tenant
        self._n[k] -= 1
        self._tok[k] -= r.req.prompt_tokens + r.out
        self._psum[k] -= r.req.prompt_tokens
        self._osum[k] -= r.out
        self._queued -= 1
        heap = self._rq[k][t]
        if heap[0][4] is r:
            heapq.heappop(heap)
            while heap and heap[0][4].state != QUEUED:
                heapq.heappop(heap)
            if heap:
                self._push_head(k, t)
            else:
                self._kver[k][t] += 1
        self._backlog[t] -= 1
        if self._backlog[t] == 0:
            self._tver[t] += 1
            if self._min_counter() == INF:
                self._idle_floor = self._counter[t]
        if state == DONE:
            del self._by_id[r.req.id]

    def _expire(self, now: float, out: list[Dispatch | Reject]) -> None:
        """Reject queued requests that can no longer finish before their deadline."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] < now:
            r = heapq.heappop(deadlines)[4]
            if r.state != QUEUED:
                continue
            self._unqueue(r, DONE)
            late = now - r.req.arrival + r.service
            out.append(Reject(r.req.id, "deadline", f"deadline {r.req.deadline:.3f} can no "
                              f"longer be met: completion {late:.3f}s after arrival", 0.0, late))

    # ------------------------------------------------------------ fairness

    def _touch(self, t: int) -> None:
        self._tver[t] += 1
        heapq.heappush(self._active, (self._counter[t], t, self._tver[t]))

    def _most_behind(self) -> int:
        """The backlogged tenant with the smallest counter (ties: first seen), or -1."""
        active = self._active
        while active:
            _, t, v = active[0]
            if v == self._tver[t]:
                return t
            heapq.heappop(active)
        return -1

    def _min_counter(self) -> float:
        """The smallest virtual counter among backlogged tenants (inf if none)."""
        t = self._most_behind()
        return INF if t < 0 else self._counter[t]

    def _eligible(self, t: int) -> bool:
        """Within the slack of the most-behind backlogged tenant: fair_slack_tokens of
        service at t's own budget, ``counter ≤ min + slack_tokens / weight``."""
        slack = self.config.fair_slack_tokens / self._weight[t]
        return self._counter[t] <= self._min_counter() + slack

    def _serve(self, r: _Req, batch: list[_Req]) -> None:
        """Charge the tenant's counter for the request's tokens and move it to ``batch``."""
        cfg = self.config
        t = r.tenant
        self._counter[t] += (cfg.fair_input_weight * r.req.prompt_tokens
                             + cfg.fair_output_weight * r.out) / r.req.weight
        self._touch(t)
        self._unqueue(r, INFLIGHT)
        batch.append(r)

    def _observe_output(self, r: _Req, produced: int) -> None:
        """Learn the output length; correct the counter charged with the estimate."""
        cfg = self.config
        t, k = r.tenant, r.bucket
        alpha = cfg.ewma_alpha
        est = self._est[t]
        est[k] = float(produced) if est[k] < 0.0 else est[k] + alpha * (produced - est[k])
        eb = self._est_bucket
        eb[k] = float(produced) if eb[k] < 0.0 else eb[k] + alpha * (produced - eb[k])
        self._counter[t] += cfg.fair_output_weight * (produced - r.out) / r.req.weight
        if self._backlog[t] > 0:
            self._touch(t)

    # ------------------------------------------------------------ release

    def _free(self, p: int) -> int:
        return self._lim[p] - self._used[p]

    # ------------------------------------------------------------ macro-states

    def _classify(self) -> int:
        """The macro-state now (``sched_core.smdp``): the queue against the free slots and
        all slots, a long prompt waiting, a path running in its ``full_share`` of slots."""
        cap, used = self._cap, self._used
        free = (cap[CPU] - used[CPU] if cap[CPU] > used[CPU] else 0) + (
            cap[GPU] - used[GPU] if cap[GPU] > used[GPU] else 0)
        long_waiting = any(self._n[k] > 0 for k in range(self._long_k, len(self._bounds)))
        share = self._table.full_share
        full = (cap[CPU] > 0 and used[CPU] >= share * cap[CPU]) or (cap[GPU] > 0 and used[GPU] >= share * cap[GPU])
        return classify(self._queued, free, cap[CPU] + cap[GPU], long_waiting, full)

    def _apply(self, state: int) -> None:
        """Put the state's action in force."""
        self._state = state
        action = self._table.actions[state]
        self._queue_steps = action.prefill_queue_steps
        self._key_w = action.key_weight
        if action.slot_share != self._share:
            self._share = action.slot_share
            self._limits()

    def _limits(self) -> None:
        """The slots each path may fill: its share of the capacity, at least one."""
        for p in (CPU, GPU):
            lim = int(self._cap[p] * self._share)
            self._lim[p] = lim if lim > 0 or self._cap[p] <= 0 else 1

    def _per_worker(self, p: int) -> tuple[float, float]:
        """Sequences and KV tokens one worker of path p holds now: the path's dispatched,
        unfinished requests spread over its workers."""
        w = float(self._workers[p])
        return self._used[p] / w, self._kv[p] / w

    def _step_s(self, p: int, prefill: float, seqs: float, kv: float) -> float:
        """One worker step: a decode forward of ``seqs`` sequences holding ``kv`` KV tokens
        and a prefill forward of ``prefill`` prompt tokens (either may be absent)."""
        dl, ds, kc, pl, pt = self._coef[p]
        s = 0.0
        if seqs > 0.0:
            s = dl + ds * seqs + kc * kv
        if prefill > 0.0:
            s = s + (pl + pt * prefill)
        return s

    def _chunk(self, p: int, u: float) -> float:
        """Prompt tokens per step a worker running u sequences prefills: its step budget
        less their decode tokens, at least a quarter of the budget."""
        budget = float(self._budget[p])
        c = budget - u
        return c if c > 0.25 * budget else 0.25 * budget

    def _prefill_s(self, p: int, tokens: float, u: float, kv: float) -> float:
        """Chunked prefill of ``tokens`` prompt tokens next to u running sequences:
        ``ceil(tokens / chunk)`` steps, each also decoding the running ones; one pass when
        nothing decodes (the engine's budget binds only while sequences decode)."""
        if tokens <= 0.0:
            return 0.0
        dl, ds, kc, pl, pt = self._coef[p]
        if u <= 0.0:
            return pl + pt * tokens  # nothing decodes: the worker prefills whole prompts at once
        steps = math.ceil(tokens / self._chunk(p, u))
        return steps * (pl + (dl + ds * u + kc * kv)) + pt * tokens

    def _fm(self, p: int, k: int, nbar: float) -> tuple[float, float]:
        """The batch line ``S(B) = F + m·B`` of path p for bucket k (prefill in chunks of the
        worker's budget, then ``nbar`` decode steps with the batch joined to the running
        sequences): F the fixed part, m the part per request."""
        u, kv = self._per_worker(p)
        length = float(self._bounds[k])
        dl, ds, kc, pl, pt = self._coef[p]
        step = dl + ds * u + kc * kv
        fixed = pl + step if u > 0.0 else pl
        f = fixed + nbar * step
        share = fixed / self._chunk(p, u) if u > 0.0 else 0.0
        m = length * (share + pt) + nbar * (ds + kc * (length + 0.5 * nbar))
        return f, m

    def _b2(self, p: int, k: int, nbar: float) -> float:
        """B2 for continuous batching: the most sequences of bucket k one worker of path p
        decodes within the TPOT SLO, ``step(B2) = tpot_slo_s``."""
        dl, ds, kc, _, _ = self._coef[p]
        per = ds + kc * (self._bounds[k] + 0.5 * nbar)
        room = self.config.tpot_slo_s - dl
        if room <= 0.0:
            return 0.0
        return room / per if per > 0.0 else INF

    def _target(self, k: int, n: int, nbar: float) -> int:
        """The path that finishes n requests of bucket k sooner, running sequences counted
        (n < B1 ⟺ cpu)."""
        if self._cap[GPU] <= 0:
            return CPU
        if self._cap[CPU] <= 0:
            return GPU
        fc, mc = self._fm(CPU, k, nbar)
        fg, mg = self._fm(GPU, k, nbar)
        return CPU if fc + mc * n < fg + mg * n else GPU

    def _tpot_holds(self, p: int, k: int, n: int, now: float) -> bool:
        """Marginal cost in continuous batching: hold bucket k's next batch off path p iff,
        once it decodes beside them, the running sequences' decode step would pass the TPOT
        SLO while it now meets it (the prefill steps in between are bounded by the workers'
        step budget and spread over every output token), and the bucket's oldest request
        would still get its first token (after the prompts already sent to the path and its
        own) within ``HOLD_SLACK`` of the TTFT SLO. Nothing running: never held."""
        if self._used[p] <= 0:
            return False
        slo = self.config.tpot_slo_s
        u, kv = self._per_worker(p)
        if self._step_s(p, 0.0, u, kv) > slo:
            return False
        r = min(n, self._free(p), self._max_batch[p])
        if r <= 0:
            return False
        tokens = r * (self._psum[k] / n)
        if self._step_s(p, 0.0, u + r, kv + tokens) <= slo:
            return False
        head = self._fifo_head(k)
        slack = HOLD_SLACK * self.config.ttft_p99_slo_s
        return head is not None and self._first_token_s(p, head.t_in, tokens, now) < slack

    def _overdue(self, k: int, now: float, t_cut: float) -> bool:
        r = self._fifo_head(k)
        return r is not None and r.t_in + t_cut <= now

    def _saturated(self, p: int) -> bool:
        """Path p's workers hold ``prefill_queue_steps`` steps of prompt tokens they have not
        prefilled yet: more would only queue in their FIFO, out of the order's reach."""
        return self._used[p] > 0 and self._pend[p] >= self._queue_limit(p)

    def _queue_limit(self, p: int) -> float:
        """Prompt tokens path p's workers prefill in ``prefill_queue_steps`` steps beside
        the sequences they run."""
        u, _ = self._per_worker(p)
        return self._queue_steps * self._chunk(p, u) * self._workers[p]

    def _room(self, p: int, k: int) -> int:
        """How many of bucket k's requests (at its mean prompt) fill path p's prefill queue
        up to its limit, at least one; no limit while nothing runs there."""
        if self._used[p] <= 0:
            return self._max_batch[p]
        room = self._queue_limit(p) - self._pend[p]
        mean = self._psum[k] / self._n[k] if self._n[k] > 0 else 0.0
        if room <= 0.0 or mean <= 0.0:
            return 1
        count = math.ceil(room / mean) if room / mean < self._max_batch[p] else self._max_batch[p]
        return max(1, count)

    def _releases(self, p: int, k: int, n: int, now: float, t_cut: float) -> bool:
        """Release to p now unless its prefill queue is full, or the TPOT rule holds it and
        the bucket is not overdue (a full prefill queue holds even an overdue bucket: more
        would only wait there, in the worker's order instead of this one)."""
        if self._saturated(p):
            return False
        return self._overdue(k, now, t_cut) or not self._tpot_holds(p, k, n, now)

    def _busy_for(self, p: int, now: float) -> float:
        """Predicted time until the first in-flight batch of path p finishes."""
        ends = [b.end for b in self._inflight.values() if b.path == p]
        return max(0.0, min(ends) - now) if ends else 0.0

    def _plan(self, k: int, now: float, t_cut: float) -> int:
        """The path bucket k releases a batch to now, or -1 to wait."""
        n = self._n[k]
        free = (self._free(CPU), self._free(GPU))
        if free[CPU] <= 0 and free[GPU] <= 0:
            return -1
        nbar = self._osum[k] / n
        target = self._target(k, n, nbar)
        if free[target] > 0 and self._releases(target, k, n, now, t_cut):
            return target
        # The target is busy or holds the batch for its running sequences: the other path
        # takes it if it finishes it no later than the target would after it frees up, or
        # if only there does its oldest request still make its SLO.
        other = 1 - target
        if free[other] <= 0:
            return -1
        size = min(n, free[other], self._max_batch[other])
        fo, mo = self._fm(other, k, nbar)
        ft, mt = self._fm(target, k, nbar)
        if (fo + mo * size > self._busy_for(target, now) + (ft + mt * size)
                and not self._rescues(other, k, n, size, now)):
            return -1
        return other if self._releases(other, k, n, now, t_cut) else -1

    def _rescues(self, other: int, k: int, n: int, size: int, now: float) -> bool:
        """The overflow that keeps a request's SLO where the target path cannot start it now
        (no free slot, or it holds the batch): the other path takes the batch though it
        finishes it later, if bucket k's oldest request gets its first token there within the
        TTFT SLO (after the prompts already sent there, then its own) and its decode step,
        with the batch beside its running sequences, stays within the TPOT SLO. Waiting for
        the target is not priced: a full path's next free slot is the least known figure here
        (its running sequences' lengths are estimates), and the other path's is not needed
        (docs/scheduling.md §7)."""
        head = self._fifo_head(k)
        if head is None:
            return False
        u, kv = self._per_worker(other)
        tokens = size * (self._psum[k] / n)
        if self._first_token_s(other, head.t_in, tokens, now) > self.config.ttft_p99_slo_s:
            return False
        return self._step_s(other, 0.0, u + size, kv + tokens) <= self.config.tpot_slo_s

    def _bucket_order(self) -> list[int]:
        """Non-empty buckets: first the one holding the best request of the most-behind
        tenant (serving it is what lets everyone else's slack advance), then the others,
        most urgent head first (ties: arrival, then bucket)."""
        t = self._most_behind()
        lead = -1
        if t >= 0:
            best = min((heap[0][:3], k) for k in range(len(self._bounds))
                       if (heap := self._rq[k][t]))
            lead = best[1]
        order = []
        for k in range(len(self._bounds)):
            if self._n[k] > 0 and k != lead:
                key, arrival, _, _, _ = self._head(k)
                order.append((key, arrival, k))
        order.sort()
        return ([lead] if lead >= 0 else []) + [k for _, _, k in order]

    def _take(self, k: int, limit: int) -> list[_Req]:
        """Up to ``limit`` requests of bucket k by aging key, skipping tenants that are
        more than the slack ahead of the smallest backlogged counter."""
        heads = self._heads[k]
        batch: list[_Req] = []
        aside: list[_HeadEntry] = []
        while len(batch) < limit and heads:
            entry = heapq.heappop(heads)
            t = entry[4]
            if entry[3] != self._kver[k][t]:
                continue
            if not self._eligible(t):
                aside.append(entry)
                continue
            self._serve(self._rq[k][t][0][4], batch)
        for entry in aside:
            heapq.heappush(heads, entry)
        return batch

    def _tail(self, now: float) -> tuple[float, float]:
        """(T_cut, μ_a − λ_a): T_cut = SLO − ln(100)/(μ_a − λ_a), inf where that is not
        positive (the cpu path cannot honour the SLO bound, or there is no cpu path)."""
        mu = self._mu_cpu()
        if mu <= 0.0:
            return INF, INF
        gap = mu - self._cpu_meter.rate(now)
        slo = self.config.ttft_p99_slo_s
        if gap * slo <= LN100:
            return INF, INF
        return slo - LN100 / gap, gap

    def _mu_cpu(self) -> float:
        """μ_a: requests/s the cpu path serves with every worker full, at the current mix."""
        cap = self._lim[CPU]
        if cap <= 0:
            return 0.0
        w = self._workers[CPU]
        b = min(max(cap // w, 1), self._max_batch[CPU])
        lp, lo = self._mix_prompt, self._mix_out
        s = (self._prefill_s(CPU, b * lp, 0.0, 0.0)
             + lo * self._step_s(CPU, 0.0, float(b), b * (lp + 0.5 * lo)))
        return (w * b) / s if s > 0.0 else INF

    def _late_buckets(self, now: float, wait: float) -> list[int]:
        """The buckets whose oldest queued request has waited ``wait``, the one whose oldest
        entered first first (ties: arrival, then bucket)."""
        firsts = []
        for k in range(len(self._bounds)):
            r = self._fifo_head(k)
            if r is not None and r.t_in + wait <= now:
                firsts.append((r.t_in, r.req.arrival, k))
        firsts.sort()
        return [k for _, _, k in firsts]

    def _tail_cut(self, now: float, t_cut: float, out: list[Dispatch | Reject]) -> None:
        """Requests that waited T_cut go to the cpu path in admission order, bucket by
        bucket (the bucket whose overdue head entered first goes first)."""
        for k in self._late_buckets(now, t_cut):
            limit = min(self._free(CPU), self._max_batch[CPU], self._room(CPU, k))
            if limit <= 0 or self._saturated(CPU):
                return
            batch: list[_Req] = []
            aside: list[_Req] = []
            while len(batch) < limit:
                r = self._fifo_head(k)
                if r is None or r.t_in + t_cut > now:
                    break
                self._fifo[k].popleft()
                if self._eligible(r.tenant):
                    self._serve(r, batch)
                else:
                    aside.append(r)
            self._fifo[k].extendleft(reversed(aside))
            if batch:
                self._dispatch(CPU, k, batch, now, out)

    def _rescue(self, now: float, t_cut: float, out: list[Dispatch | Reject]) -> None:
        """The late go first: a bucket's oldest request that has waited ``RESCUE_AFTER`` of the
        TTFT SLO is dispatched alone, ahead of the order, to the path the bucket releases to,
        if it still gets its first token there within the SLO (after the prompts already sent
        to the path, then its own); buckets by their oldest request's admission, each in
        admission order. A request that can no longer make it, or whose tenant is ahead of
        its share, is left to the order and stops its bucket's rescue; a path that holds
        stops every rescue (docs/scheduling.md §6)."""
        late = RESCUE_AFTER * self.config.ttft_p99_slo_s
        for k in self._late_buckets(now, late):
            while (r := self._fifo_head(k)) is not None and r.t_in + late <= now:
                p = self._plan(k, now, t_cut)
                if p < 0:
                    return
                if (not self._eligible(r.tenant) or self._first_token_s(p, r.t_in, float(r.req.prompt_tokens), now)
                        > self.config.ttft_p99_slo_s):
                    break
                batch: list[_Req] = []
                self._serve(r, batch)
                self._dispatch(p, k, batch, now, out)

    def _first_token_s(self, p: int, t_in: float, tokens: float, now: float) -> float:
        """From admission to the first token of a request admitted at ``t_in`` with ``tokens``
        prompt tokens, sent to path p now: its wait so far, the prompts already sent there
        (``pending_prefill``), then its own; the TPOT hold (§6), the overflow that keeps the SLO
        (§7) and the rescue (§6) test it against the TTFT SLO."""
        u, kv = self._per_worker(p)
        queue = self._prefill_s(p, self._pend[p] / self._workers[p], u, kv)
        return (now - t_in) + queue + self._prefill_s(p, tokens, u, kv)

    def _dispatch(self, p: int, k: int, batch: list[_Req], now: float,
                  out: list[Dispatch | Reject]) -> None:
        size = len(batch)
        tokens = float(size * max(r.req.prompt_tokens for r in batch))
        steps = max(r.out for r in batch)
        u, kv = self._per_worker(p)
        predicted = (self._prefill_s(p, tokens, u, kv)
                     + steps * self._step_s(p, 0.0, u + size, kv + tokens))
        bid = self._next_batch
        self._next_batch += 1
        for r in batch:
            r.batch = bid
            self._kv[p] += r.req.prompt_tokens + r.out // 2
            self._pend[p] += r.req.prompt_tokens
        self._used[p] += size
        self._inflight[bid] = _Batch(p, batch, now + predicted)
        if p == CPU:
            self._cpu_meter.add(now, float(size))
        out.append(Dispatch(bid, POOLS[p], k, tuple(r.req.id for r in batch), predicted))

    def _finish(self, r: _Req, p: int, produced: int) -> None:
        """A dispatched request is over: its slot and KV come back; ``produced`` ≥ 0 is
        learnt as its output length."""
        self._used[p] -= 1
        self._kv[p] -= r.req.prompt_tokens + r.out // 2
        if self._used[p] == 0:
            self._pend[p] = 0.0  # nothing running: nothing waits for prefill
        if produced >= 0:
            self._observe_output(r, produced)
        r.state = DONE
        del self._by_id[r.req.id]
