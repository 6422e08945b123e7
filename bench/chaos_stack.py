"""The stack ``bench.chaos`` injects faults into, and how it reads what a client saw: a
persistent redis-server, gateway and echo worker processes (pinned where there are two
cores), an open-loop load whose every request ends as ok, refused, cut or a finding, and
the summaries of each phase."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
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
import redis

from bench.fuzz import is_openai_error
from bench.harness import ADMIN_TOKEN, OUT, RawClient, pct, table
from gateway.cli.embedded_redis import EmbeddedRedis, free_port

MODEL = "SmolLM2-135M-Instruct"
ECHO_TOKENS = 8
ECHO_TEXT = " echo" * ECHO_TOKENS
REQUEST_TIMEOUT_S = 30.0  # the gateways' --request-timeout; a client waits this plus slack
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
TWO_CORES = (os.cpu_count() or 1) >= 2


def pinned(cmd: list[str], core: int) -> list[str]:
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
            Proc(f"worker-{i}", pinned([py, "-m", "workers", "--redis-url", url, "--engine", "echo",
                                         "--echo-tokens", str(ECHO_TOKENS), "--echo-step-ms", str(step_ms),
                                         "--slots", str(slots), "--claim-idle", "5", "--heartbeat", "1",
                                         "--worker-id", f"chaos-{i}", "--max-deliveries", "50"], 1),
                 OUT / f"chaos-worker-{i}.log")
            for i in range(workers)
        ]
        self.gateways = [
            Proc(f"gateway-{i}", pinned([py, "-m", "gateway.cli", "--log-level", "WARNING", "gateway",
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


async def measure_capacity(stack: Stack, seconds: float = 5.0, clients: int = 64) -> float:
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


def status_counts(base: str) -> Counter[str]:
    """Requests the gateway answered, by status code, from its own /metrics."""
    counts: Counter[str] = Counter()
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tokengate_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels.split('status="')[1].split('"')[0]] += int(float(value))
    return counts


def print_phases(title: str, rows: dict[str, dict[str, Any]]) -> None:
    cols = ["phase", "requests", "ok", "refused", "cut", "findings", "p50 ms", "p99 ms"]
    table(title, cols, [[name, r["requests"], r["ok"], r["refused"], r["cut"], r["findings"],
                         r["p50_ms"], r["p99_ms"]] for name, r in rows.items()])
