"""No needless holds: one client at a time through the gateway, per scheduling policy.

    python -m bench.holds [--policies fcfs,tokengate] [--requests 2000] [--rounds 2] [--json]

A closed loop of concurrency 1 (each request sent when the previous one is answered) against
the echo engine, once per policy and round, rounds in reversed order so that drift of the
machine falls on both. A policy that holds a lone request "for company" shows up as added
latency over ``fcfs``, which never holds. Prints p50/p99 per policy and the difference of
each policy's p50 from fcfs's (the issue's target: tokengate ≤ fcfs + 0.5 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from urllib.parse import urlparse

from bench.harness import RawClient, auth, json_lines, pct, stack, table
from bench.overhead import CHAT


async def closed_loop(base: str, key: str, requests: int) -> list[float]:
    url = urlparse(base)
    client = RawClient(url.hostname or "127.0.0.1", url.port or 80, auth(key))
    for _ in range(50):  # warm-up
        await client.post("/v1/chat/completions", CHAT)
    latencies = []
    for _ in range(requests):
        t0 = time.perf_counter()
        status, _ = await client.post("/v1/chat/completions", CHAT)
        if status != 200:
            raise RuntimeError(f"status {status}")
        latencies.append(time.perf_counter() - t0)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="fcfs,tokengate")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    policies = args.policies.split(",")
    samples: dict[str, list[float]] = {p: [] for p in policies}
    for round_ in range(args.rounds):
        for policy in policies if round_ % 2 == 0 else reversed(policies):
            with stack(engine="echo", extra_gateway=["--policy", policy]) as (base, _redis, key):
                samples[policy] += asyncio.run(closed_loop(base, key, args.requests))
    base_p50 = pct(samples[policies[0]], 50)
    rows = [{"policy": p, "requests": len(lat), "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
             "p50_minus_first_ms": (pct(lat, 50) - base_p50) * 1e3} for p, lat in samples.items()]
    if args.json:
        json_lines(rows)
        return
    table(f"closed loop, concurrency 1, echo engine ({args.rounds} rounds, order reversed each round)",
          ["policy", "requests", "p50 ms", "p99 ms", f"p50 - {policies[0]} ms"],
          [[r["policy"], r["requests"], r["p50_ms"], r["p99_ms"], r["p50_minus_first_ms"]] for r in rows])


if __name__ == "__main__":
    main()
