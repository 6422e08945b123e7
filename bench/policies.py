"""Scheduling policies side by side on real traffic: the real gateway, the real model, one CPU worker.

    python -m bench.policies [--policies fcfs,grid,tokengate] [--loads 0.5,0.9,1.5]
                             [--requests 60] [--start 6140] [--length-scale 32] [--max-output 32]
                             [--slo-ttft-ms 3000] [--slo-tpot-ms 400] [--json]

A slice of the Azure LLM code trace (``bench/contracts.py``'s reader: prompt lengths divided by
--length-scale, random token ids, outputs capped at --max-output and forced with ignore_eos) is
replayed through ``tokengate gateway --policy P`` and one ``hf`` CPU worker, once per policy and
load, with identical arrivals: the slice's arrival times are scaled so that their mean rate is
the given multiple of the worker's capacity, measured first in the same run (the slice sent all
at once under ``fcfs``: completions per second). Policies: ``fcfs``, the design notes' grid
(``grid`` = ``fixed:batch=1|4|8,window_ms=0|10|50``) and ``tokengate``. Three tenants share the
traffic round-robin with budgets 4000/2000/1000 tokens/s.

Per policy and load: SLO attainment (TTFT and time per later token both within the SLO), goodput
(requests/s meeting it), TTFT and TPOT p50/p95/p99, throughput, and Jain's index of the three
tenants' served tokens per budget over the whole run (a fairness figure only where all three
stay backlogged, i.e. at overload; below it the index just reflects the traffic mix). The same
slice goes through ``tokengate simulate``'s simulator
with the measured CPU profile, for ``fcfs`` and ``tokengate``, and the simulator's relative error
is printed beside the live figures. With ``--json`` the last line is one object with
``attainment_margin_90`` (tokengate minus the best other policy at the load nearest 0.9),
``goodput_ratio_150`` (tokengate ÷ fcfs at the load nearest 1.5) and ``sim_error_max``.
Tables go to stdout, plots to ``bench/out/policies_*.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import orjson

from bench.common import OUT, pct, stack, table
from bench.contracts import BUDGETS, DEFAULT_TRACE, Row, at_arrivals, load_trace, make_tenants
from sched_core.simulate import experiment as ex
from sched_core.simulate.engine import Pool, simulate
from sched_core.simulate.metrics import Slo, summarize
from sched_core.simulate.profile import CostProfile
from sched_core.simulate.workload import Arrival, Tenant, Workload
from sched_core.types import DEFAULT_PROFILES, packaged_profile
from workers import model_store

Figures = dict[str, float | str]  # one run's figures, as printed and as JSON
Sims = dict[tuple[str, float], dict[str, float]]  # (policy, load) -> the simulator's figures

GRID = tuple(f"fixed:batch={b},window_ms={w}" for b in (1, 4, 8) for w in (0, 10, 50))
SLOTS = 32  # the worker's slots (the default of `tokengate worker`)


@dataclass(slots=True)
class Sample:
    tenant: int
    tokens: int
    ok: bool = False
    ttft_s: float = math.nan
    e2e_s: float = math.nan

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else 0.0


@dataclass(slots=True)
class Run:
    policy: str
    load: float
    rate: float
    samples: list[Sample] = field(default_factory=list)
    span_s: float = 0.0


async def replay(base: str, keys: list[str], rows: list[Row], seed: int) -> tuple[list[Sample], float]:
    """Stream every row at its arrival time; returns the samples and the wall time of the run."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, 40_000, size=r.prompt).tolist() for r in rows]
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(base_url=base, timeout=900, limits=limits) as client:

        async def one(i: int, row: Row) -> Sample:
            tenant = i % len(keys)
            sample = Sample(tenant, row.output)
            body = {"model": "SmolLM2-135M-Instruct", "prompt": prompts[i], "max_tokens": row.output,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            t0 = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers={"authorization": f"Bearer {keys[tenant]}"}) as r:
                if r.status_code != 200:
                    await r.aread()
                    return sample
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and math.isnan(sample.ttft_s) and line != "data: [DONE]":
                        sample.ttft_s = time.perf_counter() - t0
                    if line == "data: [DONE]":
                        sample.ok = True
            sample.e2e_s = time.perf_counter() - t0
            return sample

        start = time.perf_counter()
        samples = await at_arrivals(rows, one)
        return samples, time.perf_counter() - start


def live(policy: str, rows: list[Row], model_dir: str, seed: int) -> tuple[list[Sample], float]:
    with stack(engine="hf", slots=SLOTS, model_dir=model_dir, extra_gateway=["--policy", policy]) as (base, _r, _k):
        keys = make_tenants(base, len(BUDGETS))
        return asyncio.run(replay(base, keys, rows, seed))


def scaled(rows: list[Row], rate: float) -> list[Row]:
    """The slice's arrivals stretched or compressed to a mean rate of ``rate`` requests/s."""
    native = (len(rows) - 1) / max(rows[-1].at, 1e-9)
    return [Row(r.at * native / rate, r.prompt, r.output) for r in rows]


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


def simulated(policy: str, rows: list[Row], slo: Slo) -> dict[str, float]:
    """The same arrivals through the simulator: one CPU worker of ``SLOTS`` slots, measured
    profile, the workers' default step budget."""
    profile = CostProfile.from_dict(packaged_profile(DEFAULT_PROFILES["cpu"]))
    setup = ex.Setup((Pool("cpu", 1, SLOTS, profile, profile.step_tokens or 64),), slo)
    tenants = tuple(Tenant(f"t{i}", b, 1 / len(BUDGETS)) for i, b in enumerate(BUDGETS))
    arrivals = tuple(Arrival(f"r{i}", r.at, f"t{i % len(BUDGETS)}", r.prompt, r.output, r.output)
                     for i, r in enumerate(rows))
    workload = Workload(arrivals, tenants, "bench.policies slice")
    result = simulate(ex.make_policy(policy, None, setup, workload), workload, setup.sim_config())
    return summarize(result, slo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--start", type=int, default=6140, help="first trace row of the slice")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--length-scale", type=float, default=32.0)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--policies", default="fcfs,grid,tokengate",
                        help="comma-separated: fcfs, tokengate, fixed:batch=B,window_ms=W or grid")
    parser.add_argument("--loads", default="0.5,0.9,1.5", help="multiples of the measured capacity")
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=400.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model_store.offline()
    model_dir = str(model_store.resolve(None, model_store.default_cache_dir()).path)
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    policies = [p for name in _names(args.policies) for p in (GRID if name == "grid" else (name,))]
    rows = load_trace(args.trace, args.start, args.requests, 1.0, args.length_scale, args.max_output)

    burst = [Row(0.0, r.prompt, r.output) for r in rows]  # capacity: everything at once, fcfs
    samples, span = live("fcfs", burst, model_dir, args.seed)
    capacity = sum(s.ok for s in samples) / span
    print(f"measured capacity: {capacity:.2f} requests/s ({len(rows)} requests at once, fcfs)")

    runs: list[Figures] = []
    sims: Sims = {}
    for load in [float(x) for x in args.loads.split(",")]:
        arrivals = scaled(rows, load * capacity)
        for i, policy in enumerate(policies if int(load * 10) % 2 == 0 else reversed(policies)):
            samples, span = live(policy, arrivals, model_dir, args.seed + i)
            runs.append(figures(Run(policy, load, load * capacity, samples, span), slo))
            print(orjson.dumps(runs[-1]).decode() if args.json else f"  {policy} at {load}x: "
                  f"SLO {runs[-1]['slo_attainment']:.1%}, goodput {runs[-1]['goodput_rps']:.2f}/s")
        for policy in ("fcfs", "tokengate"):
            sims[(policy, load)] = simulated(policy, arrivals, slo)

    _tables(runs, sims, slo)
    _plots(runs)
    summary = _summary(runs, sims)
    print(orjson.dumps(summary).decode() if args.json else summary)


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
        for live_key, sim_key in (("ttft_p50_ms", "ttft_p50_ms"), ("ttft_p99_ms", "ttft_p99_ms"),
                                  ("slo_attainment", "slo_attainment")):
            real = float(r[live_key])
            err = abs(sim[sim_key] - real) / real if real else math.inf
            rows.append([r["policy"], r["load"], live_key, real, sim[sim_key], err])
    return rows


def _summary(runs: list[Figures], sims: Sims) -> dict[str, float]:
    at90, at150 = _nearest(runs, 0.9), _nearest(runs, 1.5)
    mine = {float(r["load"]): r for r in runs if r["policy"] == "tokengate"}
    others = [float(r["slo_attainment"]) for r in runs if r["policy"] != "tokengate" and r["load"] == at90]
    fcfs = {float(r["load"]): r for r in runs if r["policy"] == "fcfs"}
    margin = float(mine[at90]["slo_attainment"]) - max(others) if at90 in mine and others else math.nan
    ratio = (float(mine[at150]["goodput_rps"]) / float(fcfs[at150]["goodput_rps"])
             if at150 in mine and at150 in fcfs and float(fcfs[at150]["goodput_rps"]) else math.nan)
    errors = [float(e[-1]) for e in _sim_errors(runs, sims)]
    return {"attainment_margin_90": margin, "goodput_ratio_150": ratio,
            "sim_error_max": max(errors) if errors else math.nan}


def _tables(runs: list[Figures], sims: Sims, slo: Slo) -> None:
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
    table("simulator vs live (same arrivals, measured cpu profile)",
          ["policy", "load", "figure", "live", "simulated", "relative error"], _sim_errors(runs, sims))


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
