"""Who owns an admitted request, and what became of it: ``wire.request(tenant, rid)``, in the
tenant's slot.

The admission script writes the record (tenant, ``state`` = ``admitted``, tokens, budget
wait) with a TTL; settling sets the final state (``done``, ``cancelled``, ``failed``) and
the tokens charged. A tenant may read only its own requests: any other id is 404, with
the same message whether the request exists or not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


async def read(client: aioredis.Redis, ref: str, tenant_ids: Sequence[str]) -> dict[str, Any]:
    """The record of ``ref`` if one of ``tenant_ids`` owns it (a tenant reads its own: its id;
    the admin anyone's: every tenant's, a read in each one's slot, pipelined); NotFound for
    anything else, with the same message whether the request exists or not."""
    rid = request_id(ref)
    if len(rid) <= 64 and tenant_ids:
        pipe = client.pipeline(transaction=False)
        for tid in tenant_ids:
            pipe.hgetall(wire.request(tid, rid))
        for tid, fields in zip(tenant_ids, await pipe.execute(), strict=True):
            if fields.get(b"tenant") == tid.encode():
                return decode(rid, fields)
    raise NotFound(f"No request '{ref}'.", param="id")
