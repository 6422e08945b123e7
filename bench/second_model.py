"""A second real model, built here: a small Llama with random weights beside SmolLM2's tokenizer.

    python -m bench.second_model OUT_DIR [--layers 4] [--hidden 256]

Several models behind one deployment (issue 39) need a second model that differs from the
packaged SmolLM2-135M in speed and shape, and nothing may be downloaded. ``build`` makes one
with ``transformers`` (a ``LlamaConfig`` of a few layers and a narrower hidden size, random
weights from a fixed seed, saved as safetensors) and copies the packaged model's tokenizer,
chat template and generation config beside it, so a worker loads it as any model directory
and a gateway counts its tokens as SmolLM2's. Its answers are noise; its steps are real.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from common.tokenizer_bundle import BUNDLE_FILES
from workers import model_store

DEFAULT_NAME = "random-llama"


def build(target: Path, tokenizer_from: Path, *, layers: int = 4, hidden: int = 256, heads: int = 4,
          kv_heads: int = 2, intermediate: int = 768, seed: int = 0) -> model_store.ModelSpec:
    """A random-weights Llama in ``target`` (made once: a directory holding one is reused),
    with ``tokenizer_from``'s tokenizer files and its vocabulary and context."""
    if not (target / "model.safetensors").is_file():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        source = json.loads((tokenizer_from / "config.json").read_text())
        config = LlamaConfig(vocab_size=source["vocab_size"], hidden_size=hidden, intermediate_size=intermediate,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             max_position_embeddings=source.get("max_position_embeddings", 2048),
                             bos_token_id=source.get("bos_token_id"), eos_token_id=source.get("eos_token_id"),
                             pad_token_id=source.get("pad_token_id"), tie_word_embeddings=True)
        torch.manual_seed(seed)
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(staging, safe_serialization=True)
        for name in BUNDLE_FILES:
            if name != "config.json" and (tokenizer_from / name).is_file():
                shutil.copyfile(tokenizer_from / name, staging / name)
        shutil.rmtree(target, ignore_errors=True)
        staging.replace(target)
    return model_store.ModelSpec(DEFAULT_NAME, target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the directory to write the model into")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    packaged = model_store.resolve(None, model_store.default_cache_dir())
    spec = build(args.out, packaged.path, layers=args.layers, hidden=args.hidden)
    print(f"{spec.name} in {spec.path}: serve it with `tokengate worker --model {spec.path} --model-name {spec.name}`")


if __name__ == "__main__":
    main()
