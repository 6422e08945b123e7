"""Property tests: random event sequences into both implementations at once.

Every call goes to the reference and to the compiled core; the two must return equal
decisions, contracts and reports (floats to the bit). Along the way the lifecycle of every
request is checked (admitted once, then dispatched, rejected or cancelled exactly once),
then the queue must drain once capacity is offered, and backlogged tenants must stay
within the fair-share bound.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import sched_core
from common.pools import POOLS
from sched_core import (
    BatchTimings,
    Contract,
    Dispatch,
    PathConfig,
    Reject,
    Request,
    SchedulerConfig,
)
from sched_core.smdp import N_STATES, Action, PolicyTable

TENANTS = ("t0", "t1", "t2", "t3")


@dataclass
class Lockstep:
    """Both implementations behind one interface; every answer is compared."""

    config: SchedulerConfig
    now: float = 0.0
    impls: list[Any] = field(default_factory=list)
    open: set[str] = field(default_factory=set)  # admitted, not yet dispatched/ended
    running: dict[int, Dispatch] = field(default_factory=dict)
    unfinished: dict[int, set[str]] = field(default_factory=dict)  # per running batch
    capacity: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "gpu": 0})
    used: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "gpu": 0})

    def __post_init__(self) -> None:
        self.impls = [cls(self.config) for cls in sched_core.IMPLEMENTATIONS.values()]

    def call(self, method: str, *args: Any) -> Any:
        return self.same(method, [getattr(s, method)(*args) for s in self.impls])

    def queued(self) -> int:
        return int(self.same("queued", [s.queued for s in self.impls]))

    @staticmethod
    def same(what: str, answers: list[Any]) -> Any:
        first, *others = answers
        for other in others:
            assert other == first, f"{what}: {other!r} != {first!r}"
        return first

    def arrive(self, r: Request) -> None:
        result = self.call("arrive", r, self.now)
        self.same("macro_state", [s.macro_state for s in self.impls])
        self.call("admission")
        if isinstance(result, Contract):
            assert r.id not in self.open and not self.is_running(r.id)
            assert result.ttft_s <= result.total_s <= result.p99_s
            self.open.add(r.id)
        else:
            assert result.reason in {"duplicate", "too_long", "queue_full", "deadline"}

    def tick(self) -> None:
        for d in self.call("tick", self.now):
            if isinstance(d, Reject):
                assert d.reason == "deadline"
                self.open.remove(d.request_id)
                continue
            assert set(d.request_ids) <= self.open and len(set(d.request_ids)) == len(
                d.request_ids)
            self.open -= set(d.request_ids)
            size = len(d.request_ids)
            assert 1 <= size <= self.config.path(POOLS.index(d.path)).max_batch
            assert self.used[d.path] + size <= self.capacity[d.path]
            self.used[d.path] += size
            self.running[d.batch_id] = d
            self.unfinished[d.batch_id] = set(d.request_ids)

    def complete(self, batch_id: int, rng: random.Random) -> None:
        d = self.running.pop(batch_id)
        self.used[d.path] -= len(self.unfinished.pop(batch_id))
        outs = tuple(rng.randint(0, 300) for _ in d.request_ids)
        self.call("completed", BatchTimings(
            d.batch_id, d.path, len(outs), 64 * (d.bucket + 1), rng.uniform(0.001, 1.0),
            max(outs), rng.uniform(0.001, 2.0), outs), self.now)

    def finish(self, rid: str, out: int) -> None:
        """One request of a running batch finishes before its batch reports."""
        batch = next((b for b, left in self.unfinished.items() if rid in left), None)
        assert self.call("finished", rid, out, self.now) == (batch is not None)
        if batch is not None:
            self.unfinished[batch].remove(rid)
            self.used[self.running[batch].path] -= 1
            if not self.unfinished[batch]:
                del self.unfinished[batch]
                del self.running[batch]

    def steps(self, path: str, rng: random.Random) -> None:
        """Worker step telemetry: (prefill tokens, decode sequences, KV tokens, seconds)."""
        records = []
        for _ in range(rng.randint(1, 8)):
            seqs = rng.randint(0, 32)
            records.append((rng.choice([0, 0, rng.randint(1, 512)]), seqs,
                            rng.randint(seqs, 600 * seqs), rng.uniform(0.001, 0.5)))
        self.call("observe_steps", path, records, self.now)

    def set_capacity(self, path: str, slots: int, workers: int = 1, step_tokens: int = 0) -> None:
        self.capacity[path] = slots
        self.call("worker_capacity", path, slots, self.now, workers, step_tokens)

    def is_running(self, rid: str) -> bool:
        return any(rid in left for left in self.unfinished.values())

    def check_reports(self, ids: list[str]) -> None:
        self.call("snapshot")
        self.call("state_visits")
        assert self.queued() == len(self.open)
        for rid in ids:
            self.call("explain", rid)


actions = st.builds(
    Action, prefill_queue_steps=st.sampled_from([0.5, 2.0, 4.0, math.inf]),
    slot_share=st.sampled_from([0.1, 0.5, 0.75, 1.0]), aging=st.sampled_from([0.1, 1.0, 30.0]),
    admit_quantile=st.sampled_from([0.5, 0.9, 0.99]), admit_slack=st.sampled_from([0.5, 1.0]))
tables = st.builds(PolicyTable, st.lists(actions, min_size=N_STATES, max_size=N_STATES).map(tuple),
                   long_prompt=st.sampled_from([100, 1000, 2048]), full_share=st.sampled_from([0.5, 1.0]))

configs = st.builds(
    SchedulerConfig,
    bucket_bounds=st.sampled_from([(64, 128, 256, 512, 1024, 2048, 4096, 8192), (100, 1000)]),
    cpu=st.builds(PathConfig, decode_launch=st.sampled_from([0.0, 0.006]),
                  decode_seq=st.just(0.0015), kv_token=st.sampled_from([1e-7, 2e-6]),
                  prefill_launch=st.sampled_from([0.0, 0.004]), prefill_token=st.just(4e-5),
                  max_batch=st.integers(1, 8), step_tokens=st.sampled_from([16, 128, 512])),
    gpu=st.builds(PathConfig, decode_launch=st.just(0.008), decode_seq=st.just(1e-4),
                  kv_token=st.just(3e-8), prefill_launch=st.sampled_from([0.03, 0.3]),
                  prefill_token=st.just(1e-6), max_batch=st.integers(1, 64),
                  step_tokens=st.sampled_from([64, 512])),
    ttft_p99_slo_s=st.sampled_from([0.3, 2.0, 30.0]),
    tpot_slo_s=st.sampled_from([0.01, 0.1, 1.0]),
    prefill_queue_steps=st.sampled_from([0.5, 2.0, math.inf]),
    max_queued=st.sampled_from([3, 1000]),
    fair_slack_tokens=st.sampled_from([0.0, 500.0, 65536.0]),
    rate_window_s=st.sampled_from([0.05, 10.0]),
    policy_table=st.one_of(st.none(), tables),
)

arrivals = st.tuples(
    st.just("arrive"), st.integers(0, len(TENANTS) - 1),
    st.one_of(st.integers(1, 900), st.integers(1, 9000)),
    st.integers(1, 300), st.sampled_from([0, 0, 1, 40, 300]), st.integers(0, 2),
    st.one_of(st.none(), st.floats(0.0, 5.0)), st.sampled_from([0.0, 0.0, 0.3]),
    st.floats(0.0, 0.2), st.booleans())
events = st.lists(st.one_of(
    arrivals,
    arrivals,
    st.tuples(st.just("tick"), st.floats(0.0, 0.5)),
    st.tuples(st.just("complete"), st.integers(0, 10**6)),
    st.tuples(st.just("finish"), st.integers(0, 10**6), st.integers(0, 300)),
    st.tuples(st.just("steps"), st.sampled_from(["cpu", "gpu"])),
    st.tuples(st.just("cancel"), st.integers(0, 10**6)),
    st.tuples(st.just("capacity"), st.sampled_from(["cpu", "gpu"]), st.integers(0, 12),
              st.integers(0, 3), st.sampled_from([0, 32, 256])),
), min_size=20, max_size=100)


@given(config=configs, script=events, seed=st.integers(0, 2**16))
def test_both_implementations_decide_alike_and_every_request_ends_once(
        config: SchedulerConfig, script: list[tuple[Any, ...]], seed: int) -> None:
    rng = random.Random(seed)
    run = Lockstep(config)
    ids: list[str] = []
    for event in script:
        kind = event[0]
        if kind == "arrive":
            _, t, prompt, max_tokens, out, prio, deadline, budget_wait, dt, again = event
            run.now += dt
            rid = rng.choice(ids) if again and ids else f"r{len(ids)}"
            ids.append(rid)
            run.arrive(Request(
                rid, TENANTS[t], weight=100.0 * (t + 1), prompt_tokens=prompt,
                max_tokens=max_tokens, arrival=run.now - budget_wait,
                expected_output_tokens=out, priority=prio,
                deadline=None if deadline is None else run.now + deadline,
                budget_wait=budget_wait))
        elif kind == "tick":
            run.now += event[1]
            run.tick()
        elif kind == "complete" and run.running:
            run.complete(sorted(run.running)[event[1] % len(run.running)], rng)
        elif kind == "finish" and ids:
            run.finish(ids[event[1] % len(ids)], event[2])
        elif kind == "steps":
            run.steps(event[1], rng)
        elif kind == "cancel" and ids:
            rid = ids[event[1] % len(ids)]
            if run.call("cancel", rid, run.now):
                run.open.remove(rid)
        elif kind == "capacity":
            run.set_capacity(*event[1:])
        run.queued()
    run.check_reports(ids)

    # With capacity offered and batches completing, everything queued leaves in bounded
    # time: nothing waits forever (aging, fairness and the release rule all give way).
    if run.capacity["cpu"] == 0 and run.capacity["gpu"] == 0:
        run.set_capacity("gpu", 4)
    for _ in range(400):
        if not run.open and not run.running:
            break
        run.now += 0.05
        run.tick()
        for batch_id in sorted(run.running):
            run.complete(batch_id, rng)
    assert not run.open and not run.running, "requests left waiting while capacity is offered"
    run.check_reports(ids)


@given(
    weights=st.lists(st.sampled_from([100.0, 300.0, 1000.0, 5000.0]), min_size=2, max_size=5),
    sizes=st.lists(st.tuples(st.integers(1, 4000), st.integers(1, 200)), min_size=30,
                   max_size=120),
    slack=st.sampled_from([0.0, 300.0, 4000.0, 65536.0]),
    capacity=st.tuples(st.integers(0, 8), st.integers(1, 64)),
)
def test_backlogged_tenants_stay_within_the_fair_share_bound(
        weights: list[float], sizes: list[tuple[int, int]], slack: float,
        capacity: tuple[int, int]) -> None:
    """Counters start equal and outputs match the estimates (no corrections), so a
    tenant's counter is its served tokens over its budget. A tenant is served only while
    its counter is within slack/weight of the smallest backlogged one, so
    ``served_f/w_f − served_g/w_g ≤ slack/w_f + (largest charge of f)`` while both wait."""
    config = SchedulerConfig(fair_slack_tokens=slack)
    run = Lockstep(config)
    run.set_capacity("cpu", capacity[0])
    run.set_capacity("gpu", capacity[1])
    charge: dict[str, float] = {}
    expected: dict[str, int] = {}
    for i, (prompt, out) in enumerate(sizes):
        t = i % len(weights)
        tenant = f"t{t}"
        run.arrive(Request(f"r{i}", tenant, weights[t], prompt, out, 0.0,
                           expected_output_tokens=out))
        expected[f"r{i}"] = out
        charge[tenant] = max(charge.get(tenant, 0.0), (prompt + 2 * out) / weights[t])
    served = dict.fromkeys(charge, 0.0)
    for _ in range(300):
        if not run.open:
            break
        run.now += 0.05
        for d in run.call("tick", run.now):
            for rid in d.request_ids:
                run.open.remove(rid)
            outs = tuple(expected[rid] for rid in d.request_ids)
            run.call("completed", BatchTimings(d.batch_id, d.path, len(outs), 100, 0.01,
                                               max(outs), 0.01, outs), run.now)
            for rid, prompt_out in zip(d.request_ids, outs, strict=True):
                i = int(rid[1:])
                t = i % len(weights)
                served[f"t{t}"] += (sizes[i][0] + 2 * prompt_out) / weights[t]
        tenants = run.call("snapshot")["fairness"]["tenants"]
        backlogged = [t for t, v in tenants.items() if v["queued"] > 0]
        for f in backlogged:
            assert abs(tenants[f]["counter"] - served[f]) <= 1e-6 * (1.0 + served[f])
            w = weights[int(f[1:])]
            for g in backlogged:
                assert served[f] - served[g] <= slack / w + charge[f] + 1e-9
    assert not run.open


def _random_table(rng: random.Random) -> PolicyTable:
    return PolicyTable(tuple(Action(rng.choice([1.0, 4.0, math.inf]), rng.choice([0.25, 0.5, 1.0]),
                                    rng.choice([0.1, 1.0, 10.0]), rng.choice([0.5, 0.99]), 1.0)
                             for _ in range(N_STATES)), long_prompt=2048)


@pytest.mark.parametrize(("seed", "rate", "slo", "table"), [
    (1, 400.0, 2.0, False), (2, 30.0, 2.0, False), (3, 100.0, 20.0, False), (6, 400.0, 2.0, True),
    (5, 60.0, 2.0, True)])
def test_long_runs_agree(seed: int, rate: float, slo: float, table: bool) -> None:
    """Thousands of events, overloaded to light: holds, tail cuts, fairness, refits; with
    the heuristic, and with a random SMDP table switching the knobs state by state."""
    rng = random.Random(seed)
    run = Lockstep(SchedulerConfig(rate_window_s=1.0, fair_slack_tokens=2000.0,
                                   ttft_p99_slo_s=slo,
                                   policy_table=_random_table(rng) if table else None))
    run.set_capacity("cpu", 8)
    run.set_capacity("gpu", 32)
    for i in range(3000):
        run.now += rng.expovariate(rate)
        roll = rng.random()
        if roll < 0.6:
            t = rng.randrange(len(TENANTS))
            run.arrive(Request(
                f"r{i}", TENANTS[t], 200.0 * (t + 1), rng.randint(1, 8192),
                rng.randint(1, 256), run.now, rng.choice([0, 16, 128]),
                deadline=run.now + rng.uniform(0.5, 5.0) if rng.random() < 0.1 else None))
        elif roll < 0.85:
            run.tick()
        elif roll < 0.93 and run.running:
            run.complete(rng.choice(sorted(run.running)), rng)
        elif roll < 0.96 and run.running:
            batch = rng.choice(sorted(run.unfinished))
            run.finish(rng.choice(sorted(run.unfinished[batch])), rng.randint(1, 300))
        elif roll < 0.97:
            run.steps(rng.choice(["cpu", "gpu"]), rng)
        else:
            rid = f"r{rng.randrange(i + 1)}"
            if run.call("cancel", rid, run.now):
                run.open.remove(rid)
    run.check_reports([f"r{i}" for i in range(0, 3000, 7)])
    if table:  # the run went through several macro-states, so the tables' knobs did switch
        assert sum(1 for v in run.call("state_visits") if v) >= 3
