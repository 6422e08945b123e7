"""`tokengate gateway --model-from-workers`: a gateway on a host without the model's files.

The gateway tokenizes every prompt, so it needs the model's tokenizer, chat template, context
length and sampling defaults. A worker that has the model publishes them
(``common/tokenizer_bundle.py``) and names their digest in its heartbeat; here the gateway waits
for a live worker that does (the one serving ``--model-name`` where given), fetches that bundle
once into its cache (``<cache>/tokenizers/<digest>``: a restart with the same model reads the
disk) and goes on as with a local ``--model`` directory. docs/operations.md, "A gateway without
the model's files".
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common import protocol as p
from common import tokenizer_bundle, wire
from gateway.dispatch.liveness import live_workers
from workers import model_store

log = logging.getLogger("tokengate.gateway")

POLL_S = 0.5  # how often the live workers are read while none has published its tokenizer
SAY_EVERY_S = 10.0  # how often the wait says what it waits for


def announced(workers: list[p.Heartbeat], name: str | None) -> p.Heartbeat | None:
    """The live worker whose tokenizer the gateway takes: one that published one (serving
    ``name``, where given), the longest running first, so that every gateway of a fleet picks
    the same model while workers come and go."""
    found = [hb for hb in workers if hb.tokenizer and not hb.down and (name is None or hb.model == name)]
    return min(found, key=lambda hb: (hb.started, hb.worker)) if found else None


async def wait_for(redis_url: str, name: str | None, cache_dir: Path | None) -> model_store.ModelSpec:
    """The model a live worker serves, its tokenizer files unpacked here; waits (saying so every
    ``SAY_EVERY_S``) until a worker has published them."""
    target = (cache_dir or model_store.cache_root()) / "tokenizers"
    client = aioredis.Redis.from_url(redis_url, socket_timeout=5.0, socket_connect_timeout=5.0)
    started = said = time.monotonic()
    what = f"model {name!r}" if name else "a model"
    try:
        while True:
            try:
                hb = announced(list((await live_workers(client)).values()), name)
                blob = await client.get(wire.tokenizer_key(hb.tokenizer)) if hb is not None else None
            except RedisError as exc:
                hb, blob = None, None
                log.warning("reading the workers from Redis failed (%s); trying again", exc)
            if hb is not None and isinstance(blob, bytes):
                path = tokenizer_bundle.unpack(hb.tokenizer, blob, target)
                log.info("model %s: its tokenizer as worker %s published it (%s), in %s",
                         hb.model, hb.worker, hb.tokenizer, path)
                return model_store.ModelSpec(hb.model, path)
            now = time.monotonic()
            if now - said >= SAY_EVERY_S:
                said = now
                log.warning("waiting for a live worker serving %s to publish its tokenizer (%.0f s so far): "
                            "start one with the model's files (`tokengate worker --model ...`)", what,
                            now - started)
            await asyncio.sleep(POLL_S)
    finally:
        await client.aclose()
