"""A worker's start-up self-profile on this machine, and what its step model promises against
what the engine then takes: the first-request check of issue 24 without a gateway or Redis.

    python -m bench.start_profile [--pool cpu|gpu] [--dtype auto|float32|bfloat16] [--starts 3] [--json F]

Each start builds the engine a worker builds (``workers.hf_engine.HFEngine``, the device and
dtype ``workers.devices`` picks, ``--step-tokens`` as a worker's default), warms it up like a
worker, and runs ``workers.selfprofile.obtain`` into a fresh profile directory (so it
measures; ``--reuse`` keeps one directory and shows the re-check). Then, on the idle engine,
one prompt each of 250, 2,000 and 4,000 tokens with one token out, and a 48-token answer:
the step model's promise for an idle worker (what the scheduler prices a first request
with: ``prefill_launch + prefill_token·L + prefill_attention·L²``; plus, for the answer, its decode steps) against
the measured time. The tables print the profile's cost and figures and each ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from common import stepmodel
from workers import selfprofile as sp
from workers.cli import setting_default

CHECKS = ((250, 1), (2000, 1), (4000, 1), (8, 48))


def _engine(pool: str, dtype: str, model: Path | None, slots: int, step_tokens: int) -> Any:
    from workers import model_store
    from workers.devices import probe
    from workers.hf_engine import HFEngine

    model_store.offline()
    path = model if model is not None else model_store.resolve(None, model_store.default_cache_dir()).path
    return HFEngine(path, probe(pool, dtype), slots=slots, step_tokens=step_tokens)


def promised_s(model: dict[str, float], prompt: int, out: int) -> float:
    """An idle worker's time for ``prompt`` tokens in and ``out`` out, by the step model."""
    fit = stepmodel.as_fit(model)
    return stepmodel.prefill_s(fit, 1, prompt) + sum(stepmodel.decode_s(fit, 1, prompt + i) for i in range(1, out))


def took_s(engine: Any, prompt: int, out: int) -> float:
    run = sp.Run(engine, float("inf"))
    run.add(1, prompt, out)
    t0 = time.perf_counter()
    run.drain()
    return time.perf_counter() - t0


def one_start(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine = _engine(args.pool, args.dtype, args.model, args.slots, args.step_tokens)
    loaded = time.perf_counter() - t0
    warm = sp.Run(engine, float("inf"))
    warm.add(1, 32, 16)  # the worker's warm-up
    warm.drain()
    t1 = time.perf_counter()
    profile = sp.obtain(engine, pool=args.pool, model="bench", setup={"step_tokens": engine.step_tokens},
                        budget_s=args.budget, slots=engine.slots, directory=directory)
    cost = time.perf_counter() - t1
    assert profile is not None, "the self-profile failed"
    checks = []
    for prompt, out in CHECKS:
        promise = promised_s(profile["step_model"], prompt, out)
        took = took_s(engine, prompt, out)
        checks.append({"prompt": prompt, "out": out, "promised_s": promise, "took_s": took, "ratio": took / promise})
    return {"load_s": loaded, "profile_s": cost, "how": profile["how"], "device": profile["device"],
            "facts": profile["facts"], "fit": profile["fit"], "step_model": profile["step_model"],
            "summary": profile["summary"], "mixed_error": profile["mixed_error"], "checks": checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--dtype", default="auto", help="a CPU worker's dtype (auto, float32, bfloat16)")
    parser.add_argument("--model", type=Path, help="a model directory (default: the default model)")
    parser.add_argument("--slots", type=int, default=setting_default("slots"))
    parser.add_argument("--step-tokens", type=int, default=setting_default("step_tokens"))
    parser.add_argument("--budget", type=float, default=setting_default("profile_s"), help="the profile's budget, s")
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--reuse", action="store_true", help="one profile directory for every start")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    console = Console()
    starts = []
    with tempfile.TemporaryDirectory() as shared:
        for _ in range(args.starts):
            with tempfile.TemporaryDirectory() as own:
                starts.append(one_start(args, Path(shared if args.reuse else own)))
    first = starts[0]
    console.print(f"{first['device']}; facts: {first['facts']}")
    t = Table(title=f"self-profile at start ({args.pool}, step tokens {args.step_tokens})")
    for col in ("start", "how", "cost s", "prefill tok/s @512", "decode ms @1x256", "mixed err", "noise cv"):
        t.add_column(col, justify="right")
    for i, s in enumerate(starts):
        t.add_row(str(i + 1), s["how"], f"{s['profile_s']:.2f}", f"{s['summary']['prefill_tokens_per_s']:.0f}",
                  f"{s['summary']['decode_step_ms']:.2f}",
                  "-" if s["mixed_error"] is None else f"{s['mixed_error']:.2f}", f"{s['fit']['noise_cv']:.3f}")
    console.print(t)
    c = Table(title="an idle worker's promise by the measured step model, and what the engine took")
    for col in ("start", "prompt", "out", "promised ms", "took ms", "took / promised"):
        c.add_column(col, justify="right")
    for i, s in enumerate(starts):
        for ch in s["checks"]:
            c.add_row(str(i + 1), str(ch["prompt"]), str(ch["out"]), f"{ch['promised_s'] * 1000:.1f}",
                      f"{ch['took_s'] * 1000:.1f}", f"{ch['ratio']:.2f}")
    console.print(c)
    ratios = [ch["ratio"] for s in starts for ch in s["checks"]]
    worst = max(max(r, 1 / r) for r in ratios)
    console.print(f"within 1.5x: {sum(1 / 1.5 <= r <= 1.5 for r in ratios)} of {len(ratios)}; worst {worst:.2f}x; "
                  f"largest profile cost {max(s['profile_s'] for s in starts):.2f} s")
    if args.json:
        args.json.write_text(json.dumps(starts, indent=1))


if __name__ == "__main__":
    main()
