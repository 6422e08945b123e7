"""Multi-turn conversations against several replicas of llama.cpp's server behind tokengate:
prefix-aware routing against round-robin and against the earliest predicted first token
(issue 40, targets 1 and 3).

    python -m bench.multiturn [--replicas 3] [--slots 4] [--users 9] [--turns 6]
                              [--routings prefix,worker,round-robin] [--json]

Each routing gets a fresh stack: Redis, ``--replicas`` llama-servers (``-np --slots``, one
thread each: their caches start empty), one ``--engine upstream`` worker per replica, and a
gateway with ``--routing``. ``--users`` users each hold a conversation of ``--turns`` turns,
one after another (closed loop): a shared system prompt (``--system-words``), then per turn a
new user message (``--user-words`` words, its own words) appended to the whole history with
the engine's previous answers, a streamed greedy chat of at most ``--max-tokens`` tokens.
Every turn resends the history: the replica that served the previous turn holds it in its
slot's cache and prefills only what is new; any other replica prefills everything.

Reported per routing: TTFT p50/p99 (first streamed token), turns per second, completion
tokens per second, the engines' own prompt tokens prefilled and found cached and the hit
share (llama-server's ``/metrics``, summed over the replicas), and the ratios of each other
routing's TTFT to prefix's (above 1: prefix is faster) and prefix's throughput to each's. With
``--json`` the last line is one object with every routing's figures and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from typing import Any

import httpx
import orjson

from bench.harness import (
    ADMIN_TOKEN,
    OUT,
    auth,
    bench_key,
    console,
    gateway_server,
    json_lines,
    pct,
    spawn,
    stop,
    table,
)
from bench.llamacpp import LlamaCppServer
from gateway.cli.embedded_redis import EmbeddedRedis
from workers.model_store import DEFAULT_MODEL_NAME as MODEL

WORDS = ("river stone lantern orchard copper meadow harbor violet engine silver canyon thunder garden "
         "marble falcon winter ember quartz willow signal amber glacier cedar comet velvet tundra beacon "
         "saffron island prairie ribbon cobalt mirror summit fern anchor").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def conversation(client: httpx.AsyncClient, base: str, key: str, model: str, system: str, user: int,
                       args: argparse.Namespace, until: float,
                       refusals: list[int]) -> list[tuple[int, float, float, int]]:
    """One user's turns: (turn, TTFT s, total s, completion tokens) each; a refusal (429/503 with
    Retry-After) is counted in ``refusals`` and the turn sent again after it."""
    rng = random.Random(user)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    out: list[tuple[int, float, float, int]] = []
    turn = 0
    while turn < args.turns:
        if time.monotonic() > until:
            break
        messages.append({"role": "user", "content": f"({user}.{turn}) {words(rng, args.user_words)}"})
        body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True}
        sent = time.monotonic()
        first: float | None = None
        pieces: list[str] = []
        async with client.stream("POST", base + "/v1/chat/completions", json=body, headers=auth(key),
                                 timeout=120) as reply:
            if reply.status_code in (429, 503) and "retry-after" in reply.headers:  # as the openai client does
                refusals.append(reply.status_code)
                await asyncio.sleep(float(reply.headers["retry-after"]))
                messages.pop()
                continue
            if reply.status_code != 200:
                raise RuntimeError(f"{reply.status_code}: {(await reply.aread())[:200]!r}")
            async for line in reply.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                chunk = orjson.loads(line[5:])
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        first = first or time.monotonic()
                        pieces.append(text)
        ended = time.monotonic()
        out.append((turn, (first or ended) - sent, ended - sent, len(pieces)))
        messages.append({"role": "assistant", "content": "".join(pieces)})
        turn += 1
    return out


def engine_figures(servers: list[LlamaCppServer]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for s in servers:
        for name, value in s.metrics().items():
            if name.startswith("llamacpp:") and name.endswith("_total"):
                totals[name] = totals.get(name, 0.0) + value
    return totals


async def run_routing(routing: str, args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.ExitStack() as stack, EmbeddedRedis() as redis:
        servers = [LlamaCppServer(OUT / f"multiturn-llama-{i}.log", slots=args.slots, context=args.context)
                   for i in range(args.replicas)]
        for s in servers:
            s.start()
            stack.callback(s.stop)
        workers = [spawn(["-m", "workers", "--redis-url", redis.url, "--engine", "upstream", "--upstream-url", s.url,
                          "--slots", str(args.slots), "--worker-id", f"replica-{i}", "--model-name", MODEL],
                         OUT / f"multiturn-worker-{i}.log") for i, s in enumerate(servers)]
        stack.callback(stop, workers)
        # the bench compares routings: no request is refused for a long predicted wait
        with gateway_server(redis.url, ["--routing", routing, "--max-queue-wait-ms", "0"],
                            backend_procs=workers) as (base, _proc):
            key = bench_key(base)
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=args.users + 2)) as client:
                model = (await client.get(base + "/v1/models", headers=auth(key))).json()["data"][0]["id"]
                while len((await client.get(base + "/admin/workers",
                                            headers=auth(ADMIN_TOKEN))).json()["data"]) < args.replicas:
                    await asyncio.sleep(0.2)
                before = engine_figures(servers)
                system = words(random.Random(-1), args.system_words)
                started = time.monotonic()
                refusals: list[int] = []
                turns = await asyncio.gather(*(conversation(client, base, key, model, system, u, args,
                                                            started + args.max_seconds, refusals)
                                               for u in range(args.users)))
                wall = time.monotonic() - started
            after = engine_figures(servers)
    flat = [t for user in turns for t in user]
    ttfts = [t[1] for t in flat]
    later = [t[1] for t in flat if t[0] > 0]  # turns with a history to reuse
    moved = {k: after[k] - before.get(k, 0.0) for k in after}
    prefilled = moved.get("llamacpp:prompt_tokens_total", 0.0)  # llama-server counts what it computed
    cached = moved.get("llamacpp:prompt_tokens_cached_total", 0.0)  # and, apart, what it found cached
    return {
        "routing": routing,
        "turns": len(flat),
        "refused": len(refusals),
        "ttft_p50_ms": pct(ttfts, 50) * 1000,
        "ttft_p99_ms": pct(ttfts, 99) * 1000,
        "later_ttft_p50_ms": pct(later, 50) * 1000,
        "turns_per_s": len(flat) / wall,
        "tokens_per_s": sum(t[3] for t in flat) / wall,
        "engine_prefilled": prefilled,
        "engine_cached": cached,
        "engine_hit": cached / (cached + prefilled) if cached + prefilled else 0.0,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    for routing in args.routings.split(","):
        console.print(f"routing {routing} …")
        rows[routing] = await run_routing(routing, args)
    ratios: dict[str, dict[str, float]] = {}
    if "prefix" in rows:
        p = rows["prefix"]
        for other, r in rows.items():
            if other != "prefix":
                ratios[other] = {"ttft_p50": r["ttft_p50_ms"] / p["ttft_p50_ms"],
                                 "ttft_p99": r["ttft_p99_ms"] / p["ttft_p99_ms"],
                                 "throughput": p["turns_per_s"] / r["turns_per_s"]}
    return {"rows": rows, "prefix_vs": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4, help="llama-server -np, and the worker's --slots")
    parser.add_argument("--context", type=int, default=4096, help="each slot's context")
    parser.add_argument("--users", type=int, default=9)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--user-words", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-seconds", type=float, default=300, help="no turn starts after this")
    parser.add_argument("--routings", default="prefix,worker,round-robin")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    table(f"{args.users} users x {args.turns} turns on {args.replicas} llama-server replicas (-np {args.slots})",
          ["routing", "turns", "refused", "TTFT p50 ms", "TTFT p99 ms", "later turns p50 ms", "turns/s", "tok/s",
           "engines: prompt tokens prefilled", "found cached", "hit"],
          [(r["routing"], r["turns"], r["refused"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["later_ttft_p50_ms"],
            r["turns_per_s"], r["tokens_per_s"], int(r["engine_prefilled"]), int(r["engine_cached"]),
            f"{r['engine_hit']:.1%}")
           for r in result["rows"].values()])
    for other, ratio in result["prefix_vs"].items():
        console.print(f"prefix vs {other}: TTFT p50 {ratio['ttft_p50']:.2f}x better, p99 {ratio['ttft_p99']:.2f}x, "
                      f"throughput {ratio['throughput']:.2f}x")
    if args.json:
        json_lines([result])


if __name__ == "__main__":
    main()
