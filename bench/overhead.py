"""The gateway's own cost, against a model-free echo engine, with its floors measured in the same run.
The HTTP floor and the gateway run alone on core 0; the load generator, Redis and the echo
worker on core 1 (``taskset``).

    python -m bench.overhead [--rates 100,200,500,1000] [--duration 10] [--json]

Three targets receive the same open-loop Poisson load from one lean client:
  http-floor   Starlette on uvicorn+httptools answering a fixed body (no Redis, no worker);
  redis-floor  XADD a job to the echo worker and XREAD its reply (no HTTP);
  gateway      POST /v1/chat/completions through the tokengate gateway to the echo worker.
"Added" is the gateway's latency minus the echo engine's own time per request (measured
in-process here), i.e. everything the gateway, Redis and the worker loop add.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
from urllib.parse import urlparse

import orjson
import redis.asyncio as aioredis

from bench.harness import RawClient, auth, floor_server, open_loop, pct, save_plot, stack, table
from common import protocol as p
from common import wire
from workers.engine import EchoEngine
from workers.model_store import DEFAULT_MODEL_NAME

JOBS = wire.jobs_stream(DEFAULT_MODEL_NAME, "cpu")  # the default model's, which echo workers stand in for

GATEWAY_CPUS, REST_CPUS = (0,), (1,)  # the floor and the gateway alone on core 0; the rest on core 1
CHAT = orjson.dumps(
    {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}
)


def echo_own_time_s(n: int = 20_000) -> float:
    engine = EchoEngine(tokens=16)
    job = p.SeqJob("r", tuple(range(30)), p.SamplingParams(16))
    t0 = time.perf_counter()
    for _ in range(n):
        engine.add(job)
        engine.step()
    return (time.perf_counter() - t0) / n


async def _measure(send: object, rates: list[float], duration: float) -> list[tuple[float, list[float], int, float]]:
    out = []
    await open_loop(send, 50, 2.0, seed=99)  # warm-up
    for rate in rates:
        lat, errors, elapsed = await open_loop(send, rate, duration, seed=int(rate))
        out.append((rate, lat, errors, elapsed))
    return out


async def http_floor(rates: list[float], duration: float) -> list[tuple[float, list[float], int, float]]:
    with floor_server(GATEWAY_CPUS) as base:
        url = urlparse(base)
        client = RawClient(url.hostname or "127.0.0.1", url.port or 80)

        async def send() -> bool:
            status, _ = await client.post("/v1/chat/completions", CHAT)
            return status == 200

        return await _measure(send, rates, duration)


async def redis_floor(
    redis_url: str, rates: list[float], duration: float
) -> list[tuple[float, list[float], int, float]]:
    client = aioredis.Redis.from_url(redis_url)
    stream = wire.replies_stream(DEFAULT_MODEL_NAME, "bench-floor")
    waiting: dict[str, asyncio.Future[bool]] = {}
    ids = itertools.count()

    async def reader() -> None:
        last = b"0-0"
        while True:
            for _s, entries in await client.xread({stream: last}, block=1000, count=1000) or []:
                for entry_id, fields in entries:
                    last = entry_id
                    for ev in p.decode_events(fields):
                        if isinstance(ev, p.Finished | p.Failed):  # a Delta first must not drop the waiter
                            fut = waiting.pop(ev.rid, None)
                            if fut is not None:
                                fut.set_result(isinstance(ev, p.Finished))

    task = asyncio.create_task(reader())

    async def send() -> bool:
        rid = f"f{next(ids)}"
        fut = asyncio.get_running_loop().create_future()
        waiting[rid] = fut
        job = p.BatchJob(rid, stream, 0, (p.SeqJob(rid, tuple(range(30)), p.SamplingParams(16)),))
        await client.xadd(JOBS, p.encode_job(job))
        try:
            async with asyncio.timeout(10.0):  # a reply that never comes is an error, not a hang
                return await fut
        except TimeoutError:
            waiting.pop(rid, None)
            return False

    try:
        return await _measure(send, rates, duration)
    finally:
        # a cancel that lands as the blocking XREAD's own timeout is swallowed by redis-py
        # (see gateway.dispatch.dispatcher.Dispatcher.close): do not wait on the reader for ever
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)
        await client.aclose()


async def gateway(
    base: str, key: str, rates: list[float], duration: float
) -> list[tuple[float, list[float], int, float]]:
    url = urlparse(base)
    client = RawClient(url.hostname or "127.0.0.1", url.port or 80, auth(key))

    async def send() -> bool:
        status, _ = await client.post("/v1/chat/completions", CHAT)
        return status == 200

    return await _measure(send, rates, duration)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100,200,500,1000")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    own = echo_own_time_s()
    os.sched_setaffinity(0, set(REST_CPUS))  # this load generator, with Redis and the worker
    results: dict[str, list[tuple[float, list[float], int, float]]] = {}
    results["http-floor"] = asyncio.run(http_floor(rates, args.duration))
    with stack(engine="echo", gateway_cpus=GATEWAY_CPUS, backend_cpus=REST_CPUS) as (base, redis_url, key):
        results["redis-floor"] = asyncio.run(redis_floor(redis_url, rates, args.duration))
        results["gateway"] = asyncio.run(gateway(base, key, rates, args.duration))
    rows = []
    for target, runs in results.items():
        for rate, lat, errors, elapsed in runs:
            row = {
                "target": target,
                "rate": rate,
                "achieved_rps": len(lat) / elapsed,
                "errors": errors,
                "p50_ms": pct(lat, 50) * 1e3,
                "p99_ms": pct(lat, 99) * 1e3,
                "added_p50_ms": (pct(lat, 50) - own) * 1e3,
                "added_p99_ms": (pct(lat, 99) - own) * 1e3,
            }
            rows.append(row)
            if args.json:
                print(orjson.dumps(row).decode())
    if not args.json:
        print(f"echo engine's own time per request: {own * 1e6:.1f} us (subtracted in 'added')")
        table(
            "gateway overhead (open loop, Poisson arrivals)",
            ["target", "offered rps", "achieved rps", "errors", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms"],
            [[r["target"], r["rate"], r["achieved_rps"], r["errors"], r["p50_ms"], r["p99_ms"],
              r["added_p50_ms"], r["added_p99_ms"]] for r in rows],
        )
        gw = {r["rate"]: r for r in rows if r["target"] == "gateway"}
        floor = {r["rate"]: r for r in rows if r["target"] == "redis-floor"}
        http = {r["rate"]: r for r in rows if r["target"] == "http-floor"}
        table(
            "gateway vs its floors (ratio of p50 latency)",
            ["offered rps", "gateway/http-floor", "gateway/redis-floor", "gateway - (http + redis floors) p50 ms"],
            [[rate, gw[rate]["p50_ms"] / http[rate]["p50_ms"], gw[rate]["p50_ms"] / floor[rate]["p50_ms"],
              gw[rate]["p50_ms"] - http[rate]["p50_ms"] - floor[rate]["p50_ms"]] for rate in rates],
        )
        _plot(rows)


def _plot(rows: list[dict[str, object]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for target in ("http-floor", "redis-floor", "gateway"):
        pts = [r for r in rows if r["target"] == target]
        ax.plot([r["rate"] for r in pts], [r["p50_ms"] for r in pts], marker="o", label=f"{target} p50")
        ax.plot([r["rate"] for r in pts], [r["p99_ms"] for r in pts], marker="x", linestyle="--", label=f"{target} p99")
    ax.set_xlabel("offered requests/s")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("tokengate gateway overhead vs floors (echo engine)")
    print(f"plot: {save_plot(fig, 'overhead.png')}")


if __name__ == "__main__":
    main()
