"""Live traffic for the benchmarks that replay the trace through a real gateway: the trace slice,
the tenants, streamed requests timed at the client (with the contract each one was promised),
arrivals on schedule, and a closed loop that measures the worker's capacity.

Rows of the Azure LLM code trace (TIMESTAMP, ContextTokens, GeneratedTokens) become requests
of random token ids (exactly that many prompt tokens, divided by a length scale) asking for
exactly their output (capped, ``ignore_eos``); arrival times are relative to the slice's first.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import numpy as np

from bench.harness import ADMIN_TOKEN, ROOT
from sched_core.simulate.workload import parse_trace

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "azure_llm_code_2023.csv"
BUDGETS = (4000.0, 2000.0, 1000.0)  # tokens/s of the tenants, in turn
MODEL = "SmolLM2-135M-Instruct"
SLOTS = 32  # the worker's slots (the default of `tokengate worker`)
#: The flags of a gateway that measures a worker's capacity (``closed_loop``): no wait bound. With
#: the default 5 s bound, 32 requests outstanding on one cpu worker drew 324 `503 overloaded` of
#: 400, and the capacity counted the few that passed (1.5 to 9.0 requests/s in seven runs, once nan).
CAPACITY_FLAGS = ("--max-queue-wait-ms", "0")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Row:
    at: float  # seconds after the slice's first arrival
    prompt: int
    output: int


def load_trace(path: Path, start: int, n: int, speed: float, length_scale: float, max_output: int) -> list[Row]:
    """Rows start..start+n of the trace (parsed and checked by the simulator's reader, which
    names the line of a malformed row), times relative to the slice's first arrival and
    divided by ``speed``."""
    with open(path, newline="") as f:
        rows = parse_trace(f, str(path))[start : start + n]
    t0 = rows[0].time_s
    return [
        Row(
            at=(r.time_s - t0) / speed,
            prompt=max(1, round(r.prompt_tokens / length_scale)),
            output=max(1, min(max_output, r.output_tokens)),
        )
        for r in rows
    ]


def scaled(rows: list[Row], rate: float) -> list[Row]:
    """The slice's arrivals stretched or compressed to a mean rate of ``rate`` requests/s."""
    native = (len(rows) - 1) / max(rows[-1].at, 1e-9)
    return [Row(r.at * native / rate, r.prompt, r.output) for r in rows]


def make_tenants(base: str, n: int) -> list[str]:
    """``n`` tenants with the ``BUDGETS`` in turn; their API keys."""
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    keys = []
    for i in range(n):
        rate = BUDGETS[i % len(BUDGETS)]
        # the default burst: 10 s of its rate, and at least one request of the model's context (a burst of
        # 8 s, as before issue 38, no longer held one at 1000 tokens/s and is refused at create)
        body = {"name": f"tenant{i}", "rate": rate, "max_queue_delay_s": 30}
        httpx.post(base + "/admin/tenants", json=body, headers=admin).raise_for_status()
        r = httpx.post(base + f"/admin/tenants/tenant{i}/keys", headers=admin)
        r.raise_for_status()
        keys.append(str(r.json()["key"]))
    return keys


def prompts(rows: list[Row], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40_000, size=r.prompt).tolist() for r in rows]


def client(base: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    return httpx.AsyncClient(base_url=base, timeout=900, limits=limits)


@dataclass(slots=True)
class Sample:
    """One request as its client saw it (seconds from its start; nan: never)."""

    tenant: int
    tokens: int
    status: int = 0
    ok: bool = False
    error: str = ""
    message: str = ""  # a refusal's reason
    answered_s: float = math.nan  # the response's headers
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    # the contract (or, refused for its SLO, the best bounds offered)
    ttft_pred_s: float = math.nan
    total_pred_s: float = math.nan
    ttft_bound_s: float = math.nan
    total_bound_s: float = math.nan

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else 0.0


def _ms(headers: httpx.Headers, name: str) -> float:
    value = headers.get(name)
    return float(value) / 1000 if value is not None else math.nan


async def stream(http: httpx.AsyncClient, keys: list[str], i: int, prompt: list[int], tokens: int,
                 extra: dict[str, str] | None = None) -> Sample:
    """Request ``i``'s streamed completion of exactly ``tokens`` tokens, from the tenants in
    turn, timed from the request's start."""
    tenant = i % len(keys)
    sample = Sample(tenant, tokens)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    headers = {"authorization": f"Bearer {keys[tenant]}", **(extra or {})}
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        sample.answered_s = time.perf_counter() - t0
        sample.status = r.status_code
        h = r.headers
        sample.ttft_pred_s, sample.total_pred_s = _ms(h, "x-tokengate-ttft-ms"), _ms(h, "x-tokengate-latency-ms")
        sample.ttft_bound_s, sample.total_bound_s = _ms(h, "x-tokengate-ttft-p99-ms"), _ms(h, "x-tokengate-p99-ms")
        if r.status_code != 200:
            await r.aread()
            error = r.json().get("error", {})
            sample.error = str(error.get("code"))
            sample.message = str(error.get("message", ""))
            return sample
        async for line in r.aiter_lines():
            if line.startswith("data: ") and math.isnan(sample.ttft_s) and line != "data: [DONE]":
                sample.ttft_s = time.perf_counter() - t0
            if line == "data: [DONE]":
                sample.ok = True
    sample.e2e_s = time.perf_counter() - t0
    return sample


async def at_arrivals(rows: list[Row], one: Callable[[int, Row], Awaitable[T]]) -> list[T]:
    """Start ``one(i, row)`` for every row at its arrival time (seconds from now); their results."""
    tasks = []
    start = time.perf_counter()
    for i, row in enumerate(rows):
        delay = start + row.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, row)))
    return list(await asyncio.gather(*tasks))


async def replay(base: str, keys: list[str], rows: list[Row], seed: int,
                 extra: dict[str, str] | None = None) -> tuple[list[Sample], float]:
    """Stream every row at its arrival time; returns the samples and the wall time of the run."""
    bodies = prompts(rows, seed)
    async with client(base) as http:
        start = time.perf_counter()
        samples = await at_arrivals(rows, lambda i, row: stream(http, keys, i, bodies[i], row.output, extra))
        return samples, time.perf_counter() - start


async def closed_loop(base: str, keys: list[str], rows: list[Row], seed: int, clients: int) -> float:
    """Requests/s the worker sustains with ``clients`` requests always outstanding (the slice
    twice over, in order): completions counted from the ``clients``-th to the last one
    before the first client runs dry, so neither the start nor the drain is in it. On a gateway
    started with ``CAPACITY_FLAGS``; a request that fails is an error: the completions between
    refusals are not the worker's capacity."""
    work = rows + rows
    bodies = prompts(work, seed)
    done: list[float] = []
    failed: list[Sample] = []
    next_row = iter(range(len(work)))
    async with client(base) as http:

        async def loop() -> None:
            for i in next_row:
                sample = await stream(http, keys, i, bodies[i], work[i].output)
                if sample.ok:
                    done.append(time.perf_counter())
                else:
                    failed.append(sample)

        await asyncio.gather(*(loop() for _ in range(clients)))
    if failed:
        first = failed[0]
        raise RuntimeError(f"{len(failed)} of {len(work)} requests of the capacity's closed loop failed "
                           f"(first: {first.status} {first.error} {first.message}): no capacity to measure")
    steady = done[clients - 1 : len(done) - clients]
    return (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 else math.nan
