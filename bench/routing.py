"""Two workers of different speed in one pool: routed by predicted first token, or split as they read
(issue 26, target 2).

    python -m bench.routing [--duration 15] [--clients 8] [--prompt 1024] [--json]

Redis and two echo workers in the cpu pool, 8 slots each, one four times slower than the
other: 1 ms steps and 5 µs per prompt token prefilled, against 4 ms and 20 µs (each measures
itself at start and publishes the profile). The same workers serve one gateway with
``--routing pool`` (the jobs on the pool's stream, taken by whichever worker reads first: the
even split) and then one with ``--routing worker`` (each job to the worker where it is
predicted to start first), in the same run. Closed-loop clients stream completions of
``--prompt`` prompt tokens and 16 output tokens. Reported per routing: requests/s and the time
to the first token (first streamed chunk) p50 and p99, and the ratio of the p99s
(pool ÷ worker: above 1, worker routing is faster).

With ``--json`` the last line is one object with ``ttft_p99_ratio`` and each routing's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import httpx

from bench.harness import ADMIN_TOKEN, OUT, auth, bench_key, gateway_server, json_lines, pct, spawn, stop, table
from gateway.cli.embedded_redis import EmbeddedRedis

WORKERS = {"fast": ("1", "5"), "slow": ("4", "20")}  # worker id -> (--echo-step-ms, --echo-prefill-us)


async def load(base: str, key: str, clients: int, prompt: int, duration: float) -> tuple[list[float], float]:
    """Time to first token of every streamed request answered in ``duration`` (after a 2 s warm-up)."""
    ttfts: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=httpx.Limits(max_connections=clients)) as http:

        async def client(n: int, until: float, keep: bool) -> None:
            body = {"model": "SmolLM2-135M-Instruct", "prompt": [1 + (n + i) % 900 for i in range(prompt)],
                    "max_tokens": 16, "stream": True}
            while time.monotonic() < until:
                started = time.monotonic()
                first = None
                async with http.stream("POST", "/v1/completions", json=body, headers=auth(key)) as r:
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.monotonic() - started
                if r.status_code == 200 and first is not None and keep:
                    ttfts.append(first)

        warm = time.monotonic() + 2.0
        await asyncio.gather(*(client(n, warm, False) for n in range(clients)))
        started = time.monotonic()
        await asyncio.gather(*(client(n, started + duration, True) for n in range(clients)))
        return ttfts, time.monotonic() - started


def run(duration: float, clients: int, prompt: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    key = ""
    with EmbeddedRedis() as redis:
        workers = [spawn(["-m", "workers", "--redis-url", redis.url, "--engine", "echo", "--echo-tokens", "16",
                          "--slots", "8", "--worker-id", wid, "--echo-step-ms", step, "--echo-prefill-us", prefill],
                         OUT / f"routing-{wid}.log") for wid, (step, prefill) in WORKERS.items()]
        try:
            for routing in ("pool", "worker"):
                with gateway_server(redis.url, ["--routing", routing], backend_procs=workers) as (base, _proc):
                    _wait_for_profiles(base)
                    key = key or bench_key(base)  # tenants and keys live in Redis: one for both gateways
                    ttfts, elapsed = asyncio.run(load(base, key, clients, prompt, duration))
                out[routing] = {"requests_per_s": len(ttfts) / elapsed, "ttft_p50_ms": pct(ttfts, 50) * 1000,
                                "ttft_p99_ms": pct(ttfts, 99) * 1000, "requests": len(ttfts)}
        finally:
            stop(workers)
    out["ttft_p99_ratio"] = out["pool"]["ttft_p99_ms"] / out["worker"]["ttft_p99_ms"]
    return out


def _wait_for_profiles(base: str, timeout_s: float = 120) -> None:
    """Both workers alive with their measured profiles (their self-profiles take a few seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        data = httpx.get(base + "/admin/workers", headers=auth(ADMIN_TOKEN)).json()["data"]
        if len(data) == len(WORKERS) and all(w.get("profile") for w in data):
            return
        time.sleep(0.5)
    raise RuntimeError("the workers did not publish their profiles")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds measured per routing")
    parser.add_argument("--clients", type=int, default=8, help="closed-loop streaming clients")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.duration, args.clients, args.prompt)
    if args.json:
        json_lines([result])
        return
    table(f"{args.clients} streaming clients, {args.prompt}-token prompts; echo workers fast (1 ms, 5 µs/token) "
          "and slow (4 ms, 20 µs/token), 8 slots each, same run",
          ["routing", "req/s", "TTFT p50 ms", "TTFT p99 ms"],
          [[r, result[r]["requests_per_s"], result[r]["ttft_p50_ms"], result[r]["ttft_p99_ms"]]
           for r in ("pool", "worker")])
    print(f"TTFT p99, pool ÷ worker routing: {result['ttft_p99_ratio']:.2f}")


if __name__ == "__main__":
    main()
