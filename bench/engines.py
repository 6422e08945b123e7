"""Continuous batching inside one CPU worker: tokengate's engine vs what `transformers` offers.

    python -m bench.engines [--sizes 1,8,32] [--new-tokens 32] [--step-tokens N] [--threads N] [--json]
    python -m bench.engines --join [--running 16] [--long-prompt 1024] [--budgets 64,128,256,512,0]

For each concurrency B, B chat prompts are decoded greedily for exactly --new-tokens
tokens (end-of-sequence ignored by taking the token budget as given) by:
  tokengate     workers.hf_engine.HFEngine: iteration-level batching, shared left-padded KV;
  generate      a plain batched `model.generate` (left padding), the issue's baseline;
  cb-manager    `model.generate_batch`, transformers' continuous-batching manager.
Reported: generated tokens/s and the ratio to the same engine at B=1.

--join: a long prompt arrives while --running sequences decode, once per per-step token
budget (0: no budget, the prompt is prefilled whole). Reported: the idle step (the running
sequences alone, median of five steps); the running sequences' worst inter-token gap from
the long prompt's arrival to its first token, the step it joins the batch included (each
running sequence gets one token per step, so a gap is a step's wall time), and the worst
step before that one (chunks only), each also over the idle step; the steps it took, the
long prompt's time to its first token, and the median of the three steps after it joined. Of --trials runs per
budget, the one with the smallest worst gap is reported (a worst case is one sample, and a
shared host's other work shows up in it).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.harness import json_lines, table
from bench.model import PROMPTS
from common.protocol import Finished, SamplingParams, SeqJob
from workers import model_store
from workers.cli import setting_default
from workers.devices import probe
from workers.hf_engine import HFEngine
from workers.memory import retain_freed_memory


def _prompts(engine: HFEngine, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        enc = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], add_generation_prompt=True, return_dict=True
        )
        out.append(list(enc["input_ids"]))
    return out


def run_tokengate(engine: HFEngine, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    params = SamplingParams(new_tokens, temperature=0.0)
    t0 = time.perf_counter()
    for i, x in enumerate(prompts):
        engine.add(SeqJob(str(i), tuple(x), params))
    tokens = 0
    while engine.busy:
        tokens += sum(e.completion_tokens for e in engine.step().events if isinstance(e, Finished))
    return tokens, time.perf_counter() - t0


def run_generate(engine: HFEngine, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    tok = engine.tokenizer
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = engine.model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    elapsed = time.perf_counter() - t0
    generated = out[:, batch["input_ids"].shape[1]:]
    eos = set(engine.eos_ids)
    tokens = 0
    for row in generated.tolist():  # count up to and including the first end-of-sequence
        for t in row:
            tokens += 1
            if t in eos:
                break
    return tokens, elapsed


def run_cb_manager(engine: HFEngine, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=list(engine.eos_ids),
                              pad_token_id=engine.pad_id)
    t0 = time.perf_counter()
    # the manager runs its own thread (and its own no-grad handling): no inference_mode here
    out = engine.model.generate_batch(prompts, generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.generated_tokens) for o in out.values()), elapsed


RUNNERS = {"tokengate": run_tokengate, "generate": run_generate, "cb-manager": run_cb_manager}


def _timed_step(engine: HFEngine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def run_join(engine: HFEngine, running: int, long_prompt: int, step_tokens: int) -> dict[str, float]:
    """The running sequences' worst gap while a ``long_prompt``-token prompt joins them."""
    engine.reset()
    engine.step_tokens = step_tokens
    forever = SamplingParams(100_000, temperature=0.0, ignore_eos=True)
    for i, x in enumerate(_prompts(engine, running)):
        engine.add(SeqJob(f"r{i}", tuple(x), forever))
    while engine.running < running or engine.queued_prefill:
        engine.step()
    idle = sorted(_timed_step(engine) for _ in range(5))[2]
    text = " ".join(PROMPTS) * (1 + long_prompt // 64)
    ids = tuple(engine.tokenizer.encode(text)[:long_prompt])
    assert len(ids) == long_prompt, "the repeated prompts are too short for --long-prompt"
    engine.add(SeqJob("long", ids, SamplingParams(100_000, temperature=0.0, ignore_eos=True)))
    t0 = time.perf_counter()
    gaps: list[float] = []
    while engine.queued_prefill:  # the long prompt's first token comes with its last chunk
        gaps.append(_timed_step(engine))
    ttft = time.perf_counter() - t0
    after = sorted(_timed_step(engine) for _ in range(3))[1]
    engine.reset()
    before_join = max(gaps[:-1] or gaps)  # the steps that only prefill chunks
    return {"idle_ms": idle * 1000, "worst_gap_ms": max(gaps) * 1000, "ratio": max(gaps) / idle,
            "chunk_ms": before_join * 1000, "chunk_ratio": before_join / idle, "steps": len(gaps),
            "ttft_s": ttft, "after_ms": after * 1000}


def main_join(args: argparse.Namespace, engine: HFEngine, model: str) -> None:
    run_join(engine, 2, 64, 0)  # warm-up
    rows = []
    for budget in [int(x) for x in args.budgets.split(",")]:
        # a worst case is one sample: on a shared host, keep the trial least disturbed
        trials = [run_join(engine, args.running, args.long_prompt, budget) for _ in range(args.trials)]
        rows.append({"step_tokens": budget, **min(trials, key=lambda r: r["worst_gap_ms"])})
    if args.json:
        json_lines(rows)
        return
    table(
        f"a {args.long_prompt}-token prompt joining {args.running} running sequences ({model}, this CPU)",
        ["step tokens", "idle step ms", "worst gap ms", "× idle", "worst chunk step ms", "× idle", "steps",
         "long TTFT s", "step after ms"],
        [[r["step_tokens"] or "unchunked", r["idle_ms"], r["worst_gap_ms"], r["ratio"], r["chunk_ms"],
          r["chunk_ratio"], r["steps"], r["ttft_s"], r["after_ms"]] for r in rows],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--engines", default=",".join(RUNNERS))
    parser.add_argument("--step-tokens", type=int, default=setting_default("step_tokens"),
                        help="the tokengate engine's per-step token budget (0: none)")
    parser.add_argument("--join", action="store_true", help="measure a long prompt joining running sequences")
    parser.add_argument("--running", type=int, default=16)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--budgets", default="64,128,256,512,0")
    parser.add_argument("--trials", type=int, default=2, help="--join: runs per budget, the best reported")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    retain_freed_memory()  # as the worker does
    model_store.offline()
    spec = model_store.resolve(None, model_store.default_cache_dir())
    engine = HFEngine(spec.path, probe("cpu"), slots=256, step_tokens=args.step_tokens)
    if args.join:
        main_join(args, engine, spec.name)
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = []
    for name in args.engines.split(","):
        run = RUNNERS[name]
        try:
            run(engine, _prompts(engine, 2), 4)  # warm-up
        except Exception as exc:  # an engine that cannot run here is reported, not hidden
            rows.append({"engine": name, "concurrency": 0, "error": repr(exc)[:120]})
            continue
        base = None
        for b in sizes:
            tokens, secs = run(engine, _prompts(engine, b), args.new_tokens)
            if tokens == 0:
                rows.append({"engine": name, "concurrency": b, "error": "generated no tokens"})
                continue
            tps = tokens / secs
            base = base or tps
            rows.append({"engine": name, "concurrency": b, "tokens": tokens, "seconds": secs,
                         "tokens_per_s": tps, "vs_b1": tps / base})
    if args.json:
        json_lines(rows)
        return
    table(
        f"continuous batching on this CPU ({spec.name}, greedy, {args.new_tokens} new tokens, "
        f"step tokens {args.step_tokens or 'unbudgeted'})",
        ["engine", "concurrency", "tokens", "seconds", "tokens/s", "x its B=1", "error"],
        [[r["engine"], r["concurrency"], r.get("tokens", ""), r.get("seconds", ""), r.get("tokens_per_s", ""),
          r.get("vs_b1", ""), r.get("error", "")] for r in rows],
    )


if __name__ == "__main__":
    main()
