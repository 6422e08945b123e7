"""Shared benchmark plumbing: processes to start, a lean HTTP client, statistics, tables."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from rich.console import Console
from rich.table import Table

from gateway.cli.embedded_redis import EmbeddedRedis, free_port
from sched_core.simulate.cli import fleet_profiles
from sched_core.simulate.profile import CostProfile

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
console = Console()


# -- processes -----------------------------------------------------------------------------


def spawn(
    args: list[str],
    log: Path,
    cpus: Sequence[int] = (),
    executable: str = sys.executable,
    env: Mapping[str, str | None] | None = None,
) -> subprocess.Popen[bytes]:
    """``executable args`` (this Python by default) logging to ``log``; with ``cpus``, pinned
    to those cores by ``taskset`` (which execs, so the pid is the program's own, and its
    children inherit the pinning). ``env`` is laid over this environment; None unsets."""
    merged: dict[str, str | None] = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env = {k: v for k, v in merged.items() if v is not None}
    pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen([*pin, executable, *args], stdout=out, stderr=subprocess.STDOUT, env=full_env)


def pin_threads(pid: int, cpus: Sequence[int]) -> None:
    """Pin every thread of a running process (``sched_setaffinity`` acts on one thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), set(cpus))


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and all its live descendants, from /proc."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        parent[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    tree, frontier = {pid}, [pid]
    while frontier:
        frontier = [child for child, ppid in parent.items() if ppid in frontier and child not in tree]
        tree.update(frontier)
    return sum(cpu.get(p, 0.0) for p in tree)


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_ready(
    base: str, procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 180, path: str = "/readyz"
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a benchmark process exited early; see bench/out/*.log")
        try:
            if httpx.get(base + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{base} not ready within {timeout_s} s")


@contextmanager
def backend(
    engine: str = "echo",
    workers: int = 1,
    echo_tokens: int = 16,
    slots: int = 32,
    model_dir: str | None = None,
    cpus: Sequence[int] = (),
    extra_worker: Sequence[str] = (),
    env: Mapping[str, str | None] | None = None,
    redis_cpus: Sequence[int] | None = None,
) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """Redis + N workers, as separate processes (pinned to ``cpus`` if given, Redis to
    ``redis_cpus`` where given apart, ``env`` laid over theirs); yields (redis_url, worker processes)."""
    OUT.mkdir(parents=True, exist_ok=True)
    with EmbeddedRedis() as redis:
        if (redis_on := cpus if redis_cpus is None else redis_cpus) and redis.proc is not None:
            pin_threads(redis.proc.pid, redis_on)
        model = ["--model", model_dir] if model_dir else []
        procs = [
            spawn(
                ["-m", "workers", "--redis-url", redis.url, "--engine", engine, "--echo-tokens", str(echo_tokens),
                 "--slots", str(slots), "--worker-id", f"bench-{i}", *model, *extra_worker],
                OUT / f"worker-{i}.log",
                cpus,
                env=env,
            )
            for i in range(workers)
        ]
        try:
            yield redis.url, procs
        finally:
            stop(procs)


@contextmanager
def gateway_server(
    redis_url: str,
    extra_gateway: Sequence[str] = (),
    model_dir: str | None = None,
    backend_procs: Sequence[subprocess.Popen[bytes]] = (),
    cpus: Sequence[int] = (),
    env: Mapping[str, str | None] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """One gateway process against ``redis_url`` (``env`` laid over its environment), ready
    (``/readyz``); yields its base URL and the process (for its pid)."""
    port = free_port()
    model = ["--model", model_dir] if model_dir else []
    proc = spawn(
        ["-m", "gateway.cli", "--log-level", "WARNING", "gateway", "--redis-url", redis_url,
         "--port", str(port), "--admin-token", ADMIN_TOKEN, *model, *extra_gateway],
        OUT / "gateway.log",
        cpus,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, [proc, *backend_procs])
        yield base, proc
    finally:
        stop([proc])


@contextmanager
def floor_server(cpus: Sequence[int] = ()) -> Iterator[str]:
    """``bench.floor_app`` (a zero-cost OpenAI chat endpoint) on uvicorn+httptools+uvloop,
    answering; yields its base URL."""
    port = free_port()
    proc = spawn(
        ["-m", "uvicorn", "bench.floor_app:app", "--port", str(port), "--http", "httptools", "--loop", "uvloop",
         "--log-level", "warning", "--no-access-log"],
        OUT / "floor.log",
        cpus,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, [proc], timeout_s=60, path="/healthz")
        yield base
    finally:
        stop([proc])


@contextmanager
def stack(
    engine: str = "echo",
    workers: int = 1,
    echo_tokens: int = 16,
    slots: int = 32,
    extra_gateway: Sequence[str] = (),
    model_dir: str | None = None,
    gateway_cpus: Sequence[int] = (),
    backend_cpus: Sequence[int] = (),
    extra_worker: Sequence[str] = (),
) -> Iterator[tuple[str, str, str]]:
    """Redis + N workers + one gateway, as separate processes (each group pinned to its cpus
    if given); yields (base_url, redis_url, API key of a tenant whose budget never binds)."""
    with backend(engine, workers, echo_tokens, slots, model_dir, backend_cpus, extra_worker) as (redis_url, procs):
        with gateway_server(redis_url, extra_gateway, model_dir, procs, cpus=gateway_cpus) as (base, _proc):
            yield base, redis_url, bench_key(base)


ADMIN_TOKEN = "bench-admin-token-0123456789"


def bench_key(base: str) -> str:
    """A key for a tenant with a budget far above any benchmark's load."""
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    body = {"name": "bench", "rate": 1e8, "burst": 10**10, "max_queue_delay_s": 0}
    httpx.post(base + "/admin/tenants", json=body, headers=admin).raise_for_status()
    r = httpx.post(base + "/admin/tenants/bench/keys", headers=admin)
    r.raise_for_status()
    return str(r.json()["key"])


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# -- a lean HTTP/1.1 client (so the load generator costs little of the 2 cores) --------------


class RawClient:
    """Keep-alive HTTP/1.1 POSTs over asyncio streams; one request per connection at a time."""

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None) -> None:
        self.host, self.port = host, port
        self.headers = headers or {}
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        while self._idle:
            conn = self._idle.pop()
            result = await self._post(conn, path, body, headers)
            if result is not None:  # None: the server closed this idle connection
                return result
        conn = await asyncio.open_connection(self.host, self.port)
        result = await self._post(conn, path, body, headers)
        if result is None:
            raise ConnectionError("the server closed a fresh connection")
        return result

    async def _post(
        self,
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        path: str,
        body: bytes,
        headers: dict[str, str] | None,
    ) -> tuple[int, bytes] | None:
        try:
            return await self._exchange(conn, path, body, headers)
        except BaseException:  # an error or a cancellation (a time-out) mid-exchange: the connection is spent
            conn[1].close()
            raise

    async def _exchange(
        self,
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        path: str,
        body: bytes,
        headers: dict[str, str] | None,
    ) -> tuple[int, bytes] | None:
        reader, writer = conn
        head = f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
        for k, v in {**self.headers, **(headers or {})}.items():
            head += f"{k}: {v}\r\n"
        writer.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
        try:
            status_line = await reader.readline()
        except ConnectionError:
            return None
        if not status_line:
            writer.close()
            return None
        length, chunked, keep = -1, False, True
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value == b"chunked"
            elif name == b"connection":
                keep = value != b"close"
        if chunked:  # a stream (SSE): chunks until the empty one
            parts: list[bytes] = []
            while size := int((await reader.readline()).split(b";")[0], 16):
                parts.append(await reader.readexactly(size))
                await reader.readexactly(2)
            await reader.readline()
            payload = b"".join(parts)
        elif length >= 0:
            payload = await reader.readexactly(length)
        else:
            payload, keep = await reader.read(), False
        if keep:
            self._idle.append(conn)
        else:
            writer.close()
        return int(status_line.split()[1]), payload

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def open_loop(
    send: object, rate: float, duration_s: float, seed: int = 0
) -> tuple[list[float], int, float]:
    """Poisson arrivals at ``rate``/s for ``duration_s``; returns latencies (s), errors, elapsed."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=int(rate * duration_s * 1.5) + 10)
    latencies: list[float] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        t0 = time.perf_counter()
        ok = await send()  # type: ignore[operator]
        if ok:
            latencies.append(time.perf_counter() - t0)
        else:
            errors += 1

    tasks: list[asyncio.Task[None]] = []
    start = time.perf_counter()
    due = start
    for gap in gaps:
        due += gap
        if due - start > duration_s:
            break
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return latencies, errors, time.perf_counter() - start


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def save_plot(fig: Any, name: str, dpi: int = 120) -> Path:
    """Lay out a matplotlib figure and write it to ``bench/out/<name>``; returns the path."""
    OUT.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    path = OUT / name
    fig.savefig(path, dpi=dpi)
    return path


def json_lines(rows: Iterable[Mapping[str, Any]]) -> None:
    """A benchmark's ``--json`` output: one JSON object per row, one per line."""
    for row in rows:
        print(orjson.dumps(row).decode())


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*(f"{x:.3f}" if isinstance(x, float) else str(x) for x in r))
    console.print(t)


@contextmanager
def hogs(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` other programs, each keeping one core busy (a spinning Python), while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def start_profile(redis_url: str, timeout_s: float = 600.0) -> CostProfile:
    """The profile the cpu worker measured of itself at start, once it published it (before it
    takes a job)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fleet_profiles(redis_url)["cpu"]
        except (LookupError, ValueError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker published no profile in {timeout_s:g} s") from None
            time.sleep(1.0)
