"""Fault injection over real processes: overload, Redis stalls and restarts, kill -9, abusive
prompts, slow connections, and a long soak. Every scenario compares against the same stack
without the fault, in the same run, and prints what a client saw.

    python -m bench.chaos overload [--spike-s 20]
    python -m bench.chaos wait [--spike-s 20] [--step-ms 10 --slots 8]   # 4x the worker's capacity, no SLO
    python -m bench.chaos oversize [--duration 30]            # oversized requests: a mistake is free, a flood held
    python -m bench.chaos redis
    python -m bench.chaos kill [--duration 300]
    python -m bench.chaos prompts
    python -m bench.chaos slowloris [--connections 10000]
    python -m bench.chaos soak [--duration 3600 --rate 200]
    python -m bench.chaos all            # everything but soak

The stack: a persistent redis-server (append-only file, as ``tokengate serve`` runs it),
``--gateways`` gateway processes and ``--workers`` echo workers, each its own process;
gateways are pinned to core 0 and everything else to core 1 (``taskset``) where the machine
has two cores or more. A request's outcome is one of:

    ok         200 and exactly the echo text (no token repeated, none missing)
    refused    a 4xx/503 with an OpenAI error body (a clear, retryable answer)
    cut        the connection broke while its gateway was being killed (nothing can answer)
    FINDING    anything else: a 5xx other than 503, a reset from a live gateway, a request
               that outlived its deadline, wrong text, an error that is not OpenAI-shaped

The exit status is 1 when a scenario has findings or misses its target.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

import httpx
import orjson
import psutil

from bench.chaos_http import oversize, prompts, slowloris, wait_bound
from bench.chaos_stack import (
    ECHO_TOKENS,
    MODEL,
    REQUEST_TIMEOUT_S,
    TWO_CORES,
    Load,
    Stack,
    findings,
    measure_capacity,
    pinned,
    print_phases,
    recovery_s,
    status_counts,
    summary,
)
from bench.harness import OUT, console, table
from gateway.cli.embedded_redis import FSYNC_CHOICES
from gateway.http.protocol import raise_nofile_limit


async def _spike(stack: Stack, rate: float, seconds: float) -> dict[str, Any]:
    """``rate`` requests/s for ``seconds`` from h2load (C, so the load generator is not the
    bottleneck): ``clients`` connections, each sending at ``rate / clients`` per second."""
    if shutil.which("h2load") is None:
        raise RuntimeError("the overload spike needs h2load (Debian: apt install nghttp2-client)")
    clients = 8000  # HTTP/1.1 waits for each answer: clients enough to keep 4x capacity outstanding
    with tempfile.NamedTemporaryFile(suffix=".json") as body:
        body.write(orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}],
                                 "max_tokens": ECHO_TOKENS}))
        body.flush()
        cmd = ["h2load", "--h1", "-c", str(clients), "--rps", f"{rate / clients:.3f}", "-D", f"{seconds:g}",
               "-T", "30", "-N", "30", "-d", body.name, "-H", "content-type: application/json",
               "-H", f"authorization: Bearer {stack.key}", stack.bases[0] + "/v1/chat/completions"]
        proc = await asyncio.create_subprocess_exec(*pinned(cmd, 1), stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out = (await proc.communicate())[0].decode()
    (OUT / "chaos-h2load.log").write_text(out)
    figures: dict[str, Any] = {"clients": clients}
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("requests:"):
            for part in line.removeprefix("requests:").split(","):
                n, name = part.split()
                figures[name] = int(n)
        elif line.startswith("status codes:"):
            for part in line.removeprefix("status codes:").split(","):
                n, name = part.split()
                figures[name] = int(n)
    return figures


async def overload(args: argparse.Namespace) -> dict[str, Any]:
    """Target 2: 20 s at 4× capacity, then normal load: 0 × 500, 0 resets, full service in 5 s."""
    with Stack(gateways=1, workers=1) as stack:
        capacity = await measure_capacity(stack)
        normal = 0.3 * capacity
        load = Load(stack, normal, seed=2)
        t0 = time.monotonic()
        await load.run(8.0)
        base = summary(load.outcomes, t0, time.monotonic())
        before = status_counts(stack.bases[0])
        s0 = time.monotonic()
        spike = await _spike(stack, 4 * capacity, args.spike_s)
        s1 = time.monotonic()
        during = status_counts(stack.bases[0]) - before
        after = Load(stack, normal, seed=4)
        await after.run(15.0)
        rec = recovery_s(after.outcomes, s1, base["p50_ms"] / 1000, time.monotonic())
        for lg in (load, after):
            await lg.close()
        rows = {"baseline": base, "after": summary(after.outcomes, s1, time.monotonic())}
        print_phases("overload", rows)
        done = max(1, spike.get("done", 0))
        table("the spike (h2load)", ["offered/s", "sent", "answered", "2xx", "4xx", "5xx", "errored",
                                      "timeout", "gateway: 500s", "gateway: 503s", "took s"],
              [[4 * capacity, spike.get("started", 0), done, spike.get("2xx", 0), spike.get("4xx", 0),
                spike.get("5xx", 0), spike.get("errored", 0), spike.get("timeout", 0), during.get("500", 0),
                during.get("503", 0), s1 - s0]])
        result = {
            "capacity_rps": capacity, "offered_rps": 4 * capacity, "spike": spike, "gateway_statuses": dict(during),
            "phases": rows, "recovery_s": rec, "findings": dict(findings(load.outcomes + after.outcomes)),
            "exited": stack.exited(),
        }
        result["met"] = (not result["findings"] and not result["exited"] and rec <= 5.0
                         and not during.get("500") and not spike.get("errored") and not spike.get("timeout"))
        return result


async def redis_faults(args: argparse.Namespace) -> dict[str, Any]:
    """Target 3: Redis paused 10 s, then killed and restarted, under load."""
    with Stack(gateways=1, workers=1, step_ms=2.0) as stack:
        load = Load(stack, args.rate, seed=5)
        runner = asyncio.create_task(load.run())
        await asyncio.sleep(10)
        assert stack.redis.proc is not None
        p0 = time.monotonic()
        stack.redis.proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(10)
        stack.redis.proc.send_signal(signal.SIGCONT)
        p1 = time.monotonic()
        await asyncio.sleep(25)
        k0 = time.monotonic()
        stack.redis.proc.kill()
        stack.redis.proc.wait()
        await asyncio.sleep(1)
        await asyncio.to_thread(stack.redis.restart)
        k1 = time.monotonic()
        await asyncio.sleep(35)
        load.stop()
        await runner
        await load.close()
        end = time.monotonic()
        p50 = summary(load.outcomes, 0, p0)["p50_ms"] / 1000
        rows = {
            "before": summary(load.outcomes, 0, p0),
            "paused": summary(load.outcomes, p0, p1),
            "after pause": summary(load.outcomes, p1, k0),
            "killed": summary(load.outcomes, k0, k1),
            "after restart": summary(load.outcomes, k1, end),
        }
        print_phases("redis paused 10 s, then killed and restarted", rows)
        late = [o for o in load.outcomes if o.t1 - o.t0 > REQUEST_TIMEOUT_S + 1]
        key_ok = httpx.get(stack.bases[0] + "/v1/models", headers={"authorization": f"Bearer {stack.key}"}).status_code
        result = {
            "phases": rows,
            "recovery_after_pause_s": recovery_s(load.outcomes, p1, p50, k0),
            "recovery_after_restart_s": recovery_s(load.outcomes, k1, p50, end),
            "answers_after_deadline": len(late),
            "findings": dict(findings(load.outcomes)),
            "exited": stack.exited(),
            "key_after_restart": key_ok,
        }
        result["met"] = (not result["findings"] and not late and not result["exited"] and key_ok == 200
                         and result["recovery_after_pause_s"] <= 30 and result["recovery_after_restart_s"] <= 30)
        return result


async def kill(args: argparse.Namespace) -> dict[str, Any]:
    """Target 4: kill -9 of a worker, a gateway and Redis at random during a long load."""
    rng = random.Random(args.seed)
    with Stack(gateways=2, workers=2, step_ms=2.0, fsync=args.redis_fsync) as stack:
        load = Load(stack, args.rate, seed=args.seed)
        runner = asyncio.create_task(load.run())
        start = time.monotonic()
        kills: list[tuple[float, str]] = []
        victims = ["worker", "gateway", "redis"]
        while time.monotonic() - start < args.duration - 30:
            await asyncio.sleep(rng.uniform(15, 35))
            what = victims[len(kills) % 3] if len(kills) < 3 else rng.choice(victims)
            t = time.monotonic()
            if what == "redis":
                assert stack.redis.proc is not None
                stack.redis.proc.kill()
                stack.redis.proc.wait()
                await asyncio.sleep(rng.uniform(0.5, 2))
                await asyncio.to_thread(stack.redis.restart)
                name = "redis"
            else:
                proc = rng.choice(stack.workers if what == "worker" else stack.gateways)
                proc.killed_at.append((t, float("inf")))  # down until it answers again
                proc.kill9()
                await asyncio.sleep(rng.uniform(0.5, 2))
                proc.start()
                if what == "gateway":
                    await asyncio.to_thread(stack.wait_ready, stack.bases[stack.gateways.index(proc)])
                proc.killed_at[-1] = (t, time.monotonic())
                name = proc.name
            kills.append((t - start, name))
            console.print(f"[yellow]{t - start:6.1f} s: kill -9 {name}[/yellow]")
        load.stop()
        await runner
        await load.close()
        await asyncio.sleep(20)  # dead gateways are swept after 15 s; late reports arrive
        leaks = stack.leaks()
        consumed, charged = stack.budget_balance()
        rows = {"all": summary(load.outcomes, 0, time.monotonic())}
        print_phases(f"kill -9 during {args.duration:.0f} s of load", rows)
        result = {
            "kills": kills, "phases": rows, "findings": dict(findings(load.outcomes)), "leaks": leaks,
            "budget_consumed": consumed, "budget_charged": charged, "exited": stack.exited(),
        }
        result["met"] = (not result["findings"] and not any(leaks.values()) and abs(consumed - charged) <= 1)
        return result



async def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Target 7: an hour at 200 requests/s; Redis memory and gateway RSS flat after 5 minutes."""
    with Stack(gateways=1, workers=1) as stack:
        load = Load(stack, args.rate, seed=11)
        runner = asyncio.create_task(load.run(args.duration))
        client = stack.redis_client()
        assert stack.gateways[0].proc is not None
        gateway = psutil.Process(stack.gateways[0].proc.pid)
        samples: list[tuple[float, int, int]] = []
        start = time.monotonic()
        while not runner.done():
            used = int(client.info("memory")["used_memory"])
            rss = gateway.memory_info().rss
            samples.append((time.monotonic() - start, used, rss))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(runner), 60)
        await load.close()
        warm = [s for s in samples if s[0] >= 300] or samples
        growth_redis = max(s[1] for s in warm) / warm[0][1] - 1
        growth_rss = max(s[2] for s in warm) / warm[0][2] - 1
        rows = [(f"{t / 60:.0f} min", f"{used / 2**20:.1f} MiB", f"{rss / 2**20:.1f} MiB") for t, used, rss in samples]
        table("soak: memory", ["time", "redis used_memory", "gateway RSS"], rows)
        result = {"samples": samples, "redis_growth": growth_redis, "rss_growth": growth_rss,
                  "all": summary(load.outcomes, 0, time.monotonic()), "findings": dict(findings(load.outcomes))}
        result["met"] = growth_redis <= 0.10 and growth_rss <= 0.10 and not result["findings"]
        return result


SCENARIOS = {
    "overload": overload,
    "wait": wait_bound,
    "oversize": oversize,
    "redis": redis_faults,
    "kill": kill,
    "prompts": prompts,
    "slowloris": slowloris,
    "soak": soak,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=[*SCENARIOS, "all"])
    parser.add_argument("--rate", type=float, default=None, help="requests/s of the normal load")
    parser.add_argument("--duration", type=float, default=None, help="seconds (kill: 300, soak: 3600)")
    parser.add_argument("--spike-s", type=float, default=20.0)
    parser.add_argument("--step-ms", type=float, default=10.0, help="wait: the echo worker's step time")
    parser.add_argument("--slots", type=int, default=8, help="wait: the echo worker's slots")
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--redis-fsync", choices=FSYNC_CHOICES, default="always",
                        help="kill: the Redis append-only file's fsync (serve's --redis-fsync)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per scenario")
    args = parser.parse_args(argv)
    if TWO_CORES:  # the load generator beside Redis and the workers; the gateways get core 0
        os.sched_setaffinity(0, {1})
    raise_nofile_limit()
    names = [n for n in SCENARIOS if n != "soak"] if args.scenario == "all" else [args.scenario]
    failed = False
    for name in names:
        ns = argparse.Namespace(**vars(args))
        ns.rate = args.rate or (200.0 if name == "soak" else 50.0)
        ns.duration = args.duration or {"soak": 3600.0, "oversize": 30.0}.get(name, 300.0)
        result = asyncio.run(SCENARIOS[name](ns))
        verdict = "[green]met[/green]" if result["met"] else "[red]MISSED[/red]"
        shown = {k: v for k, v in result.items() if k not in ("phases", "samples")}
        console.print(f"{name}: {verdict} {json.dumps(shown, default=str)}")
        if args.json:
            print(json.dumps({"scenario": name, **result}, default=str))
        failed |= not result["met"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
