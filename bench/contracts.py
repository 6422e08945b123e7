"""Latency contracts against the live gateway with the real model, on a slice of the trace.

    python -m bench.contracts [--trace PATH] [--requests 200] [--speed 0.3]
                              [--length-scale 8] [--max-output 48] [--tenants 3] [--json]

Replays rows of the Azure LLM code trace (TIMESTAMP, ContextTokens, GeneratedTokens):
arrival times divided by --speed's inverse (speed 0.3 = 0.3x the trace's rate), prompt
lengths divided by --length-scale (random token ids, so exactly that many prompt tokens),
outputs capped at --max-output and forced with ignore_eos. Requests go round-robin to
--tenants tenants with different budgets. Every response carries its contract; the client
measures the latency and reports the share within the p99 bound and the mean absolute
percentage error of the predicted latency. The first --warmup requests (sent one at a
time, so the scheduler's cost fit sees real timings) are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import numpy as np
import orjson

from bench.common import ADMIN_TOKEN, OUT, ROOT, pct, stack, table
from sched_core.simulate.workload import parse_trace
from workers import model_store

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "azure_llm_code_2023.csv"
BUDGETS = (4000.0, 2000.0, 1000.0)  # tokens/s of the tenants, in turn
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Row:
    at: float  # seconds after the slice's first arrival
    prompt: int
    output: int


@dataclass(slots=True)
class Result:
    tenant: int
    status: int
    actual_s: float
    error: str = ""
    predicted_s: float = 0.0
    p99_s: float = 0.0
    budget_wait_s: float = 0.0


def load_trace(path: Path, start: int, n: int, speed: float, length_scale: float, max_output: int) -> list[Row]:
    """Rows start..start+n of the trace (parsed and checked by the simulator's reader, which
    names the line of a malformed row), times relative to the slice's first arrival."""
    with open(path, newline="") as f:
        rows = parse_trace(f, str(path))[start : start + n]
    t0 = rows[0].time_s
    return [
        Row(
            at=(r.time_s - t0) / speed,
            prompt=max(1, round(r.prompt_tokens / length_scale)),
            output=max(1, min(max_output, r.output_tokens)),
        )
        for r in rows
    ]


def make_tenants(base: str, n: int) -> list[str]:
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    keys = []
    for i in range(n):
        rate = BUDGETS[i % len(BUDGETS)]
        body = {"name": f"tenant{i}", "rate": rate, "burst": int(rate * 8), "max_queue_delay_s": 30}
        httpx.post(base + "/admin/tenants", json=body, headers=admin).raise_for_status()
        r = httpx.post(base + f"/admin/tenants/tenant{i}/keys", headers=admin)
        r.raise_for_status()
        keys.append(str(r.json()["key"]))
    return keys


async def replay(base: str, keys: list[str], rows: list[Row], warmup: list[Row], seed: int) -> list[Result]:
    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:

        async def one(i: int, row: Row) -> Result:
            tenant = i % len(keys)
            body = {
                "model": "SmolLM2-135M-Instruct",
                "prompt": rng.integers(100, 40_000, size=row.prompt).tolist(),
                "max_tokens": row.output,
                "temperature": 0,
                "ignore_eos": True,
            }
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {keys[tenant]}"})
            res = Result(tenant, r.status_code, time.perf_counter() - t0)
            if r.status_code != 200:
                res.error = str(r.json().get("error", {}).get("code"))
            if r.status_code == 200:
                h = r.headers
                res.predicted_s = float(h["x-tokengate-latency-ms"]) / 1000
                res.p99_s = float(h["x-tokengate-p99-ms"]) / 1000
                res.budget_wait_s = float(h["x-tokengate-budget-wait-ms"]) / 1000
            return res

        for i, row in enumerate(warmup):
            await one(i, row)
        return await at_arrivals(rows, one)


async def at_arrivals(rows: list[Row], one: Callable[[int, Row], Awaitable[T]]) -> list[T]:
    """Start ``one(i, row)`` for every row at its arrival time (seconds from now); their results."""
    tasks = []
    start = time.perf_counter()
    for i, row in enumerate(rows):
        delay = start + row.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, row)))
    return list(await asyncio.gather(*tasks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--start", type=int, default=0, help="first trace row of the slice")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--speed", type=float, default=0.3, help="arrival rate as a multiple of the trace's")
    parser.add_argument("--length-scale", type=float, default=8.0, help="prompt lengths are divided by this")
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-priors", type=Path, help="passed to the gateway (docs/scheduling.md)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model_store.offline()
    spec = model_store.resolve(None, model_store.default_cache_dir())
    rows = load_trace(args.trace, args.start, args.requests + args.warmup, args.speed, args.length_scale,
                      args.max_output)
    warmup, rows = rows[: args.warmup], rows[args.warmup :]
    t_first = rows[0].at
    rows = [Row(r.at - t_first, r.prompt, r.output) for r in rows]
    priors = ["--cost-priors", str(args.cost_priors)] if args.cost_priors else []
    with stack(engine="hf", slots=32, model_dir=str(spec.path), extra_gateway=priors) as (base, _redis, _key):
        keys = make_tenants(base, args.tenants)
        results = asyncio.run(replay(base, keys, rows, warmup, args.seed))
    ok = [r for r in results if r.status == 200]
    within = sum(r.actual_s <= r.p99_s for r in ok) / len(ok) if ok else 0.0
    mape = float(np.mean([abs(r.actual_s - r.predicted_s) / r.actual_s for r in ok])) if ok else float("nan")
    summary = {
        "requests": len(results),
        "ok": len(ok),
        "status_other": len(results) - len(ok),
        "offered_rps": len(rows) / max(rows[-1].at, 1e-9),
        "speed": args.speed,
        "length_scale": args.length_scale,
        "max_output": args.max_output,
        "within_p99_bound": within,
        "mape": mape,
        "p50_s": pct([r.actual_s for r in ok], 50),
        "p99_s": pct([r.actual_s for r in ok], 99),
        "mean_prompt": float(np.mean([r.prompt for r in rows])),
        "mean_output": float(np.mean([r.output for r in rows])),
    }
    errors: dict[str, int] = {}
    for r in results:
        if r.status != 200:
            errors[f"{r.status} {r.error}"] = errors.get(f"{r.status} {r.error}", 0) + 1
    summary["errors"] = errors
    if args.json:
        print(orjson.dumps(summary).decode())
        return
    if errors:
        print("refused or failed:", errors)
    table(
        f"contracts on trace rows {args.start}..{args.start + len(results) + args.warmup} "
        f"(speed {args.speed}x, prompts /{args.length_scale:g}, outputs <= {args.max_output})",
        ["requests", "ok", "other", "offered rps", "within p99 bound", "MAPE", "p50 s", "p99 s"],
        [[summary["requests"], summary["ok"], summary["status_other"], summary["offered_rps"],
          f"{within:.1%}", f"{mape:.1%}", summary["p50_s"], summary["p99_s"]]],
    )
    per = []
    for t in range(args.tenants):
        mine = [r for r in ok if r.tenant == t]
        if mine:
            within = sum(r.actual_s <= r.p99_s for r in mine) / len(mine)
            per.append([t, BUDGETS[t % len(BUDGETS)], len(mine), f"{within:.1%}",
                        f"{np.mean([abs(r.actual_s - r.predicted_s) / r.actual_s for r in mine]):.1%}",
                        float(np.mean([r.budget_wait_s for r in mine]))])
    table("per tenant", ["tenant", "budget tok/s", "ok", "within p99", "MAPE", "mean budget wait s"], per)
    _plot(ok)


def _plot(ok: list[Result]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter([r.predicted_s for r in ok], [r.actual_s for r in ok], s=8, label="requests")
    ax.scatter([r.p99_s for r in ok], [r.actual_s for r in ok], s=4, marker="x", alpha=0.4, label="p99 bound")
    hi = max(max(r.actual_s for r in ok), max(r.p99_s for r in ok))
    ax.plot([0, hi], [0, hi], color="grey", linewidth=1)
    ax.set_xlabel("predicted (s)")
    ax.set_ylabel("actual (s)")
    ax.legend()
    ax.set_title("latency contracts: predicted vs actual")
    fig.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT / "contracts.png", dpi=110)
    print(f"plot: {OUT / 'contracts.png'}")


if __name__ == "__main__":
    main()
