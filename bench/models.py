"""Two models on one Redis, each its own scheduling domain (issue 39).

    python -m bench.models [--shared] [--duration 10] [--clients 32] [--json]

Redis; model ``alpha`` with two echo workers and two gateway processes, model ``beta`` with one
echo worker and one gateway process (echo workers: 8 slots, 16 tokens at 5 ms a step, about 100
requests/s each); with ``--shared``, three gateway processes instead, each serving both models
behind its one endpoint (each model's scheduler elected among all three). Tenants A and B send
to alpha, C and D to beta, from closed-loop streaming clients (each model's in a process of its
own), spread over the gateways that serve the model. Phases, in one run:

1. ``alpha alone``: ``--clients`` on alpha (A and B, half each, spread over its gateways);
2. ``beta alone``: 4 light clients on beta (C and D);
3. ``both``: the two loads at once (alpha flooded, beta light);
4. ``half each``: ``--clients`` split evenly between the models (the hot path with two models).

``--pin`` puts alpha's processes on CPU 0 and beta's on CPU 1 (the domains then share only
Redis and the clients' CPU). Reported per phase: requests/s per model, first-token p50/p99
per model, Jain's index over each model's tenants, the most sequences any worker held beyond
its slots (heartbeats every 0.2 s), and, at the end, which workers read each model's jobs
stream and which gateway holds each model's scheduling lease. Targets (issue 39): 0 jobs read by a worker of the
other model; beta's first-token p99 with alpha flooded within 1.2x of beta alone; two models'
throughput (``half each``) at least 0.95x of one model's (``alpha alone``); 0 over-commit;
Jain >= 0.99 within each model.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import redis.asyncio as aioredis

from bench.harness import ADMIN_TOKEN, OUT, auth, backend, json_lines, spawn, stop, table, wait_ready
from bench.replicas import Tally as Heartbeats
from bench.replicas import jain, tenant_keys, watch_workers
from common import protocol as p
from common import wire
from gateway.cli.embedded_redis import free_port
from workers import model_store

MODELS = {"alpha": ("A", "B"), "beta": ("C", "D")}  # model -> its tenants
WORKERS = {"alpha": 2, "beta": 1}
GATEWAYS = {"alpha": 2, "beta": 1}
SHARED = 3  # ``--shared``: gateway processes, each serving both models
LIGHT = 4  # beta's clients in the light load


@dataclass
class Load:
    ok: Counter[str] = field(default_factory=Counter)  # tenant -> streams answered whole
    ttft: dict[str, list[float]] = field(default_factory=dict)  # model -> first-token seconds
    errors: Counter[str] = field(default_factory=Counter)


@contextmanager
def fleet(redis_url: str, pin: bool, shared: bool = False) -> Iterator[dict[str, list[str]]]:
    """The workers and gateways of each model (``pin``: alpha's on CPU 0, beta's on CPU 1;
    ``shared``: ``SHARED`` gateways serving both models, unpinned); yields model -> the base URLs
    of the gateways that serve it."""
    procs, bases = [], {}
    try:
        for k, (model, n) in enumerate(WORKERS.items()):
            cpus = (k,) if pin else ()
            procs += [spawn(["-m", "workers", "--redis-url", redis_url, "--engine", "echo", "--echo-tokens", "16",
                             "--slots", "8", "--echo-step-ms", "5", "--model-name", model,
                             "--worker-id", f"{model}-{i}"], OUT / f"models-{model}-worker-{i}.log", cpus)
                      for i in range(n)]
        if shared:  # every gateway serves both, counting tokens with the packaged model's tokenizer
            packaged = str(model_store.resolve(None, model_store.default_cache_dir()).path)
            ports = [free_port() for _ in range(SHARED)]
            both = [arg for m in MODELS for arg in ("--model", packaged)] + [
                arg for m in MODELS for arg in ("--model-name", m)]
            procs += [spawn(["-m", "gateway.cli", "--log-level", "WARNING", "gateway", "--redis-url", redis_url,
                             "--port", str(port), "--admin-token", ADMIN_TOKEN, *both],
                            OUT / f"models-shared-gateway-{i}.log", ()) for i, port in enumerate(ports)]
            bases = {m: [f"http://127.0.0.1:{port}" for port in ports] for m in MODELS}
        for k, (model, n) in enumerate(() if shared else GATEWAYS.items()):
            ports = [free_port() for _ in range(n)]
            procs += [spawn(["-m", "gateway.cli", "--log-level", "WARNING", "gateway", "--redis-url", redis_url,
                             "--port", str(port), "--admin-token", ADMIN_TOKEN, "--model-name", model],
                            OUT / f"models-{model}-gateway-{i}.log", (k,) if pin else ())
                      for i, port in enumerate(ports)]
            bases[model] = [f"http://127.0.0.1:{port}" for port in ports]
        for urls in bases.values():
            for base in urls:
                wait_ready(base, procs)
        yield bases
    finally:
        stop(procs)


async def one_stream(http: httpx.AsyncClient, model: str, key: str, load: Load, tenant: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": True}
    started, first = time.monotonic(), None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as r:
            if r.status_code != 200:
                load.errors[f"{model} {r.status_code}"] += 1
                await r.aread()
                await asyncio.sleep(0.05)
                return
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {") and _text(orjson.loads(line[6:])):
                    first = time.monotonic() - started
    except httpx.HTTPError as exc:
        load.errors[f"{model} {type(exc).__name__}"] += 1
        return
    load.ok[tenant] += 1
    if first is not None:
        load.ttft.setdefault(model, []).append(first)


async def run_load(bases: dict[str, list[str]], keys: dict[str, str], clients: dict[str, int],
                   seconds: float, redis_url: str) -> tuple[Load, Heartbeats, float]:
    """``clients[model]`` closed-loop clients on each model, its tenants in turn, spread over its
    gateways, for ``seconds`` after 2 s of warm-up."""
    http = {b: httpx.AsyncClient(base_url=b, timeout=60) for urls in bases.values() for b in urls}
    beats, done = Heartbeats(), asyncio.Event()
    watcher = asyncio.create_task(watch_workers(redis_url, beats, done))

    async def client(model: str, n: int, load: Load, until: float) -> None:
        tenant = MODELS[model][n % len(MODELS[model])]
        base = bases[model][n % len(bases[model])]
        while time.monotonic() < until:
            await one_stream(http[base], model, keys[tenant], load, tenant)

    plan = [(m, n) for m, count in clients.items() for n in range(count)]
    await asyncio.gather(*(client(m, n, Load(), time.monotonic() + 2.0) for m, n in plan))
    load, started = Load(), time.monotonic()
    await asyncio.gather(*(client(m, n, load, started + seconds) for m, n in plan))
    elapsed = time.monotonic() - started
    done.set()
    await watcher
    for h in http.values():
        await h.aclose()
    return load, beats, elapsed


def _text(chunk: dict[str, Any]) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices", []))


def _one_model(args: tuple[dict[str, list[str]], dict[str, str], str, int, float, str]) -> tuple[Load, int, float]:
    """One model's clients, in a process of their own (``phase``)."""
    bases, keys, model, clients, seconds, redis_url = args
    load, beats, elapsed = asyncio.run(run_load(bases, keys, {model: clients}, seconds, redis_url))
    return load, beats.overcommit, elapsed


def phase(bases: dict[str, list[str]], keys: dict[str, str], clients: dict[str, int], seconds: float,
          redis_url: str) -> tuple[Load, Heartbeats, float]:
    """Each model's clients in a process of their own, at once: one model's flood does not
    share the other's load generator (an event loop of 36 streaming clients is a queue of its
    own: beta's first tokens read 1.7x slower beside alpha's flood with one process for both)."""
    with multiprocessing.get_context("fork").Pool(len(clients)) as pool:
        parts = pool.map(_one_model, [(bases, keys, m, n, seconds, redis_url) for m, n in clients.items()])
    load, beats = Load(), Heartbeats()
    for part, overcommit, _elapsed in parts:
        load.ok.update(part.ok)
        load.errors.update(part.errors)
        for model, values in part.ttft.items():
            load.ttft.setdefault(model, []).extend(values)
        beats.overcommit = max(beats.overcommit, overcommit)
    return load, beats, sum(elapsed for _, _, elapsed in parts) / len(parts)


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(phase: str, load: Load, beats: Heartbeats, elapsed: float) -> dict[str, Any]:
    row: dict[str, Any] = {"phase": phase, "overcommit": max(0, beats.overcommit), "errors": dict(load.errors)}
    for model, tenants in MODELS.items():
        rates = [load.ok[t] / elapsed for t in tenants]
        row[model] = {"requests_per_s": sum(rates), "jain": jain(rates) if any(rates) else None,
                      "ttft_p50_s": quantile(load.ttft.get(model, []), 0.5),
                      "ttft_p99_s": quantile(load.ttft.get(model, []), 0.99)}
    return row


async def domains(redis_url: str) -> dict[str, Any]:
    """Per model: the requests its jobs stream carried, the workers that read it, the lease's holder."""
    client = aioredis.Redis.from_url(redis_url)
    out: dict[str, Any] = {}
    try:
        for model in MODELS:
            stream = wire.jobs_stream(model, "cpu")
            rids = {s.rid for _id, f in await client.xrange(stream) for s in p.decode_job(f).seqs}
            readers = sorted(wire.text(c["name"]) for c in await client.xinfo_consumers(stream, wire.GROUP))
            holder = await client.get(wire.scheduler_lease(model))
            out[model] = {"requests_left_on_stream": len(rids), "readers": readers,
                          "scheduler": wire.text(holder or b"")}
    finally:
        await client.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured per phase")
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients of the flood")
    parser.add_argument("--pin", action="store_true",
                        help="alpha's processes on CPU 0, beta's on CPU 1 (Redis and the clients unpinned)")
    parser.add_argument("--shared", action="store_true",
                        help=f"{SHARED} gateway processes, each serving both models (not with --pin)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.shared and args.pin:
        parser.error("--shared gateways serve both models: they cannot be pinned by model")
    phases = {"alpha alone": {"alpha": args.clients}, "beta alone": {"beta": LIGHT},
              "both": {"alpha": args.clients, "beta": LIGHT},
              "half each": {"alpha": args.clients // 2, "beta": args.clients // 2}}
    rows = []
    with backend("echo", workers=0) as (url, _), fleet(url, args.pin, args.shared) as bases:
        keys = tenant_keys(bases["alpha"][0])  # (A-D, made through one gateway: tenants are shared)
        for name, clients in phases.items():
            rows.append(summary(name, *phase(bases, keys, clients, args.duration, url)))
        seen = asyncio.run(domains(url))
    alone, both = rows[1]["beta"]["ttft_p99_s"], rows[2]["beta"]["ttft_p99_s"]
    result = {
        "layout": f"{SHARED} gateways serving both models" if args.shared else "a gateway deployment per model",
        "phases": rows, "domains": seen,
        "crossed": sum(1 for m, d in seen.items() for r in d["readers"] if not r.startswith(f"{m}-")),
        "beta_p99_flooded_over_alone": both / alone if alone and both else None,
        "two_models_over_one": (rows[3]["alpha"]["requests_per_s"] + rows[3]["beta"]["requests_per_s"])
        / rows[0]["alpha"]["requests_per_s"],
    }
    if args.json:
        json_lines([result])
        return
    layout = (f"{SHARED} gateways serving both, alpha 2 workers, beta 1" if args.shared
              else "alpha (2 workers, 2 gateways) and beta (1, 1)")
    table(f"two models on one Redis: {layout}; flood {args.clients} clients"
          f"{'; alpha on CPU 0, beta on CPU 1' if args.pin else ''}",
          ["phase", "alpha req/s", "alpha TTFT p50 / p99 ms", "beta req/s", "beta TTFT p50 / p99 ms",
           "Jain alpha / beta", "overcommit", "errors"],
          [[r["phase"], r["alpha"]["requests_per_s"], _ms(r["alpha"]), r["beta"]["requests_per_s"], _ms(r["beta"]),
            f"{_f(r['alpha']['jain'])} / {_f(r['beta']['jain'])}", r["overcommit"], r["errors"] or "none"]
           for r in rows])
    print(orjson.dumps(seen).decode())
    print(f"jobs read by the other model's workers: {result['crossed']}; beta's first-token p99 flooded / alone: "
          f"{_f(result['beta_p99_flooded_over_alone'])}; two models' throughput / one model's: "
          f"{result['two_models_over_one']:.2f}")


def _ms(row: dict[str, Any]) -> str:
    p50, p99 = row["ttft_p50_s"], row["ttft_p99_s"]
    return "-" if p50 is None else f"{p50 * 1000:.0f} / {p99 * 1000:.0f}"


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
