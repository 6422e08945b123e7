"""The backlog a scaler reads, under a step of load (docs/operations.md, "Scaling on backlog").

    python -m bench.backlog [--rate 40] [--step-s 3] [--slots 4] [--step-ms 20] [--json]

One gateway, Redis and one echo worker of ``--slots`` slots whose steps take ``--step-ms``
(a request of 16 tokens holds a slot 16 steps), and no gpu worker. An open loop offers
``--rate`` requests/s for ``--step-s`` seconds (several times what the worker serves), then
stops. Every 25 ms the bench reads the gateway's ``/metrics`` (``tokengate_backlog_*``) and
the gateway's field of Redis's ``{tg}:backlog``. It reports how long after the step began each
signal first showed a backlog, its peak, whether the gpu pool's demand showed although the
pool has no worker, when ``/metrics`` read zero again (the queue drained), and how much
later Redis's entry did.
Targets (issue 26): a rise within 1 s, and a fall back once drained.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import redis.asyncio as aioredis

from bench.harness import ADMIN_TOKEN, OUT, auth, json_lines, save_plot, stack, table
from common import wire

SAMPLE_S = 0.025
_BACKLOG = re.compile(r'^tokengate_backlog_(requests|tokens)\{model="[^"]*",pool="(\w+)"\} (\S+)$', re.MULTILINE)


@dataclass
class Trace:
    metrics: list[tuple[float, float, float]] = field(default_factory=list)  # (t, cpu requests, gpu requests)
    stored: list[tuple[float, float]] = field(default_factory=list)  # (t, cpu requests in {tg}:backlog)


async def sample(base: str, redis_url: str, gateway_id: str, t0: float, trace: Trace, stop: asyncio.Event) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=5) as http:
            while not stop.is_set():
                text = (await http.get("/metrics")).text
                found = {(kind, pool): float(v) for kind, pool, v in _BACKLOG.findall(text)}
                now = time.monotonic() - t0
                trace.metrics.append((now, found.get(("requests", "cpu"), 0.0), found.get(("requests", "gpu"), 0.0)))
                raw = await client.hget(wire.BACKLOG_HASH, gateway_id)
                if raw is not None:
                    trace.stored.append((now, float(orjson.loads(raw)["cpu"]["requests"])))
                await asyncio.sleep(SAMPLE_S)
    finally:
        await client.aclose()


async def offer(base: str, key: str, rate: float, seconds: float) -> tuple[dict[str, int], float]:
    """``rate`` requests/s for ``seconds``; (count per status, when the last answer came, from t0)."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    async with httpx.AsyncClient(base_url=base, timeout=120,
                                 headers={"authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=1000)) as http:
        t0 = time.monotonic()

        async def one(at: float) -> int:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
            return (await http.post("/v1/chat/completions", json=body)).status_code

        codes = await asyncio.gather(*(one(i / rate) for i in range(int(rate * seconds))))
        return {str(code): n for code, n in sorted(Counter(codes).items())}, time.monotonic() - t0


def _first(points: list[tuple[float, float]], after: float, test: str) -> float | None:
    for t, v in points:
        if t >= after and (v > 0 if test == "up" else v == 0):
            return t - after
    return None


async def run(args: argparse.Namespace) -> dict[str, object]:
    with stack("echo", workers=1, echo_tokens=16, slots=args.slots,
               extra_worker=["--echo-step-ms", str(args.step_ms)]) as (base, redis_url, key):
        snap = httpx.get(base + "/admin/scheduler", headers=auth(ADMIN_TOKEN)).json()
        trace, stop = Trace(), asyncio.Event()
        t0 = time.monotonic()
        sampler = asyncio.create_task(sample(base, redis_url, snap["gateway"], t0, trace, stop))
        await asyncio.sleep(1.0)  # idle first: the backlog must read zero
        step_at = time.monotonic() - t0
        statuses, took = await offer(base, key, args.rate, args.step_s)
        answered_at = step_at + took
        await asyncio.sleep(2.0)
        stop.set()
        await sampler
    cpu = [(t, c) for t, c, _ in trace.metrics]
    gpu = [(t, g) for t, _, g in trace.metrics]
    result: dict[str, object] = {
        "offered": int(args.rate * args.step_s), "statuses": statuses,
        "idle_backlog": max((c for t, c in cpu if t < step_at), default=0.0),
        "metrics_rise_s": _first(cpu, step_at, "up"), "redis_rise_s": _first(trace.stored, step_at, "up"),
        "gpu_demand_rise_s": _first(gpu, step_at, "up"),
        "peak_requests": max((c for _, c in cpu), default=0.0),
    }
    peak_at = max(cpu, key=lambda tv: tv[1])[0] if cpu else step_at
    empty = _first(cpu, peak_at, "down")  # the queue drained: /metrics reads zero again
    result["metrics_zero_after_step_s"] = None if empty is None else peak_at + empty - step_at
    stored_zero = _first(trace.stored, peak_at, "down")
    result["redis_zero_after_metrics_s"] = (None if empty is None or stored_zero is None
                                            else stored_zero - empty)
    result["last_answer_after_step_s"] = answered_at - step_at
    result["plot"] = str(plot(trace, step_at, args.step_s, answered_at).relative_to(OUT.parent.parent))
    return result


def plot(trace: Trace, step_at: float, step_s: float, answered_at: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    times = [t for t, _, _ in trace.metrics]
    ax.plot(times, [c for _, c, _ in trace.metrics], label="/metrics, cpu pool")
    ax.plot(times, [g for _, _, g in trace.metrics], "--", label="/metrics, gpu pool (no worker)")
    ax.plot([t for t, _ in trace.stored], [v for _, v in trace.stored], ":", label="{tg}:backlog, cpu pool")
    ax.axvspan(step_at, step_at + step_s, alpha=0.1, label="load offered")
    ax.axvline(answered_at, color="grey", lw=0.8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("queued requests")
    ax.legend(fontsize=7)
    return save_plot(fig, "backlog.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=40.0, help="offered requests/s during the step")
    parser.add_argument("--step-s", type=float, default=3.0, help="how long the step lasts")
    parser.add_argument("--slots", type=int, default=4, help="the echo worker's slots")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the echo worker's step time")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        json_lines([result])
        return
    fmt = {k: ("never" if v is None else f"{v:.2f}" if isinstance(v, float) else v) for k, v in result.items()}
    table(f"backlog under a step of {args.rate:g} requests/s for {args.step_s:g} s (1 echo worker, "
          f"{args.slots} slots, {args.step_ms:g} ms steps; no gpu worker)",
          ["measure", "value"], [[k, v] for k, v in fmt.items()])


if __name__ == "__main__":
    main()
