"""A deployment's keys renamed to the current names (``common.wire``), at a gateway's start.

Names began with ``tg:`` before they carried the ``{tg}`` hash tag that keeps them in one
Redis Cluster slot (docs/operations.md, "Redis Cluster and Sentinel"). A gateway that
starts on a Redis still holding old names renames them before it serves, so tenants, API
keys, budgets, usage and the fitted model carry over (a key keeps its TTL). ``RENAMENX``
never overwrites: where the new name exists already (written by a worker of the new release
that started first), the old key stays, and is logged, for an operator to look at. Several
gateways starting at once rename each key once: a key another one renamed first is gone.

Then a model's scheduling state moves from ``{tg}`` to the model's slot (``wire.model_slot``):
its jobs streams (consumer groups and pending entries kept), arrivals, scheduler lease and
term, fitted model and dead letters; the shared telemetry stream and the workers' doorbells,
which have no TTL, are deleted (the workers of the new release write their model's), the rest
(reply streams, progress, cancels) expires on its own. And a tenant's own keys move from
``{tg}`` to the tenant's slot (``wire.tenant_slot``, issue
39): its budget, leases, usage minutes and request records are renamed, its key set becomes
the hash of its keys' digests, and each gateway's list of open requests is split into the
tenants' open requests (so a gateway of the old release that died is still swept).
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
    renamed += await _per_model(client, model)
    return renamed + await _model_slots(client, model) + await _tenant_slots(client)


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


async def _model_slots(client: aioredis.Redis, model: str) -> int:
    """A model's keys from under ``{tg}`` to its own slot (``model``: the one this gateway
    serves first, which gets the dead letters); how many were moved or deleted."""
    moved = 0
    singles = {"arrivals": wire.arrivals_stream, "scheduler": wire.scheduler_lease,
               "scheduler-term": wire.scheduler_term, "model": wire.model_key}
    for kind, name in singles.items():
        async for raw in client.scan_iter(match=f"{wire.NS}{kind}:*", count=1000):
            owner = wire.text(raw).removeprefix(f"{wire.NS}{kind}:")
            moved += await _rename(client, wire.text(raw), name(owner))
    async for raw in client.scan_iter(match=f"{wire.NS}jobs:*", count=1000):
        owner, _, pool = wire.text(raw).removeprefix(f"{wire.NS}jobs:").rpartition(":")
        if owner:  # ({tg}:jobs:<pool>, from before models were domains: _per_model's)
            moved += await _rename(client, wire.text(raw), wire.jobs_stream(owner, pool))
    moved += await _rename(client, f"{wire.NS}dead", wire.dead_letter_stream(model))
    stale = [raw async for raw in client.scan_iter(match=f"{wire.NS}bell:*", count=1000)]
    moved += await client.delete(f"{wire.NS}steps", *stale)
    if moved:
        log.warning("moved %d keys of the models to their own slots (Redis Cluster: one per model)", moved)
    return moved


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


async def _tenant_slots(client: aioredis.Redis) -> int:
    """A tenant's keys from under ``{tg}`` to its own slot; how many were moved."""
    moved = 0
    ids = [wire.text(i) for i in await client.smembers(wire.TENANT_IDS)]
    for tid in ids:
        moved += await _rename(client, f"{wire.NS}budget:{tid}", wire.budget(tid))
        moved += await _rename(client, f"{wire.NS}inflight:{tid}", wire.in_flight(tid))
        old_set = f"{wire.NS}tenant-keys:{tid}"
        prefixes = [wire.text(p) for p in await client.smembers(old_set)]
        for prefix in prefixes:
            digest = await client.hget(wire.api_key(prefix), "digest")
            if digest is not None:
                await client.hset(wire.tenant_keys(tid), prefix, digest)
        moved += await client.delete(old_set)
    async for raw in client.scan_iter(match=f"{wire.NS}usage:*", count=1000):
        tid, _, minute = wire.text(raw).removeprefix(f"{wire.NS}usage:").rpartition(":")
        if tid and minute.isdigit():
            moved += await _rename(client, wire.text(raw), wire.usage(tid, int(minute)))
    async for raw in client.scan_iter(match=f"{wire.NS}req:*", count=1000):
        try:
            owner = await client.hget(raw, "tenant")
        except ResponseError:  # not a record: left as it is
            continue
        if owner is not None:
            rid = wire.text(raw).removeprefix(f"{wire.NS}req:")
            moved += await _rename(client, wire.text(raw), wire.request(wire.text(owner), rid))
    async for raw in client.scan_iter(match=f"{wire.NS}gateway-requests:*", count=1000):
        gateway = wire.text(raw).removeprefix(f"{wire.NS}gateway-requests:")
        for entry, value in (await client.hgetall(raw)).items():
            owner_id, _, rest = wire.text(value).partition(" ")  # "tenant rate reserved"
            await client.hset(wire.open_requests(owner_id), wire.text(entry), f"{rest} {gateway}")
        moved += await client.delete(raw)
    if moved:
        log.warning("moved %d keys of %d tenants to their own slots (Redis Cluster: one per tenant)", moved, len(ids))
    return moved
