"""The one scheduler killed under load (issue 26, target 3).

    python -m bench.failover [--duration 60] [--kill-every 10] [--gateways 3] [--json]

Redis, two echo workers (8 slots, 5 ms steps) and ``--gateways`` gateway processes, with
closed-loop clients spread evenly over them. Every ``--kill-every`` seconds the gateway that
holds the scheduling lease (``wire.scheduler_lease``) gets SIGKILL and is started again on
its port (it comes back as a follower). Every job sent to the workers is read off the jobs
stream as it arrives. Reported:

- ``answered``: requests answered 200;
- ``died``: requests whose own gateway was killed under them (the connection broke: nothing
  can answer those; a client retries them elsewhere);
- ``lost``: requests on a gateway that lived and did not end in 200, by status (0 is right);
  ``why_lost`` gives the first such error's message for each status;
- ``duplicated``: requests sent to the workers in more than one job (0 is right);
- ``gap_s``: the longest time without a job sent to the workers during the load (the
  target is 2 s at most);
- ``takeover_s``: per kill, the seconds until another gateway held the lease;
- ``stuck``: per kill that nobody took over from within ``TAKEOVER_GIVE_UP_S``, the end of
  each gateway's log (the run goes on: the killed gateway is started again).

With ``--json`` the last line is one object with those keys.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench.harness import ADMIN_TOKEN, OUT, auth, backend, json_lines, spawn, stop, table, wait_ready
from bench.replicas import BODY, TENANTS, tenant_keys
from common import protocol as p
from common import wire
from gateway.cli.embedded_redis import free_port
from workers.model_store import DEFAULT_MODEL_NAME

JOBS = wire.jobs_stream(DEFAULT_MODEL_NAME, "cpu")  # the default model's, which echo workers stand in for
LEASE = wire.scheduler_lease(DEFAULT_MODEL_NAME)  # the scheduling lease of the model the gateways serve

TAKEOVER_GIVE_UP_S = 30.0  # a kill nobody takes over from within this long is reported (with the logs)


@dataclass
class Tally:
    answered: int = 0
    died: int = 0
    lost: Counter[str] = field(default_factory=Counter)
    why_lost: dict[str, str] = field(default_factory=dict)  # status and code -> the first such refusal's message
    dispatched: Counter[str] = field(default_factory=Counter)  # request id -> jobs that carried it
    jobs: dict[str, list[str]] = field(default_factory=dict)  # request id -> the batch ids that carried it
    gap_s: float = 0.0
    takeover_s: list[float] = field(default_factory=list)
    stuck: list[dict[str, str]] = field(default_factory=list)  # per kill nobody took over after: the gateways' logs


class Fleet:
    """The gateway processes, each on its own port for the whole run."""

    def __init__(self, redis_url: str, n: int) -> None:
        self.redis_url = redis_url
        self.ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = [self._start(i) for i in range(n)]
        self.bases = [f"http://127.0.0.1:{port}" for port in self.ports]
        for base in self.bases:
            wait_ready(base, self.procs)

    def _start(self, i: int) -> subprocess.Popen[bytes]:
        return spawn(["-m", "gateway.cli", "--log-level", "WARNING", "gateway", "--redis-url", self.redis_url,
                      "--port", str(self.ports[i]), "--admin-token", ADMIN_TOKEN], OUT / f"failover-{i}.log")

    def index_of(self, gateway_id: str) -> int | None:
        pid = int(gateway_id.rsplit("-", 2)[1])  # a gateway's id is "<host>-<pid>-<random>"
        return next((i for i, proc in enumerate(self.procs) if proc.pid == pid), None)

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    async def restart(self, i: int) -> None:
        self.procs[i] = self._start(i)
        await asyncio.to_thread(wait_ready, self.bases[i], [self.procs[i]])

    def log_tails(self, chars: int = 2000) -> dict[str, str]:
        """The end of each gateway's log, by pid and whether it is still running."""
        return {f"{proc.pid} {'running' if proc.poll() is None else f'exited {proc.returncode}'}":
                (OUT / f"failover-{i}.log").read_text(errors="replace")[-chars:] for i, proc in enumerate(self.procs)}

    def close(self) -> None:
        stop(self.procs)


async def watch_jobs(client: aioredis.Redis, tally: Tally, done: asyncio.Event, until: float) -> None:
    """Every job XADDed to the cpu jobs stream, read as it arrives: which requests it carries,
    and the longest time between two (or from the last one to the end of the load)."""
    last_id, last_at = "$", time.monotonic()
    while not done.is_set():
        reply = await client.xread({JOBS: last_id}, count=1000, block=100)
        for _stream, entries in reply or []:
            now = time.monotonic()
            tally.gap_s = max(tally.gap_s, now - last_at)
            last_at = now
            for entry_id, fields in entries:
                last_id = entry_id
                job = p.decode_job(fields)
                for seq in job.seqs:
                    tally.dispatched[seq.rid] += 1
                    tally.jobs.setdefault(seq.rid, []).append(job.batch_id)
    tally.gap_s = max(tally.gap_s, min(time.monotonic(), until) - last_at)


async def kill_the_scheduler(fleet: Fleet, client: aioredis.Redis, tally: Tally, every_s: float,
                             until: float) -> None:
    at = time.monotonic() + every_s
    while at < until:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        if time.monotonic() >= until:  # (a restart took past the end)
            return
        at += every_s
        holder = await client.get(LEASE)
        i = fleet.index_of(wire.text(holder)) if holder else None
        if i is None:
            continue
        fleet.kill(i)
        killed = time.monotonic()
        while (now := await client.get(LEASE)) is None or now == holder:
            if time.monotonic() - killed > TAKEOVER_GIVE_UP_S:  # reported, not waited for forever
                tally.stuck.append(fleet.log_tails())
                break
            await asyncio.sleep(0.01)
        tally.takeover_s.append(time.monotonic() - killed)
        await fleet.restart(i)  # always: the next kill must leave a gateway to take over


async def measure(fleet: Fleet, keys: dict[str, str], clients: int, duration: float, every_s: float) -> Tally:
    tally, done = Tally(), asyncio.Event()
    client = aioredis.Redis.from_url(fleet.redis_url)
    http = [httpx.AsyncClient(base_url=b, timeout=60, limits=httpx.Limits(max_connections=clients))
            for b in fleet.bases]

    async def one_client(n: int, until: float) -> None:
        gateway, key = n % len(http), keys[TENANTS[n % len(TENANTS)]]
        while time.monotonic() < until:
            try:
                r = await http[gateway].post("/v1/chat/completions", json=BODY, headers=auth(key))
            except httpx.HTTPError:  # its gateway was killed under it (or is starting again)
                tally.died += 1
                await asyncio.sleep(0.2)
                continue
            if r.status_code == 200:
                tally.answered += 1
            else:
                error = r.json().get("error", {})
                kind = f"{r.status_code} {error.get('code')}"
                tally.lost[kind] += 1
                tally.why_lost.setdefault(kind, error.get("message", ""))

    until = time.monotonic() + duration
    watcher = asyncio.create_task(watch_jobs(client, tally, done, until))
    await asyncio.gather(kill_the_scheduler(fleet, client, tally, every_s, until),
                         *(one_client(n, until) for n in range(clients)))
    done.set()
    await watcher
    for h in http:
        await h.aclose()
    await client.aclose()
    return tally


def run(duration: float, every_s: float, gateways: int = 3, clients: int = 30) -> dict[str, Any]:
    with backend("echo", workers=2, echo_tokens=16, slots=8, extra_worker=["--echo-step-ms", "5"]) as (url, _):
        fleet = Fleet(url, gateways)
        try:
            keys = tenant_keys(fleet.bases[0])
            tally = asyncio.run(measure(fleet, keys, clients, duration, every_s))
        finally:
            fleet.close()
    return {
        "gateways": gateways, "duration_s": duration, "kills": len(tally.takeover_s),
        "answered": tally.answered, "died": tally.died, "lost": sum(tally.lost.values()),
        "lost_by_status": dict(tally.lost), "why_lost": tally.why_lost,
        "duplicated": sum(1 for n in tally.dispatched.values() if n > 1),
        "duplicates": {rid: tally.jobs[rid] for rid, n in tally.dispatched.items() if n > 1},
        "gap_s": round(tally.gap_s, 3), "takeover_s": [round(t, 3) for t in tally.takeover_s],
        "stuck": tally.stuck,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--kill-every", type=float, default=10.0, help="seconds between kills of the scheduler")
    parser.add_argument("--gateways", type=int, default=3)
    parser.add_argument("--clients", type=int, default=30, help="closed-loop clients, spread over the gateways")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.duration, args.kill_every, args.gateways, args.clients)
    if args.json:
        json_lines([result])
        return
    table(f"kill -9 of the scheduling gateway every {args.kill_every:g} s, {args.duration:g} s of load, "
          f"{args.gateways} gateways (pid {os.getpid()})",
          ["kills", "answered", "died with their gateway", "lost", "duplicated", "longest gap (s)",
           "takeover (s)"],
          [[result["kills"], result["answered"], result["died"],
            f"{result['lost']} {result['lost_by_status'] or ''}", result["duplicated"], result["gap_s"],
            " ".join(f"{t:.2f}" for t in result["takeover_s"])]])


if __name__ == "__main__":
    main()
