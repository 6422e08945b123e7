"""The Lua budget against its Python model (``gateway.tenancy.gcra``), step by step, on a real Redis.

The scripts take ``now`` as an argument here (production passes none and they read Redis's
``TIME``), so the comparison is exact: same decisions, same floats, same stored state.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from common import wire
from gateway.dispatch.liveness import Liveness
from gateway.settings import GatewaySettings
from gateway.tenancy.budget import Budget
from gateway.tenancy.gcra import BucketModel
from gateway.tenancy.tenants import Limits, Tenant

pytestmark = pytest.mark.redis

T0 = 1_800_000_000.123


class BudgetMachine(RuleBasedStateMachine):
    url = ""
    admitted = Bundle("admitted")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.client = aioredis.Redis.from_url(self.url)
        self.gateway = GatewaySettings(redis_url=self.url, model_name="m", request_timeout_s=4.0)
        self.budget = Budget(self.client, self.gateway)
        self.liveness = Liveness(self.client, self.gateway)
        self.reserved: dict[str, tuple[float, int]] = {}  # unsettled rid -> (rate, cost) at admission
        self.limits: dict[str, int] = {}  # rid -> the max_concurrent it was admitted under
        self.tid = "tn_" + secrets.token_hex(8)
        self.run(self.client.sadd(wire.TENANT_IDS, self.tid))  # a sweep looks in every tenant's slot
        self.model = BucketModel()
        self.now = T0
        self.rate = 100.0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def tenant(self, rate: float, burst: int = 1, max_concurrent: int = 0) -> Tenant:
        return Tenant(
            self.tid, "t", rate, burst, limits=Limits(max_concurrent=max_concurrent or None)
        )

    @rule(
        target=admitted,
        cost=st.integers(1, 3000),
        max_wait=st.sampled_from([0.0, 0.5, 2.0, 7.25]),
        rate=st.sampled_from([0.5, 3.0, 100.0, 1234.5]),
        burst=st.sampled_from([1, 50, 1000, 2500]),
        max_concurrent=st.sampled_from([0, 1, 3]),
    )
    def admit(
        self, cost: int, max_wait: float, rate: float, burst: int, max_concurrent: int
    ) -> Any:
        self.rate = rate
        rid = secrets.token_hex(6)
        got = self.run(
            self.budget.reserve(
                self.tenant(rate, burst, max_concurrent), rid, cost, max_wait, 1, now=self.now
            )
        )
        lease_s = max_wait + 4.0 + 30.0
        want = self.model.admit(self.now, rate, burst, cost, max_wait, max_concurrent, rid, lease_s)
        assert got == want
        if got.status == "ok":
            self.reserved[rid] = (rate, cost)
            self.limits[rid] = max_concurrent
        return rid if got.status == "ok" else multiple()

    @rule(rid=admitted, used=st.integers(0, 4000))
    def settle(self, rid: str, used: int) -> None:
        # a rid may be settled again (a second settle must change nothing); `used` is the
        # difference to charge, so refunds and overcharges both occur
        delta = used - 2000
        limit = self.limits[rid]  # the tenant as admitted: its limit says whether a lease was taken
        got = self.run(
            self.budget.settle_raw(self.tenant(self.rate, max_concurrent=limit), rid, delta, "done", 0, 0, now=self.now)
        )
        assert got == self.model.settle(self.now, self.rate, rid, delta, leased=limit > 0)
        self.reserved.pop(rid, None)

    @rule()
    def gateway_dies(self) -> None:
        """A survivor sweeps the dead gateway: each unsettled request is settled as
        abandoned, refunded its whole reservation at the rate it was admitted with."""
        me = self.gateway.gateway_id
        self.run(self.client.zadd(wire.GATEWAYS_ZSET, {me: self.now - 3600}))
        swept = self.run(self.liveness.sweep(me, now=self.now))
        refunded = sum(
            self.model.settle(self.now, rate, rid, -cost) for rid, (rate, cost) in self.reserved.items()
        )
        assert swept == refunded
        self.reserved.clear()
        assert self.run(self.client.exists(wire.open_requests(self.tid))) == 0
        assert self.run(self.liveness.sweep(me, now=self.now)) == -1  # once only

    @rule(dt=st.floats(0.0, 30.0) | st.sampled_from([0.0, 1e-6, 0.01]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def same_state(self) -> None:
        raw = self.run(self.client.get(wire.budget(self.tid)))
        assert (None if raw is None else float(raw)) == self.model.tat
        leases = self.run(self.client.zrange(wire.in_flight(self.tid), 0, -1, withscores=True))
        assert {r.decode(): s for r, s in leases} == self.model.leases
        open_ = self.run(self.client.hkeys(wire.open_requests(self.tid)))
        assert {r.decode() for r in open_} == self.model.open

    @invariant()
    def usage_and_records_expire(self) -> None:
        """No usage minute (written by the gateway's usage book) and no request record lives
        for ever."""
        self.run(self.budget.usage.flush())
        usage = self.run(self.client.keys(wire.usage(self.tid, 0).rsplit(":", 1)[0] + ":*"))
        records = [wire.request(self.tid, rid) for rid in self.reserved]
        for key in [*usage, *records]:
            assert self.run(self.client.ttl(key)) > 0, key

    def teardown(self) -> None:
        self.run(self.client.srem(wire.TENANT_IDS, self.tid))
        self.run(self.client.aclose())
        self.loop.close()


def test_lua_budget_matches_the_python_model(redis_url: str) -> None:
    class Machine(BudgetMachine):
        url = redis_url

    run_state_machine_as_test(
        Machine, settings=settings(max_examples=150, stateful_step_count=40, deadline=None)
    )
