"""The llama.cpp build `make install-llamacpp` installs runs on every x86-64 machine the project
meets: built with GGML_NATIVE=OFF, its CPU backend holds no AVX-512 or AMX code (a native build
on an AMX Xeon faulted in `ggml_backend_amx_mul_mat`; one built on an AVX-512 machine would
fault with SIGILL on a CPU without it)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="the llamacpp extra (make install-llamacpp)")

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the portable build is about x86-64")

# feature names ggml reports for instructions a portable build leaves out
NOT_PORTABLE = ("AVX512", "AVX_VNNI", "AMX")


def test_the_cpu_backend_was_built_for_any_x86_64() -> None:
    info = llama_cpp.llama_print_system_info().decode()
    assert "AVX2 = 1" in info, info  # the x86-64-v3 baseline every machine here has
    compiled = [part.strip() for part in info.replace("|", "\n").splitlines() if part.strip().endswith("= 1")]
    assert not [f for f in compiled if f.startswith(NOT_PORTABLE)], info


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
def test_the_cpu_backend_holds_no_avx512_or_amx_instruction() -> None:
    lib = next((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu.so*"))
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True,
                             check=True).stdout
    assert listing.count("\n") > 10_000  # a real disassembly
    for mark in ("%zmm", "ldtilecfg", "tdpbf16ps", "tdpbssd"):
        assert mark not in listing, f"{lib.name} uses {mark}: not a portable build"
