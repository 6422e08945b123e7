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
    return renamed + await _slots(client, model)


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


async def _slots(client: aioredis.Redis, model: str) -> int:
    """A model's and a tenant's keys from under ``{tg}`` to their own slots, in one pass over the
    ``{tg}`` names (``model``: the one this gateway serves first, which gets the dead letters);
    how many were moved or deleted."""
    by_model = {"arrivals": wire.arrivals_stream, "scheduler": wire.scheduler_lease,
                "scheduler-term": wire.scheduler_term, "model": wire.model_key}
    by_tenant = {"budget": wire.budget, "inflight": wire.in_flight}
    models = tenants = 0
    async for raw in client.scan_iter(match=wire.NS + "*", count=1000):
        name = wire.text(raw)
        kind, _, rest = name.removeprefix(wire.NS).partition(":")
        if kind in by_model and rest and name != f"{wire.NS}scheduler:term":  # (that one: _per_model's)
            models += await _rename(client, name, by_model[kind](rest))
        elif kind == "jobs" and ":" in rest:  # ({tg}:jobs:<pool>, from before models were domains: _per_model's)
            owner, _, pool = rest.rpartition(":")
            models += await _rename(client, name, wire.jobs_stream(owner, pool))
        elif name == f"{wire.NS}dead":
            models += await _rename(client, name, wire.dead_letter_stream(model))
        elif name == f"{wire.NS}steps" or kind == "bell":  # no TTL: the new release's workers write their model's
            models += await client.delete(name)
        elif kind in by_tenant and rest:
            tenants += await _rename(client, name, by_tenant[kind](rest))
        elif kind == "tenant-keys" and rest:
            tenants += await _key_digests(client, name, rest)
        elif kind == "usage" and rest.rpartition(":")[2].isdigit():
            tid, _, minute = rest.rpartition(":")
            tenants += await _rename(client, name, wire.usage(tid, int(minute)))
        elif kind == "req" and rest:
            tenants += await _record(client, name, rest)
        elif kind == "gateway-requests" and rest:
            tenants += await _open_requests(client, name, rest)
    if models:
        log.warning("moved %d keys of the models to their own slots (Redis Cluster: one per model)", models)
    if tenants:
        log.warning("moved %d keys of the tenants to their own slots (Redis Cluster: one per tenant)", tenants)
    return models + tenants


async def _key_digests(client: aioredis.Redis, name: str, tid: str) -> int:
    """A tenant's set of key prefixes, as the hash of its keys' digests."""
    for prefix in [wire.text(p) for p in await client.smembers(name)]:
        digest = await client.hget(wire.api_key(prefix), "digest")
        if digest is not None:
            await client.hset(wire.tenant_keys(tid), prefix, digest)
    return int(await client.delete(name))


async def _record(client: aioredis.Redis, name: str, rid: str) -> int:
    """A request record, to its owner's slot."""
    try:
        owner = await client.hget(name, "tenant")
    except ResponseError:  # not a record: left as it is
        return 0
    return 0 if owner is None else int(await _rename(client, name, wire.request(wire.text(owner), rid)))


async def _open_requests(client: aioredis.Redis, name: str, gateway: str) -> int:
    """A gateway's list of open requests, into its tenants' open requests."""
    for entry, value in (await client.hgetall(name)).items():
        owner_id, _, rest = wire.text(value).partition(" ")  # "tenant rate reserved"
        await client.hset(wire.open_requests(owner_id), wire.text(entry), f"{rest} {gateway}")
    return int(await client.delete(name))
