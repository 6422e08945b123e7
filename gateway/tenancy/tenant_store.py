"""Tenants and their API keys in Redis (key schema: ``common.wire``, docs/tenants.md).

Every write that must not race (a unique name, a key for a tenant that is being deleted)
is one Lua script; reads are plain commands. Only key prefixes and digests are stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from common import wire
from gateway.errors import Conflict, NotFound
from gateway.tenancy import keys
from gateway.tenancy.tenants import Tenant, from_doc, is_id, to_doc

# KEYS: names, tenant doc, ids. ARGV: id, name, doc, expected old doc ('' to create), old name
_SAVE = """
local current = redis.call('GET', KEYS[2])
if ARGV[4] == '' then
  if current then return 'exists' end
elseif not current then
  return 'missing'
elseif current ~= ARGV[4] then
  return 'changed'
end
local owner = redis.call('HGET', KEYS[1], ARGV[2])
if owner and owner ~= ARGV[1] then return 'conflict' end
if ARGV[5] ~= '' and ARGV[5] ~= ARGV[2] then redis.call('HDEL', KEYS[1], ARGV[5]) end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[1])
redis.call('SET', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[1])
return 'ok'
"""

# The catalog (names, tenant documents, ids, API key records) is under ``{tg}``; a tenant's own
# keys (its key digests, budget, leases, open requests) are in its slot (``wire.tenant_slot``),
# written by a second call after the catalog's (docs/operations.md, "Redis Cluster").

# KEYS: names, tenant doc, ids. ARGV: id, name, API key record prefix, then the tenant's key prefixes
_DELETE = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
for i = 4, #ARGV do
  redis.call('DEL', ARGV[3] .. ARGV[i])
end
if redis.call('HGET', KEYS[1], ARGV[2]) == ARGV[1] then redis.call('HDEL', KEYS[1], ARGV[2]) end
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[2])
return 1
"""

# KEYS: tenant doc, key record. ARGV: tenant id, digest, name, created
_ISSUE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'missing' end
if redis.call('EXISTS', KEYS[2]) == 1 then return 'taken' end
redis.call('HSET', KEYS[2], 'tenant', ARGV[1], 'digest', ARGV[2],
           'name', ARGV[3], 'created', ARGV[4])
return 'ok'
"""

# KEYS: key record. Its tenant's id (false: no such key), once deleted
_REVOKE = """
local tenant = redis.call('HGET', KEYS[1], 'tenant')
if not tenant then return false end
redis.call('DEL', KEYS[1])
return tenant
"""

# KEYS: key record. ARGV: tenant doc prefix. The key's digest and its tenant's document.
_LOOKUP = """
local rec = redis.call('HMGET', KEYS[1], 'tenant', 'digest')
if not rec[1] then return false end
local doc = redis.call('GET', ARGV[1] .. rec[1])
if not doc then return false end
return {rec[2], doc}
"""


@dataclass(frozen=True, slots=True)
class KeyInfo:
    prefix: str
    tenant: str
    name: str
    created: int

    def doc(self) -> dict[str, Any]:
        return {
            "object": "api_key",
            "prefix": self.prefix,
            "tenant": self.tenant,
            "name": self.name,
            "created": self.created,
        }


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _tenant(raw: bytes) -> Tenant:
    return from_doc(orjson.loads(raw))


def _no_tenant(ref: str) -> NotFound:
    return NotFound(f"No tenant '{ref}'.", param="tenant")


async def tenant_ids(client: aioredis.Redis) -> list[str]:
    """Every tenant's id, sorted."""
    return sorted(wire.text(i) for i in await client.smembers(wire.TENANT_IDS))


class TenantStore:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._save = client.register_script(_SAVE)
        self._delete = client.register_script(_DELETE)
        self._issue = client.register_script(_ISSUE)
        self._revoke = client.register_script(_REVOKE)
        self._lookup = client.register_script(_LOOKUP)

    # -- tenants -------------------------------------------------------------------------------

    async def _raw(self, ref: str) -> bytes:
        tid = ref if is_id(ref) else await self.client.hget(wire.TENANT_NAMES, ref)
        raw = await self.client.get(wire.tenant(wire.text(tid))) if tid else None
        if raw is None:
            raise _no_tenant(ref)
        return _bytes(raw)

    async def get(self, ref: str) -> Tenant:
        """By id (``tn_…``) or by name."""
        return _tenant(await self._raw(ref))

    async def list_tenants(self) -> list[Tenant]:
        ids = await tenant_ids(self.client)
        raws = await self.client.mget([wire.tenant(i) for i in ids]) if ids else []
        return sorted(
            (_tenant(_bytes(r)) for r in raws if r is not None), key=lambda t: (t.created, t.name)
        )

    async def _write(self, t: Tenant, old: bytes | None, old_name: str = "") -> str:
        doc = orjson.dumps(to_doc(t))
        reply = await self._save(
            keys=[wire.TENANT_NAMES, wire.tenant(t.id), wire.TENANT_IDS],
            args=[t.id, t.name, doc, old or b"", old_name],
        )
        status = reply.decode()
        if status == "conflict":
            raise Conflict(f"A tenant named '{t.name}' exists already.", param="name")
        return str(status)

    async def create(self, t: Tenant) -> Tenant:
        status = await self._write(t, None)
        if status != "ok":  # an id collision: 64 random bits, so never in practice
            raise Conflict(f"Tenant id {t.id} is taken; try again.")
        return t

    async def update(self, ref: str, change: Callable[[Tenant], Tenant]) -> Tenant:
        """``change(tenant) -> tenant``, applied atomically (retried if another write won)."""
        for _ in range(10):
            raw = await self._raw(ref)
            old = _tenant(raw)
            new = change(old)
            status = await self._write(new, raw, old.name)
            if status == "ok":
                return new
            if status == "missing":
                raise _no_tenant(ref)
        raise Conflict(f"Tenant '{ref}' is being changed by another request; try again.")

    async def delete(self, ref: str) -> Tenant:
        t = await self.get(ref)
        prefixes = [wire.text(p) for p in await self.client.hkeys(wire.tenant_keys(t.id))]
        done = await self._delete(
            keys=[wire.TENANT_NAMES, wire.tenant(t.id), wire.TENANT_IDS],
            args=[t.id, t.name, wire.KEY_PREFIX, *prefixes],
        )
        if not done:
            raise _no_tenant(ref)
        await self.client.delete(wire.tenant_keys(t.id), wire.budget(t.id), wire.in_flight(t.id),
                                 wire.open_requests(t.id))
        return t

    # -- keys ----------------------------------------------------------------------------------

    async def issue_key(
        self, ref: str, name: str = "", now: float | None = None
    ) -> tuple[str, KeyInfo]:
        """A new key for the tenant: the plaintext (to show once) and what is stored of it."""
        t = await self.get(ref)
        created = int(time.time() if now is None else now)
        for _ in range(10):
            new = keys.new_key()
            status = (
                await self._issue(
                    keys=[wire.tenant(t.id), wire.api_key(new.prefix)],
                    args=[t.id, new.digest, name, created],
                )
            ).decode()
            if status == "ok":  # usable once its digest is in the tenant's slot too
                await self.client.hset(wire.tenant_keys(t.id), new.prefix, new.digest)
                return new.key, KeyInfo(new.prefix, t.id, name, created)
            if status == "missing":
                raise _no_tenant(ref)
        raise Conflict("Could not find a free key prefix; try again.")

    async def list_keys(self, ref: str) -> list[KeyInfo]:
        t = await self.get(ref)
        prefixes = sorted(wire.text(p) for p in await self.client.hkeys(wire.tenant_keys(t.id)))
        pipe = self.client.pipeline(transaction=False)
        for prefix in prefixes:
            pipe.hmget(wire.api_key(prefix), "name", "created")
        out = []
        for prefix, (name, created) in zip(prefixes, await pipe.execute(), strict=True):
            if created is not None:
                out.append(KeyInfo(prefix, t.id, (name or b"").decode(), int(created)))
        return sorted(out, key=lambda k: (k.created, k.prefix))

    async def revoke_key(self, prefix: str) -> None:
        tenant = await self._revoke(keys=[wire.api_key(prefix)]) if keys.is_prefix(prefix) else None
        if not tenant:
            raise NotFound(f"No API key with prefix '{prefix}'.", param="prefix")
        await self.client.hdel(wire.tenant_keys(wire.text(tenant)), prefix)

    async def lookup(self, prefix: str) -> tuple[str, Tenant] | None:
        """The stored digest of the key with this prefix and its tenant, in one round trip."""
        found = await self._lookup(keys=[wire.api_key(prefix)], args=[wire.TENANT_PREFIX])
        if not found:
            return None
        digest, raw = found
        return wire.text(digest), _tenant(raw)

    async def authenticate(self, key: str) -> Tenant | None:
        """The tenant a key belongs to, or None for a malformed, unknown or revoked key."""
        prefix = keys.prefix_of(key)
        found = await self.lookup(prefix) if prefix is not None else None
        if found is None or not keys.matches(key, found[0]):
            return None
        return found[1]
