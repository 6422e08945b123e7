"""llama.cpp's OpenAI-compatible servers on the default model's GGUF file, as subprocesses: the
real upstreams of the upstream engine's tests and of the benches that front an engine.

- ``LlamaServer``: llama-cpp-python's Python server (``llama-cpp-python[server]``, the
  ``llamacpp`` extra), one sequence at a time;
- ``LlamaCppServer``: llama.cpp's own C++ server (``make install-llama-server``), ``slots``
  sequences at once (``-np``: continuous batching, a prompt cache per slot) and its Prometheus
  metrics (``--metrics``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

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


def llama_server_bin() -> Path | None:
    """``make install-llama-server``'s binary (linked into the venv beside this Python), or None."""
    found = Path(sys.executable).parent / "llama-server"
    return found if found.exists() else None


def llama_server_argv(port: int, slots: int = 4, context: int = 2048, threads: int = 1) -> list[str]:
    """``slots`` sequences at once, each with a context of ``context`` tokens (``-c`` is the
    total, shared by the slots), its metrics on, no web page; ``threads`` for decode and prefill."""
    binary = llama_server_bin()
    if binary is None:
        raise RuntimeError("llama-server is not built: make install-llama-server")
    return [
        str(binary), "-m", str(default_gguf()), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "-c", str(slots * context), "-t", str(threads), "-tb", str(threads),
        "--metrics", "--no-webui",
    ]


class LlamaServer:
    """llama-cpp-python's server; ``argv`` another server's command line (``LlamaCppServer``)."""

    ready_path = "/v1/models"

    def __init__(self, log: Path, port: int | None = None, cpus: str | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.cpus = cpus  # taskset's list, for benchmarks
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        return llamacpp_argv(self.port)

    def start(self, timeout_s: float = 60) -> LlamaServer:
        argv = self.argv()
        if self.cpus:
            argv = ["taskset", "-c", self.cpus, *argv]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(self.url, [self.proc], timeout_s, path=self.ready_path)
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"{self.argv()[0]}: {exc}:\n{self.log.read_text()[-3000:]}") from None
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


class LlamaCppServer(LlamaServer):
    """llama.cpp's C++ server: ``slots`` sequences at once, ``context`` tokens each."""

    ready_path = "/health"  # 503 while the model loads

    def __init__(self, log: Path, slots: int = 4, context: int = 2048, threads: int = 1, port: int | None = None,
                 cpus: str | None = None) -> None:
        super().__init__(log, port, cpus)
        self.slots, self.context, self.threads = slots, context, threads

    def argv(self) -> list[str]:
        return llama_server_argv(self.port, self.slots, self.context, self.threads)

    def metrics(self) -> dict[str, float]:
        """Its Prometheus figures, llama.cpp's names (``llamacpp:…``)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {s.name: float(s.value) for fam in text_string_to_metric_families(text) for s in fam.samples}
