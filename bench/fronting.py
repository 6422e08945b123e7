"""tokengate in front of llama.cpp's OpenAI-compatible server, against the server directly.

    python -m bench.fronting [--engine llamacpp-python|llama-server] [--slots N] [--concurrency 1,8,32]
                             [--requests 16,32,64] [--max-tokens 48] [--pairs 40] [--rounds 2]
                             [--load 0.7] [--load-s 60] [--kill-s 30] [--no-plot]

``--engine``: llama-cpp-python's server (one sequence at a time, ``--slots 1``) or llama.cpp's
C++ server (``make install-llama-server``; ``-np --slots``, 4 by default: continuous batching).

One run, the same workload both ways: closed loops of streaming greedy chats (four prompts
in turn, each numbered so that none is a cached prefix of the next), at each concurrency a
fixed number of requests per round, direct to the server and through ``tokengate`` (a
gateway and one ``--engine upstream`` worker with ``--slots 1``: the server runs one
sequence at a time), ``--rounds`` rounds, every other one in the other order. The server is
pinned to core 1, everything else (Redis, the gateway, the worker and this load generator)
to core 0, so tokengate's overhead does not slow the server down. It prints, per
concurrency, completion tokens per second and TTFT both ways with their ratios, and the
contracts' accuracy: the share of requests that ended within the ``x-tokengate-p99-ms`` the
gateway promised, and the measured over promised latency.

The TTFT tokengate adds is measured on its own first: one client, a request sent direct and
then one through tokengate, ``--pairs`` times; the median of the per-pair difference.

Then, with ``--kill-s`` > 0, a fault run through tokengate: 8 clients for that many seconds;
a third of the way in the server is SIGKILLed, and started again 2 s later. Every request
must end in a result or a clear error before its client's 60 s timeout (a hang is counted),
and the time from the server answering again to the first token a client receives is
reported. Writes ``bench/out/upstream.png``.

With ``--load`` > 0, before the fault run: the engine's capacity is measured direct (a closed
loop of 2 x slots clients), then requests arrive through tokengate in an open loop (Poisson)
at that share of it for ``--load-s`` seconds: the share that ended inside their p99 bound, and
the first-token promise's mean absolute error relative to the mean first token
(mean |measured - promised| / mean measured, ``x-tokengate-ttft-ms``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import orjson

from bench.harness import ADMIN_TOKEN, OUT, auth, console, pct, save_plot, stack, table
from bench.llamacpp import LlamaCppServer, LlamaServer
from workers.model_store import DEFAULT_MODEL_NAME as MODEL

GATEWAY_CPUS = (0,)
SERVER_CPUS = "1"
CLIENT_TIMEOUT_S = 60.0
PROMPTS = (
    "Tell me a story about a dragon and a knight.",
    "Explain how a bicycle works.",
    "Write a poem about the autumn rain.",
    "What should I pack for a week of hiking?",
)
_NONCE = itertools.count()


def prompt(base: str | None = None) -> str:
    """The next prompt (``base``, else the next of ``PROMPTS``), numbered: llama.cpp reuses
    the KV cache of the longest prefix it has seen, so a prompt sent twice in a row would skip
    its prefill the second time. Numbered, a request shares only the chat template's opening
    with the one before."""
    n = next(_NONCE)
    return f"({n}) {base or PROMPTS[n % len(PROMPTS)]}"


@dataclass
class Outcome:
    sent: float
    ttft_s: float | None = None
    total_s: float | None = None
    tokens: int = 0
    status: int = 0
    error: str = ""
    promised_s: float | None = None  # x-tokengate-latency-ms
    p99_s: float | None = None  # x-tokengate-p99-ms
    ttft_promised_s: float | None = None  # x-tokengate-ttft-ms
    first_at: float | None = None  # monotonic time of the first token
    retry_after_s: float = 0.0  # a 429/503's Retry-After
    ended: float = 0.0  # monotonic time it ended (a result or an error)


async def one(client: httpx.AsyncClient, url: str, headers: dict[str, str], model: str, prompt: str,
              max_tokens: int, timeout_s: float = CLIENT_TIMEOUT_S) -> Outcome:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    out = Outcome(time.monotonic())
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers,
                                 timeout=timeout_s) as reply:
            out.status = reply.status_code
            if "x-tokengate-p99-ms" in reply.headers:
                out.p99_s = float(reply.headers["x-tokengate-p99-ms"]) / 1000
                out.promised_s = float(reply.headers["x-tokengate-latency-ms"]) / 1000
                out.ttft_promised_s = float(reply.headers["x-tokengate-ttft-ms"]) / 1000
            if reply.status_code != 200:
                out.error = (await reply.aread()).decode(errors="replace")[:200]
                out.retry_after_s = float(reply.headers.get("retry-after", 0))
                return out
            async for line in reply.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                chunk = orjson.loads(line[5:])
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return out
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        if out.ttft_s is None:
                            out.first_at = time.monotonic()
                            out.ttft_s = out.first_at - out.sent
                        out.tokens += 1
        out.total_s = time.monotonic() - out.sent
    except httpx.TimeoutException:
        out.error = "hang: no end within the client's timeout"
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.ended = time.monotonic()
    return out


async def closed_loop(url: str, headers: dict[str, str], model: str, clients: int, requests: int,
                      max_tokens: int, until: float | None = None) -> tuple[list[Outcome], float]:
    """``clients`` loops sending one request after another: ``requests`` in all, or until
    ``until`` (monotonic); the outcomes and the wall time."""
    left = itertools.count()
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(limits=limits) as client:

        async def loop() -> None:
            while (until is None and next(left) < requests) or (until is not None and time.monotonic() < until):
                outcome = await one(client, url, headers, model, prompt(), max_tokens)
                outcomes.append(outcome)
                if outcome.retry_after_s:  # as the openai client does, at most a second here
                    await asyncio.sleep(min(outcome.retry_after_s, 1.0))

        started = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(clients)))
    return outcomes, time.monotonic() - started


def _summary(outcomes: Sequence[Outcome], wall_s: float) -> dict[str, float]:
    ok = [o for o in outcomes if o.total_s is not None and not o.error]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    for o in outcomes:
        if o.error:
            failed = len(outcomes) - len(ok)
            console.print(f"[red]failed[/red] ({failed} of {len(outcomes)}), e.g. {o.status}: {o.error}")
            break
    return {
        "ok": len(ok),
        "failed": len(outcomes) - len(ok),
        "tokens_per_s": sum(o.tokens for o in ok) / wall_s,
        "ttft_p50_ms": pct(ttfts, 50) * 1000,
        "ttft_p90_ms": pct(ttfts, 90) * 1000,
    }


def _accuracy(outcomes: Sequence[Outcome]) -> tuple[int, int, float]:
    """(requests with a p99 promise, of which ended within it, median measured/promised)."""
    kept = [o for o in outcomes if o.total_s is not None and o.p99_s is not None and not o.error]
    inside = sum(1 for o in kept if o.total_s is not None and o.p99_s is not None and o.total_s <= o.p99_s)
    ratios = [o.total_s / o.promised_s for o in kept if o.total_s and o.promised_s]
    return len(kept), inside, pct(ratios, 50)


def _mean(values: Sequence[float | None]) -> float:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else float("nan")


def ttft_error(outcomes: Sequence[Outcome]) -> float:
    """The first-token promise's mean absolute error, relative: mean |measured - promised| over
    the mean measured first token, for the requests answered with a promise."""
    pairs = [(o.ttft_s, o.ttft_promised_s) for o in outcomes
             if o.ttft_s is not None and o.ttft_promised_s is not None and not o.error]
    if not pairs:
        return float("nan")
    return sum(abs(m - p) for m, p in pairs) / sum(m for m, _ in pairs)


async def load_run(url: str, headers: dict[str, str], model: str, rate: float, seconds: float,
                   max_tokens: int) -> list[Outcome]:
    """Poisson arrivals at ``rate`` per second for ``seconds`` (open loop: arrivals do not wait
    for answers), each a streamed greedy chat; every outcome."""
    rng = random.Random(7)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(limits=limits) as client:

        async def send() -> None:
            outcomes.append(await one(client, url, headers, model, prompt(), max_tokens))

        tasks = []
        due = started = time.monotonic()
        while due - started < seconds:
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(send()))
        await asyncio.gather(*tasks)
    return outcomes


async def paired_ttft(sides: dict[str, tuple[str, dict[str, str], str]], pairs: int,
                      max_tokens: int) -> list[tuple[float, float]]:
    """One client, a request direct then one through tokengate (the next prompt of the same
    length), ``pairs`` times: (direct TTFT, tokengate TTFT) per pair. The machine's speed
    changes from minute to minute; paired, it cancels out of the difference."""
    out: list[tuple[float, float]] = []
    async with httpx.AsyncClient() as client:
        for i in range(pairs):
            base = PROMPTS[i % len(PROMPTS)]
            got = [await one(client, url, headers, name, prompt(base), max_tokens)
                   for url, headers, name in sides.values()]
            if all(o.ttft_s is not None for o in got):
                out.append((got[0].ttft_s or 0.0, got[1].ttft_s or 0.0))
    return out


async def _workers_down(base: str) -> bool:
    async with httpx.AsyncClient() as client:
        reply = await client.get(base + "/admin/workers", headers=auth(ADMIN_TOKEN))
        return any(w.get("down") for w in reply.json()["data"])


async def fault_run(server: LlamaServer, base: str, headers: dict[str, str], model: str, seconds: float,
                    max_tokens: int) -> dict[str, object]:
    started = time.monotonic()
    load = asyncio.create_task(closed_loop(base, headers, model, 8, 0, max_tokens, until=started + seconds))
    await asyncio.sleep(seconds / 3)
    killed_at = time.monotonic()
    await asyncio.to_thread(server.kill)
    await asyncio.sleep(2.0)
    await asyncio.to_thread(server.start)
    back_at = time.monotonic()
    up_again: float | None = None
    while up_again is None and time.monotonic() - back_at < 30:
        if not await _workers_down(base):
            up_again = time.monotonic() - back_at
        await asyncio.sleep(0.05)
    outcomes, _wall = await load
    firsts = [o.first_at for o in outcomes if o.first_at is not None and o.first_at > back_at]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            key = "hang" if o.error.startswith("hang") else f"{o.status or 'stream'}: {o.error[:60]}"
            errors[key] = errors.get(key, 0) + 1
    hit = [o for o in outcomes if o.sent < killed_at < o.ended]
    return {
        "requests": len(outcomes),
        "ok": sum(1 for o in outcomes if not o.error),
        "in_flight_at_kill": len(hit),
        "of_which_ok": sum(1 for o in hit if not o.error),
        "hangs": errors.get("hang", 0),
        "errors": errors,
        "killed_after_s": killed_at - started,
        "worker_up_after_s": up_again,
        "first_token_after_s": min(firsts) - back_at if firsts else None,
    }


def _plot(rows: dict[int, dict[str, dict[str, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = sorted(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for side, style in (("direct", "o-"), ("tokengate", "s--")):
        left.plot(conc, [rows[c][side]["tokens_per_s"] for c in conc], style, label=side)
        right.plot(conc, [rows[c][side]["ttft_p50_ms"] for c in conc], style, label=side)
    left.set(xscale="log", xlabel="concurrent clients", ylabel="completion tokens/s", title="throughput")
    left.set_ylim(bottom=0)
    right.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="TTFT p50 (ms)", title="first token")
    for ax in (left, right):
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.legend()
        ax.grid(alpha=0.3)
    console.print(f"plot: {save_plot(fig, 'upstream.png')}")


async def main_async(args: argparse.Namespace) -> None:
    concurrency = [int(x) for x in args.concurrency.split(",")]
    requests = [int(x) for x in args.requests.split(",")]
    if len(requests) != len(concurrency):
        raise SystemExit("--requests needs one count per --concurrency")
    server = (LlamaCppServer(OUT / "llama-server.log", slots=args.slots, cpus=SERVER_CPUS)
              if args.engine == "llama-server" else LlamaServer(OUT / "llamacpp.log", cpus=SERVER_CPUS))
    server.start()
    load: dict[str, float] | None = None
    try:
        # Redis, one upstream worker and a gateway, all on core 0
        with stack("upstream", slots=args.slots, gateway_cpus=GATEWAY_CPUS, backend_cpus=GATEWAY_CPUS,
                   extra_worker=["--upstream-url", server.url, "--model-name", MODEL]) as (base, _redis_url, key):
            model = httpx.get(base + "/v1/models", headers=auth(key)).json()["data"][0]["id"]
            sides = {"direct": (server.url, {}, "any"), "tokengate": (base, auth(key), model)}
            for url, headers, name in sides.values():  # warm both (and the worker's telemetry)
                await closed_loop(url, headers, name, 2, 6, args.max_tokens)
            paired = await paired_ttft(sides, args.pairs, args.max_tokens)
            rows: dict[int, dict[str, dict[str, float]]] = {}
            accuracy: list[tuple[int, int, int, float]] = []
            for c, n in zip(concurrency, requests, strict=True):
                pooled: dict[str, tuple[list[Outcome], float]] = {side: ([], 0.0) for side in sides}
                for r in range(args.rounds):  # the second round in the other order: drift cancels
                    for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                        url, headers, name = sides[side]
                        outcomes, wall = await closed_loop(url, headers, name, c, n, args.max_tokens)
                        pooled[side] = (pooled[side][0] + outcomes, pooled[side][1] + wall)
                rows[c] = {side: _summary(outcomes, wall) for side, (outcomes, wall) in pooled.items()}
                accuracy.append((c, *_accuracy(pooled["tokengate"][0])))
            if args.load > 0:  # the engine's capacity direct, then Poisson arrivals at a share of it
                done, wall = await closed_loop(server.url, {}, "any", 2 * args.slots, 8 * args.slots,
                                               args.max_tokens)
                capacity = sum(1 for o in done if not o.error) / wall
                outcomes = await load_run(base, auth(key), model, args.load * capacity, args.load_s, args.max_tokens)
                kept, inside, ratio = _accuracy(outcomes)
                load = {"capacity_per_s": capacity, "rate_per_s": args.load * capacity, "requests": len(outcomes),
                        "failed": sum(1 for o in outcomes if o.error), "kept": kept, "inside": inside,
                        "inside_share": inside / kept if kept else float("nan"),
                        "measured_over_promised_p50": ratio, "ttft_mae": ttft_error(outcomes),
                        "ttft_mean_s": _mean([o.ttft_s for o in outcomes if o.ttft_promised_s is not None]),
                        "ttft_promised_mean_s": _mean([o.ttft_promised_s for o in outcomes if o.ttft_s is not None])}
            fault = None
            if args.kill_s > 0:
                fault = await fault_run(server, base, auth(key), model, args.kill_s, args.max_tokens)
    finally:
        server.stop()

    table(
        f"{args.engine} (--slots {args.slots}) direct vs through tokengate (streaming greedy chats, "
        f"{args.max_tokens} tokens max)",
        ["clients", "direct tok/s", "tokengate tok/s", "ratio", "direct TTFT p50 ms", "tokengate TTFT p50 ms",
         "added p50 ms", "direct TTFT p90 ms", "tokengate TTFT p90 ms", "failed"],
        [
            (c, r["direct"]["tokens_per_s"], r["tokengate"]["tokens_per_s"],
             r["tokengate"]["tokens_per_s"] / r["direct"]["tokens_per_s"], r["direct"]["ttft_p50_ms"],
             r["tokengate"]["ttft_p50_ms"], r["tokengate"]["ttft_p50_ms"] - r["direct"]["ttft_p50_ms"],
             r["direct"]["ttft_p90_ms"], r["tokengate"]["ttft_p90_ms"],
             int(r["direct"]["failed"] + r["tokengate"]["failed"]))
            for c, r in rows.items()
        ],
    )
    table(
        "contracts of the upstream worker (x-tokengate-p99-ms against the measured latency)",
        ["clients", "requests", "inside p99 bound", "share", "measured / promised (p50)"],
        [(c, kept, inside, f"{inside / kept:.1%}" if kept else "-", ratio) for c, kept, inside, ratio in accuracy],
    )
    added = [t - d for d, t in paired]
    direct_ms, via_ms = pct([d for d, _ in paired], 50) * 1000, pct([t for _, t in paired], 50) * 1000
    console.print(
        f"TTFT, one client, {len(paired)} pairs (direct, then the same request through tokengate): direct p50 "
        f"{direct_ms:.2f} ms, tokengate p50 {via_ms:.2f} ms, added per pair p50 {pct(added, 50) * 1000:.2f} ms, "
        f"p90 {pct(added, 90) * 1000:.2f} ms"
    )
    kept = sum(a[1] for a in accuracy)
    inside = sum(a[2] for a in accuracy)
    console.print(f"all concurrencies: {inside}/{kept} inside the p99 bound ({inside / max(kept, 1):.1%})")
    if load is not None:
        console.print(
            f"open loop at {args.load:.0%} of the engine's capacity ({load['capacity_per_s']:.2f} req/s direct, "
            f"{args.slots * 2} clients): {load['requests']:.0f} requests over {args.load_s:.0f} s, "
            f"{load['failed']:.0f} failed; {load['inside']:.0f}/{load['kept']:.0f} inside the p99 bound "
            f"({load['inside_share']:.1%}); first-token mean absolute error {load['ttft_mae']:.1%} of the mean "
            f"(measured mean {load['ttft_mean_s'] * 1000:.0f} ms, "
            f"promised {load['ttft_promised_mean_s'] * 1000:.0f} ms); "
            f"measured / promised latency p50 {load['measured_over_promised_p50']:.2f}")
    if fault is not None:
        console.print(f"fault run ({args.kill_s:.0f} s, 8 clients, server SIGKILLed after "
                      f"{fault['killed_after_s']:.1f} s, started again 2 s later): {fault}")
    if not args.no_plot:
        _plot(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", default="16,32,64", help="requests per concurrency, in the same order")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--pairs", type=int, default=40, help="paired one-client requests for the added TTFT")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per concurrency, every other one reversed")
    parser.add_argument("--kill-s", type=float, default=30.0, help="the fault run's length (0: none)")
    parser.add_argument("--engine", choices=("llamacpp-python", "llama-server"), default="llamacpp-python",
                        help="llama-cpp-python's server (one sequence at a time) or llama.cpp's C++ server")
    parser.add_argument("--slots", type=int, default=0, help="the engine's parallelism (default: 1, llama-server 4)")
    parser.add_argument("--load", type=float, default=0.0,
                        help="after the rounds, Poisson arrivals at this share of the engine's capacity (0: none)")
    parser.add_argument("--load-s", type=float, default=60.0, help="the load run's length")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    args.slots = args.slots or (4 if args.engine == "llama-server" else 1)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
