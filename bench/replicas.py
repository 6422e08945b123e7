"""Several gateway processes in front of the same workers (issue 26, target 1).

    python -m bench.replicas [--duration 10] [--clients 40] [--json]

Redis and two echo workers (8 slots each, 16 tokens a request, 5 ms steps: about 200
requests/s together) serve first one gateway process, then three, with the same workers, in
the same run. Four tenants of equal weight send from closed-loop clients, spread unevenly
over the gateways: with three, 90 % of the clients talk to the first gateway (tenants A and B
only there, C also on the second, D also on the third). Reported per configuration:

- throughput, and ``throughput_ratio``: three gateways' over one gateway's;
- ``jain``: Jain's fairness index over the tenants' requests/s (1 = equal shares);
- ``overcommit``: the most sequences any worker held beyond its slots, from the heartbeats
  read every 0.2 s (0 is right);
- ``contracts_inside``: the share of answered requests that finished inside the p99 bound
  their contract promised (``x-tokengate-p99-ms``).

With ``--json`` the last line is one object for the three-gateway run with those keys.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench.harness import ADMIN_TOKEN, OUT, auth, backend, json_lines, spawn, stop, table, wait_ready
from common import protocol as p
from common import wire
from gateway.cli.embedded_redis import free_port

TENANTS = ("A", "B", "C", "D")
BODY = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}


@dataclass
class Tally:
    ok: Counter[str] = field(default_factory=Counter)  # tenant -> answered 200
    errors: Counter[str] = field(default_factory=Counter)  # status or exception -> count
    inside: int = 0  # answered within their contract's p99 bound
    promised: int = 0  # answered with a contract
    overcommit: int = 0


def placement(clients: int, gateways: int) -> list[tuple[str, int]]:
    """(tenant, gateway index) per client: a quarter of the clients per tenant; with several
    gateways, A and B only on the first, C's last fifth on the second, D's on the third."""
    per = clients // len(TENANTS)
    out: list[tuple[str, int]] = []
    for tenant in TENANTS:
        for i in range(per):
            other = {"C": 1, "D": 2}.get(tenant, 0) if gateways > 1 and i >= per - per // 5 else 0
            out.append((tenant, min(other, gateways - 1)))
    return out


@contextmanager
def gateways(redis_url: str, n: int) -> Iterator[list[str]]:
    procs, bases = [], []
    try:
        for i in range(n):
            port = free_port()
            procs.append(spawn(["-m", "gateway.cli", "--log-level", "WARNING", "gateway", "--redis-url", redis_url,
                                "--port", str(port), "--admin-token", ADMIN_TOKEN], OUT / f"replica-{i}.log"))
            bases.append(f"http://127.0.0.1:{port}")
        for base in bases:
            wait_ready(base, procs)
        yield bases
    finally:
        stop(procs)


def tenant_keys(base: str) -> dict[str, str]:
    keys = {}
    with httpx.Client(base_url=base, headers=auth(ADMIN_TOKEN)) as admin:
        for name in TENANTS:
            if admin.get(f"/admin/tenants/{name}").status_code == 404:
                admin.post("/admin/tenants", json={"name": name, "rate": 1e7, "burst": 10**9}).raise_for_status()
            keys[name] = admin.post(f"/admin/tenants/{name}/keys").raise_for_status().json()["key"]
    return keys


async def watch_workers(redis_url: str, tally: Tally, done: asyncio.Event) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        while not done.is_set():
            members: list[bytes] = await client.zrange(wire.WORKERS_ZSET, 0, -1)  # type: ignore[assignment]
            for wid in members:
                raw = await client.get(wire.worker_key(wire.text(wid)))
                if isinstance(raw, bytes):
                    hb = p.decode_heartbeat(raw)
                    tally.overcommit = max(tally.overcommit, hb.running - hb.slots)
            await asyncio.sleep(0.2)
    finally:
        await client.aclose()


async def measure(bases: list[str], keys: dict[str, str], redis_url: str, clients: int,
                  duration: float) -> tuple[Tally, float]:
    tally, done = Tally(), asyncio.Event()
    http = [httpx.AsyncClient(base_url=b, timeout=60, limits=httpx.Limits(max_connections=clients)) for b in bases]

    async def client(tenant: str, gateway: int, until: float) -> None:
        while time.monotonic() < until:
            started = time.monotonic()
            try:
                r = await http[gateway].post("/v1/chat/completions", json=BODY, headers=auth(keys[tenant]))
            except httpx.HTTPError as exc:
                tally.errors[type(exc).__name__] += 1
                continue
            if r.status_code != 200:
                tally.errors[str(r.status_code)] += 1
                await asyncio.sleep(0.05)
                continue
            tally.ok[tenant] += 1
            bound = r.headers.get("x-tokengate-p99-ms")
            if bound is not None:
                tally.promised += 1
                tally.inside += (time.monotonic() - started) * 1000 <= float(bound)

    watcher = asyncio.create_task(watch_workers(redis_url, tally, done))
    warm = time.monotonic() + 2.0  # the gateways' models learn the workers first
    await asyncio.gather(*(client(t, g, warm) for t, g in placement(clients, len(bases))))
    tally.ok.clear()
    tally.errors.clear()
    tally.inside = tally.promised = 0
    started = time.monotonic()
    await asyncio.gather(*(client(t, g, started + duration) for t, g in placement(clients, len(bases))))
    elapsed = time.monotonic() - started
    done.set()
    await watcher
    for h in http:
        await h.aclose()
    return tally, elapsed


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured per configuration")
    parser.add_argument("--clients", type=int, default=40, help="closed-loop clients, a quarter per tenant")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict[int, dict[str, Any]] = {}
    with backend("echo", workers=2, echo_tokens=16, slots=8, extra_worker=["--echo-step-ms", "5"]) as (url, _procs):
        for n in (1, 3):
            with gateways(url, n) as bases:
                keys = tenant_keys(bases[0])
                tally, elapsed = asyncio.run(measure(bases, keys, url, args.clients, args.duration))
            per_tenant = [tally.ok[t] / elapsed for t in TENANTS]
            results[n] = {
                "gateways": n, "requests_per_s": sum(per_tenant),
                "per_tenant": dict(zip(TENANTS, per_tenant, strict=True)),
                "jain": jain(per_tenant), "overcommit": max(0, tally.overcommit),
                "contracts_inside": tally.inside / tally.promised if tally.promised else None,
                "errors": dict(tally.errors),
            }
    results[3]["throughput_ratio"] = results[3]["requests_per_s"] / results[1]["requests_per_s"]
    if args.json:
        json_lines([results[1], results[3]])
        return
    table(f"{args.clients} closed-loop clients, 2 echo workers (8 slots, 5 ms steps), same run",
          ["gateways", "req/s", "A / B / C / D req/s", "Jain", "overcommit", "inside p99 bound", "errors"],
          [[r["gateways"], r["requests_per_s"], " / ".join(f"{v:.0f}" for v in r["per_tenant"].values()),
            r["jain"], r["overcommit"], r["contracts_inside"], r["errors"] or "none"] for r in results.values()])
    print(f"throughput, 3 gateways / 1: {results[3]['throughput_ratio']:.2f}; "
          f"median tenant {statistics.median(results[3]['per_tenant'].values()):.0f} req/s")


if __name__ == "__main__":
    main()
