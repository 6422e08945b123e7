"""Token budgets in Redis: one Lua call admits a request, one settles it.

The scripts implement ``gateway.tenancy.gcra`` (the specification, with the formulas) on Redis's
clock, so every gateway replica shares one budget per tenant. Admission also opens the
request (and, under a concurrency limit, takes a lease) and writes its ownership record, in
the same atomic call; settlement closes it (and ends the lease) and refunds (or charges) the
difference between reserved and used tokens. Both take an explicit ``now`` for tests. The
usage they make is counted by the gateway (``gateway.tenancy.usage.UsageBook``), not by the
scripts: a second's worth of requests is one write per tenant instead of three per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from common import wire
from gateway.errors import RETRY_AFTER_S, GatewayError, RateLimited, TokensRateLimited, Unauthorized
from gateway.lua import CLOCK
from gateway.redis_batch import AutoPipeline
from gateway.settings import GatewaySettings
from gateway.tenancy import gcra
from gateway.tenancy.keys import KeyRef
from gateway.tenancy.limits import over_burst
from gateway.tenancy.tenants import Tenant, weighted
from gateway.tenancy.usage import UsageBook

_PRELUDE = (
    CLOCK
    + """
local tat = tonumber(redis.call('GET', KEYS[1]))
local start = now
if tat and tat > now then start = tat end
"""
)

# Every key is the tenant's (``wire.tenant_slot``: one cluster slot).
# KEYS: budget, leases, request record, open requests, API key digests
# ARGV: rate, burst, cost, max_wait, max_concurrent (0: none), lease_s, rid, tenant id,
#       prompt tokens, record ttl s, key digest ('' to skip the key check), key prefix, gateway id,
#       now ('' for Redis TIME)
# Only under a concurrency limit does a request take a lease (and count the live ones,
# dropping the expired): ``gcra.BucketModel.admit``; every request is open until it settles.
ADMIT = (
    _PRELUDE
    + """
if ARGV[11] ~= '' and redis.call('HGET', KEYS[5], ARGV[12]) ~= ARGV[11] then
  return {'revoked', num(now), num(start), '0', 0}
end
local rate, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local max_wait, max_concurrent, lease = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local in_flight = 0
if max_concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', num(now))
  in_flight = redis.call('ZCARD', KEYS[2])
end
local function refuse(status, wait)
  return {status, num(now), num(start), num(wait), in_flight}
end
if cost > burst then return refuse('too_large', 0) end
if max_concurrent > 0 and in_flight >= max_concurrent then return refuse('concurrency', 0) end
local new_tat = start + cost / rate
local wait = new_tat - burst / rate - now
if wait < 0 then wait = 0 end
if wait > max_wait then return refuse('budget', wait) end
redis.call('SET', KEYS[1], num(new_tat), 'PX', math.ceil((new_tat - now) * 1000) + 60000)
if max_concurrent > 0 then
  redis.call('ZADD', KEYS[2], num(now + lease), ARGV[7])
  redis.call('PEXPIRE', KEYS[2], math.ceil(lease * 1000) + 60000)
  in_flight = in_flight + 1
end
redis.call('HSET', KEYS[3], 'tenant', ARGV[8], 'state', 'admitted', 'admitted_at', num(now),
           'prompt_tokens', ARGV[9], 'reserved_tokens', ARGV[3], 'budget_wait_s', num(wait))
redis.call('EXPIRE', KEYS[3], ARGV[10])
redis.call('HSET', KEYS[4], ARGV[7], num(rate) .. ' ' .. ARGV[3] .. ' ' .. ARGV[13])
return {'ok', num(now), num(new_tat), num(wait), in_flight}
"""
)

# One request's settlement (the spec: ``gcra.BucketModel.settle``): forget it in its tenant's
# open requests, end its lease if it took one (``leased``), charge ``delta`` more
# tokens (a refund when negative), write ``fields`` (its final state, as field/value pairs) to
# its record if the record has not expired. Returns 0 when it had ended already (settled by
# the gateway or a survivor's sweep): then nothing changes.
_SETTLE_ONE = """
local function settle_one(now, budget, leases, record, open, rid, rate, delta, fields, leased)
  if redis.call('HDEL', open, rid) == 0 then
    return 0
  end
  if leased then
    redis.call('ZREM', leases, rid)
  end
  local tat = tonumber(redis.call('GET', budget))
  local start = now
  if tat and tat > now then start = tat end
  local new_tat = start + delta / rate
  if new_tat > now then
    redis.call('SET', budget, num(new_tat), 'PX', math.ceil((new_tat - now) * 1000) + 60000)
  else
    redis.call('DEL', budget)
  end
  -- a live record already has 'state': every field new means it had expired (made again: gone)
  if redis.call('HSET', record, unpack(fields)) * 2 == #fields then
    redis.call('DEL', record)
  end
  return 1
end
"""

# KEYS: budget, leases, request record, open requests (the tenant's: one slot)
# ARGV: rate, rid, delta tokens, state, budget tokens charged (the tokens at the model's token
#       weight), '1' if admitted under a concurrency limit (a lease to end) else '0', then
#       field/value pairs for the request record, now ('' for Redis TIME)
SETTLE = (
    CLOCK
    + _SETTLE_ONE
    + """
local fields = {'state', ARGV[4], 'finished_at', num(now), 'charged_tokens', ARGV[5]}
for i = 7, #ARGV - 1 do  -- extra record fields: the contract and what happened
  fields[#fields + 1] = ARGV[i]
end
return settle_one(now, KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], tonumber(ARGV[1]), tonumber(ARGV[3]), fields,
                  ARGV[6] == '1')
"""
)

# A dead gateway's requests of one tenant (``gateway.dispatch.liveness.Liveness.sweep`` runs it
# for each tenant): each is settled as ``abandoned`` and refunded its whole reservation at the
# rate it was admitted with (exactly undoing the admission). Returns how many.
# KEYS: the tenant's budget, leases, open requests (its slot); ARGV: gateway id, the tenant's
# request record prefix (``wire.request(tid, "")``), now ('' for Redis TIME)
SWEEP = (
    CLOCK
    + _SETTLE_ONE
    + """
local entries = redis.call('HGETALL', KEYS[3])
local n = 0
for i = 1, #entries, 2 do
  local rid = entries[i]
  local rate, reserved, gateway = string.match(entries[i + 1], '^(%S+) (%S+) (.+)$')
  if gateway == ARGV[1] then
    n = n + settle_one(now, KEYS[1], KEYS[2], ARGV[2] .. rid, KEYS[3], rid, tonumber(rate), -tonumber(reserved),
                       {'state', 'abandoned', 'finished_at', num(now), 'charged_tokens', 0}, true)
  end
end
return n
"""
)


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted request: it may start after ``wait_s`` seconds (already reserved) and
    must be settled exactly once (``Budget.settle``; a second call changes nothing)."""

    rid: str
    tenant: Tenant
    reserved: int  # prompt + max output tokens
    wait_s: float
    headers: dict[str, str]


def headers(tenant: Tenant, verdict: gcra.Verdict) -> dict[str, str]:
    """OpenAI's rate limit headers: tokens from the budget, requests from the concurrency limit."""
    out = {
        "x-ratelimit-limit-tokens": str(tenant.burst),
        "x-ratelimit-remaining-tokens": str(
            gcra.remaining_tokens(verdict.tat, verdict.now, tenant.rate, tenant.burst)
        ),
        "x-ratelimit-reset-tokens": gcra.duration(gcra.reset_s(verdict.tat, verdict.now)),
    }
    limit = tenant.limits.max_concurrent
    if limit is not None:
        out["x-ratelimit-limit-requests"] = str(limit)
        out["x-ratelimit-remaining-requests"] = str(max(0, limit - verdict.in_flight))
    return out


def refusal(tenant: Tenant, verdict: gcra.Verdict, cost: int, max_wait: float) -> GatewayError:
    """The error for a verdict other than ``ok``."""
    if verdict.status == "too_large":  # a tenant update raced the check in gateway.tenancy.limits
        return over_burst(tenant, cost)
    if verdict.status == "revoked":
        return Unauthorized("Incorrect API key provided: it is unknown or revoked.")
    hdrs = headers(tenant, verdict)
    # every message states the Retry-After header's figure: whole seconds, rounded up
    if verdict.status == "concurrency":
        hdrs["retry-after"] = str(RETRY_AFTER_S)
        return RateLimited(
            f"Rate limit reached for tenant '{tenant.name}': {verdict.in_flight} requests in "
            f"flight, the limit is {tenant.limits.max_concurrent} (its max_concurrent). Retry after "
            f"{RETRY_AFTER_S} s, or as soon as one has finished.",
            headers=hdrs,
        )
    retry = gcra.retry_after_s(verdict.wait, max_wait)
    why = ("its tenant's max_queue_delay_s" if max_wait >= tenant.max_queue_delay_s
           else "its deadline or first-token SLO")
    hdrs["retry-after"] = str(retry)
    then = f"it would then wait at most the {max_wait:g} s it may" if max_wait > 0 else "the budget has them then"
    return TokensRateLimited(
        f"Rate limit reached for tenant '{tenant.name}' on tokens: this request needs {cost} "
        f"tokens, for which the budget ({tenant.rate:g} tokens/s, burst {tenant.burst}) would hold it "
        f"{verdict.wait:.2f} s, longer than the {max_wait:g} s it may wait ({why}). "
        f"Retry after {retry} s: {then}.",
        headers=hdrs,
        extra={"budget_wait_s": round(verdict.wait, 3)},
    )


def _args(*values: float | int | str | None) -> list[str]:
    return ["" if v is None else repr(v) if isinstance(v, float) else str(v) for v in values]


def _verdict(reply: list[bytes | int]) -> gcra.Verdict:
    status, now, tat, wait, in_flight = reply
    assert isinstance(status, bytes) and isinstance(in_flight, int)
    return gcra.Verdict(status.decode(), float(now), float(tat), float(wait), in_flight)  # type: ignore[arg-type]


class Budget:
    """Both scripts go out through the gateway's ``AutoPipeline``: the admissions and
    settlements of requests arriving together share one round trip."""

    def __init__(self, client: aioredis.Redis, settings: GatewaySettings, batch: AutoPipeline | None = None,
                 usage: UsageBook | None = None) -> None:
        self.settings = settings
        self.weight = settings.token_weight(settings.model_name)  # budget tokens per token of the model
        self.client = client
        self.batch = batch or AutoPipeline(client)
        self.usage = usage or UsageBook(client, settings.usage_retention_s)  # the gateway's, shared by its models
        self._admit = client.register_script(ADMIT)
        self._settle = client.register_script(SETTLE)

    async def _run(self, script: AsyncScript, keys: list[str], args: list[str]) -> Any:
        try:
            return await self.batch.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:  # a fresh (or flushed) Redis: load it, once, and again
            await self.client.script_load(script.script)
            return await self.batch.call("EVALSHA", script.sha, len(keys), *keys, *args)

    async def reserve(
        self,
        tenant: Tenant,
        rid: str,
        cost: int,
        max_wait: float,
        prompt_tokens: int,
        *,
        key: KeyRef | None = None,
        now: float | None = None,
        wall: float | None = None,
    ) -> gcra.Verdict:
        """One admission attempt, as the script decided it (the raw verdict). With ``key``,
        the script first checks that the key is still live (``revoked`` otherwise)."""
        s = self.settings
        lease_s = max_wait + s.request_timeout_s + 30.0
        reply = await self._run(
            self._admit,
            [*self._keys(tenant.id, rid), wire.tenant_keys(tenant.id)],
            _args(
                tenant.rate,
                tenant.burst,
                cost,
                max_wait,
                tenant.limits.max_concurrent or 0,
                lease_s,
                rid,
                tenant.id,
                prompt_tokens,
                s.request_record_ttl_s,
                key.digest if key else "",
                key.prefix if key else "",
                s.gateway_id,
                now,
            ),
        )
        verdict = _verdict(reply)
        if verdict.status == "ok":
            self.usage.add(tenant.id, wall, requests=1)
        elif verdict.status in ("budget", "concurrency"):
            self.usage.add(tenant.id, wall, rate_limited=1)
        return verdict

    async def admit(
        self,
        tenant: Tenant,
        rid: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        key: KeyRef | None = None,
        deadline_s: float | None = None,
        now: float | None = None,
    ) -> Admission:
        """Reserve ``prompt_tokens + max_tokens`` or raise the 429 (or 400, or 401 for a
        ``key`` revoked meanwhile) that says why.

        The request may wait for its budget up to the tenant's ``max_queue_delay_s`` and,
        when given, ``deadline_s`` (seconds from now); the caller sleeps ``wait_s``."""
        cost = self.charge(prompt_tokens + max_tokens)
        max_wait = tenant.max_queue_delay_s
        if deadline_s is not None:
            max_wait = max(0.0, min(max_wait, deadline_s))
        verdict = await self.reserve(tenant, rid, cost, max_wait, prompt_tokens, key=key, now=now)
        if verdict.status != "ok":
            raise refusal(tenant, verdict, cost, max_wait)
        return Admission(rid, tenant, cost, verdict.wait, headers(tenant, verdict))

    async def settle(
        self,
        admission: Admission,
        state: str,
        prompt_tokens: int,
        completion_tokens: int,
        record: dict[str, float] | None = None,
        slo: bool | None = None,
    ) -> bool:
        """Ends the request (and its lease) and charges the tokens given (refunding the rest of
        its reservation); False when it was settled already (here, or by a survivor's sweep),
        and then nothing changes. ``record`` adds fields to the request's record; ``slo``: whether it
        met its SLO (None: it had none), counted in the tenant's usage."""
        charged = self.charge(prompt_tokens + completion_tokens)
        return await self.settle_raw(
            admission.tenant, admission.rid, charged - admission.reserved, state, prompt_tokens, completion_tokens,
            record=record, slo=slo, charged=charged,
        )

    def charge(self, tokens: int) -> int:
        """What ``tokens`` of this budget's model cost the tenant's budget (its token weight)."""
        return weighted(tokens, self.weight)

    async def settle_raw(
        self,
        tenant: Tenant,
        rid: str,
        delta: int,
        state: str,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        now: float | None = None,
        wall: float | None = None,
        record: dict[str, float] | None = None,
        slo: bool | None = None,
        charged: int | None = None,
    ) -> bool:
        """``tenant``: as it was admitted (its concurrency limit then says whether the request
        holds a lease). ``charged``: the budget tokens the request cost (default: its prompt and completion
        tokens, a weight of 1), counted in the record and the tenant's usage; usage is counted
        in the minute of ``wall`` (unix time; default now)."""
        pairs = [x for item in (record or {}).items() for x in item]
        tokens = prompt_tokens + completion_tokens
        charged = tokens if charged is None else charged
        reply = await self._run(
            self._settle, self._keys(tenant.id, rid),
            _args(tenant.rate, rid, delta, state, charged, int(bool(tenant.limits.max_concurrent)), *pairs, now),
        )
        if not reply:
            return False
        slo_field = "" if slo is None else "slo_met" if slo else "slo_missed"
        self.usage.add(tenant.id, wall, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       weighted_extra_tokens=charged - tokens, **({slo_field: 1} if slo_field else {}))
        return True

    def _keys(self, tid: str, rid: str) -> list[str]:
        """The keys both scripts take."""
        return [wire.budget(tid), wire.in_flight(tid), wire.request(tid, rid), wire.open_requests(tid)]

    async def state(self, tenant: Tenant) -> dict[str, float | int]:
        """The tenant's budget right now (Redis clock), for operators; ``in_flight``: its
        requests admitted and not settled."""
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        pipe.get(wire.budget(tenant.id))
        pipe.hlen(wire.open_requests(tenant.id))
        (sec, usec), raw, in_flight = await pipe.execute()
        now = sec + usec / 1_000_000
        tat = max(float(raw), now) if raw is not None else now
        return {
            "remaining_tokens": gcra.remaining_tokens(tat, now, tenant.rate, tenant.burst),
            "reset_s": round(gcra.reset_s(tat, now), 3),
            "in_flight": in_flight,
        }
