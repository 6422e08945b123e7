"""Which device and dtype a worker runs on, decided from facts passed in (pure) plus probes."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

AMX_FLAGS = frozenset({"amx_bf16", "amx_tile"})
AVX512_BF16 = "avx512_bf16"  # bf16 dot products in AVX-512 (AMD Zen 4 and later, Intel Cooper Lake)
DTYPES = ("auto", "float32", "bfloat16")  # what --dtype may ask of a CPU worker


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    device: str  # "cpu" | "cuda"
    dtype: str  # "float32" | "bfloat16" | "float16"
    ipex: bool  # intel-extension-for-pytorch optimizes the model
    reason: str  # one line for logs, heartbeats and /admin/workers


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def choose(
    pool: str,
    flags: frozenset[str],
    cuda: bool,
    ipex_installed: bool,
    cuda_bf16: bool = True,
    dtype: str = "auto",
) -> DeviceChoice:
    """CPU pool: bf16 on AMX (with IPEX when installed), bf16 where AVX512-BF16 runs it
    (``bench/amx.py``: 2.2-2.6x fp32's prefill and 1.8x its decode on an AMD EPYC with it),
    fp32 otherwise; ``dtype`` other than "auto" is taken as asked. GPU pool: CUDA in bf16
    (fp16 where bf16 is unsupported) when present, else the CPU rules."""
    if pool == "gpu" and cuda:
        gpu_dtype = "bfloat16" if cuda_bf16 else "float16"
        return DeviceChoice("cuda", gpu_dtype, False, f"CUDA available: {gpu_dtype} on the GPU")
    prefix = "no CUDA device; " if pool == "gpu" else ""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if dtype != "auto":
        amx = "AMX" if AMX_FLAGS <= flags else "no AMX"
        return DeviceChoice("cpu", dtype, False, prefix + f"{dtype} on the CPU as asked (--dtype; {amx})")
    if AMX_FLAGS <= flags:
        if ipex_installed:
            return DeviceChoice(
                "cpu", "bfloat16", True, prefix + "AMX found: bf16 with intel-extension-for-pytorch"
            )
        return DeviceChoice(
            "cpu", "bfloat16", False, prefix + "AMX found: bf16 (intel-extension-for-pytorch not installed)"
        )
    missing = ", ".join(sorted(AMX_FLAGS - flags))
    if AVX512_BF16 in flags:
        reason = f"no AMX (missing {missing}), AVX512-BF16: bf16 on the CPU"
        return DeviceChoice("cpu", "bfloat16", False, prefix + reason)
    reason = f"no AMX (missing {missing}), no AVX512-BF16: fp32 on the CPU"
    return DeviceChoice("cpu", "float32", False, prefix + reason)


def probe(pool: str, dtype: str = "auto") -> DeviceChoice:
    import torch

    cuda = torch.cuda.is_available()
    return choose(
        pool,
        cpu_flags(),
        cuda=cuda,
        ipex_installed=importlib.util.find_spec("intel_extension_for_pytorch") is not None,
        cuda_bf16=cuda and torch.cuda.is_bf16_supported(),
        dtype=dtype,
    )
