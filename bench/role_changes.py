"""The elected scheduler killed or paused under `tokengate serve --gateways 3` (issue 37).

    python -m bench.role_changes [--faults kill,stop3,stop8] [--clients 20] [--json]

For each fault, a fresh `tokengate serve --gateways 3` (echo engine, 16 tokens at 20 ms a
step, 4 slots: a queue builds) and ``--clients`` closed-loop streaming clients on its port.
Each client keeps its connection (as behind a load balancer): it stays with the gateway the
kernel gave it until that gateway dies (a new connection can land on a paused gateway and
wait with it). ``--warm`` seconds in, the gateway that holds the scheduling lease gets the fault:

- ``kill``: SIGKILL (`serve` starts it again; its own clients' streams break with it);
- ``stopN``: SIGSTOP, and SIGCONT N seconds later (its clients' streams wait; nothing
  they were promised may fail).

Every job sent to the workers is read off the jobs stream. Reported per fault:

- ``answered``: streams that ended with a finish reason and ``[DONE]``;
- ``cut``: streams broken with their gateway (kill only: nothing can answer those);
- ``failed``: everything else (an error status, an error inside the stream, a break with
  no kill), by what it said (0 is right);
- ``duplicated``: requests sent to the workers in more than one job (0 is right);
- ``moved_s``: fault to another gateway holding the lease; ``resume_s``: from then to the
  next job sent; ``stall_s``: the longest time without a job sent from the lease's move to
  the end of the load (the target is 2 s at most), ``stall_at_s`` when it began;
- ``schedulers``: the most gateways ``/admin/cluster`` listed as scheduler at once (1 is right);
- ``serve_alive``: `serve` itself still running after the fault.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from bench.harness import ADMIN_TOKEN, OUT, auth, bench_key, json_lines, table
from common import protocol as p
from common import wire
from gateway.cli.embedded_redis import free_port
from workers.model_store import DEFAULT_MODEL_NAME

JOBS = wire.jobs_stream(DEFAULT_MODEL_NAME, "cpu")  # the default model's, which echo workers stand in for
LEASE = wire.scheduler_lease(DEFAULT_MODEL_NAME)  # the scheduling lease of the model the gateways serve

STEP_MS, TOKENS, SLOTS = 20, 16, 4
BODY = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "count"}],
        "max_tokens": TOKENS, "stream": True}


@dataclass
class Tally:
    answered: int = 0
    cut: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    dispatched: Counter[str] = field(default_factory=Counter)  # request id -> jobs that carried it
    jobs: dict[str, list[str]] = field(default_factory=dict)  # request id -> the batch ids that carried it
    sent_at: list[float] = field(default_factory=list)  # when each job was read off the stream
    schedulers: int = 0
    moved_at: float | None = None
    fault_at: float = 0.0


class Served:
    """`tokengate serve --gateways 3` with the echo engine, in a directory of its own."""

    def __init__(self, gateways: int, tmp: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = OUT / f"role-changes-{self.port}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "gateway.cli", "--log-level", "INFO", "serve", "--engine", "echo",
               "--echo-tokens", str(TOKENS), "--echo-step-ms", str(STEP_MS), "--slots", str(SLOTS),
               "--gateways", str(gateways), "--admin-token", ADMIN_TOKEN, "--port", str(self.port),
               "--data-dir", str(tmp)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def ready(self, timeout_s: float = 120.0) -> str:
        """The private Redis's URL, once the banner is out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            found = re.search(r"; redis (redis://\S+)\)", self.log.read_text())
            if found:
                return found.group(1)
            time.sleep(0.2)
        raise RuntimeError(f"serve not ready in {timeout_s:g} s: {self.log}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def pid_of(gateway_id: str) -> int:
    return int(gateway_id.rsplit("-", 2)[1])  # a gateway's id is "<host>-<pid>-<random>"


async def watch(client: aioredis.Redis, http: httpx.AsyncClient, tally: Tally, done: asyncio.Event) -> None:
    """Jobs as they are sent, the lease's holder and the cluster view's schedulers."""
    last_id, holder = "$", await client.get(LEASE)
    next_view = 0.0
    while not done.is_set():
        try:
            reply = await client.xread({JOBS: last_id}, count=1000, block=20)
        except RedisError:  # `serve` went down with its Redis (before issue 37, killing the scheduler did that)
            await asyncio.sleep(0.1)
            continue
        now = time.monotonic()
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                last_id = entry_id
                tally.sent_at.append(now)
                job = p.decode_job(fields)
                for seq in job.seqs:
                    tally.dispatched[seq.rid] += 1
                    tally.jobs.setdefault(seq.rid, []).append(job.batch_id)
        if tally.fault_at and tally.moved_at is None:
            now_holder = await client.get(LEASE)  # (just answered the read above)
            if now_holder is not None and now_holder != holder:
                tally.moved_at = time.monotonic()
        if now >= next_view:
            next_view = now + 0.1
            try:
                view = (await http.get("/admin/cluster", headers=auth(ADMIN_TOKEN), timeout=1.0)).json()
                tally.schedulers = max(tally.schedulers,
                                       sum(1 for g in view["gateways"] if g["role"] == "scheduler"))
            except (httpx.HTTPError, KeyError, ValueError):
                pass


async def stream_once(http: httpx.AsyncClient, key: str, tally: Tally, kill: bool) -> None:
    finish = done = False
    try:
        async with http.stream("POST", "/v1/chat/completions", json=BODY, headers=auth(key)) as r:
            if r.status_code != 200:
                body = orjson.loads(await r.aread())
                tally.failed[f"{r.status_code} {body.get('error', {}).get('code')}"] += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":  # read on to the body's end: the connection is kept
                    done = True
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    tally.failed[f"in-stream {chunk['error'].get('code')}"] += 1
                    return
                finish = finish or any(c.get("finish_reason") for c in chunk.get("choices", []))
    except httpx.HTTPError as exc:
        if kill and tally.fault_at:  # its gateway may be the one killed
            tally.cut += 1
        else:
            tally.failed[f"broken {type(exc).__name__}"] += 1
        await asyncio.sleep(0.2)
        return
    if finish and done:
        tally.answered += 1
    else:
        tally.failed["no finish"] += 1


async def measure(served: Served, redis_url: str, key: str, fault: str, clients: int, warm_s: float,
                  after_s: float) -> Tally:
    tally, stop_load, stop_watch = Tally(), asyncio.Event(), asyncio.Event()
    client = aioredis.Redis.from_url(redis_url)
    http = httpx.AsyncClient(base_url=served.base, timeout=60)
    killed = fault == "kill"

    async def one_client() -> None:
        """One kept-alive connection, as behind a load balancer: it stays with the gateway the
        kernel gave it (SO_REUSEPORT) until that gateway is killed."""
        async with httpx.AsyncClient(base_url=served.base, timeout=60, limits=httpx.Limits(max_connections=1)) as own:
            while not stop_load.is_set():
                await stream_once(own, key, tally, killed)

    async def inject() -> None:
        await asyncio.sleep(warm_s)
        holder = wire.text(await client.get(LEASE) or b"")
        pid = pid_of(holder)
        tally.fault_at = time.monotonic()
        if killed:
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(float(fault.removeprefix("stop")))
            os.kill(pid, signal.SIGCONT)
        await asyncio.sleep(after_s)
        stop_load.set()

    watcher = asyncio.create_task(watch(client, http, tally, stop_watch))
    await asyncio.gather(inject(), *(one_client() for _ in range(clients)))
    stop_watch.set()
    await watcher
    await http.aclose()
    await client.aclose()
    return tally


def run_fault(fault: str, clients: int, warm_s: float, after_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tg-roles-") as tmp:
        served = Served(3, Path(tmp))
        try:
            redis_url = served.ready()
            key = bench_key(served.base)
            tally = asyncio.run(measure(served, redis_url, key, fault, clients, warm_s, after_s))
            alive = served.proc.poll() is None
        finally:
            served.close()
    moved = tally.moved_at
    after = [t for t in tally.sent_at if moved is not None and t >= moved]
    end = tally.sent_at[-1] if tally.sent_at else tally.fault_at
    gaps = [b - a for a, b in zip([moved, *after], [*after, end], strict=True)] if moved is not None else []
    return {
        "fault": fault, "answered": tally.answered, "cut": tally.cut, "failed": sum(tally.failed.values()),
        "failed_by": dict(tally.failed),
        "duplicated": sum(1 for n in tally.dispatched.values() if n > 1),
        "duplicates": {rid: tally.jobs[rid] for rid, n in tally.dispatched.items() if n > 1},
        "moved_s": None if moved is None else round(moved - tally.fault_at, 2),
        "resume_s": round(after[0] - moved, 2) if moved is not None and after else None,
        "stall_s": round(max(gaps), 2) if gaps else None,
        "stall_at_s": round([moved, *after][gaps.index(max(gaps))] - tally.fault_at, 2) if gaps else None,
        "schedulers": tally.schedulers, "serve_alive": alive,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default="kill,stop3,stop8")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--warm", type=float, default=5.0, help="seconds of load before the fault")
    parser.add_argument("--after", type=float, default=8.0, help="seconds of load after the fault (or the resume)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [run_fault(f, args.clients, args.warm, args.after) for f in args.faults.split(",")]
    if args.json:
        json_lines(rows)
        return
    table(f"the scheduler killed or paused under serve --gateways 3, {args.clients} streaming clients",
          ["fault", "answered", "cut with it", "failed", "duplicated", "lease moved (s)", "next job (s)",
           "longest stall (s)", "schedulers at once", "serve alive"],
          [[r["fault"], r["answered"], r["cut"], f"{r['failed']} {r['failed_by'] or ''}", r["duplicated"],
            r["moved_s"], r["resume_s"], r["stall_s"], r["schedulers"], r["serve_alive"]] for r in rows])


if __name__ == "__main__":
    main()
