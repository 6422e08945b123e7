"""The self-tuning table live (issue 41): serving while a re-solve runs, and a re-solve after
the traffic shifts. The real gateway, the real model, one ``hf`` CPU worker.

    python -m bench.self_tuning [--window-requests 160] [--load 0.7] [--seed-rows 1500]
                                [--phase-requests 150] [--shift-load 1.2] [--json]

One Redis and one worker for everything; gateways run ``--policy smdp --tune-every 0`` (the
self-tuned table, re-solved only when this bench asks, ``POST /admin/scheduler/tune``). The
worker's capacity is measured first (``bench.traffic.closed_loop`` under fcfs, mix A).

**Serving while a re-solve runs.** The traffic stream is seeded with ``--seed-rows`` rows of
the code trace (through ``traffic_log.flush``, the gateway's own writer), so that a re-solve has
as much to do as on a deployment's window of that size. The same slice of mix A
(``--window-requests``, open loop at ``--load`` × capacity) is replayed four times: quiet; while
the gateway's own re-solve runs (its child at ``SCHED_IDLE`` and ``--tune-cpu`` of a core;
killed at the window's end, so that it never spills into the next); while the same re-solve
runs as a plain ``tokengate policy tune`` at normal priority, restarted as it ends (the
baseline: what bounding its CPU buys); ``--rounds`` times, after a warm-up, with the same
Poisson arrivals at ``--load`` × capacity. Per kind of window, every round's requests pooled:
TTFT and end-to-end p50/p99, their ratio to the quiet windows', and the re-solve's CPU as a
share of one core.

**A traffic shift.** The stream is cleared; mix A (code trace rows from ``--start``, prompts ÷
32, outputs ≤ 32) is served for ``--phase-requests``, then mix B (rows from ``--start-b``,
prompts ÷ 64, outputs ≤ 96: short questions, long answers) at the same rate (``--shift-load``
× A's capacity: B is heavier, so it overloads); every request carries the SLO
(``x-slo-ttft-ms``, ``x-slo-tpot-ms``), so the table's admission decides. The gateway re-solves
on what it recorded and the verdict is printed. Then the next slice of mix B is replayed through
the table in force (swapped or not) and through the fixed packaged table (a fresh gateway,
``--policy smdp:FILE``), with the same arrivals: SLO attainment, goodput, TTFT p99.

Tables go to stdout; with ``--json`` the last line is one object with the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis
import redis.asyncio as aioredis

from bench.harness import ADMIN_TOKEN, OUT, backend, gateway_server, pct, table
from bench.policies_live import Run, figures
from bench.traffic import (
    CAPACITY_FLAGS,
    DEFAULT_TRACE,
    SLOTS,
    Row,
    Sample,
    closed_loop,
    load_trace,
    make_tenants,
    replay,
    scaled,
)
from common import wire
from gateway.dispatch import traffic_log
from sched_core.recorded import Seen, Traffic
from sched_core.simulate.metrics import Slo
from sched_core.simulate.workload import parse_trace
from sched_core.smdp import DEFAULT_TABLE
from workers import model_store

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def seed(redis_url: str, model: str, trace: Path, rows: int) -> Path:
    """``rows`` of ``trace`` appended to the model's traffic stream as the gateway writes them
    (ending now); the same rows as a CSV for the baseline's re-solve."""
    with open(trace, newline="") as f:
        picked = parse_trace(f, str(trace))[:rows]
    traffic = Traffic()
    now, last = time.monotonic(), picked[-1].time_s
    for r in picked:
        traffic.closed.append(Seen(now - (last - r.time_s), r.prompt_tokens, r.output_tokens, "t0", r.output_tokens))

    async def flush() -> None:
        client = aioredis.Redis.from_url(redis_url)
        await traffic_log.flush(client, model, traffic)
        text = await traffic_log.read_csv(client, model)
        await client.aclose()
        path.write_text(text)

    path = OUT / "self_tuning_seeded.csv"
    asyncio.run(flush())
    return path


def poisson(rows: list[Row], rate: float, seed_: int = 3) -> list[Row]:
    """``rows``' lengths arriving as a Poisson process of ``rate``: windows alike in load, not
    one burst of the trace's."""
    rng = random.Random(seed_)
    at, out = 0.0, []
    for r in rows:
        out.append(Row(at, r.prompt, r.output))
        at += rng.expovariate(rate)
    return out


def status(base: str) -> dict[str, Any]:
    r = httpx.get(base + "/admin/scheduler", headers=ADMIN, timeout=30)
    r.raise_for_status()
    doc: dict[str, Any] = r.json()
    return doc


def ask(base: str) -> None:
    httpx.post(base + "/admin/scheduler/tune", headers=ADMIN, timeout=30).raise_for_status()


def wait_verdict(base: str, since: float, timeout_s: float = 1800.0) -> dict[str, Any]:
    """The first re-solve verdict after ``since`` (wall time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        last = status(base)["tuning"]["status"].get("last")
        if last and last["at"] > since:
            return dict(last)
        time.sleep(1.0)
    raise RuntimeError("no re-solve verdict in time")


def latency(samples: list[Sample]) -> dict[str, float]:
    done = [s for s in samples if s.ok]
    ttft, e2e = [s.ttft_s for s in done], [s.e2e_s for s in done]
    return {"completed": len(done), "ttft_p50_ms": pct(ttft, 50) * 1000, "ttft_p99_ms": pct(ttft, 99) * 1000,
            "e2e_p50_ms": pct(e2e, 50) * 1000, "e2e_p99_ms": pct(e2e, 99) * 1000}


@contextmanager
def gateway(redis_url: str, model_dir: str, procs: list[subprocess.Popen[bytes]], slo: Slo,
            policy: str = "smdp", extra: tuple[str, ...] = ()) -> Iterator[str]:
    flags = ["--policy", policy, "--tune-every", "0", "--slo-ttft-ms", f"{slo.ttft_s * 1000:g}",
             "--slo-tpot-ms", f"{slo.tpot_s * 1000:g}", *extra]
    with gateway_server(redis_url, flags, model_dir, procs) as (base, _proc):
        yield base


KINDS = ("quiet", "re-solve at idle priority", "re-solve at normal priority (baseline)")


def tuning_child() -> int | None:
    """The pid of a gateway's re-solve child (``policy tune --name tuned-…``), if one runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tune" in argv and any(a.startswith(b"tuned-") for a in argv):
            return int(entry.name)
    return None


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def keep_solving(kind: str, base: str, baseline_cmd: list[str], stop: threading.Event, used: list[float]) -> None:
    """Re-solve through the window until ``stop``: the gateway's own (asked; at ``stop`` its
    child is killed, so that it never spills into the next window: the gateway records the
    failure) or the baseline's plain process at normal priority. ``used``: the CPU seconds the
    re-solves took in the window."""
    while not stop.is_set():
        if kind == KINDS[0]:  # the same watching, nothing to watch: every window pays the observer alike
            tuning_child()
            time.sleep(0.2)
            continue
        if kind == KINDS[1]:
            ask(base)
            pid = None
            while pid is None and not stop.is_set():
                time.sleep(0.2)
                pid = tuning_child()
            while pid is not None and not stop.is_set() and Path(f"/proc/{pid}").exists():
                used[0] = cpu_s(pid)
                time.sleep(0.2)
            if pid is not None and Path(f"/proc/{pid}").exists():
                used[0] = cpu_s(pid)
                os.kill(pid, signal.SIGKILL)
            return  # one ask per window: a re-solve at 10 % of a core outlasts it
        proc = subprocess.Popen(baseline_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and not stop.is_set():
            used[1] = cpu_s(proc.pid)
            time.sleep(0.2)
        used[0] += used[1]
        used[1] = 0.0
        if proc.poll() is None:
            proc.kill()
        elif proc.returncode != 0:
            raise RuntimeError(f"the baseline re-solve failed: exit {proc.returncode}")
        proc.wait()


def serving_while_solving(base: str, keys: list[str], rows: list[Row], baseline_cmd: list[str],
                          rounds: int) -> list[dict[str, Any]]:
    """A warm-up, then ``rounds`` of the three windows (the same arrivals each time); per kind
    the figures of every window's requests pooled."""
    asyncio.run(replay(base, keys, rows[: len(rows) // 4], 0))  # warm-up: not counted
    pooled: dict[str, list[Sample]] = {k: [] for k in KINDS}
    cpu = dict.fromkeys(KINDS, 0.0)
    wall = dict.fromkeys(KINDS, 0.0)
    for r in range(rounds):
        for kind in KINDS:
            stop, used = threading.Event(), [0.0, 0.0]
            worker = threading.Thread(target=keep_solving, args=(kind, base, baseline_cmd, stop, used))
            worker.start()
            samples, span = asyncio.run(replay(base, keys, rows, 0))
            stop.set()
            worker.join()
            pooled[kind] += samples
            cpu[kind] += used[0]
            wall[kind] += span
            print(f"  round {r + 1}, {kind}: re-solve CPU {used[0]:.1f} s of {span:.0f} s; "
                  + ", ".join(f"{k} {v:.0f}" for k, v in latency(samples).items()))
    return [{"window": kind, "requests": len(pooled[kind]), "solve_cpu_share": cpu[kind] / wall[kind],
             **latency(pooled[kind])} for kind in KINDS]


def shift(base: str, keys: list[str], a: list[Row], b: list[Row], rate: float, slo: Slo) -> dict[str, Any]:
    """Mix A then mix B at ``rate``, every request with the SLO; then the re-solve's verdict."""
    header = {"x-slo-ttft-ms": f"{slo.ttft_s * 1000:g}", "x-slo-tpot-ms": f"{slo.tpot_s * 1000:g}"}
    served = {}
    for name, rows in (("A", a), ("B", b)):
        samples, span = asyncio.run(replay(base, keys, scaled(rows, rate), 1, header))
        served[name] = figures(Run(f"mix {name}", 0.0, rate, samples, span), slo)
    time.sleep(11.0)  # the scheduler appends what it saw every 10 s
    asked = time.time()
    ask(base)
    verdict = wait_verdict(base, asked)
    return {"served": served, "verdict": verdict}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--start", type=int, default=6140, help="mix A's first trace row")
    parser.add_argument("--start-b", type=int, default=2000, help="mix B's first trace row")
    parser.add_argument("--window-requests", type=int, default=150)
    parser.add_argument("--load", type=float, default=0.5, help="the windows' load, × the measured capacity")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three windows")
    parser.add_argument("--seed-rows", type=int, default=1500, help="trace rows seeded as recorded traffic")
    parser.add_argument("--phase-requests", type=int, default=150)
    parser.add_argument("--shift-load", type=float, default=1.2, help="the shift's rate, × mix A's capacity")
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=400.0)
    parser.add_argument("--skip", choices=("none", "serving", "shift"), default="none")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model_store.offline()
    spec = model_store.resolve(None, model_store.default_cache_dir())
    model_dir = str(spec.path)
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    mix_a = load_trace(args.trace, args.start, max(args.window_requests, args.phase_requests), 1.0, 32.0, 32)
    mix_b = load_trace(args.trace, args.start_b, 2 * args.phase_requests, 1.0, 64.0, 96)
    summary: dict[str, Any] = {}
    started = time.perf_counter()
    OUT.mkdir(parents=True, exist_ok=True)
    with backend("hf", slots=SLOTS, model_dir=model_dir) as (redis_url, procs):
        with gateway(redis_url, model_dir, procs, slo, "fcfs", CAPACITY_FLAGS) as base:
            keys = make_tenants(base, 3)
            capacity = asyncio.run(closed_loop(base, keys, mix_a, 0, SLOTS))
        print(f"measured capacity, mix A: {capacity:.2f} requests/s ({SLOTS} outstanding, fcfs)")
        summary["capacity_rps"] = capacity
        if args.skip != "serving":
            seeded = seed(redis_url, spec.name, args.trace, args.seed_rows)
            baseline_cmd = [sys.executable, "-m", "gateway.cli", "policy", "tune", "--trace", str(seeded),
                            "--jobs", "1", "--json", "--out", str(OUT / "self_tuning_baseline.json"),
                            "--fleet", redis_url, "--fleet-model", spec.name, "--cpu-slots", str(SLOTS),
                            "--gpu-workers", "0"]
            arrivals = poisson(mix_a[:args.window_requests], args.load * capacity)
            with gateway(redis_url, model_dir, procs, slo) as base:
                windows = serving_while_solving(base, keys, arrivals, baseline_cmd, args.rounds)
            quiet = windows[0]
            for w in windows:
                for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms"):
                    w[k.replace("_ms", "_vs_quiet")] = w[k] / quiet[k]
            table(f"serving at {args.load:g}x capacity (Poisson) while a re-solve runs, {args.rounds} rounds pooled",
                  ["window", "done", "re-solve CPU", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99", "TTFT p99 ratio",
                   "e2e p99 ratio"],
                  [[w["window"], f"{w['completed']}/{w['requests']}", f"{w['solve_cpu_share']:.0%}",
                    f"{w['ttft_p50_ms']:.0f}",
                    f"{w['ttft_p99_ms']:.0f}", f"{w['e2e_p50_ms']:.0f}", f"{w['e2e_p99_ms']:.0f}",
                    f"{w['ttft_p99_vs_quiet']:.3f}", f"{w['e2e_p99_vs_quiet']:.3f}"] for w in windows])
            summary["windows"] = windows
        if args.skip != "shift":
            client = redis.Redis.from_url(redis_url)
            client.delete(wire.traffic_stream(spec.name), wire.policy_key(spec.name))
            client.close()
            rate = args.shift_load * capacity
            n = args.phase_requests
            with gateway(redis_url, model_dir, procs, slo) as base:
                shifted = shift(base, keys, mix_a[:n], mix_b[:n], rate, slo)
                verdict = shifted["verdict"]
                print(f"  re-solve after the shift: {'swapped' if verdict['swap'] else 'kept'}: {verdict['why']}")
                header = {"x-slo-ttft-ms": f"{slo.ttft_s * 1000:g}", "x-slo-tpot-ms": f"{slo.tpot_s * 1000:g}"}
                later = scaled(mix_b[n:], rate)
                tuned_name = status(base)["policy"]["name"]
                samples, span = asyncio.run(replay(base, keys, later, 2, header))
                tuned = figures(Run(f"in force: {tuned_name}", 1.0, rate, samples, span), slo)
            packaged = resources.files("sched_core") / "tables" / DEFAULT_TABLE
            with gateway(redis_url, model_dir, procs, slo, f"smdp:{packaged}") as base:
                samples, span = asyncio.run(replay(base, keys, later, 2, header))
                fixed = figures(Run("fixed: the packaged table", 1.0, rate, samples, span), slo)
            rows = [*shifted["served"].values(), tuned, fixed]
            table(f"a traffic shift at {rate:.2f} requests/s (SLO {slo.describe()})",
                  ["run", "requests", "SLO %", "goodput/s", "TTFT p50/p99 ms", "refused"],
                  [[r["policy"], r["requests"], f"{float(r['slo_attainment']):.1%}", r["goodput_rps"],
                    f"{float(r['ttft_p50_ms']):.0f}/{float(r['ttft_p99_ms']):.0f}",
                    int(r["requests"]) - int(r["completed"])] for r in rows])
            scenarios = verdict.get("scenarios", [])
            if scenarios:
                table("the re-solve's test on the later recorded traffic (simulated)",
                      ["scenario", "figure", "table in force", "candidate"],
                      [[s["scenario"], s["figure"], s["running"], s["candidate"]] for s in scenarios])
            summary["shift"] = {"verdict": {k: verdict.get(k) for k in ("swap", "why", "score_running",
                                                                        "score_candidate", "seconds")},
                                "tuned": tuned, "fixed": fixed,
                                "attainment_tuned_minus_fixed": float(tuned["slo_attainment"])
                                - float(fixed["slo_attainment"])}
    summary["seconds"] = time.perf_counter() - started
    print(orjson.dumps(summary).decode() if args.json else {k: v for k, v in summary.items() if k != "windows"})


if __name__ == "__main__":
    main()
