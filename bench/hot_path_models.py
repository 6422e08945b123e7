"""The gateway's hot path serving two models against one: closed-loop throughput in one run.

    python -m bench.hot_path_models [--requests 3000] [--clients 16] [--json]

Redis and echo workers (64 slots, 16 tokens, instant steps) on CPU 1, one gateway process
alone on CPU 0 (``taskset``). Phase ``one model``: the gateway serves ``a`` (one worker) and
``--clients`` closed loops send ``--requests`` short chats to it. Phase ``two models``: a fresh
gateway serves ``a`` and ``b`` (a worker each: the same engine capacity per model), the same
clients split between the models. Both gateways count tokens with the packaged tokenizer. The
target (issue 39): two models' throughput at least 0.95x one model's, from the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx

from bench.harness import ADMIN_TOKEN, OUT, backend, bench_key, console, gateway_server, spawn, stop, table
from bench.redis_cost import load
from workers import model_store

GATEWAY_CPUS, REST_CPUS = (0,), (1,)
MODELS = ("a", "b")


def phase(redis_url: str, models: tuple[str, ...], requests: int, clients: int) -> float:
    """Requests/s of a gateway serving ``models`` (a worker each), ``clients`` split over them."""
    packaged = str(model_store.resolve(None, model_store.default_cache_dir()).path)
    workers = [spawn(["-m", "workers", "--redis-url", redis_url, "--engine", "echo", "--echo-tokens", "16",
                      "--slots", "64", "--model-name", m, "--worker-id", f"hot-{m}-{len(models)}"],
                     OUT / f"hot-path-models-worker-{m}-{len(models)}.log", REST_CPUS) for m in models]
    served = [arg for m in models for arg in ("--model", packaged, "--model-name", m)]
    try:
        with gateway_server(redis_url, served, None, workers, cpus=GATEWAY_CPUS) as (base, _proc):
            key = bench_key(base) if len(models) == 1 else _key(base)

            async def run(n: int) -> tuple[int, float]:
                share = [n // len(models) + (i < n % len(models)) for i in range(len(models))]
                parts = await asyncio.gather(*(load(base, key, m, share[i], max(1, clients // len(models)))
                                               for i, m in enumerate(models)))
                return sum(ok for ok, _ in parts), max(wall for _, wall in parts)

            asyncio.run(run(300))  # warm-up: connections, scripts, each model's scheduler
            ok, wall = asyncio.run(run(requests))
            if ok != requests:
                console.print(f"[red]{requests - ok} of {requests} requests were not answered 200[/red]")
            return ok / wall
    finally:
        stop(workers)


def _key(base: str) -> str:
    """The tenant made in the first phase (same Redis): a new key for it."""
    r = httpx.post(base + "/admin/tenants/bench/keys", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    r.raise_for_status()
    return str(r.json()["key"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with backend("echo", workers=0, cpus=REST_CPUS) as (redis_url, _):
        one = phase(redis_url, MODELS[:1], args.requests, args.clients)
        two = phase(redis_url, MODELS, args.requests, args.clients)
    table(f"the gateway's hot path, one model against two ({args.requests} chats, {args.clients} clients, "
          "gateway alone on CPU 0)", ["gateway serves", "requests/s", "vs one model"],
          [("one model", one, 1.0), ("two models", two, two / one)])
    if args.json:
        console.print(json.dumps({"one_model_rps": one, "two_models_rps": two, "ratio": two / one}))


if __name__ == "__main__":
    main()
