"""What one request costs Redis: commands (scripts' commands included) and redis-server CPU.

    python -m bench.redis_cost [--requests 3000] [--clients 16] [--top 15] [--json]

Redis, one echo worker and one gateway, as separate processes; ``--clients`` closed loops send
``--requests`` short chats (non-streamed, 16 tokens) after a warm-up. ``INFO commandstats``
and the redis-server process's CPU time (user + system, from /proc) are read before and after
the measured requests; it prints the commands per request by command, the total, and the
redis-server CPU per request. The figure issue 39 asks to cut (a Redis core caps the fleet at
about 1 / (CPU per request) requests/s whatever the number of gateways), measured the same way
before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import orjson
import redis

from bench.harness import RawClient, auth, console, stack, table, tree_cpu_s

BODY = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 16}


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the server started (``INFO commandstats``)."""
    stats: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


async def load(base: str, key: str, model: str, requests: int, clients: int) -> tuple[int, float]:
    """``requests`` chats over ``clients`` keep-alive connections: (answered 200, wall s)."""
    host, port = base.removeprefix("http://").split(":")
    body = orjson.dumps({**BODY, "model": model})
    left = iter(range(requests))
    ok = 0

    async def loop() -> None:
        nonlocal ok
        client = RawClient(host, int(port), {**auth(key), "content-type": "application/json"})
        for _ in left:
            status, _reply = await client.post("/v1/chat/completions", body)
            ok += status == 200

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(clients)))
    return ok, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--top", type=int, default=15, help="commands listed by calls per request")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with stack("echo", echo_tokens=16, slots=64) as (base, redis_url, key):
        import httpx

        model = httpx.get(base + "/v1/models", headers=auth(key)).json()["data"][0]["id"]
        client = redis.Redis.from_url(redis_url)
        pid = int(client.info("server")["process_id"])
        asyncio.run(load(base, key, model, 300, args.clients))  # warm-up: connections, scripts, the scheduler
        before, cpu_before = command_calls(client), tree_cpu_s(pid)
        ok, wall = asyncio.run(load(base, key, model, args.requests, args.clients))
        after, cpu_after = command_calls(client), tree_cpu_s(pid)
    calls = {name: after[name] - before.get(name, 0) for name in after}
    calls = {name: n for name, n in sorted(calls.items(), key=lambda kv: -kv[1]) if n > 0}
    total = sum(calls.values())
    cpu_ms = (cpu_after - cpu_before) * 1000 / max(ok, 1)
    table(f"Redis commands per request ({ok} of {args.requests} answered, {args.clients} clients, "
          f"{ok / wall:.0f} req/s)", ["command", "calls", "per request"],
          [(name, n, n / max(ok, 1)) for name, n in list(calls.items())[: args.top]])
    console.print(f"all commands: {total} ({total / max(ok, 1):.1f} per request); redis-server CPU "
                  f"{cpu_ms:.3f} ms per request: one Redis core at most ~{1000 / cpu_ms:.0f} requests/s"
                  if cpu_ms > 0 else f"all commands: {total} ({total / max(ok, 1):.1f} per request)")
    if args.json:
        console.print(json.dumps({"answered": ok, "commands": calls, "commands_per_request": total / max(ok, 1),
                                  "redis_cpu_ms_per_request": cpu_ms}, indent=1))


if __name__ == "__main__":
    main()
