from pathlib import Path

import pytest

from workers.devices import choose, cpu_flags

NO_AMX = frozenset({"avx2", "avx512f"})
AMX = NO_AMX | {"amx_bf16", "amx_tile", "amx_int8"}


def test_cpu_without_amx_runs_fp32_and_says_why() -> None:
    c = choose("cpu", NO_AMX, cuda=False, ipex_installed=True)
    assert (c.device, c.dtype, c.ipex) == ("cpu", "float32", False)
    assert "no AMX" in c.reason and "amx_bf16" in c.reason


def test_cpu_with_amx_runs_bf16_with_ipex_when_installed() -> None:
    c = choose("cpu", AMX, cuda=False, ipex_installed=True)
    assert (c.device, c.dtype, c.ipex) == ("cpu", "bfloat16", True)
    c = choose("cpu", AMX, cuda=False, ipex_installed=False)
    assert (c.device, c.dtype, c.ipex) == ("cpu", "bfloat16", False)
    assert "not installed" in c.reason


def test_avx512_bf16_without_amx_runs_bf16_and_says_why() -> None:
    c = choose("cpu", NO_AMX | {"avx512_bf16"}, cuda=False, ipex_installed=True)
    assert (c.device, c.dtype, c.ipex) == ("cpu", "bfloat16", False)
    assert "AVX512-BF16" in c.reason and "no AMX" in c.reason


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_dtype_asked_for_is_taken(dtype: str) -> None:
    for flags in (NO_AMX, AMX, NO_AMX | {"avx512_bf16"}):
        c = choose("cpu", flags, cuda=False, ipex_installed=True, dtype=dtype)
        assert (c.device, c.dtype, c.ipex) == ("cpu", dtype, False) and "as asked" in c.reason
    assert choose("gpu", NO_AMX, cuda=True, ipex_installed=False, dtype="float32").device == "cuda"
    with pytest.raises(ValueError, match="dtype must be"):
        choose("cpu", NO_AMX, cuda=False, ipex_installed=False, dtype="int4")


def test_amx_needs_both_flags() -> None:
    assert choose("cpu", NO_AMX | {"amx_tile"}, cuda=False, ipex_installed=False).dtype == "float32"


def test_cpu_pool_never_takes_the_gpu() -> None:
    assert choose("cpu", NO_AMX, cuda=True, ipex_installed=False).device == "cpu"


@pytest.mark.parametrize(("bf16", "dtype"), [(True, "bfloat16"), (False, "float16")])
def test_gpu_pool_uses_cuda_when_present(bf16: bool, dtype: str) -> None:
    c = choose("gpu", NO_AMX, cuda=True, ipex_installed=False, cuda_bf16=bf16)
    assert (c.device, c.dtype) == ("cuda", dtype)


def test_gpu_pool_falls_back_to_cpu_and_says_so() -> None:
    c = choose("gpu", NO_AMX, cuda=False, ipex_installed=False)
    assert (c.device, c.dtype) == ("cpu", "float32")
    assert c.reason.startswith("no CUDA device")


def test_cpu_flags_parses_proc_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse amx_tile amx_bf16\n")
    assert cpu_flags(info) == {"fpu", "sse", "amx_tile", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
