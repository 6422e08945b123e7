"""The traffic a model's scheduler saw, kept in Redis as a trace to tune on (issue 41).

The scheduler's driver closes one row per request (``sched_core.recorded``); on the cadence the
fitted model is saved at (``MODEL_SAVE_S``) and at shutdown the gateway appends the rows closed
since to the model's traffic stream (``wire.traffic_stream``, trimmed to the last
``TRAFFIC_WINDOW``), each with its arrival as wall time. Any gateway reads it back, whichever
one scheduled, and a scheduler that took over adds to the same stream. ``GET /admin/traffic``
serves it as a CSV that ``tokengate simulate --trace`` and ``tokengate policy solve --trace``
read: ``TIMESTAMP`` (Unix seconds), ``ContextTokens``, ``GeneratedTokens`` (for a request that
did not finish, the ``max_tokens`` it asked for), ``Finished`` (1 or 0) and ``Tenant``.
"""

from __future__ import annotations

import asyncio
import io
import time
from typing import Any

import orjson
import redis.asyncio as aioredis

from common import wire
from sched_core.recorded import TRAFFIC_WINDOW, Traffic

CSV_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens,Finished,Tenant"


async def flush(client: aioredis.Redis, model: str, traffic: Traffic) -> int:
    """Appends the rows closed since the last flush (their arrivals turned from the driver's
    monotonic clock into wall time); how many."""
    rows = traffic.take()
    if not rows:
        return 0
    shift = time.time() - time.monotonic()
    stream = wire.traffic_stream(model)
    pipe = client.pipeline(transaction=False)
    for r in rows:  # the trace's columns: an unfinished request counts the tokens it asked for
        doc = [round(r.arrival + shift, 3), r.prompt_tokens, r.output_tokens if r.finished else r.max_tokens,
               int(r.finished), r.tenant]
        pipe.xadd(stream, {"r": orjson.dumps(doc)}, maxlen=TRAFFIC_WINDOW, approximate=True)
    await pipe.execute()
    return len(rows)


async def read_csv(client: aioredis.Redis, model: str, last: int | None = None) -> str:
    """The model's traffic stream as a trace, oldest arrival first; ``last``: only the latest
    ``last`` rows written (a re-solve reads its window, not the whole stream). The rows are
    decoded and written out in a thread: the whole stream (``TRAFFIC_WINDOW`` rows) took 40 ms
    to decode on an AMD EPYC, time the event loop would otherwise stop serving for."""
    stream = wire.traffic_stream(model)
    entries = await (client.xrange(stream) if last is None else client.xrevrange(stream, count=last))
    return await asyncio.to_thread(_csv, entries or [])


def _csv(entries: list[tuple[Any, Any]]) -> str:
    rows = []
    for _id, fields in entries:
        try:
            at, prompt, generated, finished, tenant = orjson.loads((fields or {})[b"r"])
        except (KeyError, ValueError, orjson.JSONDecodeError):
            continue  # not an entry this module wrote
        rows.append((float(at), int(prompt), int(generated), int(finished), str(tenant)))
    rows.sort()
    out = io.StringIO()
    out.write(CSV_HEADER + "\n")
    for at, *rest in rows:
        out.write(f"{at:.3f}," + ",".join(map(str, rest)) + "\n")
    return out.getvalue()
