"""Who owns an admitted request, and what became of it: ``{tg}:req:{rid}``.

The admission script writes the record (tenant, ``state`` = ``admitted``, tokens, budget
wait) with a TTL; settling sets the final state (``done``, ``cancelled``, ``failed``) and
the tokens charged. A tenant may read only its own requests: any other id is 404, with
the same message whether the request exists or not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from common import wire
from gateway.errors import NotFound

_INTS = ("prompt_tokens", "reserved_tokens", "charged_tokens")
_FLOATS = (
    "admitted_at", "finished_at", "budget_wait_s",
    "contract_ttft_s", "contract_total_s", "contract_p99_s", "contract_ttft_p99_s", "ttft_s", "total_s",
)
_RESPONSE_PREFIXES = ("chatcmpl-", "cmpl-")


def request_id(ref: str) -> str:
    """A request id from what a client holds: ``x-request-id`` or the response ``id``."""
    for prefix in _RESPONSE_PREFIXES:
        if ref.startswith(prefix):
            return ref[len(prefix) :]
    return ref


def decode(rid: str, fields: Mapping[bytes | str, bytes | str]) -> dict[str, Any]:
    doc: dict[str, Any] = {"id": rid, "object": "request"}
    for k, v in fields.items():
        name, text = wire.text(k), wire.text(v)
        doc[name] = int(text) if name in _INTS else float(text) if name in _FLOATS else text
    return doc


async def owner(client: aioredis.Redis, rid: str) -> str | None:
    """The id of the tenant that owns ``rid``, or None when unknown or expired."""
    found = await client.hget(wire.request(rid), "tenant")
    return None if found is None else wire.text(found)


async def read(client: aioredis.Redis, ref: str, tenant_id: str | None) -> dict[str, Any]:
    """The record of one of ``tenant_id``'s requests (None: any tenant's, for the admin);
    NotFound for anything else."""
    rid = request_id(ref)
    fields = await client.hgetall(wire.request(rid)) if len(rid) <= 64 else {}
    owner = fields.get(b"tenant")
    if owner is None or (tenant_id is not None and wire.text(owner) != tenant_id):
        raise NotFound(f"No request '{ref}'.", param="id")
    return decode(rid, fields)
