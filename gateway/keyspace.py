"""A deployment's keys renamed to the hash-tagged names (``common.wire.NS``), at a gateway's start.

Names began with ``tg:`` before they carried the ``{tg}`` hash tag that keeps them in one
Redis Cluster slot (docs/operations.md, "Redis Cluster and Sentinel"). A gateway that
starts on a Redis still holding old names renames them before it serves, so tenants, API
keys, budgets, usage and the fitted model carry over (a key keeps its TTL). ``RENAMENX``
never overwrites: where the new name exists already (written by a worker of the new release
that started first), the old key stays, and is logged, for an operator to look at. Several
gateways starting at once rename each key once: a key another one renamed first is gone.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from common import wire
from common.pools import POOLS

log = logging.getLogger("tokengate.keyspace")


async def migrate(client: aioredis.Redis, model: str) -> int:
    """Rename every ``wire.LEGACY_NS`` key to its ``wire.NS`` name, then the scheduling names
    from before each model was a domain of its own to ``model``'s; how many were renamed."""
    renamed = 0
    async for raw in client.scan_iter(match=wire.LEGACY_NS + "*", count=1000):
        old = wire.text(raw)
        renamed += await _rename(client, old, wire.NS + old.removeprefix(wire.LEGACY_NS))
    if renamed:
        log.warning("renamed %d keys from %s… to %s… (Redis Cluster hash tag)", renamed, wire.LEGACY_NS, wire.NS)
    return renamed + await _per_model(client, model)


async def _per_model(client: aioredis.Redis, model: str) -> int:
    """The jobs streams (with their consumer groups and pending entries), the arrivals stream
    and the lease's term of a deployment from before models were scheduling domains (one model
    per Redis): now ``model``'s, the one its gateways serve."""
    pairs = [(f"{wire.NS}jobs:{pool}", wire.jobs_stream(model, pool)) for pool in POOLS]
    pairs += [(f"{wire.NS}arrivals", wire.arrivals_stream(model)),
              (f"{wire.NS}scheduler:term", wire.scheduler_term(model))]
    renamed = 0
    for old, new in pairs:
        if await _rename(client, old, new):
            renamed += 1
            log.warning("renamed %s to %s: the model %s is a scheduling domain of its own", old, new, model)
    return renamed


async def _rename(client: aioredis.Redis, old: str, new: str) -> bool:
    """``old`` renamed to ``new`` unless ``new`` exists (then it stays, logged) or ``old`` does
    not (never there, or another gateway renamed it first)."""
    try:
        moved = await client.renamenx(old, new)
    except ResponseError:
        return False
    if not moved:
        log.warning("kept %s: %s exists already", old, new)
    return bool(moved)
