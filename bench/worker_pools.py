"""Worker pools: scaling with echo workers, recovery after `kill -9`, and the KV hand-off.

    python -m bench.worker_pools [--workers 1,2,4] [--duration 6] [--kills 3] [--lengths 64,256,1024] [--json]

scaling   N echo-engine workers (model-free, every sequence answered in one step) share the
          cpu pool's consumer group; a client keeps 64 one-sequence jobs outstanding on the
          jobs stream and counts completed requests/s. The gateway is left out on purpose:
          it would be the bottleneck, and this measures the workers and Redis.
kill-9    two echo workers decoding one token per 20 ms (a 1 s request) with --claim-idle 1;
          the worker holding the request is killed with SIGKILL mid-request; reported is the
          time from the kill to the request's one complete result (from the peer).
handoff   the real model in-process: a cpu prefill with a hand-off yields the KV cache of the
          prompt; reported are its bytes (safetensors, as the worker writes it to Redis) and
          the time to serialize + SET + GET + deserialize it, per prompt token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import time

import orjson
import redis
import redis.asyncio as aioredis

from bench.harness import OUT, pct, spawn, stop, table
from common import protocol as p
from common import wire
from gateway.cli.embedded_redis import EmbeddedRedis
from workers import model_store
from workers.model_store import DEFAULT_MODEL_NAME

JOBS = wire.jobs_stream(DEFAULT_MODEL_NAME, "cpu")  # the default model's, which echo workers stand in for

CONCURRENCY = 64


def _workers(redis_url: str, names: list[str], *extra: str) -> list[subprocess.Popen[bytes]]:
    return [
        spawn(["-m", "workers", "--redis-url", redis_url, "--engine", "echo", "--slots", "256",
               "--worker-id", name, *extra], OUT / f"workers-{name}.log")
        for name in names
    ]


def _wait_workers(client: redis.Redis, names: list[str], timeout_s: float = 60) -> None:
    """Until each named worker has a live heartbeat (a killed one's lingers in the worker set)."""
    deadline = time.monotonic() + timeout_s
    while client.exists(*(wire.worker_key(name) for name in names)) < len(names):
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers {names} did not register in {timeout_s} s; see bench/out")
        time.sleep(0.1)


async def _closed_loop(redis_url: str, duration_s: float) -> tuple[float, list[float]]:
    """Requests/s and latencies with CONCURRENCY one-sequence jobs always outstanding."""
    client = aioredis.Redis.from_url(redis_url)
    replies = wire.replies_stream(DEFAULT_MODEL_NAME, "bench-workers")
    waiting: dict[str, tuple[float, asyncio.Future[None]]] = {}
    ids = itertools.count()
    lat: list[float] = []

    async def reader() -> None:
        last = b"0-0"  # a fresh Redis: every reply on the stream is ours
        while True:
            for _s, entries in await client.xread({replies: last}, block=1000, count=1000) or []:
                for entry_id, fields in entries:
                    last = entry_id
                    for ev in p.decode_events(fields):
                        if isinstance(ev, p.Finished) and ev.rid in waiting:
                            t0, fut = waiting.pop(ev.rid)
                            lat.append(time.perf_counter() - t0)
                            fut.set_result(None)

    async def one() -> None:
        rid = f"w{next(ids)}"
        fut = asyncio.get_running_loop().create_future()
        waiting[rid] = (time.perf_counter(), fut)
        job = p.BatchJob(rid, replies, 0, (p.SeqJob(rid, tuple(range(30)), p.SamplingParams(16)),))
        await client.xadd(JOBS, p.encode_job(job))
        await fut

    async def runner(until: float) -> int:
        done = 0
        while time.perf_counter() < until:
            await one()
            done += 1
        return done

    async def watched(until: float) -> list[int]:
        """The runners, failing fast if the reader dies or a reply is lost."""
        runners = asyncio.gather(*(runner(until) for _ in range(CONCURRENCY)))
        done, _ = await asyncio.wait({runners, task}, timeout=until - time.perf_counter() + 30,
                                     return_when=asyncio.FIRST_COMPLETED)
        if runners not in done:
            runners.cancel()
            failure = task.exception() if task.done() else None
            raise RuntimeError(f"{len(waiting)} replies never came (reader: {failure!r})")
        return runners.result()

    task = asyncio.create_task(reader())
    await asyncio.sleep(0.2)
    await watched(time.perf_counter() + 1.0)  # warm-up
    lat.clear()
    t0 = time.perf_counter()
    counts = await watched(t0 + duration_s)
    elapsed = time.perf_counter() - t0
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await client.aclose()
    return sum(counts) / elapsed, lat


def scaling(counts: list[int], duration_s: float) -> list[dict[str, object]]:
    rows = []
    for n in counts:
        with EmbeddedRedis() as server:
            names = [f"bench-{i}" for i in range(n)]
            procs = _workers(server.url, names)
            try:
                _wait_workers(redis.Redis.from_url(server.url), names)
                rps, lat = asyncio.run(_closed_loop(server.url, duration_s))
            finally:
                stop(procs)
        rows.append({"bench": "scaling", "workers": n, "rps": rps,
                     "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3})
    base = rows[0]["rps"]
    for r in rows:
        r["vs_one_worker"] = float(r["rps"]) / float(base)  # type: ignore[arg-type]
    return rows


def kill9(kills: int, claim_idle_s: float = 1.0) -> list[dict[str, object]]:
    rows = []
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        slow = ("--echo-step-ms", "20", "--echo-tokens", "50", "--claim-idle", str(claim_idle_s),
                "--heartbeat", str(claim_idle_s / 4))
        names = ["bench-0", "bench-1"]
        procs = _workers(server.url, names, *slow)
        try:
            _wait_workers(client, names)
            replies = wire.replies_stream(DEFAULT_MODEL_NAME, "bench-kill")
            for k in range(kills):
                rid = f"k{k}"
                last = client.xadd(replies, {"x": "start"})  # read replies after this id
                job = p.BatchJob(rid, replies, 0, (p.SeqJob(rid, tuple(range(30)), p.SamplingParams(50)),))
                client.xadd(JOBS, p.encode_job(job))
                holder = None
                deadline = time.monotonic() + 30
                while holder is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError("no worker took the request; see bench/out/workers-*.log")
                    pending = client.xpending_range(JOBS, wire.GROUP, "-", "+", count=10)
                    holder = pending[0]["consumer"].decode() if pending else None
                    time.sleep(0.01)
                time.sleep(0.3)  # mid-request: about 15 of its 50 tokens are done
                i = names.index(holder)
                victim = procs[i]
                killed_at = time.monotonic()
                os.kill(victim.pid, signal.SIGKILL)
                finals = []
                while not finals:
                    for _s, entries in client.xread({replies: last}, block=100) or []:
                        for entry_id, fields in entries:
                            last = entry_id
                            if b"x" in fields:
                                continue
                            finals += [e for e in p.decode_events(fields)
                                       if isinstance(e, p.Finished) and e.rid == rid]
                    if time.monotonic() - killed_at > 60:
                        raise RuntimeError("the killed worker's request never completed")
                rows.append({"bench": "kill-9", "kill": k + 1, "claim_idle_s": claim_idle_s,
                             "kill_to_result_s": time.monotonic() - killed_at,
                             "completion_tokens": finals[0].completion_tokens, "results": len(finals)})
                names[i] = f"bench-{i}-{k}"  # a replacement, so two workers remain
                procs[i] = _workers(server.url, [names[i]], *slow)[0]
                _wait_workers(client, names)
        finally:
            stop(procs)
    return rows


def handoff(lengths: list[int]) -> list[dict[str, object]]:
    from safetensors.torch import load, save

    from workers.devices import probe
    from workers.hf_engine import HFEngine

    model_store.offline()
    spec = model_store.resolve(None, model_store.default_cache_dir())
    engine = HFEngine(spec.path, probe("cpu"), slots=1)
    rows = []
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        for n in lengths:
            seq = p.SeqJob(f"h{n}", tuple(range(100, 100 + n)), p.SamplingParams(4, temperature=0.0), handoff="gpu")
            engine.add(seq)
            result = engine.step()
            (h,) = result.handoffs
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                blob = save(h.kv)
                client.set("bench:kv", blob)
                got = client.get("bench:kv")
                kv = load(got)
                times.append(time.perf_counter() - t0)
                assert set(kv) == set(h.kv)
            best = min(times)
            rows.append({"bench": "handoff", "prompt_tokens": n, "bytes": len(blob),
                         "bytes_per_token": len(blob) / n, "ms": best * 1e3,
                         "us_per_token": best / n * 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--lengths", default="64,256,1024")
    parser.add_argument("--only", choices=("scaling", "kill-9", "handoff"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    parts = {
        "scaling": lambda: scaling([int(x) for x in args.workers.split(",")], args.duration),
        "kill-9": lambda: kill9(args.kills),
        "handoff": lambda: handoff([int(x) for x in args.lengths.split(",")]),
    }
    results = {name: run() for name, run in parts.items() if args.only in (None, name)}
    if args.json:
        for rows in results.values():
            for r in rows:
                print(orjson.dumps(r).decode())
        return
    if "scaling" in results:
        table(f"echo workers sharing one pool ({CONCURRENCY} jobs outstanding, {os.cpu_count()} cores)",
              ["workers", "requests/s", "x one worker", "p50 ms", "p99 ms"],
              [[r["workers"], r["rps"], r["vs_one_worker"], r["p50_ms"], r["p99_ms"]] for r in results["scaling"]])
    if "kill-9" in results:
        table("kill -9 mid-request -> the request's result from a peer",
              ["kill", "claim idle s", "kill -> result s", "completion tokens", "results"],
              [[r["kill"], r["claim_idle_s"], r["kill_to_result_s"], r["completion_tokens"], r["results"]]
               for r in results["kill-9"]])
    if "handoff" in results:
        table("KV hand-off (SmolLM2-135M, fp32, safetensors through Redis)",
              ["prompt tokens", "bytes", "bytes/token", "ms (save+SET+GET+load)", "us/token"],
              [[r["prompt_tokens"], r["bytes"], r["bytes_per_token"], r["ms"], r["us_per_token"]]
               for r in results["handoff"]])


if __name__ == "__main__":
    main()
