"""Latency contracts where users run them: a busy start, a restart on saved state, a CPU hog
that comes and goes, a load step, a worker that joins and leaves (issue 36).

    python -m bench.contract_chaos [--requests 80] [--hogs 1] [--json]

One ``tokengate serve`` with the real model on a data directory and a profile directory of
its own, kept across the phases (the restart is on saved state, as a user's is):

1. **busy start**: ``--hogs`` CPU-bound programs run while serve starts (its worker measures
   itself starved of CPU) and while the phase's traffic runs;
2. **quiet restart**: the hogs stop; Ctrl-C (timed), serve again on the same directories
   (time to ready), the same traffic; then a closed loop measures the capacity (not counted);
3. **hog**: traffic at half the capacity, a hog starting a third of the way in and stopping
   at two thirds;
4. **load step**: 0.5x, then 1.5x, then 0.5x of the capacity, a third of the requests each;
5. **worker**: half the capacity, a second worker (``tokengate worker``, on the same two
   cores) joining a third of the way in and leaving at two thirds.

The traffic is a mix: 70 % completions of random-token prompts (16-1,200 tokens, log-normal
around 150) asking for an exact output (8-48 tokens, ``ignore_eos``: the length is known),
30 % chat questions answered greedily up to 64 tokens (the length is not known); a third of
the requests send ``x-slo-ttft-ms: 2000`` (the default SLO). Every request streams; the
client times its first token and its last and reads its contract from the headers.

Per phase, the table has: the share inside the first-token bound and inside the total bound
(every answered request), the median of bound ÷ actual, the median of bound ÷ prediction
(the total: known lengths only), the mean absolute percentage error of the predictions, the
refusals (for an SLO; and of those, the ones sent with nothing in flight: an idle worker
would have served them), and after each change within the phase (its start, a hog, a load
step, a worker) how many requests it took until the last miss of either bound
(``recovered``). ``--json``: the last line is one object with every figure. The records go
to ``bench/out/contract_chaos.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import orjson

from bench.harness import OUT, hogs, spawn, table, wait_ready
from gateway.cli.embedded_redis import free_port
from workers import model_store

MODEL = "SmolLM2-135M-Instruct"
ADMIN = "chaos-admin-token-0123456789"
SLO_TTFT_MS = 2000.0  # the product's default SLO (--slo-ttft-ms)
QUESTIONS = (
    "Say hello in five words.", "Name three colours.", "What is the capital of France?",
    "Write a haiku about rain.", "Count from one to ten.", "Give me two tips for sleeping well.",
    "What is two plus two?", "Describe a cat in one sentence.", "List four fruits.",
    "Why is the sky blue? Answer briefly.", "Translate 'good morning' into Spanish.",
    "Suggest a name for a small boat.",
)


@dataclass(frozen=True, slots=True)
class Ask:
    """One request of the mix: a completion of ``prompt`` random tokens with exactly
    ``output`` out (``chat`` empty), or a chat question answered up to 64 tokens."""

    prompt: int
    output: int
    chat: str
    slo: bool


@dataclass(slots=True)
class Record:
    phase: str
    index: int
    mark: str  # the change the request came after (the phase's start, "hog on", "1.5x", ...)
    in_flight: int  # requests of this client still open when it was sent
    known: bool  # its output length was known (ignore_eos)
    slo: bool
    status: int = 0
    error: str = ""
    message: str = ""
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    tokens: int = 0
    ttft_pred_s: float = math.nan
    ttft_bound_s: float = math.nan
    total_pred_s: float = math.nan
    total_bound_s: float = math.nan

    @property
    def done(self) -> bool:
        return self.status == 200 and not math.isnan(self.e2e_s) and not math.isnan(self.ttft_s)


def mix(n: int, seed: int) -> list[Ask]:
    rng = np.random.default_rng(seed)
    asks = []
    for i in range(n):
        slo = i % 3 == 0
        if rng.random() < 0.3:
            asks.append(Ask(0, 64, QUESTIONS[int(rng.integers(len(QUESTIONS)))], slo))
        else:
            prompt = int(np.clip(rng.lognormal(math.log(150), 0.9), 16, 1200))
            asks.append(Ask(prompt, int(rng.integers(8, 49)), "", slo))
    return asks


def _ms(h: httpx.Headers, name: str) -> float:
    value = h.get(name)
    return float(value) / 1000 if value is not None else math.nan


class Traffic:
    """Sends asks on schedule and keeps what each one saw."""

    def __init__(self, base: str, key: str, seed: int) -> None:
        self.base, self.key = base, key
        self.rng = np.random.default_rng(seed)
        self.open = 0
        self.records: list[Record] = []

    async def one(self, http: httpx.AsyncClient, ask: Ask, rec: Record) -> None:
        headers = {"authorization": f"Bearer {self.key}"}
        if ask.slo:
            headers["x-slo-ttft-ms"] = f"{SLO_TTFT_MS:g}"
        if ask.chat:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": ask.chat}]}
        else:
            ids = self.rng.integers(100, 40_000, size=ask.prompt).tolist()
            path, body = "/v1/completions", {"prompt": ids, "ignore_eos": True}
        body |= {"model": MODEL, "max_tokens": ask.output, "temperature": 0, "stream": True,
                 "stream_options": {"include_usage": True}}
        self.open += 1
        t0 = time.perf_counter()
        try:
            async with http.stream("POST", path, json=body, headers=headers) as r:
                rec.status = r.status_code
                h = r.headers
                rec.ttft_pred_s, rec.ttft_bound_s = _ms(h, "x-tokengate-ttft-ms"), _ms(h, "x-tokengate-ttft-p99-ms")
                rec.total_pred_s, rec.total_bound_s = _ms(h, "x-tokengate-latency-ms"), _ms(h, "x-tokengate-p99-ms")
                if r.status_code != 200:
                    await r.aread()
                    error = r.json().get("error", {})
                    rec.error, rec.message = str(error.get("code")), str(error.get("message", ""))
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        rec.error = str(chunk["error"].get("code"))
                        return
                    choices = chunk.get("choices") or []
                    # the first token's text (a chat stream opens with a role alone, before any token)
                    if choices and math.isnan(rec.ttft_s) and (choices[0].get("text")
                                                                 or choices[0].get("delta", {}).get("content")):
                        rec.ttft_s = time.perf_counter() - t0
                    if chunk.get("usage"):
                        rec.tokens = int(chunk["usage"]["completion_tokens"])
            rec.e2e_s = time.perf_counter() - t0
        except httpx.HTTPError as exc:
            rec.error = type(exc).__name__
        finally:
            self.open -= 1

    async def run(self, phase: str, asks: list[Ask], rates: list[tuple[float, str]],
                  at: dict[int, str] | None = None) -> None:
        """Poisson arrivals; ``rates``: (requests/s, mark) for consecutive equal shares of the
        asks; ``at``: marks to set at given request indexes (a hog started there)."""
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        async with httpx.AsyncClient(base_url=self.base, timeout=600, limits=limits) as http:
            tasks = []
            share = math.ceil(len(asks) / len(rates))
            mark = rates[0][1]
            for i, ask in enumerate(asks):
                rate, step = rates[min(i // share, len(rates) - 1)]
                if i % share == 0:
                    mark = step
                if at and i in at:
                    mark = at[i]
                rec = Record(phase, i, mark, self.open, not ask.chat, ask.slo)
                self.records.append(rec)
                tasks.append(asyncio.create_task(self.one(http, ask, rec)))
                await asyncio.sleep(float(self.rng.exponential(1.0 / rate)))
            await asyncio.gather(*tasks)


async def closed_loop(base: str, key: str, asks: list[Ask], clients: int, seed: int) -> float:
    """Requests/s with ``clients`` always outstanding, counted between the first ``clients``
    completions and the last ``clients``."""
    traffic = Traffic(base, key, seed)
    done: list[float] = []
    todo = iter(asks)
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:

        async def loop() -> None:
            for ask in todo:
                rec = Record("capacity", 0, "", 0, True, False)
                await traffic.one(http, Ask(ask.prompt or 100, ask.output, ask.chat, False), rec)
                if rec.done:
                    done.append(time.perf_counter())

        await asyncio.gather(*(loop() for _ in range(clients)))
    steady = done[clients: len(done) - clients]
    return (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 else math.nan


# -- processes ---------------------------------------------------------------------------------


class Serve:
    """``tokengate serve`` on fixed data and profile directories, started and stopped by hand."""

    def __init__(self, data: Path, profiles: Path, model_dir: str) -> None:
        self.data, self.profiles, self.model_dir = data, profiles, model_dir
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = OUT / "contract_chaos-serve.log"
        self.starts = 0

    def start(self) -> float:
        """Seconds from the command to ``/readyz``."""
        self.starts += 1
        self.log = OUT / f"contract_chaos-serve-{self.starts}.log"
        t0 = time.perf_counter()
        self.proc = spawn(["-m", "gateway.cli", "serve", "--port", str(self.port), "--data-dir", str(self.data),
                           "--profile-dir", str(self.profiles), "--admin-token", ADMIN], self.log)
        wait_ready(self.base, [self.proc], timeout_s=300)
        return time.perf_counter() - t0

    def interrupt(self) -> float:
        """Ctrl-C: seconds until serve and its children are gone."""
        assert self.proc is not None
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)
        return time.perf_counter() - t0

    @property
    def key(self) -> str:
        return (self.data / "demo-key").read_text().strip()

    @property
    def redis_url(self) -> str:
        found = re.search(r"redis-server .* at (redis://\S+)", self.log.read_text())
        assert found, "serve's log names no redis"
        return found.group(1)

    def calibration(self) -> str:
        """What the scheduler's promises rest on now: the path's drift from its profile and,
        per component, its calibration's median and re-anchorings so far."""
        snap = httpx.get(self.base + "/admin/scheduler", headers={"authorization": f"Bearer {ADMIN}"}).json()
        cal = snap.get("calibration", {}).get("cpu", {})
        parts = [f"drift {snap['paths']['cpu'].get('drift', 1.0):.2f}"]
        parts += [f"{c}: median {v['median']:.2f}, re-anchored {v['reanchored']}"
                  for c, v in cal.items()]
        return "; ".join(parts)

    def profile_line(self) -> str:
        lines = [ln for ln in self.log.read_text().splitlines() if "profile " in ln and "tokengate.worker" in ln]
        return lines[-1].split("tokengate.worker: ")[-1] if lines else "?"


@contextmanager
def extra_worker(serve: Serve) -> Iterator[subprocess.Popen[bytes]]:
    proc = spawn(["-m", "gateway.cli", "worker", "--redis-url", serve.redis_url, "--pool", "cpu", "--worker-id",
                  "chaos-2", "--model", serve.model_dir, "--profile-dir", str(serve.profiles)],
                 OUT / "contract_chaos-worker-2.log")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the gateway counts it
            workers = httpx.get(serve.base + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"}).json()
            if any(w["worker"] == "chaos-2" for w in workers["data"]):
                break
            time.sleep(0.2)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


# -- figures -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Phase:
    name: str
    requests: int = 0
    answered: int = 0
    inside_ttft: float = math.nan
    inside_total: float = math.nan
    bound_over_actual_ttft: float = math.nan  # medians
    bound_over_actual_total: float = math.nan
    bound_over_pred_ttft: float = math.nan
    bound_over_pred_total_known: float = math.nan
    mape_ttft: float = math.nan
    mape_total: float = math.nan
    refused_slo: int = 0
    refused_slo_idle: int = 0
    refused_other: int = 0
    errors: int = 0
    recovered: dict[str, int] = field(default_factory=dict)  # change -> requests to its last miss


def figures(name: str, recs: list[Record]) -> Phase:
    f = Phase(name, len(recs))
    done = [r for r in recs if r.done]
    f.answered = len(done)

    def med(xs: list[float]) -> float:
        return float(np.median(xs)) if xs else math.nan

    if done:
        f.inside_ttft = sum(r.ttft_s <= r.ttft_bound_s for r in done) / len(done)
        f.inside_total = sum(r.e2e_s <= r.total_bound_s for r in done) / len(done)
        f.bound_over_actual_ttft = med([r.ttft_bound_s / r.ttft_s for r in done])
        f.bound_over_actual_total = med([r.total_bound_s / r.e2e_s for r in done])
        f.bound_over_pred_ttft = med([r.ttft_bound_s / r.ttft_pred_s for r in done])
        f.bound_over_pred_total_known = med([r.total_bound_s / r.total_pred_s for r in done if r.known])
        f.mape_ttft = float(np.mean([abs(r.ttft_pred_s - r.ttft_s) / r.ttft_s for r in done]))
        f.mape_total = float(np.mean([abs(r.total_pred_s - r.e2e_s) / r.e2e_s for r in done]))
    slo = [r for r in recs if r.error == "slo_unattainable"]
    f.refused_slo = len(slo)
    f.refused_slo_idle = sum(r.in_flight == 0 for r in slo)
    f.refused_other = sum(r.status in (429, 503) and r.error != "slo_unattainable" for r in recs)
    f.errors = sum((r.status == 200 and not r.done) or r.status in (0, 500, 502) for r in recs)
    marks: dict[str, int] = {}
    for i, r in enumerate(recs):
        marks.setdefault(r.mark, i)
    for mark, start in marks.items():
        misses = [i for i, r in enumerate(recs) if i >= start and r.mark == mark and r.done
                  and (r.ttft_s > r.ttft_bound_s or r.e2e_s > r.total_bound_s)]
        f.recovered[mark] = misses[-1] - start + 1 if misses else 0
    return f


def print_table(phases: list[Phase], notes: dict[str, str]) -> None:
    def share(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.1%}"

    def ratio(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.2f}"

    rows: list[tuple[str, Callable[[Phase], object]]] = [
        ("requests", lambda f: f.requests), ("answered", lambda f: f.answered),
        ("inside the first-token bound", lambda f: share(f.inside_ttft)),
        ("inside the total bound", lambda f: share(f.inside_total)),
        ("first-token bound / actual (median)", lambda f: ratio(f.bound_over_actual_ttft)),
        ("total bound / actual (median)", lambda f: ratio(f.bound_over_actual_total)),
        ("first-token bound / prediction (median)", lambda f: ratio(f.bound_over_pred_ttft)),
        ("total bound / prediction, known lengths (median)", lambda f: ratio(f.bound_over_pred_total_known)),
        ("first-token prediction: mean abs. error", lambda f: share(f.mape_ttft)),
        ("total prediction: mean abs. error", lambda f: share(f.mape_total)),
        ("refused for an SLO", lambda f: f.refused_slo),
        ("... of them with nothing in flight", lambda f: f.refused_slo_idle),
        ("other 429/503", lambda f: f.refused_other), ("errors", lambda f: f.errors),
        ("requests to the last miss after each change",
         lambda f: ", ".join(f"{k}: {v}" for k, v in f.recovered.items())),
    ]
    table("latency contracts where users run them (measured by the client; bounds are p99)",
          ["", *(f.name for f in phases)], [[name, *(get(f) for f in phases)] for name, get in rows])
    for k, v in notes.items():
        print(f"{k}: {v}")


# -- the run -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=80, help="requests per phase")
    parser.add_argument("--hogs", type=int, default=1, help="CPU-bound programs of the busy start and the hog phase")
    parser.add_argument("--busy-rate", type=float, default=0.8, help="requests/s of the first two phases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model_store.offline()
    model_dir = str(model_store.resolve(None, model_store.default_cache_dir()).path)
    OUT.mkdir(parents=True, exist_ok=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    notes: dict[str, str] = {"cpu": f"{cpu}, {os.cpu_count()} cores"}
    phases: list[Phase] = []
    records: list[Record] = []
    n = args.requests
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(Path(tmp) / "data", Path(tmp) / "profiles", model_dir)

        def phase(name: str, rates: list[tuple[float, str]], at: dict[int, str] | None = None,
                  seed: int = 0) -> Traffic:
            traffic = Traffic(serve.base, serve.key, args.seed + seed)
            asyncio.run(traffic.run(name, mix(n, args.seed + seed), rates, at))
            phases.append(figures(name, traffic.records))
            records.extend(traffic.records)
            notes[f"{name}: after it"] = serve.calibration()
            print(f"{name}: done", file=sys.stderr, flush=True)
            return traffic

        with hogs(args.hogs):
            notes["busy start: ready after"] = f"{serve.start():.1f} s"
            notes["busy start: profile"] = serve.profile_line()
            phase("busy start", [(args.busy_rate, "start")], seed=1)
        notes["Ctrl-C, idle"] = f"{serve.interrupt():.2f} s"
        notes["quiet restart: ready after"] = f"{serve.start():.1f} s"
        notes["quiet restart: profile"] = serve.profile_line()
        phase("quiet restart", [(args.busy_rate, "start")], seed=2)
        capacity = asyncio.run(closed_loop(serve.base, serve.key, mix(60, args.seed + 9), 8, args.seed + 9))
        notes["capacity (closed loop of 8, quiet)"] = f"{capacity:.2f} requests/s"
        base = 0.5 * capacity
        third = math.ceil(n / 3)

        def middle_third(name: str, seed: int, change: Callable[[], AbstractContextManager[object]],
                         on: str, off: str) -> None:
            """A phase at half the capacity with ``change`` in force over its middle third."""

            async def run() -> Traffic:
                traffic = Traffic(serve.base, serve.key, args.seed + seed)
                task = asyncio.create_task(traffic.run(name, mix(n, args.seed + seed), [(base, "start")],
                                                       {third: on, 2 * third: off}))
                while len(traffic.records) < third:
                    await asyncio.sleep(0.05)
                with change():
                    while len(traffic.records) < 2 * third:
                        await asyncio.sleep(0.05)
                await task
                return traffic

            traffic = asyncio.run(run())
            phases.append(figures(name, traffic.records))
            records.extend(traffic.records)
            notes[f"{name}: after it"] = serve.calibration()

        middle_third("hog", 3, lambda: hogs(args.hogs), "hog on", "hog off")
        phase("load step", [(base, "0.5x"), (3 * base, "1.5x"), (base, "0.5x again")], seed=4)
        middle_third("worker", 5, lambda: extra_worker(serve), "worker joins", "worker leaves")
        notes["Ctrl-C, idle (end)"] = f"{serve.interrupt():.2f} s"
    print_table(phases, notes)
    (OUT / "contract_chaos.json").write_bytes(orjson.dumps([asdict(r) for r in records]))
    if args.json:
        print(orjson.dumps({"phases": [asdict(f) for f in phases], "notes": notes}).decode())


if __name__ == "__main__":
    main()
