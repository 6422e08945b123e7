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
import errno
import json
import os
import random
import shutil
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
import numpy as np
import orjson
import psutil
import redis

from bench.common import ADMIN_TOKEN, OUT, RawClient, console, pct, table
from bench.fuzz import is_openai_error
from gateway.cli.embedded_redis import FSYNC_CHOICES, EmbeddedRedis, free_port
from gateway.http.protocol import raise_nofile_limit
from gateway.tenancy.limits import REFUSAL_BURST_BYTES, REFUSAL_BYTES_PER_S, REFUSAL_OVERHEAD_BYTES

MODEL = "SmolLM2-135M-Instruct"
ECHO_TOKENS = 8
ECHO_TEXT = " echo" * ECHO_TOKENS
REQUEST_TIMEOUT_S = 30.0  # the gateways' --request-timeout; a client waits this plus slack
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
TWO_CORES = (os.cpu_count() or 1) >= 2


def _pinned(cmd: list[str], core: int) -> list[str]:
    return ["taskset", "-c", str(core), *cmd] if TWO_CORES else cmd


# -- the stack ------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    cmd: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    killed_at: list[tuple[float, float]] = field(default_factory=list)  # (kill, back) monotonic

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Stack:
    """Redis (persistent) + gateways + echo workers as processes, each restartable."""

    def __init__(self, gateways: int = 1, workers: int = 1, step_ms: float = 0.0, slots: int = 64,
                 gateway_args: tuple[str, ...] = (), fsync: str = "everysec") -> None:
        OUT.mkdir(parents=True, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(prefix="tokengate-chaos-")
        self.redis = EmbeddedRedis(data_dir=Path(self._tmp.name), fsync=fsync)
        self.ports = [free_port() for _ in range(gateways)]
        url = self.redis.url
        py = sys.executable
        self.workers = [
            Proc(f"worker-{i}", _pinned([py, "-m", "workers", "--redis-url", url, "--engine", "echo",
                                         "--echo-tokens", str(ECHO_TOKENS), "--echo-step-ms", str(step_ms),
                                         "--slots", str(slots), "--claim-idle", "5", "--heartbeat", "1",
                                         "--worker-id", f"chaos-{i}", "--max-deliveries", "50"], 1),
                 OUT / f"chaos-worker-{i}.log")
            for i in range(workers)
        ]
        self.gateways = [
            Proc(f"gateway-{i}", _pinned([py, "-m", "gateway.cli", "--log-level", "WARNING", "gateway",
                                          "--redis-url", url, "--port", str(port), "--admin-token", ADMIN_TOKEN,
                                          "--request-timeout", str(REQUEST_TIMEOUT_S), *gateway_args], 0),
                 OUT / f"chaos-gateway-{i}.log")
            for i, port in enumerate(self.ports)
        ]
        self.key = ""
        self.tenant = ""

    @property
    def bases(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def __enter__(self) -> Stack:
        self.redis.start()
        with contextlib.suppress(OSError):
            if TWO_CORES and self.redis.proc is not None:
                os.sched_setaffinity(self.redis.proc.pid, {1})
        for p in [*self.workers, *self.gateways]:
            p.start()
        for base in self.bases:
            self.wait_ready(base)
        # a tenant whose budget drains at 0.001 tokens/s: what it was charged stays visible
        # as the budget's consumption, so refunds can be checked to the token
        self.tenant, self.key = self.new_tenant("chaos", rate=0.001)
        return self

    def new_tenant(self, name: str, rate: float = 1e6) -> tuple[str, str]:
        """A new tenant (its budget never binds at the default rate): (its id, a key for it)."""
        body = {"name": name, "rate": rate, "burst": 10**9, "max_queue_delay_s": 0, "weight": 1000.0}
        r = httpx.post(self.bases[0] + "/admin/tenants", json=body, headers=ADMIN)
        r.raise_for_status()
        tenant = str(r.json()["id"])
        r = httpx.post(self.bases[0] + f"/admin/tenants/{tenant}/keys", headers=ADMIN)
        r.raise_for_status()
        return tenant, str(r.json()["key"])

    def __exit__(self, *exc: object) -> None:
        for p in [*self.gateways, *self.workers]:
            p.stop()
        self.redis.stop()
        self._tmp.cleanup()

    def wait_ready(self, base: str, timeout_s: float = 120) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    return time.monotonic() - started
            time.sleep(0.1)
        raise RuntimeError(f"{base} not ready in {timeout_s} s; see {OUT}/chaos-*.log")

    def exited(self) -> list[str]:
        """Processes that died without being killed by the scenario."""
        return [p.name for p in [*self.gateways, *self.workers] if not p.alive()]

    def leaks(self) -> dict[str, Any]:
        """What is still held once all traffic ended: slots, batch leases, budget leases."""
        held: dict[str, Any] = {}
        for p, base in zip(self.gateways, self.bases, strict=True):
            snap = httpx.get(base + "/admin/scheduler", headers=ADMIN, timeout=5).json()
            held[f"{p.name} slots"] = sum(int(x["in_flight"]) for x in snap["paths"].values())
            held[f"{p.name} batches"] = int(snap["batches_in_flight"])
        tenant = httpx.get(self.bases[0] + f"/admin/tenants/{self.tenant}", headers=ADMIN, timeout=5).json()
        held["budget leases"] = int(tenant["state"]["in_flight"])
        return held

    def budget_balance(self) -> tuple[int, int]:
        """(tokens the budget holds as consumed, tokens the usage counters say were charged)."""
        base = self.bases[0]
        tenant = httpx.get(base + f"/admin/tenants/{self.tenant}", headers=ADMIN, timeout=5).json()
        consumed = 10**9 - int(tenant["state"]["remaining_tokens"])
        since = int(time.time()) - 7200
        usage = httpx.get(base + f"/admin/tenants/{self.tenant}/usage?since={since}", headers=ADMIN, timeout=5)
        totals = usage.json()["totals"]
        return consumed, int(totals["prompt_tokens"]) + int(totals["completion_tokens"])

    def redis_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url, socket_timeout=5)


# -- load -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    t0: float
    t1: float
    gateway: int
    kind: str  # ok | refused | cut | finding
    detail: str


def _openai_error(body: bytes) -> bool:
    with contextlib.suppress(orjson.JSONDecodeError):
        return is_openai_error(orjson.loads(body))
    return False


class Load:
    """Open-loop Poisson requests at ``rate``/s over the stack's gateways, half of them
    streaming; ``run`` until ``stop``. Outcomes are classified as the module says."""

    def __init__(self, stack: Stack, rate: float, seed: int = 1, prompt: str = "Say hello.",
                 max_outstanding: int = 3000) -> None:
        self.stack = stack
        self.rate = rate
        self.max_outstanding = max_outstanding  # arrivals beyond it are not sent ("unsent"): a client fleet's own limit
        self.rng = random.Random(seed)
        self.outcomes: list[Outcome] = []
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": ECHO_TOKENS}
        self.bodies = {False: orjson.dumps(body), True: orjson.dumps({**body, "stream": True})}
        self._stop = asyncio.Event()
        auth = {"authorization": f"Bearer {stack.key}"}
        # a lean raw HTTP/1.1 client: httpx costs ~1 ms of CPU per request, more than the gateway
        self.clients = [RawClient("127.0.0.1", port, auth) for port in stack.ports]

    def stop(self) -> None:
        self._stop.set()

    async def run(self, duration_s: float | None = None) -> None:
        tasks: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        due = start
        n = 0
        while not self._stop.is_set() and (duration_s is None or time.monotonic() - start < duration_s):
            due += self.rng.expovariate(self.rate)
            delay = due - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                    break
            if len(tasks) >= self.max_outstanding:
                now = time.monotonic()
                self.outcomes.append(Outcome(now, now, n % len(self.stack.bases), "unsent", ""))
                n += 1
                continue
            task = asyncio.create_task(self.one(n % len(self.stack.bases), self.rng.random() < 0.5))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
        if tasks:
            await asyncio.wait(tasks)

    def _was_killed(self, gateway: int, t0: float, t1: float) -> bool:
        proc = self.stack.gateways[gateway]
        return any(k <= t1 + 0.5 and back >= t0 for k, back in proc.killed_at) or not proc.alive()

    async def one(self, gateway: int, stream: bool) -> None:
        t0 = time.monotonic()
        try:
            status, payload = await asyncio.wait_for(
                self.clients[gateway].post("/v1/chat/completions", self.bodies[stream]), REQUEST_TIMEOUT_S + 10
            )
            kind, detail = self._judge(status, payload, stream)
        except TimeoutError:
            kind, detail = "finding", "no answer within the deadline"
        except OSError as exc:
            if exc.errno == errno.EMFILE:  # this load generator ran out of descriptors: not the server's doing
                kind, detail = "client_limit", "EMFILE"
            else:
                killed = self._was_killed(gateway, t0, time.monotonic())
                kind, detail = ("cut", str(exc)) if killed else ("finding", f"reset: {exc}")
        except (asyncio.IncompleteReadError, ValueError) as exc:
            killed = self._was_killed(gateway, t0, time.monotonic())
            kind, detail = ("cut", type(exc).__name__) if killed else ("finding", f"reset: {type(exc).__name__}")
        self.outcomes.append(Outcome(t0, time.monotonic(), gateway, kind, detail))

    def _judge(self, status: int, body: bytes, stream: bool) -> tuple[str, str]:
        if status == 200 and stream:
            return self._stream(body)
        if status == 200:
            text = orjson.loads(body)["choices"][0]["message"]["content"]
            return ("ok", "") if text == ECHO_TEXT else ("finding", "wrong text")
        if status >= 500 and status != 503:
            return "finding", f"HTTP {status}"
        if not _openai_error(body):
            return "finding", f"HTTP {status} without an OpenAI error body"
        return "refused", f"HTTP {status} {orjson.loads(body)['error'].get('code')}"

    @staticmethod
    def _stream(raw: bytes) -> tuple[str, str]:
        text, done, error = "", False, None
        for line in raw.split(b"\n"):
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                continue
            doc = orjson.loads(data)
            if "error" in doc:
                error = doc
                continue
            for choice in doc.get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
        if error is not None:
            ok = _openai_error(orjson.dumps(error))
            return ("refused", f"stream error {error['error'].get('code')}") if ok else ("finding", "bad error event")
        if not done:
            return "finding", "stream ended without [DONE] or an error"
        return ("ok", "") if text == ECHO_TEXT else ("finding", f"wrong text ({len(text)} characters)")

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


def summary(outcomes: list[Outcome], since: float, until: float) -> dict[str, Any]:
    window = [o for o in outcomes if since <= o.t0 < until and o.kind != "unsent"]
    ok = [o.t1 - o.t0 for o in window if o.kind == "ok"]
    kinds = Counter(o.kind for o in window)
    return {
        "requests": len(window),
        "ok": kinds["ok"],
        "refused": kinds["refused"],
        "cut": kinds["cut"],
        "findings": kinds["finding"],
        "client_limit": kinds["client_limit"],
        "unsent": kinds["unsent"],
        "refusals": dict(Counter(o.detail for o in window if o.kind == "refused")),
        "p50_ms": pct(ok, 50) * 1000,
        "p99_ms": pct(ok, 99) * 1000,
    }


def recovery_s(outcomes: list[Outcome], fault_end: float, p50_ok_s: float, until: float) -> float:
    """Seconds after ``fault_end`` from which every 1-second window of requests is all ok
    with a median within 2× the baseline's: full service."""
    t = fault_end
    last_bad = fault_end
    while t + 1.0 <= until:  # whole windows only; one without requests (load stopped) tells nothing
        window = [o for o in outcomes if t <= o.t0 < t + 1.0 and o.kind != "unsent"]
        lat = [o.t1 - o.t0 for o in window if o.kind == "ok"]
        if any(o.kind != "ok" for o in window) or (lat and float(np.median(lat)) > 2 * p50_ok_s):
            last_bad = t + 1.0
        t += 1.0
    return last_bad - fault_end


def findings(outcomes: list[Outcome]) -> Counter[str]:
    return Counter(o.detail for o in outcomes if o.kind == "finding")


# -- scenarios ------------------------------------------------------------------------------


async def _capacity(stack: Stack, seconds: float = 5.0, clients: int = 64) -> float:
    """Closed loop, ``clients`` at a time: requests/s the stack answers."""
    load = Load(stack, 1.0)
    done = 0
    end = time.monotonic() + seconds

    async def client(i: int) -> None:
        nonlocal done
        while time.monotonic() < end:
            status, _ = await load.clients[i % len(load.clients)].post("/v1/chat/completions", load.bodies[False])
            done += status == 200

    await asyncio.gather(*(client(i) for i in range(clients)))
    await load.close()
    return done / seconds


def _status_counts(base: str) -> Counter[str]:
    """Requests the gateway answered, by status code, from its own /metrics."""
    counts: Counter[str] = Counter()
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tokengate_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels.split('status="')[1].split('"')[0]] += int(float(value))
    return counts


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
        proc = await asyncio.create_subprocess_exec(*_pinned(cmd, 1), stdout=asyncio.subprocess.PIPE,
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
        capacity = await _capacity(stack)
        normal = 0.3 * capacity
        load = Load(stack, normal, seed=2)
        t0 = time.monotonic()
        await load.run(8.0)
        base = summary(load.outcomes, t0, time.monotonic())
        before = _status_counts(stack.bases[0])
        s0 = time.monotonic()
        spike = await _spike(stack, 4 * capacity, args.spike_s)
        s1 = time.monotonic()
        during = _status_counts(stack.bases[0]) - before
        after = Load(stack, normal, seed=4)
        await after.run(15.0)
        rec = recovery_s(after.outcomes, s1, base["p50_ms"] / 1000, time.monotonic())
        for lg in (load, after):
            await lg.close()
        rows = {"baseline": base, "after": summary(after.outcomes, s1, time.monotonic())}
        _print("overload", rows)
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
        _print("redis paused 10 s, then killed and restarted", rows)
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
        _print(f"kill -9 during {args.duration:.0f} s of load", rows)
        result = {
            "kills": kills, "phases": rows, "findings": dict(findings(load.outcomes)), "leaks": leaks,
            "budget_consumed": consumed, "budget_charged": charged, "exited": stack.exited(),
        }
        result["met"] = (not result["findings"] and not any(leaks.values()) and abs(consumed - charged) <= 1)
        return result


async def prompts(args: argparse.Namespace) -> dict[str, Any]:
    """Target 6a: two clients (tenants of their own) sending 1 MB prompts; a third's p99
    within 2× its own baseline. Twice: abusers that hammer on through their 429s, and
    abusers that wait the ``Retry-After`` they are told (as the openai client does)."""
    with Stack(gateways=1, workers=1) as stack:
        load = Load(stack, args.rate, seed=7)
        t0 = time.monotonic()
        await load.run(15.0)
        base = summary(load.outcomes, t0, time.monotonic())
        huge = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 200_000}], "max_tokens": 4}
        payload = orjson.dumps(huge)  # encoded once: the load generator's own cost stays out of the figures
        keys = [stack.new_tenant(f"abuser-{i}")[1] for i in range(2)]
        variants: dict[str, Any] = {}
        for name, honor in (("hammering", False), ("honoring Retry-After", True)):
            statuses: Counter[int | str] = Counter()
            stop = asyncio.Event()

            async def abuser(key: str, honor: bool = honor, statuses: Counter[int | str] = statuses,
                             stop: asyncio.Event = stop) -> None:
                client = RawClient("127.0.0.1", stack.ports[0], {"authorization": f"Bearer {key}"})
                while not stop.is_set():  # closed loop: the next one as soon as the last is answered
                    try:
                        status, _ = await client.post("/v1/chat/completions", payload)
                        statuses[status] += 1
                        if honor and status == 429:
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(stop.wait(), 1.0)
                    except (OSError, asyncio.IncompleteReadError):
                        statuses["reset"] += 1
                await client.close()

            abusers = [asyncio.create_task(abuser(key)) for key in keys]
            third = Load(stack, args.rate, seed=8)
            t1 = time.monotonic()
            await third.run(15.0)
            stop.set()
            await asyncio.gather(*abusers)
            under = summary(third.outcomes, t1, time.monotonic())
            await third.close()
            variants[name] = {**under, "p99_ratio": under["p99_ms"] / base["p99_ms"], "abusers": dict(statuses),
                              "findings": dict(findings(third.outcomes))}
            await asyncio.sleep(2)  # the holds run out
        await load.close()
        _print("1 MB prompts from two clients", {"alone": base, **variants})
        result = {"alone": base, "variants": variants, "findings": dict(findings(load.outcomes))}
        result["met"] = all(v["p99_ratio"] <= 2.0 and not v["findings"] for v in variants.values())
        return result


def _trickle(port: int, connections: int, seconds: float, report: Any) -> None:
    """In a process of its own (so its work does not delay the measured client): hold
    ``connections`` that send a header line every 2 s and never finish their request."""

    async def main() -> None:
        stop = asyncio.Event()
        opened, refused, closed_by_server = 0, 0, 0

        async def one() -> None:
            nonlocal opened, refused, closed_by_server
            try:
                _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                refused += 1
                return
            opened += 1
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
            try:
                await asyncio.sleep(random.uniform(0, 2.0))  # attackers are not in step with each other
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 2.0)
                    writer.write(b"x-a: b\r\n")
                    await writer.drain()
            except OSError:
                closed_by_server += 1
            writer.close()

        tasks = [asyncio.create_task(one()) for _ in range(connections)]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        report.put({"opened": opened, "refused": refused, "closed_by_server": closed_by_server})

    raise_nofile_limit()
    asyncio.run(main())


async def wait_bound(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 23: 4× the worker's capacity (an echo worker of ``--slots`` slots and ``--step-ms``
    steps: the queue forms in the scheduler, where the gateway can see it) from clients without
    an SLO (half streaming), after a calm warm-up
    that calibrates the first-token predictions: every request answered within the default
    wait bound (``--max-queue-wait-ms``, 5 s) plus 1 s, or refused within 50 ms; none left for
    its client's time-out."""
    bound_s = 5.0
    with Stack(gateways=1, workers=1, step_ms=args.step_ms, slots=args.slots) as stack:
        capacity = await _capacity(stack)
        calm = Load(stack, 0.3 * capacity, seed=11)
        await calm.run(8.0)
        base = summary(calm.outcomes, 0, time.monotonic())
        spike = Load(stack, 4 * capacity, seed=12, max_outstanding=4000)
        t0 = time.monotonic()
        await spike.run(args.spike_s)
        took = time.monotonic() - t0
        answered = [o for o in spike.outcomes if o.kind != "unsent"]
        ok = [o.t1 - o.t0 for o in answered if o.kind == "ok"]
        refused = [o.t1 - o.t0 for o in answered if o.kind == "refused"]
        late = sum(1 for x in ok if x > bound_s + 1.0)
        slow = sum(1 for x in refused if x > 0.05)
        for lg in (calm, spike):
            await lg.close()
        _print("4× capacity without an SLO", {"calm": base, "spike": summary(spike.outcomes, 0, time.monotonic())})
        table("the spike, per request", ["offered/s", "sent", "ok", "ok p50 ms", "ok p99 ms", "ok max ms",
                                         f"ok > {bound_s + 1:g} s", "refused", "refused p50 ms", "refused p99 ms",
                                         "refused max ms", "refused > 50 ms", "findings", "unsent"],
              [[4 * capacity, len(answered), len(ok), pct(ok, 50) * 1e3, pct(ok, 99) * 1e3,
                max(ok, default=0) * 1e3, late, len(refused), pct(refused, 50) * 1e3, pct(refused, 99) * 1e3,
                max(refused, default=0) * 1e3, slow, sum(1 for o in answered if o.kind == "finding"),
                sum(1 for o in spike.outcomes if o.kind == "unsent")]])
        result: dict[str, Any] = {
            "capacity_rps": capacity, "offered_rps": 4 * capacity, "spike_s": took, "sent": len(answered),
            "ok": len(ok), "ok_late": late, "refused": len(refused), "refused_slow": slow,
            "refusals": dict(Counter(o.detail for o in answered if o.kind == "refused")),
            "ok_p99_ms": pct(ok, 99) * 1e3, "refused_p99_ms": pct(refused, 99) * 1e3,
            "findings": dict(findings(spike.outcomes)), "exited": stack.exited(),
        }
        result["met"] = not late and not slow and not result["findings"] and not result["exited"]
        return result


async def _oversized(port: int, key: str, size: int, declared: int | None = None) -> int | str:
    """One request of ``size`` body bytes (declaring ``declared``, by default its size) on a
    connection of its own, sent the way a careful client does: the body stops once an answer
    has arrived. Its status, or what broke."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {declared or size}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        answer = asyncio.ensure_future(reader.readline())
        chunk, sent = b" " * 65536, 0
        with contextlib.suppress(OSError):
            while sent < size and not answer.done():
                writer.write(chunk[: size - sent])
                sent += min(len(chunk), size - sent)
                await writer.drain()
        line = await asyncio.wait_for(answer, 10)
        return int(line.split()[1]) if line else "closed"
    except (OSError, TimeoutError, IndexError, ValueError) as exc:
        return type(exc).__name__
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def oversize(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 23: one header-only request declaring 10^12 bytes, one 20 MB request and ten in a
    row cost the tenant nothing more (its next small request is a 200); a tenant sending 20 MB
    bodies back to back for ``--duration`` s is held to the refill rate, while a second tenant's
    p99 stays within 1.5× its p99 alone."""
    big = 20_000_000
    with Stack(gateways=1, workers=1) as stack:
        port = stack.ports[0]
        _, mistaken = stack.new_tenant("mistaken")
        sequence = [await _oversized(port, mistaken, 0, declared=10**12), await _oversized(port, mistaken, big)]
        sequence += [await _oversized(port, mistaken, big) for _ in range(10)]
        small = RawClient("127.0.0.1", port, {"authorization": f"Bearer {mistaken}"})
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}],
                             "max_tokens": ECHO_TOKENS})
        after, _ = await small.post("/v1/chat/completions", body)
        await small.close()
        alone = Load(stack, args.rate, seed=21)
        t0 = time.monotonic()
        await alone.run(15.0)
        base = summary(alone.outcomes, t0, time.monotonic())
        _, abuser = stack.new_tenant("flood")
        statuses: Counter[int | str] = Counter()
        stop = asyncio.Event()

        async def flood() -> None:
            while not stop.is_set():
                statuses[await _oversized(port, abuser, big)] += 1

        flooding = asyncio.create_task(flood())
        during = Load(stack, args.rate, seed=22)
        t1 = time.monotonic()
        await during.run(args.duration)
        stop.set()
        await flooding
        flood_s = time.monotonic() - t1
        under = summary(during.outcomes, t1, time.monotonic())
        for lg in (alone, during):
            await lg.close()
        _print("a second tenant, alone and beside a 20 MB flood", {"alone": base, "beside the flood": under})
        refused = statuses.get(413, 0)
        allowed = (REFUSAL_BURST_BYTES + REFUSAL_BYTES_PER_S * flood_s) / REFUSAL_OVERHEAD_BYTES
        table("the flood (20 MB bodies, back to back)",
              ["seconds", "sent", "413", "429 held", "other", "413 per s", "413 the bucket allows"],
              [[flood_s, sum(statuses.values()), refused, statuses.get(429, 0),
                sum(v for k, v in statuses.items() if k not in (413, 429)), refused / flood_s, allowed]])
        result: dict[str, Any] = {
            "sequence": sequence, "after": after, "alone": base, "beside": under,
            "p99_ratio": under["p99_ms"] / base["p99_ms"], "flood": {str(k): v for k, v in statuses.items()},
            "flood_s": flood_s, "refused_413": refused, "allowed_413": allowed,
            "findings": dict(findings(alone.outcomes + during.outcomes)),
        }
        result["met"] = (after == 200 and all(s == 413 for s in sequence) and result["p99_ratio"] <= 1.5
                         and refused <= allowed * 1.05 and not result["findings"])
        return result


async def slowloris(args: argparse.Namespace) -> dict[str, Any]:
    """Target 6b: thousands of connections that trickle their headers; others unaffected."""
    import multiprocessing

    with Stack(gateways=1, workers=1) as stack:
        load = Load(stack, args.rate, seed=9)
        t0 = time.monotonic()
        await load.run(10.0)
        base = summary(load.outcomes, t0, time.monotonic())
        ctx = multiprocessing.get_context("fork")
        report = ctx.Queue()
        slow = ctx.Process(target=_trickle, args=(stack.ports[0], args.connections, 20.0, report))
        slow.start()
        await asyncio.sleep(3)  # all of them open
        load2 = Load(stack, args.rate, seed=10)
        t1 = time.monotonic()
        await load2.run(15.0)
        under = summary(load2.outcomes, t1, time.monotonic())
        counts = await asyncio.to_thread(report.get, True, 60)
        await asyncio.to_thread(slow.join, 30)
        for lg in (load, load2):
            await lg.close()
        _print(f"{args.connections} slow connections", {"alone": base, "with slow connections": under})
        ratio = under["p99_ms"] / base["p99_ms"]
        result = {"alone": base, "with_slow": under, "p99_ratio": ratio, **counts,
                  "findings": dict(findings(load.outcomes + load2.outcomes)), "exited": stack.exited()}
        result["met"] = ratio <= 2.0 and not result["findings"] and not result["exited"]
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


def _print(title: str, rows: dict[str, dict[str, Any]]) -> None:
    cols = ["phase", "requests", "ok", "refused", "cut", "findings", "p50 ms", "p99 ms"]
    table(title, cols, [[name, r["requests"], r["ok"], r["refused"], r["cut"], r["findings"],
                         r["p50_ms"], r["p99_ms"]] for name, r in rows.items()])


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
