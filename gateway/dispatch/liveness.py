"""Which gateways and workers are alive, and what happens to a gateway that dies.

Every gateway renews its entry in ``wire.GATEWAYS_ZSET`` (score: Redis's clock) every
``WATCH_S``; an entry ``gateway_dead_after_s`` old belongs to a dead gateway. The first
survivor to notice sweeps it: its unsettled requests are refunded and marked ``abandoned``
(``gateway.tenancy.budget.SWEEP``, one atomic call in each tenant's slot: a request is
settled once, whoever sweeps), then its reply stream and its backlog entry are deleted, a
marker tells workers to drop the jobs still queued for it, and its entry goes (sweeping it
again does nothing). A gateway that exits cleanly sweeps itself. A gateway
that finds its own entry gone (Redis restarted without its data, or a peer swept it
after a long stall) knows its dispatched batches are lost.

``classify`` is the specification of the renewal script (``RENEW``), tested against it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from common import protocol as p
from common import wire
from gateway.lua import CLOCK
from gateway.settings import GatewaySettings
from gateway.tenancy.budget import SWEEP
from gateway.tenancy.tenant_store import tenant_ids

log = logging.getLogger("tokengate.liveness")

# 1 if the gateway's last renewal is ``dead after`` seconds old, else 0 (gone, or alive)
# KEYS: gateways zset; ARGV: gateway id, dead after s, now ('' for Redis TIME)
DEAD = CLOCK + """
local seen = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]))
if seen == nil or now - seen < tonumber(ARGV[2]) then return 0 end
return 1
"""

# A swept gateway's entries go: its liveness, its backlog, where its reply stream is; returns
# that stream's name (false: none known). Its stream and gone marker are in its model's slot:
# the caller deletes the one and sets the other (workers then drop the jobs still queued for it).
# KEYS: gateways zset, the gateways' reply streams hash, the backlog hash; ARGV: gateway id
BURY = """
local replies = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
return replies
"""

GONE_TTL_S = 3600  # workers drop a dead gateway's jobs this long after its sweep

# KEYS: gateways zset, the gateways' reply streams hash
# ARGV: gateway id, its reply stream, dead after s, now ('' for Redis TIME)
RENEW = CLOCK + """
local known = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local horizon = now - tonumber(ARGV[3])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. num(horizon))
local alive = redis.call('ZCOUNT', KEYS[1], num(horizon), '+inf')
return {known and 1 or 0, alive, dead}
"""


@dataclass(frozen=True, slots=True)
class View:
    """What one renewal saw: live gateways (this one included), dead ones to sweep, and
    whether Redis had forgotten this gateway although it had joined before."""

    alive: int
    dead: tuple[str, ...]
    forgotten: bool


def classify(scores: dict[str, float], me: str, now: float, dead_after_s: float) -> tuple[int, tuple[str, ...]]:
    """The specification of ``RENEW`` after it has stamped ``me`` with ``now``: (gateways
    whose last renewal is at most ``dead_after_s`` old, the others sorted by score)."""
    stamped = {**scores, me: now}
    horizon = now - dead_after_s
    alive = sum(1 for s in stamped.values() if s >= horizon)
    dead = tuple(g for g, s in sorted(stamped.items(), key=lambda kv: (kv[1], kv[0])) if s < horizon)
    return alive, dead


class Liveness:
    def __init__(self, client: aioredis.Redis, settings: GatewaySettings) -> None:
        self.client = client
        self.me = settings.gateway_id
        self.dead_after_s = settings.gateway_dead_after_s
        self.model = settings.model_name
        self._renew = client.register_script(RENEW)
        self._dead = client.register_script(DEAD)
        self._sweep = client.register_script(SWEEP)
        self._bury = client.register_script(BURY)
        self._joined = False

    async def renew(self, replies: str, now: float | None = None) -> View:
        pipe = self.client.pipeline(transaction=False)
        at = "" if now is None else repr(now)
        await self._renew(keys=[wire.GATEWAYS_ZSET, wire.GATEWAY_REPLIES],
                          args=[self.me, replies, repr(self.dead_after_s), at], client=pipe)
        pipe.pexpire(replies, wire.REPLIES_TTL_MS)  # in the model's slot: a call of its own
        (known, alive, dead), _ = await pipe.execute()
        forgotten = self._joined and not known
        self._joined = True
        return View(int(alive), tuple(wire.text(g) for g in dead), forgotten)  # never this one: just stamped

    async def sweep(self, gateway_id: str, *, force: bool = False, now: float | None = None) -> int:
        """Settle a dead gateway's requests; -1 when it is not (or no longer) dead.
        ``force`` sweeps at once: a gateway leaving cleanly sweeps itself. Its requests are
        in their tenants' slots: one call per tenant, pipelined."""
        at = "" if now is None else repr(now)
        after = "-1e308" if force else repr(self.dead_after_s)
        if not await self._dead(keys=[wire.GATEWAYS_ZSET], args=[gateway_id, after, at]):
            return -1
        tenants = await tenant_ids(self.client)
        pipe = self.client.pipeline(transaction=False)
        for tid in tenants:
            await self._sweep(keys=[wire.budget(tid), wire.in_flight(tid), wire.open_requests(tid)],
                              args=[gateway_id, wire.request(tid, ""), at], client=pipe)
        swept = sum(int(n) for n in await pipe.execute()) if tenants else 0
        replies = await self._bury(keys=[wire.GATEWAYS_ZSET, wire.GATEWAY_REPLIES, wire.BACKLOG_HASH],
                                   args=[gateway_id])
        if replies is not None:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(wire.text(replies))
            pipe.set(wire.gone_key(wire.text(replies)), 1, ex=GONE_TTL_S)
            await pipe.execute()
        return swept

    async def leave(self, replies: str) -> None:
        """A clean exit: whatever was not settled is refunded, the reply stream goes."""
        swept = await self.sweep(self.me, force=True)
        if swept > 0:
            log.warning("%d requests were still unsettled at exit: refunded", swept)
        await self.client.delete(replies)

    async def workers(self) -> dict[str, p.Heartbeat]:
        """The live workers of this gateway's model: the scheduling domain's; another model's
        workers read other streams."""
        return {wid: hb for wid, hb in (await live_workers(self.client)).items() if hb.model == self.model}


async def live_workers(client: aioredis.Redis) -> dict[str, p.Heartbeat]:
    """Every worker with a live heartbeat, of any model (their keys expire on Redis's clock);
    ids whose key expired leave the worker set."""
    members: list[bytes] = await client.zrange(wire.WORKERS_ZSET, 0, -1)  # type: ignore[assignment]
    ids = [wire.text(i) for i in members]
    if not ids:
        return {}
    raws: list[bytes | None] = await client.mget([wire.worker_key(i) for i in ids])  # type: ignore[assignment]
    workers: dict[str, p.Heartbeat] = {}
    gone: list[str] = []
    for wid, raw in zip(ids, raws, strict=True):
        if raw is None:
            gone.append(wid)
            continue
        try:
            workers[wid] = p.decode_heartbeat(raw)
        except p.ProtocolError as exc:
            log.warning("ignoring worker %s: %s", wid, exc)
    if gone:
        await client.zrem(wire.WORKERS_ZSET, *gone)
    return workers
