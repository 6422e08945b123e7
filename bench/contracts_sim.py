"""Latency contracts and shedding in the simulator: issue 12's targets 1 and 4.

    python -m bench.contracts_sim [--trace PATH] [--requests 4000] [--json]

The deployment of ``tokengate simulate`` (two CPU workers of 8 slots, one GPU worker of 64,
the packaged profiles, SLO TTFT 1 s and 100 ms per later token, four tenants of which
``noisy`` sends half the traffic on a fifth of the budget) under three arrival processes: the
Azure LLM code trace replayed, Poisson and on/off bursts with the trace's lengths. For each,
FCFS's 90 %-SLO load L is found by bisection (the baseline), then:

* contracts: tokengate at 0.25, 0.5, 0.75 and 1 L, with output lengths unknown to the
  scheduler and known (``ignore_eos``): the share of requests inside their first-token and
  total p99 bounds, the mean absolute percentage error of the predicted first token and total,
  calibrated and raw (the step-time model alone);
* overload: tokengate refusing at admission what its bounds say would miss the SLO
  (``--shed``), against FCFS, at 1, 1.5, 2 and 3 L: goodput (requests meeting the SLO per
  second, refusals count as misses), the ratios to tokengate's own goodput at 1 L and to
  FCFS's at the same load, and the SLO attainment of the tenants whose offered tokens stay
  within their budget's share of what was served. Refusals are decided at arrival (the
  simulator's admission takes no time; the gateway's is measured by ``bench.contracts_live``).

``--json``: the last line has the worst figures over the workloads and loads.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from bench.harness import table
from bench.traffic import DEFAULT_TRACE
from sched_core.simulate import experiment as ex
from sched_core.simulate import workload as wl
from sched_core.simulate.cli import DEFAULT_CPU, DEFAULT_GPU, _profile
from sched_core.simulate.engine import Outcome, Pool, simulate
from sched_core.simulate.metrics import Slo, summarize

FRACTIONS = (0.25, 0.5, 0.75, 1.0)
OVERLOADS = (1.0, 1.5, 2.0, 3.0)


def within_share(outcomes: list[Outcome], tenants: tuple[wl.Tenant, ...]) -> set[str]:
    """The tenants whose offered tokens are at most their budget's share of all tokens served."""
    budget = sum(t.budget for t in tenants)
    offered = {t.name: 0 for t in tenants}
    served = 0
    for o in outcomes:
        work = o.arrival.prompt_tokens + o.arrival.output_tokens
        offered[o.arrival.tenant] += work
        if o.rejected is None and not math.isnan(o.finished):
            served += work
    return {t.name for t in tenants if offered[t.name] <= served * t.budget / budget}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    with open(args.trace, newline="") as f:
        rows = wl.parse_trace(f, str(args.trace))[: args.requests]
    cpu, gpu = _profile(None, DEFAULT_CPU), _profile(None, DEFAULT_GPU)
    pools = (Pool("cpu", 2, 8, cpu, cpu.step_tokens or 256), Pool("gpu", 1, 64, gpu, gpu.step_tokens or 8192))
    slo = Slo(1.0, 0.1)
    native = wl.trace_rate(rows)
    lengths = wl.trace_lengths(rows)
    makers: dict[str, Callable[[float], wl.Workload]] = {
        "trace": lambda r: wl.replay(rows, time_scale=native / r, seed=args.seed),
        "poisson": lambda r: wl.poisson(r, args.requests, lengths, seed=args.seed),
        "onoff": lambda r: wl.on_off(r, args.requests, lengths, seed=args.seed),
    }
    accuracy: list[list[object]] = []
    overload: list[list[object]] = []
    worst: dict[str, float] = {"within_bounds": 1.0, "mape_ttft": 0.0, "mape_unknown": 0.0, "mape_known": 0.0,
                               "goodput_vs_own_1x": math.inf, "goodput_vs_fcfs": math.inf,
                               "within_share_attainment": 1.0}
    for name, make in makers.items():
        base = ex.Setup(pools, slo, seed=args.seed)
        load = ex.find_sustained(make, base, native if name == "trace" else 8.0)
        for known in (False, True):
            setup = replace(base, known_output=known)
            for f in FRACTIONS:
                w = make(f * load)
                r = summarize(simulate(ex.policy_for("tokengate", None, setup, w), w, setup.sim_config()), slo)
                inside = min(r["within_ttft_bound"], r["within_p99_bound"])
                worst["within_bounds"] = min(worst["within_bounds"], inside)
                worst["mape_ttft"] = max(worst["mape_ttft"], r["mape_ttft"])
                key = "mape_known" if known else "mape_unknown"
                worst[key] = max(worst[key], r["mape"])
                accuracy.append([name, f"{load:.2f}", f, "known" if known else "unknown",
                                 f"{r['within_ttft_bound']:.2%}", f"{r['within_p99_bound']:.2%}",
                                 f"{r['mape_ttft']:.1%}", f"{r['raw_mape_ttft']:.1%}",
                                 f"{r['mape']:.1%}", f"{r['raw_mape']:.1%}"])
        shed = replace(base, shed=True)
        own: float | None = None
        for f in OVERLOADS:
            w = make(f * load)
            result = simulate(ex.policy_for("tokengate", None, shed, w), w, shed.sim_config())
            mine = summarize(result, slo)
            fcfs = summarize(simulate(ex.policy_for("fcfs", None, base, w), w, base.sim_config()), slo)
            own = own if own is not None else mine["goodput_rps"]
            fair = within_share(result.outcomes, w.tenants)
            kept = [o for o in result.outcomes if o.arrival.tenant in fair]
            attained = sum(slo.met(o) for o in kept) / len(kept) if kept else math.nan
            accepted = [o for o in result.outcomes if o.accuracy is not None]
            inside = sum(o.accuracy.ttft_inside and o.accuracy.total_inside  # type: ignore[union-attr]
                         for o in accepted) / len(accepted) if accepted else math.nan
            if f > 1.0:
                worst["goodput_vs_own_1x"] = min(worst["goodput_vs_own_1x"], mine["goodput_rps"] / own)
                worst["goodput_vs_fcfs"] = min(worst["goodput_vs_fcfs"], mine["goodput_rps"] / fcfs["goodput_rps"])
                if not math.isnan(attained):
                    worst["within_share_attainment"] = min(worst["within_share_attainment"], attained)
            overload.append([name, f, f"{f * load:.2f}", f"{fcfs['goodput_rps']:.2f}", f"{mine['goodput_rps']:.2f}",
                             f"{mine['goodput_rps'] / own:.2f}", f"{mine['goodput_rps'] / fcfs['goodput_rps']:.2f}",
                             mine["refused_slo"], f"{inside:.2%}", ",".join(sorted(fair)) or "-",
                             "-" if math.isnan(attained) else f"{attained:.2%}"])
    table("contracts in the simulator (tokengate; L = FCFS's 90%-SLO load, req/s)",
          ["workload", "L", "x L", "outputs", "in TTFT bound", "in total bound", "MAPE TTFT", "raw",
           "MAPE total", "raw"], accuracy)
    table("overload: tokengate refusing at admission vs FCFS accepting all",
          ["workload", "x L", "req/s", "FCFS goodput", "tokengate goodput", "vs own at 1x", "vs FCFS",
           "refused", "accepted inside bounds", "tenants within share", "their SLO attainment"], overload)
    summary: dict[str, Any] = {**worst, "seconds": time.perf_counter() - started}
    print(orjson.dumps(summary).decode() if args.json else summary)


if __name__ == "__main__":
    main()
