"""SmolLM2 on this CPU: tokens/s one request at a time vs through the gateway at concurrency 8.

    python -m bench.model [--requests 16] [--max-tokens 32] [--concurrency 1,8] [--json]

Baseline (same run): the engine in-process, one request at a time. Then the same requests
through `tokengate gateway` + one cpu worker (continuous batching) at each concurrency.
Greedy decoding, so every configuration generates the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from urllib.parse import urlparse

import orjson

from bench.harness import RawClient, auth, json_lines, stack, table
from common.protocol import Finished, SamplingParams, SeqJob
from workers import model_store
from workers.devices import probe

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about autumn.",
    "What is the capital of Japan? Answer with details.",
    "Give three tips for learning to code.",
    "Describe a cat to someone who has never seen one.",
    "What is 12 times 13? Show your work.",
    "Summarize the plot of Romeo and Juliet.",
    "List five fruits and their colors.",
]


def direct(model_dir: str, prompts: list[str], max_tokens: int) -> tuple[int, float]:
    from workers.hf_engine import HFEngine

    engine = HFEngine(model_store.Path(model_dir), probe("cpu"), slots=1)
    ids = [
        tuple(engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   return_dict=True)["input_ids"])
        for p in prompts
    ]
    params = SamplingParams(max_tokens, temperature=0.0)
    engine.add(SeqJob("warm", ids[0], params))
    while engine.busy:
        engine.step()
    tokens = 0
    t0 = time.perf_counter()
    for i, x in enumerate(ids):
        engine.add(SeqJob(str(i), x, params))
        while engine.busy:
            tokens += sum(e.completion_tokens for e in engine.step().events if isinstance(e, Finished))
    return tokens, time.perf_counter() - t0


async def through_gateway(
    base: str, key: str, prompts: list[str], max_tokens: int, concurrency: int
) -> tuple[int, float]:
    url = urlparse(base)
    client = RawClient(url.hostname or "127.0.0.1", url.port or 80, auth(key))
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    tokens = 0

    async def one(prompt: str) -> int:
        body = orjson.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens, "temperature": 0,
                             "messages": [{"role": "user", "content": prompt}]})
        status, payload = await client.post("/v1/chat/completions", body)
        assert status == 200, payload
        return int(orjson.loads(payload)["usage"]["completion_tokens"])

    async def runner() -> None:
        nonlocal tokens
        while not queue.empty():
            n = await one(queue.get_nowait())
            tokens += n

    await one(prompts[0])  # warm-up
    t0 = time.perf_counter()
    await asyncio.gather(*(runner() for _ in range(concurrency)))
    return tokens, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model_store.offline()
    spec = model_store.resolve(None, model_store.default_cache_dir())
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    rows = []
    tokens, secs = direct(str(spec.path), prompts, args.max_tokens)
    base_tps = tokens / secs
    rows.append({"config": "engine, one at a time", "concurrency": 1, "tokens": tokens, "seconds": secs,
                 "tokens_per_s": base_tps, "vs_one_at_a_time": 1.0})
    with stack(engine="hf", slots=32, model_dir=str(spec.path)) as (base, _, key):
        for c in (int(x) for x in args.concurrency.split(",")):
            tokens, secs = asyncio.run(through_gateway(base, key, prompts, args.max_tokens, c))
            rows.append({"config": "gateway + 1 cpu worker", "concurrency": c, "tokens": tokens, "seconds": secs,
                         "tokens_per_s": tokens / secs, "vs_one_at_a_time": tokens / secs / base_tps})
    if args.json:
        json_lines(rows)
        return
    table(
        f"SmolLM2-135M-Instruct on this CPU ({args.requests} chat requests, max_tokens {args.max_tokens}, greedy)",
        ["config", "concurrency", "tokens", "seconds", "tokens/s", "x one-at-a-time"],
        [[r["config"], r["concurrency"], r["tokens"], r["seconds"], r["tokens_per_s"], r["vs_one_at_a_time"]]
         for r in rows],
    )


if __name__ == "__main__":
    main()
