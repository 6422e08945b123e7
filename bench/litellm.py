"""LiteLLM's proxy, the peer ``bench.peers`` measures tokengate against: installed once in a
venv of its own (its dependencies never meet tokengate's), configured in front of the zero
backend with nothing that costs per request (no database, callbacks, logs or retries)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from bench.harness import OUT

LITELLM_VERSION = "1.106.2"  # pinned: 1.107.0 was a compromised release
PEERS_VENV = OUT / "peers-venv"
LITELLM_KEY = "sk-bench-peers-0123456789"
ZERO_MODEL = "zero"  # the model name LiteLLM serves (and forwards as openai/zero)

TIMEOUT_S = 10.0  # LiteLLM's request timeout, the same as the benchmark's clients'

log = Console(stderr=True)


def install_litellm() -> Path | None:
    """``litellm[proxy]==LITELLM_VERSION`` in its own venv (once); its CLI, or None if it cannot be had."""
    exe = PEERS_VENV / "bin" / "litellm"
    stamp = PEERS_VENV / ".litellm-version"
    if exe.exists() and stamp.exists() and stamp.read_text().strip() == LITELLM_VERSION:
        return exe
    pip_log = OUT / "peers-venv-install.log"
    OUT.mkdir(parents=True, exist_ok=True)
    log.print(f"installing litellm[proxy]=={LITELLM_VERSION} into {PEERS_VENV} (once; minutes)")
    t0 = time.monotonic()
    try:
        with open(pip_log, "wb") as out:
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEERS_VENV)], check=True,
                           stdout=out, stderr=subprocess.STDOUT, timeout=300)
            subprocess.run([str(PEERS_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                            f"litellm[proxy]=={LITELLM_VERSION}"], check=True,
                           stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    except (OSError, subprocess.SubprocessError) as exc:
        tail = pip_log.read_text(errors="replace").strip().splitlines()[-1:] if pip_log.exists() else []
        log.print(f"LiteLLM could not be installed: {tail[0] if tail else exc} (see {pip_log}); "
                  "its rows are skipped", markup=False)
        return None
    stamp.write_text(LITELLM_VERSION + "\n")
    log.print(f"litellm {LITELLM_VERSION} installed in {time.monotonic() - t0:.0f} s")
    return exe


def litellm_config(zero_base: str) -> Path:
    """One model, no database, no callbacks, no per-request logging, no retries."""
    path = OUT / "peers-litellm.yaml"
    path.write_text(f"""\
model_list:
  - model_name: {ZERO_MODEL}
    litellm_params:
      model: openai/{ZERO_MODEL}
      api_base: {zero_base}/v1
      api_key: sk-dummy
    model_info:
      input_cost_per_token: 0
      output_cost_per_token: 0
litellm_settings:
  set_verbose: false
  json_logs: false
  request_timeout: {TIMEOUT_S:g}
  num_retries: 0
  callbacks: []
  success_callback: []
  failure_callback: []
general_settings:
  master_key: {LITELLM_KEY}
  disable_spend_logs: true
  disable_error_logs: true
""")
    return path
