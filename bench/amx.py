"""Prefill and decode of the model on this CPU: fp32 against bf16 on Intel AMX, same run.

    python -m bench.amx [--lengths 128,512,2048] [--batches 1,8,32] [--threads N] [--json]
    python -m bench.amx --model DIR --random-init     # a config only: random weights, same shapes
    python -m bench.amx --variants                   # also try what might make bf16 prefill faster

It first says what the CPU has (model name, AMX and AVX-512 flags, cores, torch threads) and
what torch reaches (``torch.cpu._is_amx_tile_supported``, oneDNN). Then, per dtype, one
forward pass of the model (``transformers``, eager PyTorch, the worker's own code path):

* prefill: one prompt of L tokens, tokens/s (median of --reps after a warm-up);
* decode: one token for each of B sequences holding 128 KV tokens each, ms per step.

bf16 is measured where a CPU worker runs it (``workers/devices.py``: AMX, or AVX512-BF16
without AMX), and elsewhere only with ``--force-bf16`` (oneDNN then emulates it, which is
not the path a worker takes); where AMX is absent the run says so. ``--variants`` adds bf16
prefill with the attention implementations ``sdpa`` and ``eager``, with ``torch.compile``
and with half the threads, each as a ratio to plain bf16, so what measures better can be
kept. Timings of one run compare with each other only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from workers.devices import AMX_FLAGS, choose, cpu_flags
from workers.selfprofile import cpu_model

KV = 128  # KV tokens each decoding sequence holds


def cpu_facts() -> dict[str, Any]:
    flags = cpu_flags()
    amx_torch = getattr(torch.cpu, "_is_amx_tile_supported", lambda: None)()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "amx_flags": sorted(f for f in flags if f.startswith("amx")),
            "amx": AMX_FLAGS <= flags, "avx512": sorted(f for f in flags if f.startswith("avx512"))[:6],
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "torch_sees_amx": amx_torch,
            "onednn": torch.backends.mkldnn.is_available()}


def load(model_dir: Path, dtype: torch.dtype, random_init: bool, attn: str | None = None) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw: dict[str, Any] = {"attn_implementation": attn} if attn else {}
    if random_init:
        config = AutoConfig.from_pretrained(model_dir, **kw)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
    return model.eval()


def _median_s(fn: Any, reps: int) -> float:
    fn()  # warm-up: first-call costs (oneDNN primitive creation) are not the steady state
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def prefill_tokens_per_s(model: Any, length: int, reps: int) -> float:
    ids = torch.randint(100, 30000, (1, length))
    return length / _median_s(lambda: model(input_ids=ids, use_cache=True), reps)


@torch.inference_mode()
def decode_step_ms(model: Any, batch: int, reps: int) -> float:
    from transformers import DynamicCache

    from workers.hf_engine import cache_keyword

    ids = torch.randint(100, 30000, (batch, KV))
    kv = {cache_keyword(model): DynamicCache()}
    model(input_ids=ids, use_cache=True, **kv)
    token = torch.randint(100, 30000, (batch, 1))

    def step() -> None:  # the cache grows by one token a step: 128 to 128 + reps + 1
        model(input_ids=token, use_cache=True, **kv)

    return _median_s(step, reps) * 1000


def measure(model: Any, lengths: list[int], batches: list[int], reps: int) -> dict[str, dict[int, float]]:
    return {"prefill_tokens_per_s": {n: prefill_tokens_per_s(model, n, reps) for n in lengths},
            "decode_step_ms": {b: decode_step_ms(model, b, reps) for b in batches}}


def variants(model_dir: Path, random_init: bool, length: int, reps: int, base: float) -> dict[str, float]:
    """bf16 prefill of ``length`` tokens under each variant, as tokens/s."""
    out: dict[str, float] = {}
    for attn in ("sdpa", "eager"):
        out[f"attn={attn}"] = prefill_tokens_per_s(load(model_dir, torch.bfloat16, random_init, attn), length, reps)
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(max(1, threads // 2))
        out[f"threads={threads // 2}"] = prefill_tokens_per_s(load(model_dir, torch.bfloat16, random_init), length,
                                                              reps)
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    compiled = torch.compile(load(model_dir, torch.bfloat16, random_init))
    prefill_tokens_per_s(compiled, length, 1)  # compiles
    compile_s = time.perf_counter() - t0
    out["torch.compile"] = prefill_tokens_per_s(compiled, length, reps)
    out["torch.compile: compile s"] = compile_s
    out["plain bf16"] = base
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a model directory (default: the default model)")
    parser.add_argument("--random-init", action="store_true", help="build the model from its config, random weights")
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--force-bf16", action="store_true", help="measure bf16 also without AMX")
    parser.add_argument("--variants", action="store_true", help="also try bf16 prefill variants")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        from workers import model_store

        model_store.offline()
        model_dir = model_store.resolve(None, model_store.default_cache_dir()).path
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    facts = cpu_facts()
    console = Console()
    console.print("CPU: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    dtypes = {"fp32": torch.float32}
    worker = choose("cpu", cpu_flags(), cuda=False, ipex_installed=False)
    console.print(f"a CPU worker here runs {worker.dtype}: {worker.reason}")
    if worker.dtype == "bfloat16" or args.force_bf16:
        dtypes["bf16"] = torch.bfloat16
    else:
        console.print(f"no AMX on this CPU (missing {', '.join(sorted(AMX_FLAGS - cpu_flags()))}): fp32 only")
    results = {name: measure(load(model_dir, dtype, args.random_init), lengths, batches, args.reps)
               for name, dtype in dtypes.items()}
    table = Table(title=f"one forward pass, {facts['cpu']}, {torch.get_num_threads()} threads")
    for col in ["measure", *dtypes, *(["bf16 / fp32"] if "bf16" in dtypes else [])]:
        table.add_column(col, justify="right")
    for key, unit in (("prefill_tokens_per_s", "prefill tokens/s, L="), ("decode_step_ms", "decode ms/step, B=")):
        for size in lengths if key.startswith("prefill") else batches:
            row = [f"{unit}{size}"] + [f"{results[d][key][size]:.1f}" for d in dtypes]
            if "bf16" in dtypes:
                ratio = results["bf16"][key][size] / results["fp32"][key][size]
                row.append(f"{ratio if key.startswith('prefill') else 1 / ratio:.2f}x faster")
            table.add_row(*row)
    console.print(table)
    doc: dict[str, Any] = {"facts": facts, "results": results}
    if args.variants and "bf16" in dtypes:
        length = 512 if 512 in lengths else lengths[0]
        base = results["bf16"]["prefill_tokens_per_s"][length]
        found = variants(model_dir, args.random_init, length, args.reps, base)
        doc["variants"] = {"length": length, "tokens_per_s": found}
        vt = Table(title=f"bf16 prefill variants, L={length}")
        vt.add_column("variant")
        vt.add_column("tokens/s (compile: s)", justify="right")
        vt.add_column("vs plain bf16", justify="right")
        for name, value in found.items():
            ratio = "" if "compile s" in name else f"{value / found['plain bf16']:.2f}"
            vt.add_row(name, f"{value:.1f}", ratio)
        console.print(vt)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1, default=str))


if __name__ == "__main__":
    main()
