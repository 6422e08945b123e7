"""The scheduling core seen from the gateway: translation in, decisions out, no I/O.

The dispatcher owns the clock and Redis; this module turns gateway objects into
``sched_core`` events and ``sched_core`` decisions into stream jobs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

from common import protocol as p
from common.pools import POOLS
from gateway.dispatch.fleet import (
    capacity_share,
    engines_identity,
    measured_prior,
    measured_trust,
    path_identity,
    running_by_pool,
)
from gateway.dispatch.placement import Placement
from sched_core import BatchTimings, Contract, Dispatch, Reject, Request, SchedulerConfig
from sched_core.contracts import Accuracy
from sched_core.driver import Driver
from sched_core.policies import DEFAULT_POLICY, make_policy
from sched_core.saved import learnt, restore


@dataclass(frozen=True, slots=True)
class Origin:
    """Who sends a request and what they asked for, beyond the tokens."""

    tenant: str
    weight: float  # the tenant's tokens/s budget: its fair share under overload
    priority: int = 0
    budget_wait_s: float = 0.0
    deadline_s: float | None = None  # relative to arrival
    slo_ttft_s: float | None = None  # the client's or its tenant's SLO (docs/tenants.md)
    slo_tpot_s: float | None = None
    max_wait_s: float | None = None  # without a first-token SLO: the longest predicted wait (None: no bound)

    def waited(self, seconds: float) -> Origin:
        """The same request ``seconds`` after its arrival: what is left of its deadline and
        its first-token SLO (handed to another scheduler, ``Dispatcher.hand_over``)."""
        def left(s: float | None) -> float | None:
            return None if s is None else max(0.0, s - seconds)

        return replace(self, deadline_s=left(self.deadline_s), slo_ttft_s=left(self.slo_ttft_s))


@dataclass(frozen=True, slots=True)
class Send:
    pool: str
    job: p.BatchJob
    batch: int  # the scheduler's batch id
    acks: tuple[str, ...] = ()  # the arrival entries of forwarded requests it dispatches (election.DISPATCH)
    worker: str = ""  # the worker chosen to run it ('' : whichever worker of the pool reads it)


#: The saved state's format: a state of another format (or none) is not restored.
STATE_FORMAT = 2


class SchedulerShell:
    """The core plus what it does not keep: the jobs of queued requests. A dispatched batch's
    slots are the driver's lease (``Driver``: batch -> requests kept there once), which ends
    exactly once: by the batch's report (``completed``), by ``abort`` (its job never left, or
    is lost), or by ``expire``, once the batch's requests have all ended here and its report
    is ``REPORT_GRACE_S`` late, or ``lease_s`` after dispatch at the latest."""

    def __init__(self, gateway_id: str, reply_to: str, config: SchedulerConfig | None = None,
                 handoff_min_prompt: int = 0, lease_s: float = 150.0, policy: str = DEFAULT_POLICY,
                 routing: str = "prefix") -> None:
        self.policy = policy
        self.driver = Driver(make_policy(policy, config or SchedulerConfig()), lease_s=lease_s)
        self.gateway_id = gateway_id
        self.reply_to = reply_to
        self.handoff_min_prompt = handoff_min_prompt
        self.lease_s = lease_s
        self._seqs: dict[str, p.SeqJob] = {}
        self._gpu_alive = False
        self._step_tokens: dict[str, int] = {}  # per pool, from the workers' telemetry
        self.priors: dict[str, str] = {}  # per pool: the measured profiles its step model starts from
        self._identity: dict[str, str] = {}  # per pool: its live workers' identities, as last seen
        self._engines = ""  # the live workers' engines and models, as last seen
        self._saved: dict[str, Any] | None = None  # a persisted state, restored path by path once its workers show
        self.saved_state: dict[str, str] = {}  # per pool: what became of the saved state
        self._threads: dict[str, int] = {}  # per worker: the intra-op threads it ran at its last heartbeat
        # a request another gateway forwarded -> (that gateway's reply stream, its arrival entry)
        self._origin: dict[str, tuple[str, str]] = {}
        # a dispatched batch with forwarded requests -> its jobs (local id -> reply stream, requests)
        self._parts: dict[int, dict[str, tuple[str, tuple[str, ...]]]] = {}
        # per pool: sequences a previous scheduler left on the workers (from their heartbeats), until they end
        self._foreign: dict[str, int] = {}
        self.placement = Placement(routing) if routing != "pool" else None  # None: jobs go to the pool's stream
        if self.placement is not None:  # it follows the driver's ledger: a slot back is a place freed
            self.driver.on_free = self.placement.release

    def __len__(self) -> int:
        return self.driver.queued

    def explain(self, rid: str) -> dict[str, object] | None:
        """The core's explanation of a request it holds, with the contract it was given."""
        found: dict[str, object] | None = self.driver.explain(rid)
        promise = self.driver.promised(rid)
        if found is not None and promise is not None:
            found["contract"] = dataclasses.asdict(promise)
        placed = self.placement.placed(rid) if self.placement is not None else None
        if found is not None and placed is not None:  # its worker, and the prefix credited there
            found["placement"] = dataclasses.asdict(placed)
        return found

    def snapshot(self) -> dict[str, object]:
        pricing = self.driver.pricing
        snap: dict[str, object] = pricing.snapshot() if pricing is not None else {"queued": self.driver.queued}
        policy = snap.get("policy")  # the core's: the SMDP table's name, state, action and visits
        snap["policy"] = {"spec": self.policy, **(policy if isinstance(policy, dict) else {})}
        if self.placement is not None:
            snap["placed"] = self.placement.held()  # requests running per worker, as this scheduler placed them
        snap["priors"] = {pool: self.priors.get(pool, "packaged profile") for pool in POOLS}
        snap["saved_state"] = dict(self.saved_state)
        snap["calibration"] = self.driver.contracts.summary()
        return snap

    def next_tick(self, now: float) -> float:
        return self.driver.next_tick(now)

    def backlog(self) -> dict[str, tuple[int, int]]:
        """Queued requests and tokens (prompt and expected output) per pool. Each bucket's queue
        counts for the pool the scheduler would send it to now, and also for the pool it would
        prefer were both staffed when that pool has no worker: its bucket's crossover B1 at the
        queue's length (``sched_core.report.thresholds``). So a pool with no worker shows the
        demand it would take (what scales it up from zero), while the pool that runs the work
        now shows it too. A baseline counts its queue for the pool it fills first."""
        staffed = [pool for pool in POOLS if self.driver.free(pool) + self.driver.running(pool) > 0]
        out = dict.fromkeys(POOLS, (0, 0))

        def add(pool: str, requests: int, tokens: int) -> None:
            out[pool] = (out[pool][0] + requests, out[pool][1] + tokens)

        queues = self.driver.queues
        if queues is not None:  # a baseline: its order of paths, no cost model
            requests, tokens = queues.backlog()
            paths = queues.paths
            now = next((pool for pool in paths if pool in staffed), paths[0])
            add(now, requests, tokens)
            if paths[0] != now:
                add(paths[0], requests, tokens)
            return out
        pricing = self.driver.pricing
        for b in pricing.snapshot()["buckets"] if pricing is not None else ():
            n = b["queued"]
            if not n:
                continue
            tokens = int(b["tokens"] + n * b["mean_output"])
            b1 = b["b1"]  # None: the cpu line never crosses the gpu line
            preferred = "cpu" if b1 is None or n < b1 else "gpu"
            now = preferred if preferred in staffed or not staffed else staffed[0]
            add(now, n, tokens)
            if now != preferred:
                add(preferred, n, tokens)
        return out

    def arrive(self, seq: p.SeqJob, who: Origin, now: float,
               forwarded: tuple[str, str] | None = None, promised: bool = False) -> Contract | Reject | None:
        """The scheduler's decision on a request; ``forwarded``: another gateway sent it
        (its reply stream, the request's arrival entry); ``promised``: its client already
        holds a contract (``Driver.arrive``: no refusal, and nothing learnt from it). Just after
        a take-over, while sequences the previous scheduler sent still hold slots this one cannot
        see end (until a heartbeat says so), its view of the wait is not whole: the same holds."""
        req = Request(
            id=seq.rid,
            tenant=who.tenant,
            weight=who.weight,
            prompt_tokens=len(seq.prompt_ids),
            max_tokens=seq.params.max_tokens,
            arrival=now,
            priority=who.priority,
            deadline=None if who.deadline_s is None else now + who.deadline_s,
            budget_wait=who.budget_wait_s,
            expected_output_tokens=_known_output(seq.params),
            slo_ttft_s=who.slo_ttft_s,
            slo_tpot_s=who.slo_tpot_s,
            max_wait_s=who.max_wait_s,
        )
        decision = self.driver.arrive(req, now, promised or bool(self._foreign))
        if not isinstance(decision, Reject):
            self._seqs[seq.rid] = seq
            if forwarded is not None:
                self._origin[seq.rid] = forwarded
        return decision

    def knows(self, rid: str) -> bool:
        """The request is queued or running here."""
        return rid in self._seqs or self.driver.batch_of(rid) is not None

    def queued_ids(self) -> list[str]:
        """The requests queued here, not yet dispatched."""
        return list(self._seqs)

    def take_origin(self, rid: str) -> tuple[str, str] | None:
        """A forwarded request leaves the queue unsent (refused, cancelled): where it came from."""
        return self._origin.pop(rid, None)

    def outcome(self, rid: str, ttft_s: float | None, total_s: float | None, tokens: int,
                now: float) -> Accuracy | None:
        """The request ended here: what it took calibrates the contracts (a request that did
        not finish is only forgotten; a non-streaming one's first token is its end less the
        decode time its worker measured, ``Finished.decode_s``)."""
        if total_s is None:
            self.driver.forget(rid)
            return None
        return self.driver.outcome(rid, ttft_s, total_s, tokens, now)

    def model_state(self) -> dict[str, Any] | None:
        """What the gateway learnt, to persist: per path the fitted step-time coefficients
        (paths with fitted steps only) and the contracts' calibration, each with what it was
        learnt on (the identities of the path's workers, the engines' for output lengths);
        None before it learnt anything. A saved state not yet matched with workers is kept."""
        found = learnt(self.driver, self._identity)
        if found is None:
            return None
        fitted, calibration = found
        if not fitted and not calibration["ratios"] and not calibration["outputs"]:
            return self._saved
        return {"format": STATE_FORMAT, "identity": dict(self._identity), "engines": self._engines,
                "step_model": fitted, "contracts": calibration}

    def load_model_state(self, state: dict[str, Any]) -> None:
        """Start from a persisted state, path by path once the path's workers show
        (``capacity``): a path's fitted coefficients become its step model's prior and its
        calibration windows are loaded only where its live workers are those it was learnt on
        (the same measured profiles); output lengths where the engines are the same. A state
        made with other workers, another engine, or by an older release, is dropped: a promise
        priced on another machine's outcomes is no promise."""
        self._saved = state if state.get("format") == STATE_FORMAT and isinstance(state.get("identity"), dict) \
            else None
        self.saved_state = {} if self._saved is not None else {pool: "dropped: saved by an older release"
                                                                for pool in POOLS}

    def _restore(self) -> list[str]:
        """Match the saved state with the paths whose workers are known now; what was done."""
        saved = self._saved
        if saved is None:
            return []
        notes = []
        identity: dict[str, Any] = saved["identity"]
        found = saved.get("contracts")
        calibration: dict[str, Any] = found if isinstance(found, dict) else {}
        for pool, now_id in self._identity.items():
            if pool in self.saved_state or pool not in identity:
                continue
            if identity[pool] != now_id:
                self.saved_state[pool] = "dropped: learnt on other workers or profiles"
                notes.append(f"the saved step-time model and calibration of the {pool} path were learnt on other "
                             f"workers or profiles ({identity[pool]}; now {now_id}): starting from the measured "
                             "profiles")
                continue
            restore(self.driver, pool, saved.get("step_model", {}).get(pool), calibration)
            self.saved_state[pool] = "restored"
            notes.append(f"the {pool} path starts from its saved step-time model and calibration (same workers "
                         "and profiles)")
        if "outputs" not in self.saved_state and self._engines:
            same = saved.get("engines") == self._engines
            if same:
                self.driver.contracts.load({"outputs": calibration.get("outputs", ())})
            self.saved_state["outputs"] = "restored" if same else "dropped: learnt on other engines or models"
        return notes

    def tick(self, now: float) -> tuple[list[Send], list[Reject]]:
        sends: list[Send] = []
        rejects: list[Reject] = []
        for d in self.driver.tick(now):
            if isinstance(d, Dispatch):
                sends += self._jobs(d)
            else:
                self._seqs.pop(d.request_id, None)
                rejects.append(d)
        return sends, rejects

    def _jobs(self, d: Dispatch) -> list[Send]:
        """The batch's job: one per gateway its requests came from, each to that gateway's
        reply stream (``{gateway}:{batch}.{part}`` when there are several)."""
        seqs = tuple(self._seqs.pop(rid) for rid in d.request_ids)
        if d.path == "cpu" and self._gpu_alive and self.handoff_min_prompt:
            # disaggregated prefill: long prompts prefill here and decode on the gpu pool
            seqs = tuple(
                replace(s, handoff="gpu") if len(s.prompt_ids) >= self.handoff_min_prompt else s for s in seqs
            )
        workers = self.placement.place(d.path, seqs) if self.placement is not None else {}
        groups: dict[tuple[str, str], tuple[list[p.SeqJob], list[str]]] = {}
        for s in seqs:
            reply_to, entry = self._origin.pop(s.rid, (self.reply_to, "")) if self._origin else (self.reply_to, "")
            group = groups.setdefault((reply_to, workers.get(s.rid, "")), ([], []))
            group[0].append(s)
            if entry:
                group[1].append(entry)
        if len(groups) == 1:
            (reply_to, worker), (_part, entries) = next(iter(groups.items()))
            if reply_to == self.reply_to and not entries:  # this gateway's own requests, to one worker
                job = p.BatchJob(f"{self.gateway_id}:{d.batch_id}", reply_to, d.bucket, seqs)
                return [Send(d.path, job, d.batch_id, (), worker)]
        parts = self._parts[d.batch_id] = {}
        sends = []
        for k, ((reply_to, worker), (part, entries)) in enumerate(groups.items()):
            local = str(d.batch_id) if len(groups) == 1 else f"{d.batch_id}.{k}"
            parts[local] = (reply_to, tuple(s.rid for s in part))
            job = p.BatchJob(f"{self.gateway_id}:{local}", reply_to, d.bucket, tuple(part))
            sends.append(Send(d.path, job, d.batch_id, tuple(entries), worker))
        return sends

    def completed(self, report: p.BatchReport, now: float) -> None:
        """Feed a worker's timings back; reports of batches this gateway did not schedule
        (hand-over decode jobs, a previous incarnation's) or whose lease already ended are
        ignored."""
        prefix, _, local = report.batch_id.rpartition(":")
        batch = local.partition(".")[0]
        if prefix != self.gateway_id or not batch.isdigit():
            return
        parts = self._parts.get(int(batch))
        if parts is not None:
            self._part_ended(int(batch), local, report.output_tokens, now)
            if int(batch) in self._parts:  # another part still runs
                return
        self.driver.completed(
            BatchTimings(
                batch_id=int(batch),
                path=report.pool,
                batch_size=report.batch_size,
                prompt_tokens=report.prompt_tokens,
                prefill_s=report.prefill_s,
                decode_steps=report.decode_steps,
                decode_s=report.decode_s,
                output_tokens=report.output_tokens,
                mean_running=report.mean_running,
            ),
            now,
        )

    def _part_ended(self, batch: int, local: str, outputs: tuple[int, ...], now: float) -> None:
        """One job of a batch sent as several ended: its requests' slots come back."""
        parts = self._parts[batch]
        _reply_to, rids = parts.pop(local, ("", ()))
        for i, rid in enumerate(rids):
            self.driver.finished(rid, outputs[i] if len(outputs) == len(rids) else -1, now)
        if not parts:
            del self._parts[batch]

    def origin_gone(self, reply_to: str, now: float) -> list[str]:
        """The gateway answering on ``reply_to`` is gone: its queued requests leave the queue
        and the jobs sent to it (which workers drop unanswered) give their slots back. Returns
        the arrival entries of the requests dropped."""
        entries = []
        for rid, (origin, entry) in list(self._origin.items()):
            if origin == reply_to and self.cancel(rid, now):
                del self._origin[rid]
                entries.append(entry)
        for batch, parts in list(self._parts.items()):
            for local, (origin, _rids) in list(parts.items()):
                if origin == reply_to:
                    self._part_ended(batch, local, (), now)
            if batch not in self._parts:
                self.driver.abort(batch, now)
        return entries

    def abort(self, batch: int, now: float) -> list[str]:
        """The batch will never report (its job could not be sent, or is lost): its slots come
        back now, nothing is fitted. Returns the requests still waiting on it here."""
        self._parts.pop(batch, None)
        return self.driver.abort(batch, now)

    def abort_all(self, now: float) -> list[str]:
        """Every dispatched batch is lost (Redis lost its data): abort them all."""
        return [rid for batch in self.driver.open_batches() for rid in self.abort(batch, now)]

    def finished(self, rid: str, output_tokens: int, now: float) -> bool:
        """A worker finished (or failed, ``output_tokens`` < 0) one request: its slot comes
        back now. True if that freed a slot."""
        return self.driver.finished(rid, output_tokens, now)

    def telemetry(self, t: p.Telemetry, now: float) -> None:
        """A worker's step records refit its pool's step-time model; its step budget is
        passed on with the pool's capacity."""
        if t.pool not in POOLS:
            return
        self._step_tokens[t.pool] = t.step_tokens
        if self.placement is not None:
            self.placement.observe(t.worker, t.queued_prefill)
        self.driver.steps(t.pool, [(s.prefill_tokens, s.decode_seqs, s.kv_tokens, s.ms / 1000.0) for s in t.steps],
                          now)

    def request_ended(self, rid: str, now: float) -> None:
        """The request is over here (answered, failed, timed out, cancelled)."""
        self.driver.ended(rid, now)

    def expire(self, now: float) -> list[str]:
        """End the leases that ran out; returns the requests still waiting on them."""
        return [rid for batch in self.driver.expired(now) for rid in self.abort(batch, now)]

    @property
    def leases(self) -> int:
        return len(self.driver.open_batches())

    def take_over(self, workers: dict[str, p.Heartbeat]) -> None:
        """This scheduler starts where another stopped: the sequences the workers hold now
        (their heartbeats say) are the other one's, and keep their slots until they end."""
        self._foreign = {pool: n for pool, n in running_by_pool(workers).items() if n > 0}

    def capacity(self, workers: dict[str, p.Heartbeat], now: float) -> list[str]:
        """The live workers' slots (less what a previous scheduler left running on them), and
        the priors their measured profiles give each pool's step-time model (re-seeded when
        the set of profiles changes); a saved state is restored for the paths it matches.
        Returns what became of the saved state, to log."""
        share = capacity_share(workers)
        self._gpu_alive = share["gpu"][0] > 0
        for wid, hb in workers.items():  # a worker that gave up a thread (or took it back) runs anew
            if self._threads.get(wid, hb.threads) != hb.threads:
                self.driver.transition(hb.pool)
        self._threads = {wid: hb.threads for wid, hb in workers.items()}
        if self.placement is not None:
            self.placement.workers(workers)
        if self._foreign:  # it shrinks as the workers report fewer sequences than this scheduler sent
            running = running_by_pool(workers)
            self._foreign = {pool: left for pool, n in self._foreign.items()
                             if (left := min(n, running[pool] - self.driver.running(pool))) > 0}
        config = self.driver.pricing.config if self.driver.pricing is not None else None
        for pool in POOLS:
            slots, count = share[pool]
            slots = max(0, slots - self._foreign.get(pool, 0))
            self.driver.capacity(pool, slots, now, count, self._step_tokens.get(pool, 0))
            if config is not None:
                measured = measured_prior(workers, pool, getattr(config, pool))
                if measured is None or self.priors.get(pool) == measured[0]:
                    continue
                if self.driver.prior(pool, measured[1], measured_trust(workers, pool)):
                    self.priors[pool] = measured[0]
        for pool in POOLS:
            identity = path_identity(workers, pool)
            if identity is not None:
                self._identity[pool] = identity
        if workers:
            self._engines = engines_identity(workers)
        return self._restore()

    def cancel(self, rid: str, now: float) -> bool:
        """True if the request was still queued here: it will never be dispatched."""
        if self.driver.cancel(rid, now):
            self._seqs.pop(rid, None)
            return True
        return False


def _known_output(params: p.SamplingParams) -> int:
    """With ``ignore_eos`` and no stop strings a request generates exactly ``max_tokens``;
    otherwise 0 lets the scheduler use the lengths it has observed."""
    return params.max_tokens if params.ignore_eos and not params.stop else 0
