"""The fitted step-time model and contract calibration a gateway saves for the next start
(``wire.model_key``: per model), and takes back at start (``SchedulerShell.load_model_state``
restores it path by path, once each path's workers show)."""

from __future__ import annotations

import logging

import orjson
import redis.asyncio as aioredis

from common import wire
from gateway.dispatch.scheduling import SchedulerShell

log = logging.getLogger("tokengate.dispatch")


async def load(client: aioredis.Redis, model: str, shell: SchedulerShell) -> None:
    """Start warm: the fitted model and calibration a gateway serving ``model`` saved."""
    raw = await client.get(wire.model_key(model))
    if raw is None:
        return
    try:
        state = orjson.loads(raw)
    except orjson.JSONDecodeError:
        log.warning("ignoring an unreadable saved model at %s", wire.model_key(model))
        return
    if isinstance(state, dict):
        shell.load_model_state(state)


async def save(client: aioredis.Redis, model: str, shell: SchedulerShell) -> None:
    try:
        state = shell.model_state()
        blob = orjson.dumps(state) if state is not None else None
    except Exception:  # noqa: BLE001 - a state that cannot be saved must not stop the watch loop
        log.exception("the fitted model could not be saved")
        return
    if blob is not None:
        await client.set(wire.model_key(model), blob)
