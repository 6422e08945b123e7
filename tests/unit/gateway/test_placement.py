"""Which worker runs each request (``gateway.dispatch.placement``): pure, no Redis."""

from __future__ import annotations

from dataclasses import replace

from common import protocol as p
from gateway.dispatch.placement import PREFIX_TOKENS, Placement


def _hb(wid: str, slots: int, token_s: float | None = None, pool: str = "cpu") -> p.Heartbeat:
    profile = {} if token_s is None else {"step_model": {"prefill_launch": 0.01, "prefill_token": token_s}}
    return p.Heartbeat(wid, pool, "cpu", "float32", "echo", "m", slots, slots, 0.0, 0.0, profile=profile)


def _seqs(*lengths: int, first: int = 1) -> tuple[p.SeqJob, ...]:
    return tuple(p.SeqJob(f"r{i}", tuple(range(first, first + n)), p.SamplingParams(4)) for i, n in enumerate(lengths))


def test_a_prompt_goes_to_the_worker_that_prefills_it_first() -> None:
    placing = Placement()
    placing.workers({"slow": _hb("slow", 8, 4e-4), "fast": _hb("fast", 8, 1e-4)})
    assert placing.place("cpu", _seqs(512), {}) == {"r0": "fast"}


def test_work_waiting_on_the_fast_worker_sends_the_next_prompt_to_the_slow_one() -> None:
    placing = Placement()
    placing.workers({"slow": _hb("slow", 8, 2e-4), "fast": _hb("fast", 8, 1e-4)})
    placing.observe("fast", 4000)  # its telemetry: 4,000 prompt tokens not prefilled yet
    assert placing.place("cpu", _seqs(512), {}) == {"r0": "slow"}
    placing.observe("fast", 0)
    assert placing.place("cpu", _seqs(512, first=5), {}) == {"r0": "fast"}


def test_no_worker_gets_more_requests_than_its_slots_and_the_rest_go_to_the_pool() -> None:
    placing = Placement()
    placing.workers({"a": _hb("a", 2), "b": _hb("b", 1), "g": _hb("g", 8, pool="gpu")})
    placed = placing.place("cpu", _seqs(10, 10, 10, 10), {})
    assert sorted(placed.values()) == ["", "a", "a", "b"]
    assert placing.held() == {"a": 2, "b": 1, "g": 0}
    placing.release(next(rid for rid, wid in placed.items() if wid == "a"))
    assert placing.place("cpu", _seqs(10, first=50), {}) == {"r0": "a"}


def test_equal_workers_share_by_what_they_hold() -> None:
    placing = Placement()
    placing.workers({"a": _hb("a", 8), "b": _hb("b", 8)})
    placed = placing.place("cpu", _seqs(1, 1, 1, 1), {})
    assert sorted(placed.values()) == ["a", "a", "b", "b"]


def test_a_down_worker_gets_nothing_and_a_worker_seen_again_keeps_its_count() -> None:
    placing = Placement()
    down = replace(_hb("b", 8), down="upstream does not answer")
    placing.workers({"a": _hb("a", 1), "c": _hb("c", 1), "b": down})
    assert sorted(placing.place("cpu", _seqs(5, 5, 5), {}).values()) == ["", "a", "c"]
    placing.workers({"a": _hb("a", 1), "c": _hb("c", 1)})
    assert placing.held() == {"a": 1, "c": 1}


def test_a_pool_of_one_worker_has_nothing_to_choose() -> None:
    placing = Placement()
    placing.workers({"a": _hb("a", 8), "g": _hb("g", 8, pool="gpu")})
    assert placing.place("cpu", _seqs(5, 5), {}) == {}  # the pool's stream, which its one worker reads
    assert placing.held() == {"a": 0, "g": 0}


def test_the_same_tenant_and_first_tokens_go_back_to_the_same_worker_on_a_tie() -> None:
    placing = Placement()
    placing.workers({"a": _hb("a", 8), "b": _hb("b", 8)})
    long = PREFIX_TOKENS + 8
    first = placing.place("cpu", _seqs(long), {"r0": "acme"})["r0"]
    placing.release("r0")
    for wid in ("a", "b"):
        placing.observe(wid, 0)
    again = placing.place("cpu", _seqs(long), {"r0": "acme"})  # same tenant, same first tokens
    assert again == {"r0": first}
    other = placing.place("cpu", _seqs(long, first=1000), {"r0": "acme"})  # held counts first
    assert other["r0"] != first
