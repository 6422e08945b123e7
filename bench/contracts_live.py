"""Latency contracts against the live gateway with the real model, on a slice of the trace.

    python -m bench.contracts_live [--requests 200] [--speed 0.25] [--busy] [--json]
    python -m bench.contracts_live --overload [--loads 1,2] [--busy] [--json]

Replays rows of the Azure LLM code trace (``bench/traffic.py``) through ``tokengate gateway``
and one ``hf`` CPU worker of 32 slots: arrivals at ``--speed`` times the trace's rate, prompts
divided by ``--length-scale``, outputs capped at ``--max-output`` (exact: ``ignore_eos``), three
tenants with budgets 4000/2000/1000 tokens/s in turn. Every request streams; the client
measures its first token and its last and compares them with the contract in the response
headers: the share inside the first-token bound (``x-tokengate-ttft-p99-ms``) and inside the
total bound (``x-tokengate-p99-ms``), and the mean absolute percentage error of the predicted
first token and total; beside them the same errors as the gateway measured them on its own
clock (``/metrics``), for the promise and for the raw step-time model. The first ``--warmup``
requests (one at a time: the gateway's first outcomes) are not counted.

``--busy`` replays the slice a second time on the same gateway with one core kept busy by
another process (a spinning Python): the worker slows down under the contracts, which must
adapt.

``--overload --busy`` keeps one core busy the same way from once the worker has measured
itself (quiet) through the capacity's closed loop and every load.

``--overload`` measures the worker's capacity first (a closed loop of 32 clients), gives the
tenants a default SLO (``--slo-ttft-ms``, ``--slo-tpot-ms``), and replays the slice at each of
``--loads`` (default 1× and 2×) capacity on fresh gateways, each started from what the one
before it saved (a restart on saved state): goodput (requests meeting the SLO per second), the
share of accepted requests inside their bounds, the refusals and how fast they were answered;
in the JSON the lowest goodput above the first load as a share of the first's
(``goodput_ratio_min``), the lowest share inside both bounds (``within_both_min``), and each
load's figures.

``--json``: the last line is one object with the figures. A table goes to stdout, the plot of
predicted vs actual to ``bench/out/contracts.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import orjson

from bench.harness import ADMIN_TOKEN, OUT, backend, gateway_server, hogs, pct, save_plot, start_profile, table
from bench.traffic import (
    BUDGETS,
    CAPACITY_FLAGS,
    DEFAULT_TRACE,
    SLOTS,
    Row,
    Sample,
    client,
    closed_loop,
    load_trace,
    make_tenants,
    prompts,
    replay,
    scaled,
    stream,
)
from workers import model_store


@dataclass(frozen=True, slots=True)
class Figures:
    label: str
    requests: int
    accepted: int
    completed: int
    refused: int
    within_ttft: float
    within_total: float
    mape_ttft: float
    mape_total: float
    raw_mape_ttft: float  # at the gateway (its clock), the step-time model alone
    raw_mape_total: float
    gw_mape_ttft: float  # at the gateway, the promise
    gw_mape_total: float
    goodput_rps: float
    refusal_p100_ms: float
    ttft_p50_s: float
    e2e_p99_s: float


def gateway_errors(base: str) -> dict[tuple[str, str], tuple[float, float]]:
    """Per (prediction, component), (sum, count) of the absolute percentage errors the gateway
    measured itself (from its /metrics): ``raw`` (the step-time model) and ``calibrated``."""
    out: dict[tuple[str, str], list[float]] = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if not line.startswith(("tokengate_contract_error_ratio_sum", "tokengate_contract_error_ratio_count")):
            continue
        name, _, value = line.rpartition(" ")
        prediction = "raw" if 'prediction="raw"' in name else "calibrated"
        component = "ttft" if 'component="ttft"' in name else "total"
        entry = out.setdefault((prediction, component), [0.0, 0.0])
        entry[0 if "_sum" in name else 1] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def figures(label: str, samples: list[Sample], span_s: float, slo: tuple[float, float] | None,
            before: dict[tuple[str, str], tuple[float, float]],
            after: dict[tuple[str, str], tuple[float, float]]) -> Figures:
    done = [s for s in samples if s.ok]
    refused = [s for s in samples if s.error == "slo_unattainable"]
    accepted = [s for s in samples if s.status == 200]

    def share(xs: list[bool]) -> float:
        return sum(xs) / len(xs) if xs else math.nan

    def mape(pairs: list[tuple[float, float]]) -> float:
        return sum(abs(p - a) / a for p, a in pairs) / len(pairs) if pairs else math.nan

    def gateway(prediction: str, component: str) -> float:
        key = (prediction, component)
        s0, n0 = before.get(key, (0.0, 0.0))
        s1, n1 = after.get(key, (0.0, 0.0))
        return (s1 - s0) / (n1 - n0) if n1 > n0 else math.nan

    met = done if slo is None else [s for s in done if s.ttft_s <= slo[0] and s.tpot_s <= slo[1]]
    return Figures(
        label=label, requests=len(samples), accepted=len(accepted), completed=len(done), refused=len(refused),
        within_ttft=share([s.ttft_s <= s.ttft_bound_s for s in done]),
        within_total=share([s.e2e_s <= s.total_bound_s for s in done]),
        mape_ttft=mape([(s.ttft_pred_s, s.ttft_s) for s in done]),
        mape_total=mape([(s.total_pred_s, s.e2e_s) for s in done]),
        raw_mape_ttft=gateway("raw", "ttft"), raw_mape_total=gateway("raw", "total"),
        gw_mape_ttft=gateway("calibrated", "ttft"), gw_mape_total=gateway("calibrated", "total"),
        goodput_rps=len(met) / span_s,
        refusal_p100_ms=max((s.answered_s for s in refused), default=math.nan) * 1000,
        ttft_p50_s=pct([s.ttft_s for s in done], 50), e2e_p99_s=pct([s.e2e_s for s in done], 99),
    )


async def warm(base: str, keys: list[str], rows: list[Row], seed: int) -> None:
    """The warm-up rows one at a time: the gateway's first outcomes, on an idle worker."""
    bodies = prompts(rows, seed + 1)
    async with client(base) as http:
        for i, row in enumerate(rows):
            await stream(http, keys, i, bodies[i], row.output)


def run(base: str, keys: list[str], label: str, rows: list[Row], seed: int,
        slo: tuple[float, float] | None = None) -> tuple[Figures, list[Sample]]:
    before = gateway_errors(base)
    samples, span = asyncio.run(replay(base, keys, rows, seed))
    return figures(label, samples, span, slo, before, gateway_errors(base)), samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--start", type=int, default=3000, help="first trace row of the slice")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--speed", type=float, default=0.25, help="arrival rate as a multiple of the trace's")
    parser.add_argument("--length-scale", type=float, default=32.0, help="prompt lengths are divided by this")
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--busy", action="store_true", help="replay again with one core kept busy (with "
                        "--overload: measure the capacity and every load with one core kept busy)")
    parser.add_argument("--overload", action="store_true", help="capacity, then 1x and 2x with tenant SLOs")
    parser.add_argument("--loads", default="1,2",
                        help="with --overload: multiples of the capacity replayed, the first the goodput's reference")
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=400.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    loads = [float(x) for x in args.loads.split(",") if x]
    if not loads or min(loads) <= 0.0:
        parser.error(f"--loads {args.loads!r}: expected positive multiples of the capacity, comma-separated")
    if args.overload and args.requests <= SLOTS:  # the closed loop needs completions between its start and drain
        parser.error(f"--overload needs --requests above the worker's {SLOTS} slots to measure its capacity")
    model_store.offline()
    model_dir = str(model_store.resolve(None, model_store.default_cache_dir()).path)
    rows = load_trace(args.trace, args.start, args.requests + args.warmup, args.speed, args.length_scale,
                      args.max_output)
    warmup, rows = rows[: args.warmup], rows[args.warmup :]
    rows = [Row(r.at - rows[0].at, r.prompt, r.output) for r in rows]
    started = time.perf_counter()
    slo = (args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    flags = ["--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}"]
    runs: list[Figures] = []
    summary: dict[str, object] = {}
    samples: list[Sample] = []
    with backend("hf", slots=SLOTS, model_dir=model_dir) as (redis_url, procs), ExitStack() as busy:
        if not args.overload:
            with gateway_server(redis_url, flags, model_dir, procs) as (base, _proc):
                keys = make_tenants(base, len(BUDGETS))
                asyncio.run(warm(base, keys, warmup, args.seed))
                fig, samples = run(base, keys, f"{args.speed:g}x trace", rows, args.seed)
                runs.append(fig)
                if args.busy:
                    with hogs(1):
                        runs.append(run(base, keys, f"{args.speed:g}x trace, one core busy", rows, args.seed)[0])
            summary = {"within_ttft": runs[0].within_ttft, "within_total": runs[0].within_total,
                       "mape_ttft": runs[0].mape_ttft, "mape_total": runs[0].mape_total}
            if args.busy:
                summary |= {"busy_within_ttft": runs[1].within_ttft, "busy_within_total": runs[1].within_total}
        else:
            if args.busy:  # from once the worker measured itself (quiet) to the last load
                start_profile(redis_url)
                busy.enter_context(hogs(1))
            with gateway_server(redis_url, [*flags, *CAPACITY_FLAGS], model_dir, procs) as (base, _proc):
                keys = make_tenants(base, len(BUDGETS))
                capacity = asyncio.run(closed_loop(base, keys, rows, args.seed, SLOTS))
                set_slo(base, len(BUDGETS), (args.slo_ttft_ms, args.slo_tpot_ms))
            print(f"measured capacity: {capacity:.2f} requests/s ({SLOTS} requests always outstanding)")
            for load in loads:
                # a fresh gateway, warm from Redis: a restart on what the gateway before it saved
                with gateway_server(redis_url, flags, model_dir, procs) as (base, _proc):
                    fig, samples = run(base, keys, f"{load:g}x capacity", scaled(rows, load * capacity),
                                       args.seed, slo)
                    runs.append(fig)
                    print(f"refusals at {load:g}x capacity, by reason: {refusal_reasons(samples)}")
            above = [r.goodput_rps / runs[0].goodput_rps for r in runs[1:]]
            summary = {"capacity_rps": capacity, "busy": args.busy, "goodput_ratio_min": min(above, default=math.nan),
                       "within_both_min": min(min(r.within_ttft, r.within_total) for r in runs),
                       "refusal_p100_ms": max(r.refusal_p100_ms for r in runs)}
            summary |= {f"{load:g}x": {"goodput_rps": r.goodput_rps, "accepted": r.accepted,
                                       "within_both": min(r.within_ttft, r.within_total)}
                        for load, r in zip(loads, runs, strict=True)}
    summary["seconds"] = time.perf_counter() - started

    _table(runs)
    if samples:
        _plot([s for s in samples if s.ok])
        (OUT / "contracts_samples.json").write_bytes(orjson.dumps([asdict(s) for s in samples]))
    print(orjson.dumps(summary).decode() if args.json else summary)


def refusal_reasons(samples: list[Sample]) -> dict[str, int]:
    """The SLO refusals, by the rule that refused them (docs/scheduling.md §14)."""
    reasons: dict[str, int] = {}
    for s in samples:
        if s.error == "slo_unattainable":
            if "over its fair share and the workers are full" in s.message:
                why = "over its share, no slot left"
            elif "first token could be promised" in s.message:
                why = "first-token bound" + (" (half the SLO: over its share)" if "half the SLO" in s.message else "")
            else:
                why = "token-time bound"
            reasons[why] = reasons.get(why, 0) + 1
    return reasons


def set_slo(base: str, n: int, slo: tuple[float, float]) -> None:
    """Give the ``n`` tenants a default SLO (TTFT, TPOT in ms)."""
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    for i in range(n):
        body = {"slo_ttft_ms": slo[0], "slo_tpot_ms": slo[1]}
        httpx.patch(base + f"/admin/tenants/tenant{i}", json=body, headers=admin).raise_for_status()


def _table(runs: list[Figures]) -> None:
    def p(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.1%}"

    table("latency contracts, live: measured by the client; 'gw' and 'raw': the gateway's own measure of "
          "the promise and of the step-time model alone",
          ["run", "requests", "accepted", "done", "refused", "in TTFT bound", "in total bound", "MAPE TTFT",
           "gw", "raw", "MAPE total", "gw", "raw", "goodput /s", "slowest refusal ms", "TTFT p50 s", "e2e p99 s"],
          [[f.label, f.requests, f.accepted, f.completed, f.refused, p(f.within_ttft), p(f.within_total),
            p(f.mape_ttft), p(f.gw_mape_ttft), p(f.raw_mape_ttft), p(f.mape_total), p(f.gw_mape_total),
            p(f.raw_mape_total), f"{f.goodput_rps:.2f}",
            "-" if math.isnan(f.refusal_p100_ms) else f"{f.refusal_p100_ms:.0f}", f.ttft_p50_s, f.e2e_p99_s]
           for f in runs])


def _plot(ok: list[Sample]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 5))
    for ax, name, pred, bound, actual in (
        (axes[0], "first token", [s.ttft_pred_s for s in ok], [s.ttft_bound_s for s in ok], [s.ttft_s for s in ok]),
        (axes[1], "total", [s.total_pred_s for s in ok], [s.total_bound_s for s in ok], [s.e2e_s for s in ok]),
    ):
        ax.scatter(pred, actual, s=8, label="predicted")
        ax.scatter(bound, actual, s=4, marker="x", alpha=0.4, label="p99 bound")
        hi = max(max(actual), max(bound))
        ax.plot([0, hi], [0, hi], color="grey", linewidth=1)
        ax.set_xlabel("promised (s)")
        ax.set_ylabel("actual (s)")
        ax.set_title(f"latency contracts: {name}")
        ax.legend()
    print(f"plot: {save_plot(fig, 'contracts.png', dpi=110)}")


if __name__ == "__main__":
    main()
