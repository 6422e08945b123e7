"""The models a gateway serves: those it has the files of (`--model`, again for each further
model; default the packaged SmolLM2) and those its workers announce (issue 39).

The gateway tokenizes every prompt, so it needs each model's tokenizer, chat template, context
length and sampling defaults. A worker that has the model publishes them
(``common/tokenizer_bundle.py``) and names their digest in its heartbeat. ``watch`` reads the
live workers every ``WATCH_S`` and gives every model one of them announces, and the gateway has
no domain for yet, a domain of its own (``Gateway.add_model``), its tokenizer fetched once into
the cache (``<cache>/tokenizers/<digest>``: a restart with the same model reads the disk).
`gateway --model-from-workers` loads no local model and waits for the first announced one
(``wait_for``) before it starts. docs/operations.md, "A gateway without the model's files" and
"Several models behind one endpoint".
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common import protocol as p
from common import tokenizer_bundle, wire
from gateway.dispatch.liveness import live_workers
from workers import model_store

if TYPE_CHECKING:
    from gateway.api.openai_protocol import SamplingDefaults
    from gateway.dispatch.prompts import PromptBuilder
    from gateway.http.services import Gateway
    from gateway.settings import GatewaySettings

log = logging.getLogger("tokengate.gateway")

POLL_S = 0.5  # how often the live workers are read while none has published its tokenizer
SAY_EVERY_S = 10.0  # how often the wait says what it waits for
WATCH_S = 2.0  # how often a serving gateway looks for models its workers announce


def local(args: argparse.Namespace) -> list[model_store.ModelSpec]:
    """The models given by --model (the packaged SmolLM2 where none is), each named by the
    --model-name in the same position (else by its file's name); a name given twice stops
    start-up."""
    model_store.offline()
    cache = Path(args.cache_dir or model_store.default_cache_dir())
    log.info("model cache directory: %s", cache)
    dirs: list[str | None] = list(args.model or [None])
    names: list[str] = list(args.model_name or [])
    if len(names) > len(dirs):
        raise ValueError("more --model-name than --model: the n-th --model-name names the n-th --model")
    specs = [model_store.resolve(d, cache, names[i] if i < len(names) else None) for i, d in enumerate(dirs)]
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"two models are named {spec.name!r}: give each --model its own --model-name")
        seen.add(spec.name)
        log.info("model %s at %s", spec.name, spec.path)
    return specs


def tokens(spec: model_store.ModelSpec, settings: GatewaySettings) -> tuple[PromptBuilder, SamplingDefaults]:
    """A model's tokenizer and the sampling a request that leaves temperature/top_p out gets
    (its generation_config.json's, else the gateway's --default-temperature/--default-top-p)."""
    from gateway.api import openai_protocol as oai
    from gateway.dispatch.prompts import PromptBuilder

    prompts = PromptBuilder.load(spec.path)
    shipped = model_store.generation_defaults(spec.path)
    sampling = oai.SamplingDefaults.of(shipped, settings.default_temperature, settings.default_top_p)
    log.info("model %s: a request without temperature/top_p gets temperature %g (%s), top_p %g (%s)", spec.name,
             sampling.temperature, _source(shipped, "temperature"), sampling.top_p, _source(shipped, "top_p"))
    return prompts, sampling


def _source(shipped: dict[str, float], name: str) -> str:
    return "the model's generation_config.json" if name in shipped else f"--default-{name.replace('_', '-')}"


def announced(workers: list[p.Heartbeat], name: str | None) -> p.Heartbeat | None:
    """The live worker whose tokenizer the gateway takes: one that published one (serving
    ``name``, where given), the longest running first, so that every gateway of a fleet picks
    the same model while workers come and go."""
    found = [hb for hb in workers if hb.tokenizer and not hb.down and (name is None or hb.model == name)]
    return min(found, key=lambda hb: (hb.started, hb.worker)) if found else None


async def _fetch(client: aioredis.Redis, hb: p.Heartbeat, target: Path) -> model_store.ModelSpec | None:
    """``hb``'s model with its published tokenizer unpacked under ``target``; None while the
    bundle is not (or no longer) in Redis."""
    blob = await client.get(wire.tokenizer_key(hb.tokenizer))
    if not isinstance(blob, bytes):
        return None
    path = tokenizer_bundle.unpack(hb.tokenizer, blob, target)
    log.info("model %s: its tokenizer as worker %s published it (%s), in %s", hb.model, hb.worker, hb.tokenizer, path)
    return model_store.ModelSpec(hb.model, path)


def _target(cache_dir: Path | None) -> Path:
    return (cache_dir or model_store.cache_root()) / "tokenizers"


async def wait_for(redis_url: str, name: str | None, cache_dir: Path | None) -> model_store.ModelSpec:
    """The model a live worker serves, its tokenizer files unpacked here; waits (saying so every
    ``SAY_EVERY_S``) until a worker has published them."""
    client = aioredis.Redis.from_url(redis_url, socket_timeout=5.0, socket_connect_timeout=5.0)
    started = said = time.monotonic()
    what = f"model {name!r}" if name else "a model"
    try:
        while True:
            try:
                hb = announced(list((await live_workers(client)).values()), name)
                spec = await _fetch(client, hb, _target(cache_dir)) if hb is not None else None
            except RedisError as exc:
                spec = None
                log.warning("reading the workers from Redis failed (%s); trying again", exc)
            if spec is not None:
                return spec
            now = time.monotonic()
            if now - said >= SAY_EVERY_S:
                said = now
                log.warning("waiting for a live worker serving %s to publish its tokenizer (%.0f s so far): "
                            "start one with the model's files (`tokengate worker --model ...`)", what,
                            now - started)
            await asyncio.sleep(POLL_S)
    finally:
        await client.aclose()


def new_models(workers: list[p.Heartbeat], served: set[str]) -> list[p.Heartbeat]:
    """One announcing worker (``announced``'s pick) for each model not in ``served``."""
    models = sorted({hb.model for hb in workers} - served)
    return [hb for hb in (announced(workers, m) for m in models) if hb is not None]


async def watch(gw: Gateway, cache_dir: Path | None, on_fatal: Callable[[str], None],
                stopping: Callable[[], bool]) -> None:
    """Until ``stopping()`` (checked every look: a cancellation can be swallowed by the Redis
    client as a connection error, as the dispatcher's loops know): every model a live worker
    announces gets a domain in ``gw``, started at once (its dispatcher's fatal errors go to
    ``on_fatal``, as the first model's). A model whose tokenizer cannot be read is tried again
    at the next look."""
    target = _target(cache_dir)
    while not stopping():
        try:
            for hb in new_models(list((await live_workers(gw.client)).values()), set(gw.domains)):
                spec = await _fetch(gw.client, hb, target)
                if spec is None or spec.name in gw.domains:
                    continue
                prompts, sampling = await asyncio.to_thread(tokens, spec, gw.settings)
                if stopping():  # shutting down: no domain the lifespan would not close
                    return
                dom = gw.add_model(spec.name, prompts, sampling)
                dom.dispatcher.on_fatal = on_fatal
                await dom.dispatcher.start()
                log.info("serving model %s as well, announced by worker %s", spec.name, hb.worker)
        except RedisError as exc:
            log.debug("looking for announced models failed: %s", exc)
        except (OSError, ValueError) as exc:  # a bundle that does not load: said, and tried again
            log.warning("a model announced by the workers cannot be loaded: %s", exc)
        await asyncio.sleep(WATCH_S)
