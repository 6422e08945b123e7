"""`tokengate policy`: the SMDP table's I/O shell around ``sched_core.simulate.solve``.

* ``solve``: search a table on one part of a trace, report it on another part and on the
  synthetic workloads, and write it (JSON, loadable with ``--policy smdp:FILE``);
* ``report``: the same report for a table already written (the packaged one by default);
* ``tune``: re-solve a table on recorded traffic and test it against the table in force on
  the traffic that came after (``sched_core.simulate.tune``; the gateway's self-tuning runs it);
* ``show``: a table's states and actions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from sched_core.driver import MAX_QUEUE_WAIT_MS
from sched_core.simulate import cli as sim
from sched_core.simulate import experiment as ex
from sched_core.simulate import solve as sv
from sched_core.simulate import tune as tn
from sched_core.simulate import workload as wl
from sched_core.smdp import QUEUE_LEVELS, STATE_NAMES, PolicyTable, heuristic_table, packaged_table

#: The synthetic workloads a table can also be reported on: (arrivals, lengths), as in
#: docs/benchmarks.md's simulator runs, and other workloads' length mixes
#: (``workload.LENGTH_MIXES``: chat and classify arrive as Poisson, agents in on/off bursts).
SYNTHETIC = {"poisson": ("poisson", "trace"), "onoff": ("onoff", "pareto"), "chat": ("poisson", "chat"),
             "classify": ("poisson", "classify"), "agent": ("onoff", "agent")}


def add_commands(sub: Any) -> None:
    policy = sub.add_parser("policy", help="the SMDP policy's table: solve it in the simulator, report it, show it",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cmds = policy.add_subparsers(dest="policy_command", required=True)
    solve = cmds.add_parser("solve", help="search a table on one part of a trace and report it on another",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sim.add_workload_args(solve, rows=False)
    solve.add_argument("--tune-rows", default="first-half", help="the part of --trace the table is searched on")
    solve.add_argument("--test-rows", default="second-half", help="the part of --trace it is reported on")
    solve.add_argument("--out", type=Path, default=Path("smdp-table.json"), help="where the table is written")
    solve.add_argument("--name", default="smdp", help="the table's name (shown in snapshots and the console)")
    solve.add_argument("--passes", type=int, default=1, help="rounds of coordinate descent")
    solve.add_argument("--dispatch-levels", default=",".join(QUEUE_LEVELS),
                       help="the queue levels whose states' dispatch knobs (prefill queue, slot share, aging) are "
                            "searched, comma-separated; the other states dispatch as the heuristic does; admission "
                            "knobs are searched everywhere")
    _common(solve)
    report = cmds.add_parser("report", help="a table beside FCFS and the heuristic, on a part of a trace and "
                             "on the synthetic workloads", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sim.add_workload_args(report, rows=False)
    report.add_argument("--rows", default="second-half", help="the part of --trace to report on")
    report.add_argument("--table", type=Path, help="the table (default: the packaged one)")
    _common(report)
    tune = cmds.add_parser("tune", help="re-solve the table in force on recorded traffic (GET /admin/traffic): "
                           "tune on its earlier part, test against the table in force on its later part, "
                           "say whether to swap", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sim.add_workload_args(tune, rows=False)
    tune.add_argument("--table", type=Path, help="the table in force (default: the packaged one)")
    tune.add_argument("--out", type=Path, default=Path("smdp-candidate.json"), help="where the candidate is written")
    tune.add_argument("--name", default="tuned", help="the candidate's name")
    tune.add_argument("--window", type=int, default=tn.WINDOW, help="the most recent requests of --trace read")
    tune.add_argument("--budget", type=int, default=tn.BUDGET, help="simulations the search may run at most")
    tune.add_argument("--margin", type=float, default=tn.MARGIN,
                      help="the score on the later traffic a candidate must gain over the table in force")
    _common(tune)
    show = cmds.add_parser("show", help="a table's states and actions")
    show.add_argument("table", nargs="?", type=Path, help="the table (default: the packaged one)")


#: Synthetic arrivals per run where --requests is not given (a trace part is used whole).
SYNTHETIC_REQUESTS = 4000


def _common(p: argparse.ArgumentParser) -> None:
    p.set_defaults(requests=None)  # a trace part whole; SYNTHETIC_REQUESTS synthetic arrivals
    p.add_argument("--synthetic", default="poisson,onoff",
                   help="synthetic workloads also reported on (poisson: trace lengths; onoff: pareto lengths; "
                        "chat, classify, agent: other workloads' mixes), comma-separated, or none")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulations run in parallel")
    p.add_argument("--max-queue-wait-ms", type=float, default=MAX_QUEUE_WAIT_MS,
                   help="a request without an SLO predicted to wait longer is refused, as the gateway does "
                        "(its default; 0: no bound)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    sim.add_deployment_args(p)


def run(args: argparse.Namespace) -> int:
    try:
        if args.policy_command == "show":
            _show(PolicyTable.load(args.table) if args.table else packaged_table())
            return 0
        if args.policy_command == "tune":
            return _tune(args)
        return _solve(args) if args.policy_command == "solve" else _report_only(args)
    except (wl.TraceError, OSError, ValueError) as exc:
        print(f"tokengate policy: {exc}", file=sys.stderr)
        return 2


def _setup(args: argparse.Namespace) -> ex.Setup:
    pools, slo = sim.deployment(args)
    wait = args.max_queue_wait_ms / 1000.0 if args.max_queue_wait_ms > 0.0 else None
    return ex.Setup(pools, slo, seed=args.seed, known_output=args.known_output, implementation=args.impl,
                    jobs_per_read=args.jobs_per_read, max_wait_s=wait)


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _workloads(makers: dict[str, Any], setup: ex.Setup,
               plan: tuple[sv.Scenario, ...]) -> tuple[float, dict[sv.Scenario, Any]]:
    """FCFS's 90%-SLO load on the first kind of arrivals, and each scenario's workload."""
    base = sim.base_load(next(iter(makers.values())), setup)
    return base, {sc: makers[sc.arrivals](base * sc.load) for sc in plan}


def _report(args: argparse.Namespace, setup: ex.Setup, table: PolicyTable, rows: str) -> dict[str, Any]:
    """The table on the trace part ``rows`` (if a trace is given) and the synthetic workloads."""
    plan = sv.scenarios(sv.REPORT_LOADS, sv.REPORT_SLO_LOADS, ("trace",))
    trace_rows = sim.read_rows(args.trace, rows, args.requests)
    parts: list[tuple[str, str | None, str | None]] = []
    if trace_rows:
        parts.append((f"trace rows {rows}", "trace", None))
    names = [] if args.synthetic == "none" else [n for n in args.synthetic.split(",") if n]
    for name in names:
        if name not in SYNTHETIC:
            raise ValueError(f"--synthetic {name!r}: expected some of {', '.join(SYNTHETIC)} or none")
        parts.append((name, *SYNTHETIC[name]))
    out: dict[str, Any] = {}
    synthetic = argparse.Namespace(**{**vars(args), "requests": args.requests or SYNTHETIC_REQUESTS})
    # a restart's saved state is learnt on another draw of the workload: the trace's gaps
    # shuffled, or the synthetic arrivals of the next seed
    warm_args = argparse.Namespace(**{**vars(synthetic), "seed": args.seed + 1})
    warm_rows = wl.shuffled_gaps(trace_rows, args.seed) if trace_rows else trace_rows
    warm_plan = tuple(sc.warm() for sc in plan if sc.shed)
    for label, kind, lengths in parts:
        _, _, _, make = sim.workloads(synthetic, trace_rows, kind=kind, lengths_kind=lengths)
        _, _, _, warm = (sim.workloads(synthetic, warm_rows, kind=kind) if kind == "trace" else
                         sim.workloads(warm_args, trace_rows, kind=kind, lengths_kind=lengths))
        started = time.perf_counter()
        base, loads = _workloads({"trace": make, sv.WARM: warm}, setup, (*plan, *warm_plan))
        with sv.Runner(setup, loads, args.jobs) as runner:
            result = sv.report(runner, plan, table)
        out[label] = {"fcfs_90pct_load_rps": base, **result, "seconds": time.perf_counter() - started}
        if not args.json:
            _print_report(label, base, result)
    return out


def _solve(args: argparse.Namespace) -> int:
    if args.trace is None:
        raise ValueError("policy solve needs --trace (it tunes on one part and reports on another)")
    setup = _setup(args)
    rows = sim.read_rows(args.trace, args.tune_rows, args.requests)
    makers = {"trace": sim.workloads(args, rows, kind="trace")[3],
              "shuffled": sim.workloads(args, wl.shuffled_gaps(rows, args.seed), kind="trace")[3]}
    plan = sv.scenarios()
    started = time.perf_counter()
    base, loads = _workloads(makers, setup, plan)
    _log(f"tuning on {args.trace.name} rows {args.tune_rows} ({len(rows)} requests); FCFS's 90%-SLO load "
         f"{base:.3g} req/s; scenarios {', '.join(sc.label() for sc in plan)}")
    config = ex.scheduler_config(setup, next(iter(loads.values())))
    with sv.Runner(setup, loads, args.jobs) as runner:
        found, how = sv.solve(runner, plan, heuristic_table(config.prefill_queue_steps), args.passes, _log,
                              dispatch_levels=_levels(args.dispatch_levels))
    how["seconds"] = time.perf_counter() - started
    about: dict[str, Any] = {
        "objective": "mean over scenarios of SLO attainment (no SLO) or goodput (SLO at admission) relative "
                     f"to the heuristic's, less {sv.BOUND_PENALTY:g} per point outside the p99 bounds beyond "
                     f"{1 - sv.BOUND_SHARE:.0%}, less {sv.TAIL_PENALTY:g} per unit of TTFT p99 above FCFS's",
        "trace": args.trace.name, "tune_rows": args.tune_rows, "test_rows": args.test_rows,
        "length_scale": args.length_scale, "requests": len(rows), "seed": args.seed,
        "deployment": {p.path: {"workers": p.workers, "slots": p.slots, "profile": p.profile.name,
                                "step_tokens": p.step_tokens} for p in setup.pools},
        "slo": setup.slo.describe(), "max_queue_wait_s": setup.max_wait_s, "fcfs_90pct_load_rps": base,
        "scenarios": [sc.label() for sc in plan], "search": how,
    }
    table = replace(found, name=args.name, about=about)
    table.dump(args.out)  # written before the report, which takes minutes more
    _log(f"wrote {args.out}: score {how['score']:.4f} against the heuristic's {how['score_heuristic']:.4f}, "
         f"{how['evaluations']} simulations in {how['seconds']:.0f} s")
    if not args.json:
        _show(table)
    figures = _report(args, setup, table, args.test_rows)
    table = replace(table, about={**about, "report": _brief(figures)})
    table.dump(args.out)
    if args.json:
        print(json.dumps({"table": table.to_json(), "report": figures}, default=_json))
    return 0


def _tune(args: argparse.Namespace) -> int:
    if args.trace is None:
        raise ValueError("policy tune needs --trace: the traffic served (GET /admin/traffic)")
    setup = _setup(args)
    running = PolicyTable.load(args.table) if args.table else packaged_table()
    rows = sim.read_rows(args.trace, "all", None)[-args.window:]
    earlier, later = tn.split(rows)
    makers = {tn.EARLIER: sim.workloads(args, earlier, kind="trace")[3],
              tn.LATER: sim.workloads(args, later, kind="trace")[3]}
    tune_plan, test_plan = tn.plans()
    started = time.perf_counter()
    loads: dict[sv.Scenario, Any] = {}
    for kind, plan in ((tn.EARLIER, tune_plan), (tn.LATER, test_plan)):
        base, part = _workloads({kind: makers[kind]}, setup, plan)
        loads |= part
        _log(f"{kind} {len(earlier if kind == tn.EARLIER else later)} requests: FCFS's 90%-SLO load {base:.3g} req/s")
    with sv.Runner(setup, loads, args.jobs) as runner:
        candidate, verdict = tn.retune(runner, running, args.name, args.budget, args.margin, _log)
    candidate.dump(args.out)
    doc = {"verdict": verdict.to_json(), "candidate": str(args.out), "requests": len(rows),
           "seconds": time.perf_counter() - started}
    if args.json:
        print(json.dumps(doc, default=_json))
    else:
        _log(f"{'SWAP' if verdict.swap else 'KEEP'} {running.name}: {verdict.why}")
        _show(candidate)
    return 0


def _levels(spec: str) -> tuple[str, ...]:
    levels = tuple(x for x in spec.split(",") if x)
    unknown = [x for x in levels if x not in QUEUE_LEVELS]
    if unknown or not levels:
        raise ValueError(f"--dispatch-levels {spec!r}: expected some of {', '.join(QUEUE_LEVELS)}")
    return levels


def _report_only(args: argparse.Namespace) -> int:
    table = PolicyTable.load(args.table) if args.table else packaged_table()
    figures = _report(args, _setup(args), table, args.rows)
    if args.json:
        print(json.dumps({"table": table.name, "report": figures}, default=_json))
    return 0


def _brief(figures: dict[str, Any]) -> dict[str, Any]:
    """What a table file keeps of its report: each workload's targets and base load."""
    return {label: {"fcfs_90pct_load_rps": f["fcfs_90pct_load_rps"], "targets": f["targets"]}
            for label, f in figures.items()}


def _json(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def _show(table: PolicyTable) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"policy table {table.name}: long prompt > {table.long_prompt} tokens, "
                    f"full at {table.full_share:.0%} of a path's slots")
    for c in ("state", "prefill queue steps", "slot share", "aging x", "admit quantile", "admit slack"):
        t.add_column(c, justify="left" if c == "state" else "right")
    for name, a in zip(STATE_NAMES, table.actions, strict=True):
        t.add_row(name, "inf" if math.isinf(a.prefill_queue_steps) else f"{a.prefill_queue_steps:g}",
                  f"{a.slot_share:g}", f"{a.aging:g}", f"{a.admit_quantile:g}", f"{a.admit_slack:g}")
    Console(width=160).print(t)


def _print_report(label: str, base: float, result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{label}: loads are multiples of FCFS's 90%-SLO load, {base:.3g} req/s")
    for c in ("load", "SLO at admission", "policy", "SLO %", "goodput/s", "TTFT p99 ms", "TTFT p99.9 ms", "p99 ms",
              "inside bounds %", "after a restart: inside % / goodput/s", "refused"):
        t.add_column(c, justify="left" if c == "policy" else "right")
    rows = result["rows"]
    for i, r in enumerate(rows):
        inside, again = r["inside_bounds"], r["after_restart"]
        t.add_row(f"{r['load']:g}x", "yes" if r["slo_at_admission"] else "no", r["policy"],
                  f"{r['slo_attainment'] * 100:.1f}", f"{r['goodput_rps']:.2f}", f"{r['ttft_p99_ms']:.0f}",
                  f"{r['ttft_p999_ms']:.0f}", f"{r['p99_ms']:.0f}", _percent(inside),
                  "-" if again is None else f"{_percent(again['inside_bounds'])} / {again['goodput_rps']:.2f}",
                  str(r["refused_slo"]),
                  end_section=i + 1 < len(rows) and rows[i + 1]["load"] != r["load"])
    console = Console(width=160)
    console.print(t)
    for name, target in result["targets"].items():
        verdict = "MET" if target.get("met") else "MISSED"
        figures = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in target.items() if k != "met")
        console.print(f"[{verdict}] {name}: {figures}")


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.1f}"
