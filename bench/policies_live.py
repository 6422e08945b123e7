"""Scheduling policies side by side on real traffic: the real gateway, the real model, one CPU worker.

    python -m bench.policies_live [--policies fcfs,grid,tokengate,smdp] [--loads 0.5,0.9,1.5]
                             [--requests 60] [--start 6140] [--length-scale 32] [--max-output 32]
                             [--slo-ttft-ms MS] [--slo-tpot-ms MS] [--aging-tokens A] [--repeat N]
                             [--restart] [--hogs N] [--pin] [--json]

A slice of the Azure LLM code trace (``bench/traffic.py``'s reader: prompt lengths divided by
--length-scale, random token ids, outputs capped at --max-output and forced with ignore_eos) is
replayed through ``tokengate gateway --policy P`` and one ``hf`` CPU worker, once per policy and
load, with identical arrivals: the slice's arrival times are scaled so that their mean rate is
the given multiple of the worker's capacity, measured first in the same run (a closed loop under
``fcfs`` with every slot always busy: completions per second once the start is past and before
the drain). One Redis and one worker serve every run; each run gets a fresh gateway that starts
as a new deployment (what the run before learnt is dropped from Redis), told the SLO and an
aging rate scaled like the prompts (``--aging-tokens``, default the gateway's ÷ --length-scale).
The SLO is ``--slo-ttft-ms``/``--slo-tpot-ms``, by default 3000/400 ms stretched by 3.63 ÷ the
measured capacity on a slower worker (``machine_slo``). Policies: ``fcfs``, the design
notes' grid (``grid`` = ``fixed:batch=1|4|8,window_ms=0|10|50``), ``tokengate`` and ``smdp`` (the
scheduler with the packaged SMDP table, or ``smdp:FILE``); the order
of the runs is reversed from one load to the next. Three tenants share the traffic
round-robin with budgets 4000/2000/1000 tokens/s; the requests carry no SLO header, so the
gateway's default wait bound applies, in the simulator too.

Per policy and load: SLO attainment (TTFT and time per later token both within the SLO), goodput
(requests/s meeting it), TTFT and TPOT p50/p95/p99, throughput, and Jain's index of the three
tenants' served tokens per budget over the whole run (a fairness figure only where all three
stay backlogged, i.e. at overload; below it the index just reflects the traffic mix). The same
slice goes through the simulator, for ``fcfs``, ``tokengate`` and ``smdp``, with five step models:
the profile the live worker measured of itself at start (``workers/selfprofile.py``, read from
its heartbeat); the packaged CPU profile; the start profile's formulas replaced by the step model
the run's scheduler fitted online (``GET /admin/scheduler``; a baseline's run takes the
scheduler's run at its load), as a re-solve of the self-tuning table simulates the workers;
and the formulas refit on the worker's step records of every run, and of each load's runs. The
live steps are also checked against the start profile per kind of step. Printed: the live
figures, the simulator's relative errors with the online fit (TTFT p50, p99, SLO attainment),
and the worst error per policy and load under each step model. With ``--json`` the last line is
one object with ``default_margin_90`` (the default policy, ``smdp``, minus the best other policy
at the load nearest 0.9), ``default_goodput_ratio_150`` (the default ÷ fcfs at the load nearest
1.5), ``attainment_margin_90`` (tokengate minus the best other policy but the table),
``goodput_ratio_150`` (tokengate ÷ fcfs), ``sim_error_max`` (the start profile),
``sim_error_max_packaged``, ``sim_error_max_learnt``, ``sim_error_max_refit`` and
``sim_error_max_refit_per_load``, and the SLO. With ``--repeat N`` every policy runs N rounds at
each load (the order alternating): a table gives how far the rounds differ (``live_error_max``:
one round taken as another's prediction, the simulator's measure) and the simulator's error
against the rounds' mean (the JSON's ``*_vs_mean``); the summary and the plots take the means.

``--restart`` (with ``--repeat``): each round after the first starts every policy's gateway
from what that policy's gateway of the round before saved (the step-time model and
calibration: a restart on saved state, on the same traffic); the first round starts fresh, so
"live vs live" is then a fresh start against a restart. ``--hogs N`` runs N other programs,
each keeping a core busy (a spinning Python), from after the worker measured itself at start
to the end of the last run: the capacity, the loads and every policy's runs are measured
beside them (the worker's start profile is then a quiet machine's, which its step-time model
must follow).

``--pin`` gives the worker a core of its own (core 1, one torch thread, measuring itself there
at start) and puts Redis, every gateway and this load generator on core 0, as a deployment
keeps its gateway off its workers' machines: the worker's steps then run at the speed it
measured, not at whatever the gateway and the load generator leave it. Without it every process
shares every core (the figures of the runs before the option). Hogs stay unpinned.

Tables go to stdout, plots to ``bench/out/policies_*.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
import orjson
import redis

from bench.harness import ADMIN_TOKEN, OUT, backend, gateway_server, hogs, pct, start_profile, table
from bench.traffic import (
    BUDGETS,
    CAPACITY_FLAGS,
    DEFAULT_TRACE,
    SLOTS,
    Row,
    Sample,
    closed_loop,
    load_trace,
    make_tenants,
    replay,
    scaled,
)
from common import protocol, stepmodel, wire
from sched_core import costmodel
from sched_core.driver import MAX_QUEUE_WAIT_MS
from sched_core.policies import DEFAULT_POLICY, make_policy
from sched_core.simulate import experiment as ex
from sched_core.simulate.engine import Pool, simulate
from sched_core.simulate.metrics import Slo, summarize
from sched_core.simulate.profile import CostProfile
from sched_core.simulate.workload import Arrival, Tenant, Workload
from sched_core.types import DEFAULT_PROFILES, SchedulerConfig, packaged_profile
from workers import model_store

Figures = dict[str, float | str]  # one run's figures, as printed and as JSON
Sims = dict[tuple[str, float], dict[str, float]]  # (policy, load) -> the simulator's figures

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
GRID = tuple(f"fixed:batch={b},window_ms={w}" for b in (1, 4, 8) for w in (0, 10, 50))


@dataclass(slots=True)
class Run:
    policy: str
    load: float
    rate: float
    samples: list[Sample] = field(default_factory=list)
    span_s: float = 0.0


@dataclass(slots=True)
class Live:
    """One Redis and one ``hf`` worker for every run, a fresh gateway per run (scheduling with
    its policy for ``slo``); the three tenants are made once; the worker's step records
    (its model's ``wire.telemetry_stream``) of each run are collected in ``steps``."""

    redis_url: str
    procs: list[subprocess.Popen[bytes]]
    model_dir: str
    model: str
    slo: Slo
    aging: float
    keys: list[str] = field(default_factory=list)
    steps: list[protocol.StepRecord] = field(default_factory=list)
    learnt: dict[str, float] = field(default_factory=dict)  # the last run's online step model (none: {})
    saved: dict[str, bytes] = field(default_factory=dict)  # per policy, what its last run's gateway saved
    cpus: tuple[int, ...] = ()  # the gateways' cores (``--pin``); () = every core

    @contextmanager
    def gateway(self, policy: str, extra: tuple[str, ...] = (), restart: bool = False) -> Iterator[str]:
        """A gateway of ``policy`` that starts as a new deployment would: what the run before
        it learnt (step model, calibration, saved under ``wire.model_key``) is dropped, as each
        simulation starts afresh; a gateway on the last run's calibration refused early and
        read TTFT p50 half the simulator's. With ``restart`` it starts instead from what the
        last gateway of the same policy saved (a restart on saved state). What it learnt of
        the step times is kept in ``learnt`` when the run ends, what it saved in ``saved``."""
        flags = ["--policy", policy, "--slo-ttft-ms", f"{self.slo.ttft_s * 1000:g}",
                 "--slo-tpot-ms", f"{self.slo.tpot_s * 1000:g}", "--aging-tokens", f"{self.aging:g}", *extra]
        client = redis.Redis.from_url(self.redis_url)
        key = wire.model_key(self.model)
        client.delete(key)
        if restart and policy in self.saved:
            client.set(key, self.saved[policy])
        with gateway_server(self.redis_url, flags, self.model_dir, self.procs, self.cpus) as (base, _proc):
            if not self.keys:
                self.keys = make_tenants(base, len(BUDGETS))
            yield base
            path = httpx.get(base + "/admin/scheduler", headers=ADMIN).json().get("paths", {}).get("cpu", {})
            self.learnt = path["step_model"] if path.get("fitted_steps") else {}
        if (state := client.get(key)) is not None:  # saved as the gateway stopped
            self.saved[policy] = state
        for _id, fields in client.xrange(wire.telemetry_stream(self.model)):
            self.steps.extend(protocol.decode_telemetry(fields).steps)
        client.delete(wire.telemetry_stream(self.model), key)
        client.close()


def figures(run: Run, slo: Slo) -> Figures:
    done = [s for s in run.samples if s.ok]
    met = [s for s in done if s.ttft_s <= slo.ttft_s and s.tpot_s <= slo.tpot_s]
    service = [sum(s.tokens for s in done if s.tenant == t) / BUDGETS[t] for t in range(len(BUDGETS))]
    jain = sum(service) ** 2 / (len(service) * sum(x * x for x in service)) if any(service) else math.nan
    ttft = [s.ttft_s for s in done]
    tpot = [s.tpot_s for s in done if s.tokens > 1]
    e2e = [s.e2e_s for s in done]
    out: Figures = {"policy": run.policy, "load": run.load, "rate_rps": run.rate,
                                   "completed": len(done), "requests": len(run.samples),
                                   "slo_attainment": len(met) / len(run.samples),
                                   "goodput_rps": len(met) / run.span_s, "throughput_rps": len(done) / run.span_s,
                                   "jain": jain, "avg_ms": float(np.mean(e2e)) * 1000 if e2e else math.nan,
                                   "p95_ms": pct(e2e, 95) * 1000 if e2e else math.nan}
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 95, 99):
            out[f"{name}_p{q}_ms"] = pct(values, q) * 1000 if values else math.nan
    return out


#: ``--pin``: the worker's core, and the core of Redis, the gateways and the load generator.
WORKER_CPUS, REST_CPUS = (1,), (0,)


#: The SLO's defaults, set where this bench's worker served 3.63 requests/s (``REFERENCE_CAPACITY``,
#: Intel Xeon with AMX, 2 cores). A slower worker gets them stretched by the ratio of capacities:
#: on an AMD EPYC that served 1.02 requests/s the unstretched 400 ms per token was under every
#: run's TPOT p50, so every policy attained 7-55 % and the attainment told nothing.
SLO_TTFT_MS, SLO_TPOT_MS, REFERENCE_CAPACITY = 3000.0, 400.0, 3.63


def machine_slo(ttft_ms: float | None, tpot_ms: float | None, capacity: float) -> Slo:
    """The SLO of the runs: each figure given, or its default stretched by
    ``REFERENCE_CAPACITY / capacity`` where the worker is slower than the reference."""
    stretch = max(1.0, REFERENCE_CAPACITY / capacity) if capacity > 0 else 1.0
    return Slo((ttft_ms if ttft_ms is not None else SLO_TTFT_MS * stretch) / 1000,
               (tpot_ms if tpot_ms is not None else SLO_TPOT_MS * stretch) / 1000)


PACKAGED = CostProfile.from_dict(packaged_profile(DEFAULT_PROFILES["cpu"]))


def simulated(policy: str, rows: list[Row], slo: Slo, aging: float, profile: CostProfile,
              model: dict[str, float] | None = None) -> dict[str, float]:
    """The same arrivals through the simulator: one CPU worker of ``SLOTS`` slots, ``profile``
    (or its cost formulas replaced by the step ``model``: a scheduler's online fit, or
    ``step_check``'s), the workers' default step budget; the policy built as the gateway builds it."""
    if model:
        fit = stepmodel.as_fit(model)
        profile = replace(profile, prefill_a=fit["prefill"]["a"], prefill_b=fit["prefill"]["b"],
                          prefill_b2=fit["prefill"]["b2"], decode_c=fit["decode"]["c"],
                          decode_d=fit["decode"]["d"], decode_e=fit["decode"]["e"])
    setup = ex.Setup((Pool("cpu", 1, SLOTS, profile, profile.step_tokens or 64),), slo,
                     max_wait_s=MAX_QUEUE_WAIT_MS / 1000)  # the gateway's default wait bound: its requests carry no SLO
    tenants = tuple(Tenant(f"t{i}", b, 1 / len(BUDGETS)) for i, b in enumerate(BUDGETS))
    arrivals = tuple(Arrival(f"r{i}", r.at, f"t{i % len(BUDGETS)}", r.prompt, r.output, r.output)
                     for i, r in enumerate(rows))
    workload = Workload(arrivals, tenants, "bench.policies_live slice")
    config = replace(ex.scheduler_config(setup, workload), aging_tokens_per_s=aging)
    result = simulate(make_policy(policy, config), workload, setup.sim_config())
    return summarize(result, slo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--start", type=int, default=6140, help="first trace row of the slice")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--length-scale", type=float, default=32.0)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--policies", default="fcfs,grid,tokengate,smdp",
                        help="comma-separated: fcfs, tokengate, smdp, smdp:FILE, fixed:batch=B,window_ms=W or grid")
    parser.add_argument("--loads", default="0.5,0.9,1.5", help="multiples of the measured capacity")
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help=f"default {SLO_TTFT_MS:g}, stretched on a worker slower than the reference (machine_slo)")
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help=f"default {SLO_TPOT_MS:g}, scaled as --slo-ttft-ms")
    parser.add_argument("--aging-tokens", type=float, default=None,
                        help="the scheduler's aging rate (default: the gateway's, divided by --length-scale, "
                        "so the scaled prompts are ordered as the trace's own would be)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of every policy at each load, to measure how far live runs differ")
    parser.add_argument("--restart", action="store_true",
                        help="with --repeat: rounds after the first start each policy from what its last round "
                        "saved (a restart on saved state); the first round starts fresh")
    parser.add_argument("--hogs", type=int, default=0,
                        help="other programs keeping a core busy each, from after the worker measured itself "
                        "to the last run (the capacity is measured beside them)")
    parser.add_argument("--pin", action="store_true",
                        help="the worker alone on core 1 with one thread; Redis, the gateways and the load "
                        "generator on core 0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.pin and not {*WORKER_CPUS, *REST_CPUS} <= os.sched_getaffinity(0):
        parser.error(f"--pin needs cores {sorted({*WORKER_CPUS, *REST_CPUS})}")
    if args.requests <= SLOTS:  # the closed loop needs completions between its start and its drain
        parser.error(f"--requests must exceed the worker's {SLOTS} slots to measure its capacity")
    model_store.offline()
    spec = model_store.resolve(None, model_store.default_cache_dir())
    model_dir = str(spec.path)
    policies = [p for name in _names(args.policies) for p in (GRID if name == "grid" else (name,))]
    simulated_policies = [p for p in policies if p in ("fcfs", "tokengate") or p.startswith("smdp")]
    rows = load_trace(args.trace, args.start, args.requests, 1.0, args.length_scale, args.max_output)

    aging = args.aging_tokens or SchedulerConfig().aging_tokens_per_s / args.length_scale
    started = time.perf_counter()

    runs: list[Figures] = []
    loads = [float(x) for x in args.loads.split(",")]
    pin = {"cpus": WORKER_CPUS, "redis_cpus": REST_CPUS, "extra_worker": ("--threads", "1")} if args.pin else {}
    if args.pin:
        os.sched_setaffinity(0, set(REST_CPUS))  # the load generator, beside the gateways
    with backend("hf", slots=SLOTS, model_dir=model_dir, **pin) as (redis_url, procs), ExitStack() as busy:
        live = Live(redis_url, procs, model_dir, spec.name, Slo(), aging, cpus=REST_CPUS if args.pin else ())
        measured = start_profile(redis_url)
        busy.enter_context(hogs(args.hogs))  # after the worker measured itself: the machine changes under it
        with live.gateway("fcfs", CAPACITY_FLAGS) as base:  # capacity: a closed loop, every slot busy
            capacity = asyncio.run(closed_loop(base, live.keys, rows, args.seed, SLOTS))
        live.slo = slo = machine_slo(args.slo_ttft_ms, args.slo_tpot_ms, capacity)
        print(f"the worker's profile, measured at start: {measured.label}, {measured.device}")
        live.steps.clear()
        print(f"measured capacity: {capacity:.2f} requests/s ({SLOTS} requests always outstanding, fcfs); "
              f"SLO: {slo.describe()}")
        steps_at: dict[float, list[protocol.StepRecord]] = {}  # the worker's steps of each load's runs
        learnt: dict[tuple[str, float], dict[str, float]] = {}  # each scheduling run's online step model
        for n, load in enumerate(loads):
            arrivals = scaled(rows, load * capacity)
            mark = len(live.steps)
            for again in range(args.repeat):  # each round runs every policy once, before any runs again
                for policy in policies if (n + again) % 2 == 0 else reversed(policies):  # order alternates
                    with live.gateway(policy, restart=args.restart and again > 0) as base:
                        samples, span = asyncio.run(replay(base, live.keys, arrivals, args.seed))
                    if live.learnt:
                        learnt[(policy, load)] = live.learnt
                    runs.append(figures(Run(policy, load, load * capacity, samples, span), slo) | {"round": again})
                    print(orjson.dumps(runs[-1]).decode() if args.json else f"  {policy} at {load}x: "
                          f"SLO {runs[-1]['slo_attainment']:.1%}, goodput {runs[-1]['goodput_rps']:.2f}/s")
            steps_at[load] = live.steps[mark:]
    print(f"live runs took {time.perf_counter() - started:.0f} s")
    check = step_check(live.steps, measured)
    fits = {load: step_check(steps_at[load], measured).fit for load in loads}
    models: dict[str, Callable[[str, float], dict[str, float] | None]] = {
        "start profile": lambda _p, _x: None,
        "packaged profile": lambda _p, _x: None,
        # a baseline learns nothing: its load's run of the scheduler stands in
        "scheduler's online fit": lambda p, x: learnt.get((p, x)) or learnt.get(("tokengate", x)),
        "refit on every run's steps": lambda _p, _x: check.fit,
        "refit on the load's steps": lambda _p, x: fits[x]}
    sims: dict[str, Sims] = {
        source: {(p, x): simulated(p, scaled(rows, x * capacity), slo, aging,
                                   PACKAGED if source == "packaged profile" else measured, model(p, x))
                 for x in loads for p in simulated_policies}
        for source, model in models.items()}

    _tables(runs, slo)
    means = _means(runs)
    table("simulator vs live (same arrivals; the worker's start profile with the step model its run's "
          "scheduler fitted online, as a re-solve simulates it)",
          ["policy", "load", "figure", "live", "simulated", "relative error"],
          _sim_errors(runs, sims["scheduler's online fit"]))
    table(f"live worker steps vs the profile it measured at start ({check.steps} steps of every run)",
          ["step", "count", "median ms", "median measured / profile"], check.rows)
    for label, fit in (("every run's", check.fit), *((f"the {x:g}x runs'", fits[x]) for x in loads)):
        print(f"the profile's formulas refit on {label} steps: " + ", ".join(f"{k} = {v:.3g}" for k, v in fit.items()))
    table("simulator vs live: worst relative error (TTFT p50, p99, SLO attainment) per policy and load",
          ["policy", "load", *models], [[p, x, *(_worst(runs, sims[m], p, x) for m in models)]
                                        for x in loads for p in simulated_policies])
    if args.repeat > 1:
        table(f"live vs live: the same policy, load and arrivals run {args.repeat} times; the worst relative "
              "error (TTFT p50, p99, SLO attainment) of one round taken as the other's prediction, and the "
              "simulator's worst error against the rounds' mean",
              ["policy", "load", "live vs live", *models],
              [[p, x, _noise(runs, p, x), *(_worst(means, sims[m], p, x) for m in models)]
               for x in loads for p in simulated_policies])
    _plots(means)
    summary = _summary(means, capacity, time.perf_counter() - started)
    for key, source in (("sim_error_max", "start profile"), ("sim_error_max_packaged", "packaged profile"),
                        ("sim_error_max_learnt", "scheduler's online fit"), ("sim_error_max_refit",
                        "refit on every run's steps"), ("sim_error_max_refit_per_load", "refit on the load's steps")):
        summary[key] = _worst(runs, sims[source])
        if args.repeat > 1:
            summary[key + "_vs_mean"] = _worst(means, sims[source])
    if args.repeat > 1:
        summary["live_error_max"] = max(_noise(runs, p, x) for x in loads for p in simulated_policies)
    summary["slo_ttft_ms"], summary["slo_tpot_ms"] = slo.ttft_s * 1000, slo.tpot_s * 1000
    summary["hogs"], summary["restart"], summary["pinned"] = args.hogs, args.restart, args.pin
    print(orjson.dumps(summary).decode() if args.json else summary)


@dataclass(frozen=True, slots=True)
class StepCheck:
    rows: list[list[object]]  # kind of step, count, median ms, median measured / profile
    fit: dict[str, float]  # the profile's coefficients refit on the live steps
    steps: int


def step_check(steps: list[protocol.StepRecord], prof: CostProfile) -> StepCheck:
    """The live workers' step times against the profile the simulator uses (its
    ``fit``: ``decode = c + d·n + e·KV``, ``prefill = a + b·T + b2·T²``, a mixed step the
    sum): per kind of step, how many, the median measured time and the median ratio measured
    ÷ profile. Then the formulas fitted on these steps as a re-solve fits them
    (``costmodel.fit_steps``; {} under its minimum), so the simulator can be rerun with them."""
    rows: list[list[object]] = []
    kinds = {"decode only": lambda s: s.decode_seqs > 0 and not s.prefill_tokens,
             "prefill only": lambda s: s.prefill_tokens > 0 and not s.decode_seqs,
             "decode + prefill chunk": lambda s: s.prefill_tokens > 0 and s.decode_seqs > 0}
    for kind, keep in kinds.items():
        mine = [s for s in steps if keep(s)]
        if not mine:
            continue
        ratios = [s.ms / 1000 / _profile_step(prof, s) for s in mine]
        rows.append([kind, len(mine), float(np.median([s.ms for s in mine])), float(np.median(ratios))])
    fit = costmodel.fit_steps([(s.prefill_tokens, s.decode_seqs, s.kv_tokens, s.ms / 1000) for s in steps])
    return StepCheck(rows, fit or {}, len(steps))


def _profile_step(prof: CostProfile, s: protocol.StepRecord) -> float:
    """A step as the simulator times it; its decode with ``n·K`` = the record's total KV."""
    decode = prof.decode_step_s(s.decode_seqs, s.kv_tokens / s.decode_seqs) if s.decode_seqs else 0.0
    return decode + (prof.prefill_s(1, s.prefill_tokens) if s.prefill_tokens else 0.0)


def _names(text: str) -> list[str]:
    """``fcfs,fixed:batch=4,window_ms=10,grid`` → the policy specs (a fixed spec keeps its comma)."""
    names: list[str] = []
    for part in text.split(","):
        if part.startswith("window_ms=") and names:
            names[-1] += "," + part
        else:
            names.append(part)
    return names


def _nearest(runs: list[Figures], load: float) -> float:
    return min({float(r["load"]) for r in runs}, key=lambda x: abs(x - load))


def _sim_errors(runs: list[Figures], sims: Sims) -> list[list[object]]:
    rows = []
    for r in runs:
        sim = sims.get((str(r["policy"]), float(r["load"])))
        if sim is None:
            continue
        for key in METRICS:
            real = float(r[key])
            err = abs(sim[key] - real) / real if real else math.inf
            rows.append([r["policy"], r["load"], key, real, sim[key], err])
    return rows


METRICS = ("ttft_p50_ms", "ttft_p99_ms", "slo_attainment")  # the figures the simulator is judged on


def _means(runs: list[Figures]) -> list[Figures]:
    """One row per policy and load: each number the mean over its rounds (``--repeat``)."""
    groups: dict[tuple[str, float], list[Figures]] = {}
    for r in runs:
        groups.setdefault((str(r["policy"]), float(r["load"])), []).append(r)
    return [{k: (v if isinstance(v, str) else float(np.mean([float(g[k]) for g in group])))
             for k, v in group[0].items()} for group in groups.values()]


def _noise(runs: list[Figures], policy: str, load: float) -> float:
    """The largest relative error between two rounds of ``policy`` at ``load``, one taken as the
    other's prediction (as the simulator's error is taken): what live runs alone differ by."""
    mine = [r for r in runs if r["policy"] == policy and r["load"] == load]
    return max((abs(float(a[k]) - float(b[k])) / float(b[k]) if float(b[k]) else math.inf
                for a in mine for b in mine if a is not b for k in METRICS), default=math.nan)


def _worst(runs: list[Figures], sims: Sims, policy: str | None = None, load: float | None = None) -> float:
    """The largest relative error of ``sims`` (of ``policy`` at ``load`` only, where given)."""
    return max((float(e[-1]) for e in _sim_errors(runs, sims)
                if policy in (None, e[0]) and load in (None, e[1])), default=math.nan)


def _margin(runs: list[Figures], policy: str, load: float, rivals: Callable[[str], bool]) -> float:
    """``policy``'s SLO attainment at ``load`` less the best of the ``rivals`` there."""
    mine = [float(r["slo_attainment"]) for r in runs if r["policy"] == policy and r["load"] == load]
    others = [float(r["slo_attainment"]) for r in runs
              if r["policy"] != policy and rivals(str(r["policy"])) and r["load"] == load]
    return mine[0] - max(others) if mine and others else math.nan


def _ratio(runs: list[Figures], policy: str, load: float) -> float:
    """``policy``'s goodput at ``load`` over FCFS's."""
    at = {str(r["policy"]): float(r["goodput_rps"]) for r in runs if r["load"] == load}
    return at[policy] / at["fcfs"] if policy in at and at.get("fcfs") else math.nan


def _summary(runs: list[Figures], capacity: float, seconds: float) -> dict[str, float]:
    at90, at150 = _nearest(runs, 0.9), _nearest(runs, 1.5)
    return {"attainment_margin_90": _margin(runs, "tokengate", at90, lambda p: not p.startswith("smdp")),
            "goodput_ratio_150": _ratio(runs, "tokengate", at150),
            "default_margin_90": _margin(runs, DEFAULT_POLICY, at90, lambda p: True),
            "default_goodput_ratio_150": _ratio(runs, DEFAULT_POLICY, at150),
            "capacity_rps": capacity, "seconds": seconds}


def _tables(runs: list[Figures], slo: Slo) -> None:
    table(f"policies on real traffic (one cpu worker, SLO: {slo.describe()})",
          ["load", "policy", "SLO %", "goodput/s", "req/s", "TTFT p50/p95/p99 ms", "TPOT p50/p95/p99 ms", "Jain"],
          [[r["load"], r["policy"], f"{float(r['slo_attainment']):.1%}", r["goodput_rps"], r["throughput_rps"],
            f"{float(r['ttft_p50_ms']):.0f}/{float(r['ttft_p95_ms']):.0f}/{float(r['ttft_p99_ms']):.0f}",
            f"{float(r['tpot_p50_ms']):.0f}/{float(r['tpot_p95_ms']):.0f}/{float(r['tpot_p99_ms']):.0f}",
            r["jain"]] for r in runs])
    grid = [r for r in runs if str(r["policy"]).startswith("fixed:")]
    if grid:
        table("the design notes' batcher grid (avg / p95 latency, throughput)",
              ["load", "setting", "avg ms", "p95 ms", "req/s"],
              [[r["load"], r["policy"], r["avg_ms"], r["p95_ms"], r["throughput_rps"]] for r in grid])


def _plots(runs: list[Figures]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    for key, label, name in (("ttft_p99_ms", "TTFT p99 (ms)", "latency"), ("slo_attainment", "SLO attainment", "slo")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy in dict.fromkeys(str(r["policy"]) for r in runs):
            mine = sorted((float(r["load"]), float(r[key])) for r in runs if r["policy"] == policy)
            ax.plot([x for x, _ in mine], [y for _, y in mine], marker="o", label=policy,
                    linewidth=2.5 if policy == "tokengate" else 1)
        ax.set_xlabel("load (× measured capacity)")
        ax.set_ylabel(label)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(OUT / f"policies_{name}_vs_load.png", dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    main()
