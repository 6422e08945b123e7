"""The SMDP policy: macro-states, the table file, and each action as the core applies it (both
builds), the admission threshold in the driver, and the ``smdp`` policy spec."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sched_core import Contract, Dispatch, Reject, SchedulerConfig
from sched_core.driver import Driver
from sched_core.policies import make_policy
from sched_core.smdp import (
    N_STATES,
    STATE_NAMES,
    Action,
    PolicyTable,
    classify,
    long_bucket,
    packaged_table,
    quantile_weight,
    weight_quantile,
)

from .conftest import Factory
from .support import req


def table(**knobs: float) -> PolicyTable:
    return PolicyTable.uniform(Action(**knobs))


def dispatched(decisions: list[Dispatch | Reject]) -> list[str]:
    return [rid for d in decisions if isinstance(d, Dispatch) for rid in d.request_ids]


def test_the_states_are_the_queue_against_the_slots_a_long_prompt_and_a_full_path() -> None:
    assert N_STATES == 12 and len(set(STATE_NAMES)) == 12
    assert STATE_NAMES[classify(3, 3, 8, False, False)] == "clear"
    assert STATE_NAMES[classify(4, 3, 8, False, True)] == "queue+full"
    assert STATE_NAMES[classify(8, 0, 8, True, False)] == "queue+long"
    assert STATE_NAMES[classify(9, 0, 8, True, True)] == "backlog+long+full"
    # bounds 64…8192: prompts above 2048 tokens are long, the 4096 bucket on
    assert long_bucket((64, 128, 256, 512, 1024, 2048, 4096, 8192), 2048) == 6
    assert long_bucket((100, 1000), 2048) == 2  # no bucket is long


def test_the_admission_quantile_sits_between_the_prediction_and_its_p99_bound() -> None:
    assert quantile_weight(0.99) == pytest.approx(1.0)
    assert quantile_weight(0.9) == pytest.approx(0.5)
    assert Action(admit_quantile=0.99).admit_weight == 1.0  # exactly: the heuristic's check
    assert weight_quantile(quantile_weight(0.9)) == pytest.approx(0.9)


def test_a_table_round_trips_through_json_and_a_bad_one_says_what_is_wrong(tmp_path: Path) -> None:
    t = table(prefill_queue_steps=math.inf, slot_share=0.5, aging=10.0).with_action(
        3, Action(admit_quantile=0.5, admit_slack=0.75))
    path = tmp_path / "t.json"
    t.dump(path)
    doc = json.loads(path.read_text())
    assert doc["states"]["clear"]["prefill_queue_steps"] is None  # JSON's way of saying inf
    assert PolicyTable.load(path) == t
    doc["states"].pop("clear")
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="must name every state"):
        PolicyTable.load(path)
    doc["states"]["clear"] = {"slot_share": 2.0}
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"t\.json: slot_share must lie in \(0, 1\]"):
        PolicyTable.load(path)
    doc["states"]["clear"] = {"slots": 1.0}
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="unknown action fields"):
        PolicyTable.load(path)
    with pytest.raises(ValueError, match="policy table .*missing.json"):
        PolicyTable.load(tmp_path / "missing.json")


def test_the_packaged_table_loads_and_smdp_policies_carry_it(tmp_path: Path) -> None:
    packaged = packaged_table()
    assert len(packaged.actions) == N_STATES
    policy = make_policy("smdp", SchedulerConfig())
    assert policy.config.policy_table == packaged  # type: ignore[attr-defined]
    mine = table(slot_share=0.5)
    mine.dump(tmp_path / "mine.json")
    policy = make_policy(f"smdp:{tmp_path / 'mine.json'}", SchedulerConfig(), implementation="reference")
    assert policy.config.policy_table == mine  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="nope.json"):
        make_policy(f"smdp:{tmp_path / 'nope.json'}", SchedulerConfig())


def test_the_slot_share_bounds_the_sequences_in_flight(make: Factory) -> None:
    for share, expected in ((1.0, 8), (0.5, 4), (0.1, 1)):
        s = make(policy_table=table(slot_share=share))
        s.worker_capacity("cpu", 8, 0.0)
        for i in range(10):
            s.arrive(req(f"r{i}"), 0.0)
        assert len(dispatched(s.tick(0.0))) == expected
        assert s.snapshot()["paths"]["cpu"]["slot_limit"] == expected


def test_a_table_set_while_requests_wait_applies_from_the_next_decision(make: Factory) -> None:
    ungated = math.inf  # no prefill gate: the slot share alone decides
    s = make(policy_table=table(slot_share=1.0, prefill_queue_steps=ungated))
    s.worker_capacity("cpu", 8, 0.0)
    for i in range(10):
        s.arrive(req(f"r{i}"), 0.0)
    s.set_table(table(slot_share=0.5, prefill_queue_steps=ungated))  # queued ones stay queued
    assert s.queued == 10 and s.snapshot()["paths"]["cpu"]["slot_limit"] == 4  # in force at once
    assert len(dispatched(s.tick(0.0))) == 4
    assert s.snapshot()["policy"]["action"]["slot_share"] == 0.5
    named = PolicyTable.uniform(Action(prefill_queue_steps=ungated), name="re-solved")
    s.set_table(named)
    assert len(dispatched(s.tick(0.1))) == 4 and s.snapshot()["policy"]["name"] == "re-solved"
    assert s.config.policy_table is named


def test_aging_turns_shortest_first_into_arrival_order(make: Factory) -> None:
    def order(aging: float) -> list[str]:
        s = make(policy_table=table(aging=aging), ttft_p99_slo_s=60.0)  # none is late (RESCUE_AFTER)
        for i, prompt in enumerate((1000, 900, 800, 100)):  # longest first, 0.05 s apart
            s.arrive(req(f"r{i}", prompt=prompt, arrival=0.05 * i), 0.05 * i)
        s.worker_capacity("cpu", 1, 1.0)
        out = []
        for i in range(4):
            out += dispatched(s.tick(1.0 + i))
            s.finished(out[-1], 8, 1.0 + i)
        return out

    assert order(1.0) == ["r3", "r2", "r1", "r0"]  # 1,000 tokens/s of aging: 0.05 s forgives 50 tokens
    assert order(100.0) == ["r0", "r1", "r2", "r3"]  # 100,000 tokens/s: arrival decides


def test_the_prefill_queue_steps_of_the_state_in_force_gate_release(make: Factory) -> None:
    def released(steps: float) -> int:
        s = make(policy_table=table(prefill_queue_steps=steps))
        s.worker_capacity("cpu", 64, 0.0, 1, 256)
        s.arrive(req("first", prompt=1000), 0.0)
        s.tick(0.0)  # something runs: the gate applies from here on
        for i in range(40):
            s.arrive(req(f"r{i}", prompt=1000), 0.0)
        return len(dispatched(s.tick(0.0)))

    assert released(1.0) < released(4.0) < released(math.inf) == 40


def test_the_state_follows_the_queue_and_only_its_own_action_applies(make: Factory) -> None:
    # only a backlog (more queued than all 8 slots) halves the slots
    t = PolicyTable.uniform(Action())
    for s_ix, name in enumerate(STATE_NAMES):
        if name.startswith("backlog"):
            t = t.with_action(s_ix, Action(slot_share=0.5))
    s = make(policy_table=t)
    s.worker_capacity("cpu", 8, 0.0)
    for i in range(20):
        s.arrive(req(f"r{i}"), 0.0)
    assert STATE_NAMES[s.macro_state].startswith("backlog")
    now = 0.0
    for left in (16, 12, 8):  # a backlog each time: 4 leave, 4 slots stay idle
        out = dispatched(s.tick(now))
        assert len(out) == 4 and STATE_NAMES[s.macro_state].startswith("backlog")
        assert s.queued == left
        now += 0.1
        for rid in out:
            s.finished(rid, 8, now)
    assert len(dispatched(s.tick(now))) == 8  # 8 queued, 8 free: clear, every slot
    assert STATE_NAMES[s.macro_state] == "clear"
    visits = dict(zip(STATE_NAMES, s.state_visits(), strict=True))
    assert visits["clear"] == 1 and sum(v for n, v in visits.items() if n.startswith("backlog")) == 3
    s.arrive(req("late"), now)  # classified as it comes: nothing queued ahead of it
    assert STATE_NAMES[s.macro_state] == "clear+full"
    assert s.tick(now) == []  # then 1 queued, every slot busy: a queue on a full path
    assert STATE_NAMES[s.macro_state] == "queue+full"
    assert s.snapshot()["policy"]["state"] == "queue+full"


def test_the_admission_threshold_is_the_states_quantile_against_its_slack_of_the_slo(make: Factory) -> None:
    def decide(slo: float, **knobs: float) -> Contract | Reject | None:
        d = Driver(make(policy_table=table(**knobs)))
        d.capacity("cpu", 1, 0.0)
        d.arrive(req("running", prompt=1000, max_tokens=400, out=400), 0.0)
        d.tick(0.0)
        for i in range(5):
            d.arrive(req(f"q{i}", prompt=1000, max_tokens=400, out=400), 0.0)
        return d.arrive(req("asks", slo_ttft_s=slo), 0.0)

    probe = decide(1e6)
    assert isinstance(probe, Contract) and probe.ttft_s < probe.ttft_p99_s
    between = (probe.ttft_s + probe.ttft_p99_s) / 2.0
    assert isinstance(decide(between), Reject)  # the heuristic checks the p99 bound
    assert isinstance(decide(between, admit_quantile=0.5), Contract)  # the median is within it
    refused = decide(probe.ttft_p99_s * 1.01, admit_slack=0.5)  # half the SLO: refused
    assert isinstance(refused, Reject) and "within 0.5x the SLO" in refused.message
