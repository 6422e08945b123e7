"""Cost profile of a worker for the simulator: prefill and decode-step times of the real model.

    python -m bench.cost_profile                      # measure this machine's CPU worker (~2-4 min)
    python -m bench.cost_profile --pool gpu           # the same on a CUDA GPU, where there is one
    python -m bench.cost_profile --derive h100-sxm    # no GPU: derive one from published figures
    python -m bench.cost_profile --refit bench/out/profile-raw-cpu.json   # refit saved points
    python -m bench.cost_profile --refit sched_core/profiles/cpu-smollm2-135m.json  # step model only

Measuring drives ``workers.hf_engine.HFEngine`` exactly as a worker does and times whole
``step()`` calls (model forward, sampling, detokenization, KV-cache merge):

* prefill: B prompts of L tokens added at once, one step (each prompt stops after one token);
* decode: n prompts of K tokens admitted, then decode-only steps, each with n running and a
  KV width of K + generated tokens.

It fits, by least squares on relative error with non-negative coefficients,

    prefill(B, L) = a + b·B·L + b2·B·L²        decode(n, K) = c + d·n + e·n·K

and maps it onto the scheduler's step-time model (``common.stepmodel``, the same fit and
mapping as a worker's self-profile: attention's ``b2`` becomes ``prefill_attention``). It
writes the raw points, the fit and the spread of the points around it (``noise_cv``) to
``sched_core/profiles/<pool>-smollm2-135m.json``; the step model goes under ``step_model``
with the PathConfig field names, and seeds the scheduler.
``--refit`` on a profile recomputes only its ``step_model`` (from its points, or for a derived
profile from its formula) and leaves every other field as it is. The raw points are saved first to
``bench/out/profile-raw-<pool>.json``, so a failed fit never costs a second measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.harness import OUT, ROOT, table
from common.stepmodel import fit, formula_points, step_model
from workers import model_store
from workers.selfprofile import cpu_model, synthetic_prompt

PROFILES = ROOT / "sched_core" / "profiles"
PREFILL_GRID = [(1, 32), (1, 128), (1, 512), (1, 1024), (1, 2048), (4, 32), (4, 128), (4, 512),
                (4, 1024), (16, 32), (16, 128), (16, 512)]
DECODE_GRID = [(n, k) for k in (64, 512) for n in (1, 2, 4, 8, 16, 32)]
DECODE_STEPS = 5
#: What the step model stores beside the coefficients: the scheduler's batch limit per pool
#: (a policy, not a measurement) and the workers' per-step token budget.
MAX_BATCH = {"cpu": 8, "gpu": 64}
STEP_TOKENS = 256


# -- measuring ---------------------------------------------------------------------------


def measure(pool: str, reps: int) -> dict[str, Any]:
    from common.protocol import SamplingParams, SeqJob
    from workers.devices import probe
    from workers.hf_engine import HFEngine

    model_store.offline()
    spec = model_store.resolve(None, model_store.default_cache_dir())
    choice = probe(pool)
    engine = HFEngine(spec.path, choice, slots=64)
    salt = itertools.count()

    def add(n: int, length: int, tokens: int) -> None:
        params = SamplingParams(tokens, temperature=0.0, ignore_eos=True)
        for _ in range(n):
            i = next(salt)
            engine.add(SeqJob(f"s{i}", synthetic_prompt(length, i), params))

    def timed_step() -> float:
        if choice.device == "cuda":
            import torch

            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        if choice.device == "cuda":
            import torch

            torch.cuda.synchronize()
        return time.perf_counter() - t0

    add(4, 64, 4)  # warm-up
    while engine.busy:
        engine.step()
    prefill = []
    for batch, length in PREFILL_GRID:
        for _ in range(reps):
            add(batch, length, 1)
            seconds = timed_step()
            assert not engine.busy, "a prefill point must fit one step"
            prefill.append({"batch": batch, "tokens": length, "seconds": seconds})
        print(f"prefill B={batch:3d} L={length:5d}: "
              f"{statistics.median(p['seconds'] for p in prefill[-reps:]) * 1000:8.1f} ms")
    decode = []
    for n, kv in DECODE_GRID:
        add(n, kv, DECODE_STEPS + 4)
        while len(engine._running) < n:  # admit every sequence (32×512 takes two prefills)
            engine.step()
        engine.step()  # the first decode step after a merge is not timed
        for _ in range(DECODE_STEPS):
            assert engine._mask is not None
            running, width = len(engine._running), engine._mask.shape[1] + 1
            seconds = timed_step()
            decode.append({"running": running, "kv_tokens": width, "seconds": seconds})
        while engine.busy:
            engine.step()
        print(f"decode  n={n:3d} K={kv:5d}: "
              f"{statistics.median(d['seconds'] for d in decode[-DECODE_STEPS:]) * 1000:8.1f} ms")
    import torch

    return {
        "device": f"{cpu_model()}, {torch.get_num_threads()} torch threads ({choice.reason})",
        "torch": torch.__version__,
        "dtype": choice.dtype,
        "model": spec.name,
        "points": {"prefill": prefill, "decode": decode},
    }


# -- fitting -----------------------------------------------------------------------------


def fit_step_model(points: dict[str, list[dict[str, float]]], pool: str) -> dict[str, Any]:
    """The scheduler's step-time prior (PathConfig field names) of the formulas fitted to the
    raw points (``common.stepmodel``: the same fit and mapping as a worker's self-profile)."""
    return step_model(fit(points), MAX_BATCH[pool], STEP_TOKENS)


# -- deriving a GPU profile from published figures ---------------------------------------

#: Datasheet figures (NVIDIA H100 Tensor Core GPU datasheet, SXM5 80 GB): HBM3 bandwidth and
#: dense BF16 tensor throughput.
GPUS: dict[str, dict[str, Any]] = {
    "h100-sxm": {"name": "NVIDIA H100 SXM5 80GB", "bandwidth": 3.35e12, "bf16_flops": 989e12},
}

#: Assumptions, written into the profile next to the figures they qualify.
ASSUME: dict[str, float] = {
    "op_launch_s": 8e-6,  # one eager PyTorch op on CUDA: dispatcher + cudaLaunchKernel
    "ops_per_layer": 40,  # eager HF Llama layer: norms, projections, rotary, cache cat, sdpa, MLP
    "mfu_prefill": 0.25,  # small GEMMs (hidden 576) keep the tensor cores far from peak
    "mfu_decode": 0.05,  # GEMV-like decode matmuls
    "bandwidth_efficiency": 0.6,
    "host_per_seq_s": 30e-6,  # sampling, bookkeeping and incremental detokenization per sequence
    "kv_passes": 3,  # attention reads the cache; DynamicCache's torch.cat reads and writes it
}


def derive(gpu: str, model_dir: Path) -> dict[str, Any]:
    g = GPUS[gpu]
    cfg = json.loads((model_dir / "config.json").read_text())
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv_heads, inter, vocab = cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"]
    per_layer = hidden * (hidden + 2 * kv_heads * head_dim) + hidden * hidden + 3 * hidden * inter
    body = layers * per_layer  # non-embedding weights
    floor = layers * ASSUME["ops_per_layer"] * ASSUME["op_launch_s"]
    kv_bytes = 2 * layers * kv_heads * head_dim * 2  # K and V, bf16, per token
    bw = g["bandwidth"] * ASSUME["bandwidth_efficiency"]
    weights_read = (body + vocab * hidden) * 2 / bw
    fit_ = {
        "prefill": {
            "a": floor,
            "b": 2 * body / (g["bf16_flops"] * ASSUME["mfu_prefill"]),
            # causal attention: QK^T and AV, 2·L²/2 pairs per layer, 2 FLOPs per MAC
            "b2": 2 * layers * hidden / (g["bf16_flops"] * ASSUME["mfu_prefill"]),
        },
        "decode": {
            "c": max(floor, weights_read),
            "d": 2 * (body + vocab * hidden) / (g["bf16_flops"] * ASSUME["mfu_decode"])
            + ASSUME["host_per_seq_s"],
            "e": ASSUME["kv_passes"] * kv_bytes / bw,
        },
        "noise_cv": 0.05,
    }
    return {
        "name": f"gpu-{gpu}-smollm2-135m",
        "device": g["name"],
        "model": model_store.DEFAULT_MODEL_NAME,
        "dtype": "bfloat16",
        "derived": True,
        "pool": "gpu",
        "source": (f"derived, not measured: {g['name']} datasheet "
                   f"({g['bandwidth'] / 1e12:.2f} TB/s HBM3, "
                   f"{g['bf16_flops'] / 1e12:.0f} TFLOPS dense BF16) applied to the "
                   f"SmolLM2-135M config ({layers} layers, hidden {hidden}); efficiencies and "
                   "eager-mode launch costs are the stated assumptions"),
        "assumptions": ASSUME,
        "fit": fit_,
        "step_model": fit_step_model(formula_points(fit_, PREFILL_GRID, DECODE_GRID), "gpu"),
        "points": None,
    }


# -- command line ------------------------------------------------------------------------


def write(profile: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    f, m = profile["fit"], profile["step_model"]
    table(f"{profile['name']}{' (DERIVED)' if profile['derived'] else ''} -> {out}",
          ["term", "value"],
          [["prefill a (s)", f["prefill"]["a"]],
           ["prefill b (s/token)", f"{f['prefill']['b']:.3e}"],
           ["prefill b2 (s/token^2)", f"{f['prefill']['b2']:.3e}"],
           ["decode c (s)", f["decode"]["c"]], ["decode d (s/seq)", f"{f['decode']['d']:.3e}"],
           ["decode e (s/seq/kv token)", f"{f['decode']['e']:.3e}"],
           ["noise cv", f["noise_cv"]]]
          + [[f"step model {k}", f"{v:.3e}" if isinstance(v, float) else v] for k, v in m.items()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--derive", choices=sorted(GPUS), help="derive a GPU profile instead")
    parser.add_argument("--refit", type=Path, help="fit saved raw points instead of measuring")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.derive:
        model_store.offline()
        spec = model_store.resolve(None, model_store.default_cache_dir())
        write(derive(args.derive, spec.path),
              args.out or PROFILES / f"gpu-{args.derive}-smollm2-135m.json")
        return
    if args.refit:
        raw = json.loads(args.refit.read_text())
        if "fit" in raw:  # a profile: refresh its step model, keep everything else
            pool = raw.get("pool") or raw["name"].split("-", 1)[0]
            points = raw["points"] or formula_points(raw["fit"], PREFILL_GRID, DECODE_GRID)
            write(raw | {"pool": pool, "step_model": fit_step_model(points, pool)}, args.out or args.refit)
            return
    else:
        t0 = time.perf_counter()
        raw = measure(args.pool, args.reps)
        raw["measured_s"] = time.perf_counter() - t0
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"profile-raw-{args.pool}.json").write_text(json.dumps(raw, indent=1))
    profile = {
        "name": f"{args.pool}-smollm2-135m",
        "device": raw["device"],
        "model": raw["model"],
        "dtype": raw["dtype"],
        "derived": False,
        "pool": args.pool,
        "source": (f"measured by bench/cost_profile.py ({time.strftime('%Y-%m-%d')}), "
                   "2-core VM shared with other work"),
        "fit": fit(raw["points"]),
        "step_model": fit_step_model(raw["points"], args.pool),
        "points": raw["points"],
    }
    write(profile, args.out or PROFILES / f"{args.pool}-smollm2-135m.json")


if __name__ == "__main__":
    main()
