"""Usage per tenant and minute: counters each gateway adds up and writes, read back as a series.

One hash per tenant and minute (``wire.usage``: ``{tg:t:<id>}:usage:<unix_minute>``, in the
tenant's slot) with the fields below;
each expires after the usage retention. A gateway counts ``requests`` (admitted) and
``rate_limited`` (429s for the token budget or the concurrency limit) as its budget script
decides them, and at each settlement the tokens charged (prompt, completion, and what a
model's token weight adds: ``weighted_extra_tokens``) and, for a request with an SLO (the
tenant's or its headers'), whether it met it (``slo_met``, ``slo_missed``: ``slo_verdict``).

The counts are added up in memory (``UsageBook``) and written to Redis once a second, and at
shutdown: a second's requests of a tenant are one write (``HINCRBY`` per field and an
``EXPIRE``, pipelined), not three in every request's scripts (issue 39: Redis commands
per request). What that costs: another gateway's counts show up to a second late (a
gateway's own admin endpoints write its counts first), and a gateway killed without a
shutdown (``kill -9``, a lost machine) loses its last second of counts; the budget itself is
never counted late (the scripts keep it). LiteLLM's proxy batches its spend writes the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common import wire
from gateway.errors import InvalidRequest

log = logging.getLogger("tokengate.gateway")

FLUSH_S = 1.0  # how often a gateway writes the usage it counted

FIELDS = ("requests", "rate_limited", "prompt_tokens", "completion_tokens", "slo_met", "slo_missed")
DERIVED = ("total_tokens", "charged_tokens")  # worked out from the counters (``row``)
MAX_MINUTES = 7 * 24 * 60


class UsageBook:
    """The usage this gateway's requests made and has not written yet, by tenant and minute."""

    def __init__(self, client: aioredis.Redis, retention_s: int) -> None:
        self.client = client
        self.retention_s = retention_s
        self._counts: dict[tuple[str, int], dict[str, int]] = {}
        self._writing = asyncio.Lock()

    def add(self, tid: str, wall: float | None = None, **counts: int) -> None:
        """Count ``counts`` (field: amount; zeros are left out) for ``tid`` in the minute of
        ``wall`` (unix seconds; default now)."""
        minute = int((time.time() if wall is None else wall) // 60)
        book = self._counts.setdefault((tid, minute), {})
        for name, n in counts.items():
            if n:
                book[name] = book.get(name, 0) + n

    async def flush(self) -> None:
        """Write what was counted since the last write, in one round trip (each tenant's
        minutes are in its own slot: a pipeline, not a transaction). On a Redis error (raised)
        nothing of it is taken as written: it is kept for the next write."""
        async with self._writing:
            counts, self._counts = self._counts, {}
            if not counts:
                return
            pipe = self.client.pipeline(transaction=False)
            for (tid, minute), fields in counts.items():
                key = wire.usage(tid, minute)
                for name, n in fields.items():
                    pipe.hincrby(key, name, n)
                pipe.expire(key, self.retention_s)
            try:
                replies = await pipe.execute(raise_on_error=False)
            except BaseException:
                for (tid, minute), fields in counts.items():
                    self.add(tid, minute * 60.0, **fields)
                raise
            for reply in replies:
                if isinstance(reply, Exception):  # a key of another type: nothing to retry
                    log.warning("a usage count was not written: %s", reply)

    async def run(self) -> None:
        """Write every ``FLUSH_S`` until cancelled; a Redis outage keeps the counts until it ends."""
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                await self.flush()
            except RedisError as exc:
                log.debug("usage not written yet: %s", exc)


def window(since: str | None, until: str | None, now: float) -> tuple[int, int]:
    """The minutes ``[first, last]`` a query asks for: unix seconds, defaulting to the last hour."""
    end = _seconds(until, "until", now)
    start = _seconds(since, "since", end - 3600)
    if start > end:
        raise InvalidRequest("'since' must not be after 'until'.", param="since")
    first, last = int(start // 60), int(end // 60)
    if last - first >= MAX_MINUTES:
        raise InvalidRequest(f"Ask for at most {MAX_MINUTES} minutes at a time.", param="since")
    return first, last


def _seconds(value: str | None, param: str, default: float) -> float:
    if value is None or value == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidRequest(
            f"'{param}' must be unix seconds, got {value!r}.", param=param
        ) from None
    if not 0 <= seconds < 1e11:
        raise InvalidRequest(f"'{param}' is out of range.", param=param)
    return seconds


def row(minute: int, counters: dict[bytes, bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {"minute": minute * 60}
    for name in FIELDS:
        out[name] = int(counters.get(name.encode(), 0))
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    # what the budget was charged: the tokens at their models' token weights (the settle script
    # counts only the difference, where a weight is not 1)
    out["charged_tokens"] = out["total_tokens"] + int(counters.get(b"weighted_extra_tokens", 0))
    return out


async def series(client: aioredis.Redis, tid: str, first: int, last: int) -> list[dict[str, Any]]:
    """The minutes in ``[first, last]`` that saw any traffic, oldest first."""
    return (await series_of(client, [tid], first, last))[0]


async def series_of(client: aioredis.Redis, tids: list[str], first: int, last: int) -> list[list[dict[str, Any]]]:
    """``series`` of each tenant in ``tids``, in one round trip."""
    pipe = client.pipeline(transaction=False)
    minutes = range(first, last + 1)
    for tid in tids:
        for minute in minutes:
            pipe.hgetall(wire.usage(tid, minute))
    found = await pipe.execute()
    n = len(minutes)
    return [[row(m, c) for m, c in zip(minutes, found[i * n:(i + 1) * n], strict=True) if c] for i in range(len(tids))]


def totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    keys = (*FIELDS, *DERIVED)
    return {k: sum(r[k] for r in rows) for k in keys}


def slo_verdict(state: str, ttft_s: float | None, total_s: float | None, completion_tokens: int,
                slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool | None:
    """Whether a settled request met its SLO, as the simulator judges one (``Slo.met``): its
    first token within ``slo_ttft_s`` and its later tokens within ``slo_tpot_s`` each on
    average. None when it had no SLO, or its client cancelled it; a failed request missed it.
    A request whose first token was not seen apart is judged by its end."""
    if (slo_ttft_s is None and slo_tpot_s is None) or state == "cancelled":
        return None
    if state != "done" or total_s is None:
        return False
    first = total_s if ttft_s is None else ttft_s
    if slo_ttft_s is not None and first > slo_ttft_s:
        return False
    later = completion_tokens - 1
    return slo_tpot_s is None or later <= 0 or (total_s - first) / later <= slo_tpot_s
