"""Gateways side by side on a zero-cost OpenAI backend: LiteLLM's proxy and tokengate.

    python -m bench.peers [--duration 10] [--clients 32] [--rates 200,500,1000,2000]
                          [--gateway-workers 1,2] [--no-litellm] [--no-pin] [--json]
                          [--baseline-tree DIR]   # also tokengate from another checkout: before/after

Targets, each started fresh for its turn and stopped after it:
  direct                  the zero backend itself (``bench.floor_app``: a fixed chat.completion
                          at once), the floor every gateway adds to;
  litellm                 LiteLLM's proxy (LITELLM_VERSION, in its own venv under bench/out,
                          installed on the first run), one worker, no database, no callbacks,
                          forwarding to the zero backend; it runs as `litellm[proxy]` installs
                          it: uvicorn with uvloop and h11 (httptools is not among its deps);
  tokengate [--workers N] the tokengate gateway, Redis and one echo worker (the echo engine
                          answers in microseconds; the gateway still tokenizes and schedules).

Workloads, the same ~1 KB chat request (max_tokens 16) for every target: a closed loop of
``--clients`` clients, each on its own keep-alive connection (after a 2 s warm-up); one client
at a time (``sequential``); open-loop Poisson arrivals at each of ``--rates``. Where ``wrk`` is
installed (``apt install wrk``) it drives the two closed loops: the Python client tops out near
2,000-3,000 requests/s on its core, below what the direct backend answers. Every request
has a 10 s time-out; a time-out, an exception or a non-200 answer is an error; percentiles are
of the requests that completed. "Added" latency is the target's percentile minus the direct
baseline's at the same load in the same round. Before each load the gateway must be idle again
(an overloaded one works on through requests whose clients gave up).
Gateway CPU is utime+stime of the gateway process and its descendants over a run, divided by
the requests completed. Two rounds, the second in reverse order, so order effects show.

Pinning (``taskset``; ``--no-pin`` turns it off): the gateway under test alone on core 0; this
load generator, Redis, the echo worker and the zero backend on core 1. ``tokengate --workers N``
(N > 1) gets cores 0 and 1, so it then shares core 1 with all the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import resource
import shutil
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import orjson
import uvloop
from rich.console import Console

from bench import wrk
from bench.harness import (
    OUT,
    RawClient,
    auth,
    backend,
    bench_key,
    console,
    floor_server,
    gateway_server,
    open_loop,
    pct,
    save_plot,
    spawn,
    stop,
    table,
    tree_cpu_s,
    wait_ready,
)
from bench.litellm import LITELLM_KEY, TIMEOUT_S, ZERO_MODEL, install_litellm, litellm_config
from gateway.cli.embedded_redis import free_port

GATEWAY_CORE, REST_CORE = 0, 1
WARMUP_S = 2.0
PATH = "/v1/chat/completions"
PROMPT = ("The quick brown fox jumps over the lazy dog while the gateway counts tokens. " * 13)[:1000]

log = Console(stderr=True)


# -- targets ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    kind: str  # direct | litellm | tokengate
    workers: int = 1
    tree: str | None = None  # another checkout of tokengate to run instead of this one (--baseline-tree)


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    headers: dict[str, str]
    body: bytes
    pid: int | None  # the gateway process whose CPU is counted (None: direct)


def chat_body(model: str) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16})


def endpoint(base: str, headers: dict[str, str], model: str, pid: int | None) -> Endpoint:
    url = urlparse(base)
    return Endpoint(url.hostname or "127.0.0.1", url.port or 80, headers, chat_body(model), pid)


@contextmanager
def serve(target: Target, zero_base: str, litellm: Path | None, pin: bool) -> Iterator[Endpoint]:
    """Start ``target`` in front of (or as) the zero backend; yield how to call it."""
    gateway_cpus = (GATEWAY_CORE, REST_CORE) if target.workers > 1 else (GATEWAY_CORE,)
    if target.kind == "direct":
        yield endpoint(zero_base, {}, ZERO_MODEL, None)
    elif target.kind == "litellm":
        assert litellm is not None
        port = free_port()
        proc = spawn(
            ["--config", str(litellm_config(zero_base)), "--host", "127.0.0.1", "--port", str(port),
             "--num_workers", "1"],
            OUT / "litellm.log",
            gateway_cpus if pin else (),
            executable=str(litellm),
            # no database even if one is configured outside; errors only; the bundled cost map
            env={"DATABASE_URL": None, "LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        )
        try:
            base = f"http://127.0.0.1:{port}"
            try:
                wait_ready(base, [proc], timeout_s=180, path="/health/liveliness")
            except RuntimeError as exc:
                last = (OUT / "litellm.log").read_text(errors="replace").strip().splitlines()[-1:]
                raise RuntimeError(f"{exc}; its log ends: {last[0][:300] if last else '(empty)'}") from exc
            yield endpoint(base, auth(LITELLM_KEY), ZERO_MODEL, proc.pid)
        finally:
            stop([proc])
    else:
        flags = ["--workers", str(target.workers)] if target.workers != 1 else []
        rest = (REST_CORE,) if pin else ()
        # that checkout ahead of this one (PYTHONSAFEPATH: the working directory, this checkout, is not)
        env = {"PYTHONPATH": target.tree, "PYTHONSAFEPATH": "1"} if target.tree else None
        with backend("echo", slots=256, cpus=rest, env=env) as (redis_url, procs):
            with gateway_server(redis_url, flags, None, procs, gateway_cpus if pin else (), env) as (base, proc):
                key = bench_key(base)
                models = httpx.get(base + "/v1/models", headers=auth(key)).raise_for_status().json()
                yield endpoint(base, auth(key), str(models["data"][0]["id"]), proc.pid)


# -- workloads -------------------------------------------------------------------------------------


@dataclass
class Run:
    latencies: list[float]
    errors: int
    elapsed: float
    cpu_s: float | None
    counted: tuple[int, dict[float, float]] | None = None  # wrk's (completed, {q: s}): it keeps no list

    @property
    def completed(self) -> int:
        return self.counted[0] if self.counted else len(self.latencies)

    def pct(self, q: float) -> float:
        """The q-th percentile in seconds (100: the slowest)."""
        if self.counted:
            return self.counted[1][q]
        return pct(self.latencies, q)

    @property
    def achieved(self) -> float:
        return self.completed / self.elapsed

    @property
    def cpu_ms_per_req(self) -> float:
        if self.cpu_s is None or not self.completed:
            return float("nan")
        return self.cpu_s / self.completed * 1e3


async def one_request(client: RawClient, ep: Endpoint) -> float | None:
    """Seconds to a 200 answer, or None for an error (a time-out, an exception, another status)."""
    t0 = time.perf_counter()
    try:
        status, _ = await asyncio.wait_for(client.post(PATH, ep.body), TIMEOUT_S)
    except Exception:
        return None
    return time.perf_counter() - t0 if status == 200 else None


async def closed_loop(ep: Endpoint, clients: int, duration: float) -> tuple[list[float], int, float]:
    """``clients`` clients, each on its own connection, back to back until ``duration`` has passed."""
    conns = [RawClient(ep.host, ep.port, ep.headers) for _ in range(clients)]
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    end = start + duration

    async def client_loop(client: RawClient) -> None:
        nonlocal errors
        while time.perf_counter() < end:
            took = await one_request(client, ep)
            if took is None:
                errors += 1
            else:
                latencies.append(took)

    await asyncio.gather(*(client_loop(c) for c in conns))
    elapsed = time.perf_counter() - start
    for c in conns:
        await c.close()
    return latencies, errors, elapsed


def wrk_loop(ep: Endpoint, clients: int, duration: float) -> Run:
    """A closed loop driven by wrk (``bench.wrk``); its percentiles, no list of latencies."""
    ok, errors, elapsed, quantiles = wrk.closed_loop(f"http://{ep.host}:{ep.port}{PATH}", ep.body,
                                                     ep.headers.get("authorization", ""), clients, duration, TIMEOUT_S)
    return Run([], errors, elapsed, None, (ok, quantiles))


async def quiesce(pid: int | None, limit_s: float = 30.0) -> None:
    """Wait until the gateway is idle (under a tenth of a core over half a second): an overloaded
    one is still working through requests whose clients gave up, which would bill the next load."""
    if pid is None:
        return
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = tree_cpu_s(pid)
        await asyncio.sleep(0.5)
        if tree_cpu_s(pid) - before < 0.05:
            return
    log.print(f"the gateway was still busy {limit_s:g} s after the last load; measuring the next anyway")


async def measure(ep: Endpoint, loads: Sequence[tuple[str, float]], clients: int, duration: float) -> dict[str, Run]:
    """Each load in turn (``("closed", n)``, ``("sequential", 1)``, ``("open", rate)``), after a warm-up."""
    await closed_loop(ep, clients, WARMUP_S)
    runs: dict[str, Run] = {}
    for kind, x in loads:
        await quiesce(ep.pid)
        cpu0 = tree_cpu_s(ep.pid) if ep.pid else None
        if kind == "open":
            shared = RawClient(ep.host, ep.port, ep.headers)

            async def send(shared: RawClient = shared) -> bool:
                return await one_request(shared, ep) is not None

            lat, errors, elapsed = await open_loop(send, x, duration, seed=int(x))
            await shared.close()
        elif wrk.INSTALLED:
            run = wrk_loop(ep, int(x), duration)
            run.cpu_s = tree_cpu_s(ep.pid) - cpu0 if ep.pid and cpu0 is not None else None
            runs[load_label(kind, x)] = run
            continue
        else:
            lat, errors, elapsed = await closed_loop(ep, int(x), duration)
        cpu = tree_cpu_s(ep.pid) - cpu0 if ep.pid and cpu0 is not None else None
        runs[load_label(kind, x)] = Run(lat, errors, elapsed, cpu)
    return runs


def load_label(kind: str, x: float) -> str:
    return {"closed": f"closed {x:g}", "sequential": "sequential"}.get(kind, f"open {x:g}/s")


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class Results:
    """runs[target][load][round]"""

    runs: dict[str, dict[str, dict[int, Run]]] = field(default_factory=dict)

    def add(self, target: str, round_: int, by_load: dict[str, Run]) -> None:
        for load, run in by_load.items():
            self.runs.setdefault(target, {}).setdefault(load, {})[round_] = run


def check(ep: Endpoint) -> None:
    """One request must answer 200 before a target is measured."""
    async def once() -> tuple[int, bytes]:
        client = RawClient(ep.host, ep.port, ep.headers)
        try:
            return await asyncio.wait_for(client.post(PATH, ep.body), 30)
        finally:
            await client.close()

    status, body = uvloop.run(once())
    if status != 200:
        raise RuntimeError(f"answered {status}: {body[:300]!r}")


def run_rounds(
    targets: Sequence[Target], litellm: Path | None, pin: bool, loads: Sequence[tuple[str, float]],
    clients: int, duration: float,
) -> Results:
    results = Results()
    with floor_server((REST_CORE,) if pin else ()) as zero_base:
        for round_, order in ((1, list(targets)), (2, list(reversed(targets)))):
            for target in order:
                log.print(f"round {round_}: {target.name}")
                try:
                    with serve(target, zero_base, litellm, pin) as ep:
                        check(ep)
                        results.add(target.name, round_, uvloop.run(measure(ep, loads, clients, duration)))
                except (RuntimeError, OSError, httpx.HTTPError) as exc:  # TimeoutError is an OSError
                    log.print(f"{target.name} could not be measured in round {round_}: {exc}; "
                              "its rows are skipped", markup=False)
    return results


# -- reporting -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    target: str
    load: str
    round: int | str  # 1, 2 or "mean"
    achieved_rps: float
    p50_ms: float
    p99_ms: float
    added_p50_ms: float  # over direct, same load, same round
    added_p99_ms: float
    errors: float  # a mean over rounds may be fractional
    gateway_cpu_ms_per_req: float
    p999_ms: float = float("nan")  # the tail: one request in a thousand, and the slowest
    max_ms: float = float("nan")


FIGURES = ("achieved_rps", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms", "errors", "gateway_cpu_ms_per_req",
           "p999_ms", "max_ms")


def rows(results: Results) -> list[Row]:
    """One row per target, load and round, and one for the mean of the rounds."""
    direct = results.runs.get("direct", {})
    out: list[Row] = []
    for target, by_load in results.runs.items():
        for load, by_round in by_load.items():
            per_round: list[Row] = []
            for round_, run in sorted(by_round.items()):
                base = direct.get(load, {}).get(round_)
                p50, p99 = run.pct(50) * 1e3, run.pct(99) * 1e3
                per_round.append(Row(
                    target, load, round_, run.achieved, p50, p99,
                    p50 - base.pct(50) * 1e3 if base else float("nan"),
                    p99 - base.pct(99) * 1e3 if base else float("nan"),
                    run.errors, run.cpu_ms_per_req, run.pct(99.9) * 1e3, run.pct(100) * 1e3,
                ))
            means = {k: statistics.fmean(getattr(r, k) for r in per_round) for k in FIGURES}
            out.extend([*per_round, Row(target, load, "mean", **means)])
    return out


def report(all_rows: list[Row], gateway_workers: Sequence[int], pin: bool) -> None:
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in all_rows:
        groups.setdefault((r.target, r.load), []).append(r)

    def fmt(r: Row, key: str, spec: str) -> str:
        if r.target == "direct" and key in ("added_p50_ms", "added_p99_ms", "gateway_cpu_ms_per_req"):
            return ""  # nothing is added to, or by, direct
        return format(getattr(r, key), spec)

    lines = []
    for (target, load), rs in groups.items():
        for r in sorted(rs, key=lambda r: r.round != "mean"):  # the mean first, then each round
            first = r.round == "mean"
            lines.append([
                target if first else "", load if first else "", r.round, format(r.achieved_rps, ".0f"),
                fmt(r, "p50_ms", ".2f"), fmt(r, "p99_ms", ".2f"), fmt(r, "added_p50_ms", ".2f"),
                fmt(r, "added_p99_ms", ".2f"), fmt(r, "p999_ms", ".2f"), fmt(r, "max_ms", ".2f"),
                "" if first else f"{r.errors:.0f}", fmt(r, "gateway_cpu_ms_per_req", ".3f"),
            ])
    table(
        "gateways side by side on a zero-cost backend (mean of the rounds, then each round)",
        ["target", "load", "round", "req/s", "p50 ms", "p99 ms", "added p50", "added p99", "p99.9 ms", "max ms",
         "errors", "gw CPU ms/req"],
        lines,
    )
    if pin:
        note = ("pinned: the gateway under test alone on core 0; load generator, Redis, echo worker and zero "
                "backend on core 1")
        if any(n > 1 for n in gateway_workers):
            note += "; tokengate --workers N>1 gets cores 0,1 and so shares core 1 with the rest"
        console.print(note)
    closed = next((load for (_, load) in groups if load.startswith("closed")), "")

    def ratio(a: str, b: str, key: str) -> str | None:
        ra, rb = groups.get((a, closed)), groups.get((b, closed))
        if not ra or not rb:
            return None
        by_a = {r.round: float(getattr(r, key)) for r in ra}
        by_b = {r.round: float(getattr(r, key)) for r in rb}
        each = "/".join(f"{by_a[k] / by_b[k]:.2f}" for k in (1, 2) if k in by_a and k in by_b)
        return f"{by_a['mean'] / by_b['mean']:.2f} ({each})"

    names = [tokengate_name(n) for n in gateway_workers]
    pairs = [(n, "litellm") for n in names] + [(n, "tokengate") for n in names if n != "tokengate"]
    pairs += [("tokengate", BASELINE)]
    ratio_rows = [[f"{a} ÷ {b}", ratio(a, b, "achieved_rps"), ratio(a, b, "gateway_cpu_ms_per_req")]
                  for a, b in pairs]
    ratio_rows = [r for r in ratio_rows if r[1] is not None]
    if ratio_rows:
        table(f"ratios, {closed}: mean (round 1/round 2)", ["ratio", "req/s", "gateway CPU ms/req"], ratio_rows)


BASELINE = "tokengate (baseline tree)"


def tokengate_name(workers: int) -> str:
    return "tokengate" if workers == 1 else f"tokengate --workers {workers}"


def plot(all_rows: list[Row], rates: Sequence[float]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 0.01  # ms: log axis; an added latency at or below it is drawn there
    fig, ax = plt.subplots(figsize=(7, 4))
    means = [r for r in all_rows if r.round == "mean" and r.target != "direct"]
    for i, target in enumerate(dict.fromkeys(r.target for r in means)):
        pts = {r.load: r for r in means if r.target == target}
        xs = [x for x in rates if load_label("open", x) in pts]
        for key, style, what in (("added_p50_ms", "-", "p50"), ("added_p99_ms", "--", "p99")):
            ys = [max(getattr(pts[load_label("open", x)], key), floor) for x in xs]
            ax.plot(xs, ys, linestyle=style, marker="o", color=f"C{i}", label=f"{target} {what}")
    ax.set_xlabel("offered requests/s (open loop, Poisson)")
    ax.set_ylabel("added latency over direct (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("gateway added latency on a zero-cost backend (mean of 2 rounds)")
    path = save_plot(fig, "peers.png")
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load")
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients")
    parser.add_argument("--rates", default="200,500,1000,2000", help="open-loop offered loads, requests/s")
    parser.add_argument("--gateway-workers", default="1,2", help="tokengate gateway processes, one target each")
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM (and its install)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--json", action="store_true", help="one JSON line per row instead of tables")
    parser.add_argument("--baseline-tree", help="also run tokengate (one process) from this checkout of another "
                        "revision, built in place (setup.py build_ext --inplace), to compare before and after "
                        "in the same run")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r]
    gateway_workers = [int(n) for n in args.gateway_workers.split(",") if n]

    pin = not args.no_pin
    if pin and (shutil.which("taskset") is None or not {GATEWAY_CORE, REST_CORE} <= os.sched_getaffinity(0)):
        log.print(f"cannot pin (needs taskset and cores {GATEWAY_CORE},{REST_CORE}); running unpinned")
        pin = False
    if pin:
        os.sched_setaffinity(0, {REST_CORE})  # this load generator; children started plainly inherit it
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # an overloaded target holds many connections
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    litellm = None if args.no_litellm else install_litellm()
    targets = [Target("direct", "direct")]
    if litellm is not None:
        targets.append(Target("litellm", "litellm"))
    targets += [Target(tokengate_name(n), "tokengate", n) for n in gateway_workers]
    if args.baseline_tree:
        targets.append(Target(BASELINE, "tokengate", 1, str(Path(args.baseline_tree).resolve())))
    loads = [("closed", float(args.clients)), ("sequential", 1.0), *(("open", r) for r in rates)]

    results = run_rounds(targets, litellm, pin, loads, args.clients, args.duration)
    all_rows = rows(results)
    if args.json:
        for r in all_rows:
            print(orjson.dumps(dataclasses.asdict(r)).decode())
    else:
        report(all_rows, gateway_workers, pin)
    log.print(f"plot: {plot(all_rows, rates)}")


if __name__ == "__main__":
    main()
