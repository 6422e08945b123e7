"""llama.cpp's OpenAI-compatible server (``llama-cpp-python[server]``, the ``llamacpp`` extra)
on the default model's GGUF file, as a subprocess: the real upstream of the upstream
engine's tests and of ``bench/fronting.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from bench.harness import wait_ready
from gateway.cli.embedded_redis import free_port
from workers.model_store import default_gguf


def llamacpp_argv(port: int, threads: int = 1) -> list[str]:
    """One sequence at a time (the server serialises requests); a new request must not
    interrupt a running stream (``interrupt_requests`` is on by default)."""
    return [
        sys.executable, "-m", "llama_cpp.server", "--model", str(default_gguf()), "--host", "127.0.0.1",
        "--port", str(port), "--n_ctx", "2048", "--interrupt_requests", "False",
        "--n_threads", str(threads), "--n_threads_batch", str(threads),
    ]


class LlamaServer:
    def __init__(self, log: Path, port: int | None = None, cpus: str | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.cpus = cpus  # taskset's list, for benchmarks
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60) -> LlamaServer:
        argv = llamacpp_argv(self.port)
        if self.cpus:
            argv = ["taskset", "-c", self.cpus, *argv]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(self.url, [self.proc], timeout_s, path="/v1/models")
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"llama.cpp's server: {exc}:\n{self.log.read_text()[-3000:]}") from None
        return self

    def kill(self) -> None:
        """SIGKILL: streams end mid-token, connections reset, nothing is said."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
