"""The one driver of a scheduling policy: the gateway's dispatcher and the simulator feed it the
same events and ask it when to tick next. No I/O and no clock: time is an argument.

The rules, in one place:

* every arrival is followed by a tick, and so is every event that frees a slot (a request
  finished, a batch reported, capacity changed): the caller ticks after calling these;
* while requests wait and some path has a free slot, the policy is ticked every ``tick_s``
  (a policy that knows when it next wants a tick, ``next_wake``, is asked instead); with no
  free slot there is no tick: nothing can leave before a slot comes back;
* a request's slot comes back when the request finishes (``finished``), not when its whole
  batch ends; a batch report (``completed``) gives back the rest and ends the batch;
* worker step telemetry refits the policy's step-time model (``steps``); the workers' slots,
  their number and their per-step token budget are its capacity (``capacity``);
* a policy that promises (the scheduler) has its raw contracts calibrated on outcomes
  (``sched_core.contracts``): the driver estimates each request's output length, turns the
  core's contract into the calibrated promise, and refuses at admission a request whose
  SLO the promise cannot meet (``slo``; a tenant over its share of the admitted work,
  ``Shares``, is held to half its TTFT SLO and refused while no slot is left for it), and a
  request without a first-token SLO whose predicted wait passes its ``max_wait_s`` (``wait``);
  every request that got a promise ends in ``outcome`` (what it took) or ``forget``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from common.pools import POOLS
from sched_core.contracts import Accuracy, Contracts
from sched_core.overtake import Overtaking
from sched_core.recorded import Traffic
from sched_core.shares import Backlogs, Shares
from sched_core.smdp import PolicyTable, weight_quantile
from sched_core.types import (
    HOLD_SLACK,
    BatchTimings,
    Contract,
    Dispatch,
    PathConfig,
    Reject,
    Request,
    SchedulerConfig,
)

TICK_S = 0.002  # how often a policy is asked while requests wait and a slot is free
REPORT_GRACE_S = 2.0  # after a batch's last request ended where it was sent from, its report has this long
#: A tenant over its fair share is refused (when it has an SLO) once its path's running and
#: queued sequences reach this share of its slots: no slot is left for it.
FULL_LOAD = 1.0
# a tenant holding less than this of its fair share of the outstanding work is judged by its own
# queue (Driver._wait); a margin under 1, so that two equal floods are both judged by the whole queue
UNDER_SHARE = 0.9
#: The gateway's default bound on the predicted wait of a request without a first-token SLO
#: (``--max-queue-wait-ms``; the ``wait`` refusal below); the simulator's scenarios use it too.
MAX_QUEUE_WAIT_MS = 5000.0

StepRecord = tuple[int, int, int, float]  # prefill tokens, decode sequences, KV tokens, seconds


class Policy(Protocol):
    """What the driver drives, every policy: the scheduler (``sched_core.Scheduler``, both
    implementations) and the baselines of ``sched_core.policies``."""

    @property
    def queued(self) -> int: ...

    def arrive(self, req: Request, now: float) -> Contract | Reject | None: ...

    def tick(self, now: float) -> list[Dispatch | Reject]: ...

    def finished(self, request_id: str, output_tokens: int, now: float) -> bool: ...

    def completed(self, timings: BatchTimings, now: float) -> None: ...

    def worker_capacity(self, path: str, slots: int, now: float, workers: int = 1,
                        step_tokens: int = 0) -> None: ...

    def observe_steps(self, path: str, records: list[StepRecord], now: float) -> None: ...

    def cancel(self, request_id: str, now: float) -> bool:
        """Drop a queued request; False where it is not queued (dispatched, or never seen)."""
        ...


@runtime_checkable
class Wakes(Protocol):
    """A policy that knows when it next wants a tick (a time window closing)."""

    def next_wake(self, now: float) -> float: ...


@runtime_checkable
class Prices(Protocol):
    """A policy that prices work with a step-time model and promises what it prices: the
    scheduler. The baselines promise nothing, and the driver asks them none of this."""

    config: SchedulerConfig

    def set_prior(self, path: str, prior: PathConfig, trust: float = 1.0) -> None:
        """Seed ``path``'s step-time model with a measured profile, held as firmly as ``trust``."""
        ...

    def set_table(self, table: PolicyTable) -> None:
        """The SMDP table in force from now on (a re-solved one)."""
        ...

    def drift(self, path: str) -> float:
        """The step-time model's re-anchoring of ``path`` (1: as fitted)."""
        ...

    def prefill_alone_s(self, path: str, prompt_tokens: int) -> float:
        """The fitted time of a prompt's prefill on an idle worker of ``path``."""
        ...

    def admission(self) -> tuple[float, float]:
        """The weight and slack of the admission rule of the state in force (the SMDP table's)."""
        ...

    def explain(self, request_id: str) -> dict[str, Any] | None:
        """Why a request it holds is where it is (None: not held)."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """Its queues, paths and step-time models, as JSON data."""
        ...


@runtime_checkable
class Queues(Protocol):
    """A baseline: one queue filled into its ``paths`` in order, no cost model."""

    paths: tuple[str, ...]

    def backlog(self) -> tuple[int, int]:
        """Queued requests, and their prompt and expected output tokens."""
        ...


@dataclass(slots=True)
class _Batch:
    """A dispatched batch: its requests, the slots its unfinished ones hold, the ones still
    awaited where it was sent from, and when it is given up should its report never come."""

    path: str
    requests: tuple[str, ...]
    running: set[str]
    waiting: set[str]
    expires: float


class Driver:
    """A policy plus the slot bookkeeping that decides when it must be asked again, and the
    calibration of its contracts. It is the one owner of batch -> requests: each dispatched
    batch holds slots until its report (``completed``), ``abort``, or its lease runs out
    (``expired``: ``lease_s`` after dispatch, or ``REPORT_GRACE_S`` after its last request
    ended, whichever is first)."""

    def __init__(self, policy: Policy, tick_s: float = TICK_S, lease_s: float = math.inf) -> None:
        self.policy = policy
        self._wakes = policy if isinstance(policy, Wakes) else None  # a Protocol check costs ~10 us a call
        #: the scheduler's pricing, asked where it promises (None: a baseline, which promises nothing)
        self.pricing: Prices | None = policy if isinstance(policy, Prices) else None
        #: a baseline's queue, for the backlog (None: the scheduler, whose snapshot says it per bucket)
        self.queues: Queues | None = policy if isinstance(policy, Queues) else None
        self.tick_s = tick_s
        config = self.pricing.config if self.pricing is not None else SchedulerConfig()
        self.contracts = Contracts(config.bucket_bounds, config.default_output_tokens)
        self.shares = Shares(config.rate_window_s)
        self.backlogs = Backlogs()
        self.overtaking = Overtaking()
        self._workers = dict.fromkeys(POOLS, 0)
        self.traffic = Traffic()  # every request it saw, as a trace to tune on
        self._cap = dict.fromkeys(POOLS, 0)
        self._used = dict.fromkeys(POOLS, 0)
        self.lease_s = lease_s
        self._open: dict[int, _Batch] = {}
        self._batch_of: dict[str, int] = {}  # request -> its batch, until the batch ends
        # the one ledger of slots is this driver's: whoever places requests on workers follows it
        self.on_free: Callable[[str], None] | None = None  # called with each request whose slot comes back

    @property
    def queued(self) -> int:
        return self.policy.queued

    def arrive(self, req: Request, now: float, promised: bool = False) -> Contract | Reject | None:
        """The policy's decision; a contract comes back calibrated, or as an ``slo`` or ``wait``
        refusal. ``promised``: its client already holds a contract (another scheduler gave it,
        then stepped down or died), or this one cannot yet see its whole wait (just after a
        take-over): neither refusal applies, and its outcome teaches the calibration nothing
        (``Contracts.promise``'s ``inherited``)."""
        self.traffic.arrived(req.id, req.tenant, req.prompt_tokens, req.max_tokens, now)
        if self.pricing is None:  # a baseline promises nothing (and refuses nothing)
            return self.policy.arrive(req, now)
        cal = self.contracts
        out, out_hi = cal.output(req)
        if out != req.expected_output_tokens:  # (the constructor: replace() costs twice as much)
            req = Request(req.id, req.tenant, req.weight, req.prompt_tokens, req.max_tokens, req.arrival, out,
                          req.priority, req.deadline, req.budget_wait, req.slo_ttft_s, req.slo_tpot_s, req.max_wait_s)
        decision = self.policy.arrive(req, now)
        if not isinstance(decision, Contract):
            self.traffic.ended(req.id)  # (refused)
            return decision
        path = decision.path
        load = (self._used[path] + self.policy.queued) / max(self._cap[path], 1)
        stretch = self.overtaking.factor(path, decision.bucket, self._workers[path], now)
        if stretch > 1.0:  # the shorter prompts that will arrive before its first token
            more = (decision.ttft_s - decision.budget_wait_s) * (stretch - 1.0)
            decision = Contract(decision.request_id, decision.bucket, path, decision.ttft_s + more,
                                decision.total_s + more, decision.p99_s, decision.tokens_ahead, decision.budget_wait_s,
                                decision.tpot_s, decision.output_tokens, decision.ttft_p99_s, decision.tpot_p99_s,
                                decision.output_tokens_hi)
        c = cal.promise(decision, req, out_hi, load, now, self._speed(path), inherited=promised)
        self.backlogs.add(req.id, req.tenant, req.weight, req.prompt_tokens, c.output_tokens)
        if not promised and (req.slo_ttft_s is not None or req.slo_tpot_s is not None):
            refusal = self._refusal(req, c, decision, load, now)
            if refusal is not None:
                self.traffic.ended(req.id)
                return refusal
        if not promised and req.slo_ttft_s is None and req.max_wait_s is not None:
            refusal = self._wait_refusal(req, c, load, now)
            if refusal is not None:
                self.traffic.ended(req.id)
                return refusal
        self.overtaking.admitted(path, c.bucket, self.pricing.prefill_alone_s(path, req.prompt_tokens), now)
        self.shares.add(req.tenant, req.weight, req.prompt_tokens + c.output_tokens, now)
        return c

    def _refusal(self, req: Request, c: Contract, raw: Contract, load: float, now: float) -> Reject | None:
        """The ``slo`` refusal of a request its promise cannot serve in time (None: keep it).
        Judged by its promise, the whole queue's (not ``_wait``'s): a request kept with an
        SLO holds a contract that must meet it, and the order serves a tenant under its share
        first only where its key or the fair-share counters do; fair share enters through
        ``HOLD_SLACK`` and ``FULL_LOAD`` for the tenants over their share.
        A request for an idle path is kept whenever the fitted step times, without the
        calibration, serve it within its SLO on an idle worker:
        calibration rests on outcomes, and a path whose outcomes went wrong (a saved state from
        another machine, a burst that just ended) must not refuse every request for an SLO, which
        would leave it no outcome to learn it was wrong from."""
        if self._idle_meets(req, c, raw):
            return None
        over = self.shares.over(req.tenant, now)
        ttft_slo = req.slo_ttft_s * (HOLD_SLACK if over else 1.0) if req.slo_ttft_s is not None else math.inf
        tpot_slo = req.slo_tpot_s if req.slo_tpot_s is not None else math.inf
        full = over and load >= FULL_LOAD  # capacity left is kept for the tenants within their share
        ttft, tpot = c.ttft_p99_s, c.tpot_p99_s
        weight, slack = self.pricing.admission() if self.pricing is not None else (1.0, 1.0)
        stricter = weight < 1.0 or slack != 1.0  # the state's quantile of each bound, against its multiple of the SLO
        if stricter:
            if weight < 1.0:
                ttft = c.ttft_s + weight * (c.ttft_p99_s - c.ttft_s)
                tpot = c.tpot_s + weight * (c.tpot_p99_s - c.tpot_s)
            ttft_slo *= slack
            tpot_slo *= slack
        if ttft <= ttft_slo and tpot <= tpot_slo and not full:
            return None
        if not self._take_back(req.id, now):
            return None  # keep the promise, bounds and all
        if full:
            why = ("its tenant is over its fair share and the workers are full: what is left goes to the "
                   "tenants within theirs")
        elif ttft > ttft_slo:
            why = (f"its first token could be promised within {c.ttft_p99_s * 1000:.0f} ms (p99), "
                   f"not the {ttft_slo / slack * 1000:.0f} ms asked" + (" (half the SLO: its tenant is over its "
                                                                        "fair share)" if over else ""))
        else:
            why = (f"its tokens could be promised every {c.tpot_p99_s * 1000:.0f} ms (p99), not the "
                   f"{tpot_slo / slack * 1000:.0f} ms asked")
        if stricter:
            why += (f"; at this load the policy admits a request only where the "
                    f"{100.0 * weight_quantile(weight):.0f}th percentile of its bounds is within {slack:g}x the SLO")
        wait = max(ttft - ttft_slo, 0.0)
        return Reject(req.id, "slo", why, max(1.0, wait), c.total_s, c.ttft_p99_s, c.p99_s)

    def _wait(self, req: Request, c: Contract) -> tuple[float, bool]:
        """The wait before ``req``'s first token as it will see it under fair share, and
        whether that is its tenant's own queue alone. A tenant holding at least ``UNDER_SHARE``
        of its fair share of the work outstanding (``Backlogs.use``, this request counted; a
        tenant alone holds all of it) waits for the whole queue and what runs now: the
        calibrated first token less its budget wait and its own prompt's prefill alone. One
        under it is served before the others' backlog (its counter is the smallest; a short
        prompt goes first anyway) and waits for what its own tenant has queued: those prompts'
        prefill and outputs' decode at this path's pace (what runs now is no tenant's queue)."""
        if self.pricing is None:
            return c.ttft_s - c.budget_wait_s, False
        if self.backlogs.use(req.tenant) >= UNDER_SHARE:
            return c.ttft_s - c.budget_wait_s - self.pricing.prefill_alone_s(c.path, req.prompt_tokens), False
        prompt, output = self.backlogs.work(req.tenant)
        prompt, output = prompt - req.prompt_tokens, output - c.output_tokens  # what is queued before it
        return (self.pricing.prefill_alone_s(c.path, prompt) + output * c.tpot_s if prompt > 0 else 0.0), True

    def _idle_meets(self, req: Request, c: Contract, raw: Contract) -> bool:
        """Its path's workers idle (nothing running there, nothing queued ahead of it, a slot
        for it), and its own prompt alone and the raw time per token within its SLO. Idle, not
        merely with a slot free: under overload, shedding keeps the queues short and a slot
        often free, and the bounds must decide there (admitting on a free slot cost the tenants
        within their share 8-17 points of attainment in the simulator)."""
        if c.tokens_ahead or self._used[c.path] or not self._cap[c.path] or self.pricing is None:
            return False
        alone = self.pricing.prefill_alone_s(c.path, req.prompt_tokens)
        return ((req.slo_ttft_s is None or c.budget_wait_s + alone <= req.slo_ttft_s)
                and (req.slo_tpot_s is None or raw.tpot_s <= req.slo_tpot_s))

    def _wait_refusal(self, req: Request, c: Contract, load: float, now: float) -> Reject | None:
        """The ``wait`` refusal of a request without a first-token SLO whose predicted first
        token comes more than ``max_wait_s`` after the time its own prompt takes alone (its
        budget wait aside: that is its tenant's own pace), the queue counted as its tenant sees
        it under fair share (``_wait``: a tenant within its share is not refused for the others'
        queue; the refusals fall on the tenants over theirs); None: keep it, as before its
        path's first-token predictions at this load level are calibrated on outcomes."""
        assert req.max_wait_s is not None
        if c.tokens_ahead == 0 and self._used[c.path] < self._cap[c.path]:
            return None  # nothing queued ahead and a slot free: no queue to wait in, whatever the model says
        if not self.contracts.calibrated("ttft", c.path, load):  # the raw model alone may be far off: no refusal
            return None
        wait, own = self._wait(req, c)
        if wait <= req.max_wait_s:
            return None
        if not self._take_back(req.id, now):
            return None
        mine = " behind its own tenant's queued requests (its tenant is under its fair share)" if own else ""
        why = (f"the workers are busy: its first token would wait about {wait:.1f} s{mine}, more than the "
               f"{req.max_wait_s:g} s a request without an SLO is kept waiting")
        return Reject(req.id, "wait", why, max(1.0, wait - req.max_wait_s), c.total_s, c.ttft_p99_s, c.p99_s)

    def _take_back(self, request_id: str, now: float) -> bool:
        """Takes an admitted request out of the policy's queue, and its promise with it, to
        refuse it; False where the policy cannot (the request then keeps its promise)."""
        if not self.cancel(request_id, now):
            return False
        self.contracts.forget(request_id)
        return True

    def cancel(self, request_id: str, now: float) -> bool:
        """Takes a queued request out of the policy's queue (False: not queued, or the policy
        cannot): it will never be dispatched."""
        if not self.policy.cancel(request_id, now):
            return False
        self.backlogs.remove(request_id)
        self.traffic.ended(request_id)
        return True

    def outcome(self, request_id: str, ttft_s: float | None, total_s: float, tokens: int,
                now: float) -> Accuracy | None:
        """A request with a promise finished: first token and last after ``ttft_s`` (None: not
        seen apart) and ``total_s`` seconds (from arrival), ``tokens`` generated. How the
        promise fared."""
        pend = self.contracts.promised(request_id)
        return self.contracts.observe(request_id, ttft_s, total_s, tokens, now,
                                      self._speed(pend.path) if pend is not None else 1.0)

    def _speed(self, path: str) -> float:
        return self.pricing.drift(path) if self.pricing is not None else 1.0

    def explain(self, request_id: str) -> dict[str, Any] | None:
        """The scheduler's explanation of a request it holds (None: not held, or a baseline)."""
        return self.pricing.explain(request_id) if self.pricing is not None else None

    def promised(self, request_id: str) -> Contract | None:
        """The contract a request was given (None: none, or its outcome is in)."""
        return self.contracts.promised(request_id) if self.pricing is not None else None

    def first_token(self, request_id: str, ttft_s: float, now: float) -> None:
        """A promised request's first token came ``ttft_s`` seconds after its arrival."""
        pend = self.contracts.promised(request_id)
        if pend is not None:
            self.contracts.first_token(request_id, ttft_s, now, self._speed(pend.path))

    def transition(self, path: str) -> None:
        """A worker of ``path`` changed how it runs (its threads): what is in flight there now
        is the change's, and the calibration does not learn from it."""
        self.contracts.transition(path)

    def forget(self, request_id: str) -> None:
        """A request ended without a usable outcome (failed, cancelled, refused later)."""
        self.contracts.forget(request_id)

    def tick(self, now: float) -> list[Dispatch | Reject]:
        decisions = self.policy.tick(now)
        for d in decisions:
            if isinstance(d, Reject):
                self.backlogs.remove(d.request_id)
                self.traffic.ended(d.request_id)
            else:
                ids = d.request_ids
                for rid in ids:
                    self.backlogs.remove(rid, running=True)
                self._open[d.batch_id] = _Batch(d.path, ids, set(ids), set(ids), now + self.lease_s)
                self._batch_of.update(dict.fromkeys(ids, d.batch_id))
                self._used[d.path] += len(ids)
        return decisions

    def finished(self, request_id: str, output_tokens: int, now: float) -> bool:
        """A dispatched request ended (``output_tokens`` < 0: unknown, e.g. it failed): its
        slot comes back now. False if it was not running (its batch already reported)."""
        batch = self._open.get(self._batch_of.get(request_id, -1))
        if batch is None or request_id not in batch.running:
            return False
        batch.running.discard(request_id)
        self.backlogs.done(request_id)
        self.traffic.finished(request_id, output_tokens)
        self._used[batch.path] -= 1
        if self.on_free is not None:
            self.on_free(request_id)
        self.policy.finished(request_id, output_tokens, now)
        return True

    def ended(self, request_id: str, now: float) -> None:
        """The request is over where it was sent from (answered, failed, timed out, cancelled):
        once its batch has no request left, its report has ``REPORT_GRACE_S`` to arrive."""
        self.traffic.ended(request_id)  # (a finished one is closed already)
        batch = self._open.get(self._batch_of.get(request_id, -1))
        if batch is not None:
            batch.waiting.discard(request_id)
            if not batch.waiting:
                batch.expires = min(batch.expires, now + REPORT_GRACE_S)

    def completed(self, timings: BatchTimings, now: float) -> bool:
        """A batch ended (a failed one reports zero sizes): the rest of its slots come back.
        False, and nothing learnt, for a batch not open (already ended, or not this driver's)."""
        batch = self._open.pop(timings.batch_id, None)
        if batch is None:
            return False
        for rid in batch.requests:
            del self._batch_of[rid]
        self._used[batch.path] -= len(batch.running)
        for rid in batch.running:
            self.backlogs.done(rid)
            if self.on_free is not None:
                self.on_free(rid)
        self.policy.completed(timings, now)
        return True

    def abort(self, batch_id: int, now: float) -> list[str]:
        """The batch will never report (its job could not be sent, or is lost): its slots come
        back now, nothing is fitted. Returns its requests still awaited."""
        batch = self._open.get(batch_id)
        if batch is None:
            return []
        waiting = sorted(batch.waiting)
        self.completed(BatchTimings(batch_id, batch.path, 0, 0, 0.0, 0, 0.0, ()), now)
        return waiting

    def expired(self, now: float) -> list[int]:
        """The batches whose lease ran out."""
        return [b for b, batch in self._open.items() if batch.expires <= now]

    def batch_of(self, request_id: str) -> int | None:
        """The open batch a dispatched request runs in (None: not dispatched, or its batch ended)."""
        return self._batch_of.get(request_id)

    def open_batches(self) -> list[int]:
        return list(self._open)

    def prior(self, path: str, prior: PathConfig, trust: float = 1.0) -> bool:
        """Seed ``path``'s step-time model with ``prior`` (its workers measured themselves),
        held as firmly as ``trust`` (0-1]; False if the policy has no model (the baselines)."""
        if self.pricing is None:
            return False
        self.pricing.set_prior(path, prior, trust)
        return True

    def steps(self, path: str, records: Sequence[StepRecord], now: float) -> None:
        if records:
            self.policy.observe_steps(path, list(records), now)

    def capacity(self, path: str, slots: int, now: float, workers: int = 1,
                 step_tokens: int = 0) -> None:
        self._cap[path] = slots
        self._workers[path] = workers
        self.policy.worker_capacity(path, slots, now, workers, step_tokens)

    def free(self, path: str) -> int:
        return self._cap[path] - self._used[path]

    def running(self, path: str) -> int:
        return self._used[path]

    def next_tick(self, now: float) -> float:
        """When the policy must be ticked next if nothing else happens (inf: only an event
        can change what it does)."""
        if not self.policy.queued:
            return math.inf
        if self._wakes is not None:
            return self._wakes.next_wake(now)
        if any(self._cap[p] > self._used[p] for p in POOLS):
            return now + self.tick_s
        return math.inf
