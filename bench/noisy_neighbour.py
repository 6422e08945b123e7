"""A quiet tenant beside a flooding one on one engine: is the quiet one served, and refused never?

    python -m bench.noisy_neighbour [--engine upstream|hf] [--seconds 120] [--noisy-clients 6]
                                    [--quiet-every-s 2] [--json]

NOISY keeps ``--noisy-clients`` long requests going (prompts of ~800 tokens, 96-token answers,
each numbered so that none is a cached prefix of another); QUIET sends a short chat (16-token
answer) every ``--quiet-every-s`` seconds, open loop. Both tenants have the same budget (one
that never binds: only the scheduler's fair share tells them apart) and the gateway's default
``--max-queue-wait-ms``. Phases, one run:

1. each tenant alone, one request at a time: QUIET's and NOISY's service times (the unit of
   the first-token target);
2. NOISY alone through tokengate for ``--seconds``: what it gets alone;
3. QUIET + NOISY through tokengate;
4. QUIET + NOISY straight to the engine (``--engine upstream`` only: llama.cpp's Python server,
   one sequence at a time, the server the upstream worker fronts).

It prints QUIET's first-token p50/p99 and its refusals, NOISY's completion tokens/s and its
refusals in each phase, and the issue's three targets: QUIET refused 0 times; QUIET's TTFT p99
at most 1.5x one NOISY request's service time; NOISY's throughput at least 0.9x of what it gets
alone less QUIET's share of the engine (QUIET's requests times its service time, per second).
``--engine hf`` runs the project's own worker on the default model instead (one slot: one
sequence at a time, as the upstream server). The engine is pinned to core 1 and everything
else to core 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import httpx

from bench.fronting import Outcome, one
from bench.harness import ADMIN_TOKEN, OUT, auth, backend, console, gateway_server, pct, table
from bench.llamacpp import LlamaServer

CLIENT_CPUS = (0,)
ENGINE_CPUS = (1,)
NOISY_TOKENS = 96
QUIET_TOKENS = 16
QUIET_PROMPT = "Name one colour of the sky."
# ~800 tokens of SmolLM2's tokenizer: a paragraph repeated, numbered per request
NOISY_BODY = ("Summarise the following notes from a long planning meeting about a product launch, "
              "its budget, its risks, the people involved and what each of them must do next. ") * 24
BUDGET = {"rate": 1e6, "burst": 10**9}  # equal, and never binding
CLIENT_TIMEOUT_S = 600.0  # the openai client's default: a long queue is waited out, not abandoned


@dataclass
class Phase:
    name: str
    quiet: list[Outcome]
    noisy: list[Outcome]
    wall_s: float


def _tenant(base: str, name: str) -> str:
    admin = auth(ADMIN_TOKEN)
    httpx.post(base + "/admin/tenants", json={"name": name, **BUDGET}, headers=admin).raise_for_status()
    reply = httpx.post(f"{base}/admin/tenants/{name}/keys", headers=admin)
    reply.raise_for_status()
    return str(reply.json()["key"])


class Side:
    """Where the load goes: a base URL, each tenant's headers, the model's name."""

    def __init__(self, url: str, quiet: dict[str, str], noisy: dict[str, str], model: str) -> None:
        self.url, self.quiet, self.noisy, self.model = url, quiet, noisy, model


_nonce = iter(range(10**9))


def noisy_prompt() -> str:
    return f"({next(_nonce)}) {NOISY_BODY}"


def quiet_prompt() -> str:
    return f"({next(_nonce)}) {QUIET_PROMPT}"


async def _noisy_loop(client: httpx.AsyncClient, side: Side, until: float, out: list[Outcome]) -> None:
    while time.monotonic() < until:
        got = await one(client, side.url, side.noisy, side.model, noisy_prompt(), NOISY_TOKENS, CLIENT_TIMEOUT_S)
        out.append(got)
        if got.retry_after_s:  # as the openai client does, at most a second here
            await asyncio.sleep(min(got.retry_after_s, 1.0))


async def _quiet_loop(client: httpx.AsyncClient, side: Side, until: float, every_s: float,
                      out: list[Outcome]) -> None:
    sent: list[asyncio.Task[Outcome]] = []
    while time.monotonic() < until:
        sent.append(asyncio.create_task(one(client, side.url, side.quiet, side.model, quiet_prompt(),
                                            QUIET_TOKENS, CLIENT_TIMEOUT_S)))
        await asyncio.sleep(every_s)
    out.extend(await asyncio.gather(*sent))


async def phase(name: str, side: Side, seconds: float, noisy_clients: int, quiet_every_s: float | None) -> Phase:
    quiet: list[Outcome] = []
    noisy: list[Outcome] = []
    limits = httpx.Limits(max_connections=noisy_clients + 64, max_keepalive_connections=noisy_clients + 64)
    started = time.monotonic()
    until = started + seconds
    async with httpx.AsyncClient(limits=limits) as client:
        loops = [_noisy_loop(client, side, until, noisy) for _ in range(noisy_clients)]
        if quiet_every_s is not None:
            loops.append(_quiet_loop(client, side, until, quiet_every_s, quiet))
        await asyncio.gather(*loops)
    return Phase(name, quiet, noisy, time.monotonic() - started)


async def service_s(side: Side, n: int) -> tuple[float, float]:
    """The median time of one QUIET request and of one NOISY request, each alone on the engine."""
    async with httpx.AsyncClient() as client:
        quiet = [await one(client, side.url, side.quiet, side.model, quiet_prompt(), QUIET_TOKENS) for _ in range(n)]
        noisy = [await one(client, side.url, side.noisy, side.model, noisy_prompt(), NOISY_TOKENS) for _ in range(n)]
    for o in (*quiet, *noisy):
        if o.error or o.total_s is None:
            raise RuntimeError(f"a request alone failed: {o.status} {o.error}")
    return pct([o.total_s or 0.0 for o in quiet], 50), pct([o.total_s or 0.0 for o in noisy], 50)


def _refused(outcomes: Sequence[Outcome]) -> int:
    return sum(1 for o in outcomes if o.status in (429, 503))


def _failed(outcomes: Sequence[Outcome]) -> int:
    return sum(1 for o in outcomes if o.error and o.status not in (429, 503))


def _ttfts(outcomes: Sequence[Outcome]) -> list[float]:
    return [o.ttft_s for o in outcomes if o.ttft_s is not None and not o.error]


def _why(outcomes: Sequence[Outcome]) -> str:
    """The first refusal's or failure's status and message ("" if none)."""
    return next((f"{o.status}: {o.error}" for o in outcomes if o.error), "")


def summary(p: Phase) -> dict[str, float | int | str]:
    q = _ttfts(p.quiet)
    return {
        "phase": p.name,
        "quiet_sent": len(p.quiet),
        "quiet_refused": _refused(p.quiet),
        "quiet_failed": _failed(p.quiet),
        "quiet_ttft_p50_s": pct(q, 50) if q else float("nan"),
        "quiet_ttft_p99_s": pct(q, 99) if q else float("nan"),
        "noisy_sent": len(p.noisy),
        "noisy_refused": _refused(p.noisy),
        "noisy_failed": _failed(p.noisy),
        "noisy_tokens_per_s": sum(o.tokens for o in p.noisy if not o.error) / p.wall_s,
        "quiet_tokens_per_s": sum(o.tokens for o in p.quiet if not o.error) / p.wall_s,
        "quiet_first_refusal": _why(p.quiet),
        "noisy_first_refusal": _why(p.noisy),
    }


async def run(args: argparse.Namespace, gateway: Side, direct: Side | None) -> dict[str, object]:
    await phase("warm-up", gateway, 10.0, 2, args.quiet_every_s)  # the worker's telemetry, the calibration
    quiet_s, noisy_s = await service_s(gateway, 3)
    phases = [
        await phase("tokengate, NOISY alone", gateway, args.seconds, args.noisy_clients, None),
        await phase("tokengate, QUIET + NOISY", gateway, args.seconds, args.noisy_clients, args.quiet_every_s),
    ]
    if direct is not None:
        phases.append(await phase("engine direct, QUIET + NOISY", direct, args.seconds, args.noisy_clients,
                                  args.quiet_every_s))
    rows = [summary(p) for p in phases]
    alone, both = rows[0], rows[1]
    quiet_busy = (float(both["quiet_sent"]) - float(both["quiet_refused"])) * quiet_s / phases[1].wall_s
    expected = float(alone["noisy_tokens_per_s"]) * max(0.0, 1.0 - quiet_busy)
    return {
        "engine": args.engine, "quiet_service_s": quiet_s, "noisy_service_s": noisy_s, "phases": rows,
        "targets": {
            "quiet_refused": both["quiet_refused"],
            "quiet_ttft_p99_over_noisy_service": float(both["quiet_ttft_p99_s"]) / noisy_s,
            "noisy_throughput_over_alone_less_quiet": float(both["noisy_tokens_per_s"]) / expected
            if expected else float("nan"),
            "quiet_engine_share": quiet_busy,
        },
    }


def report(result: dict[str, object]) -> None:
    phases = result["phases"]
    assert isinstance(phases, list)
    table(
        f"noisy neighbour ({result['engine']}; one QUIET request alone {result['quiet_service_s']:.2f} s, "
        f"one NOISY request alone {result['noisy_service_s']:.2f} s)",
        ["phase", "QUIET sent", "QUIET refused", "QUIET failed", "QUIET TTFT p50 s", "QUIET TTFT p99 s",
         "NOISY sent", "NOISY refused", "NOISY failed", "NOISY tok/s"],
        [(r["phase"], r["quiet_sent"], r["quiet_refused"], r["quiet_failed"], r["quiet_ttft_p50_s"],
          r["quiet_ttft_p99_s"], r["noisy_sent"], r["noisy_refused"], r["noisy_failed"], r["noisy_tokens_per_s"])
         for r in phases],
    )
    t = result["targets"]
    assert isinstance(t, dict)
    table("targets (tokengate, QUIET + NOISY)", ["figure", "value", "target", "met"], [
        ("QUIET refused", t["quiet_refused"], "0", t["quiet_refused"] == 0),
        ("QUIET TTFT p99 / one NOISY service time", t["quiet_ttft_p99_over_noisy_service"], "<= 1.5",
         t["quiet_ttft_p99_over_noisy_service"] <= 1.5),
        ("NOISY tok/s / (alone x (1 - QUIET's engine share))", t["noisy_throughput_over_alone_less_quiet"],
         ">= 0.9", t["noisy_throughput_over_alone_less_quiet"] >= 0.9),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("upstream", "hf"), default="upstream")
    parser.add_argument("--seconds", type=float, default=120.0, help="each loaded phase's length")
    parser.add_argument("--noisy-clients", type=int, default=6)
    parser.add_argument("--quiet-every-s", type=float, default=2.0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    with ExitStack() as stack:
        server: LlamaServer | None = None
        model_dir: str | None = None
        if args.engine == "upstream":
            server = LlamaServer(OUT / "llamacpp.log", cpus=",".join(map(str, ENGINE_CPUS))).start()
            stack.callback(server.stop)
            redis_url, procs = stack.enter_context(backend("upstream", slots=1, cpus=CLIENT_CPUS,
                                                           extra_worker=["--upstream-url", server.url]))
        else:  # the project's worker runs the model in its own process: it gets the engine's core
            from workers import model_store

            model_dir = str(model_store.resolve(None, model_store.default_cache_dir()).path)
            redis_url, procs = stack.enter_context(backend("hf", slots=1, model_dir=model_dir, cpus=ENGINE_CPUS))
        base, _proc = stack.enter_context(gateway_server(redis_url, (), model_dir, procs, cpus=CLIENT_CPUS))
        quiet = auth(_tenant(base, "quiet"))
        model = httpx.get(base + "/v1/models", headers=quiet).json()["data"][0]["id"]
        gateway = Side(base, quiet, auth(_tenant(base, "noisy")), model)
        direct = Side(server.url, {}, {}, "any") if server is not None else None
        result = asyncio.run(run(args, gateway, direct))
    report(result)
    if args.json:
        console.print(json.dumps(result, indent=1, default=float))


if __name__ == "__main__":
    main()
