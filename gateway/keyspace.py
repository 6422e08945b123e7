"""Every Redis key the tenant, key, budget and usage code touches (docs/tenants.md).

All of them live on one Redis (standalone or Sentinel): a few Lua scripts derive a key
from another one, which Redis Cluster would not allow across slots.
"""

from __future__ import annotations

TENANT_IDS = "tg:tenants"  # set of tenant ids
TENANT_NAMES = "tg:tenant-names"  # hash: name -> tenant id
TENANT_PREFIX = "tg:tenant:"  # + id: the tenant's JSON document (string)
TENANT_KEYS_PREFIX = "tg:tenant-keys:"  # + id: set of the prefixes of the tenant's keys
KEY_PREFIX = "tg:key:"  # + key prefix: hash {tenant, digest, name, created}


def tenant(tid: str) -> str:
    return TENANT_PREFIX + tid


def tenant_keys(tid: str) -> str:
    return TENANT_KEYS_PREFIX + tid


def api_key(prefix: str) -> str:
    return KEY_PREFIX + prefix


def budget(tid: str) -> str:
    """The tenant's GCRA state: its theoretical arrival time (seconds, Redis clock)."""
    return f"tg:budget:{tid}"


def in_flight(tid: str) -> str:
    """Sorted set: request id -> lease expiry (seconds, Redis clock)."""
    return f"tg:inflight:{tid}"


def request(rid: str) -> str:
    """Hash: the owning tenant and the state of one admitted request."""
    return f"tg:req:{rid}"


def usage(tid: str, minute: int) -> str:
    """Hash of counters for one tenant and one minute (``minute`` = unix time // 60)."""
    return f"tg:usage:{tid}:{minute}"


def text(value: str | bytes) -> str:
    """A value as redis-py returns it (bytes unless the client decodes), as text."""
    return value if isinstance(value, str) else value.decode()
