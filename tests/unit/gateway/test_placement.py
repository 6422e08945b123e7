"""Which worker runs each request (``gateway.dispatch.placement``): pure, no Redis."""

from __future__ import annotations

from dataclasses import replace

from common import protocol as p
from gateway.dispatch.placement import BLOCK, Placement, block_hashes


def _hb(wid: str, slots: int, token_s: float | None = None, pool: str = "cpu", cache: int = 0) -> p.Heartbeat:
    profile = {} if token_s is None else {"step_model": {"prefill_launch": 0.01, "prefill_token": token_s}}
    return p.Heartbeat(wid, pool, "cpu", "float32", "echo", "m", slots, slots, 0.0, 0.0, profile=profile,
                       prefix_cache=cache)


def _seqs(*lengths: int, first: int = 1) -> tuple[p.SeqJob, ...]:
    return tuple(p.SeqJob(f"r{i}", tuple(range(first, first + n)), p.SamplingParams(4)) for i, n in enumerate(lengths))


def test_a_prompt_goes_to_the_worker_that_prefills_it_first() -> None:
    placing = Placement()
    placing.workers({"slow": _hb("slow", 8, 4e-4), "fast": _hb("fast", 8, 1e-4)})
    assert placing.place("cpu", _seqs(512)) == {"r0": "fast"}


def test_work_waiting_on_the_fast_worker_sends_the_next_prompt_to_the_slow_one() -> None:
    placing = Placement()
    placing.workers({"slow": _hb("slow", 8, 2e-4), "fast": _hb("fast", 8, 1e-4)})
    placing.observe("fast", 4000)  # its telemetry: 4,000 prompt tokens not prefilled yet
    assert placing.place("cpu", _seqs(512)) == {"r0": "slow"}
    placing.observe("fast", 0)
    assert placing.place("cpu", _seqs(512, first=5)) == {"r0": "fast"}


def test_no_worker_gets_more_requests_than_its_slots_and_the_rest_go_to_the_pool() -> None:
    placing = Placement()
    placing.workers({"a": _hb("a", 2), "b": _hb("b", 1), "g": _hb("g", 8, pool="gpu")})
    placed = placing.place("cpu", _seqs(10, 10, 10, 10))
    assert sorted(placed.values()) == ["", "a", "a", "b"]
    assert placing.held() == {"a": 2, "b": 1, "g": 0}
    placing.release(next(rid for rid, wid in placed.items() if wid == "a"))
    assert placing.place("cpu", _seqs(10, first=50)) == {"r0": "a"}


def test_equal_workers_share_by_what_they_hold() -> None:
    placing = Placement()
    placing.workers({"a": _hb("a", 8), "b": _hb("b", 8)})
    placed = placing.place("cpu", _seqs(1, 1, 1, 1))
    assert sorted(placed.values()) == ["a", "a", "b", "b"]


def test_a_down_worker_gets_nothing_and_a_worker_seen_again_keeps_its_count() -> None:
    placing = Placement()
    down = replace(_hb("b", 8), down="upstream does not answer")
    placing.workers({"a": _hb("a", 1), "c": _hb("c", 1), "b": down})
    assert sorted(placing.place("cpu", _seqs(5, 5, 5)).values()) == ["", "a", "c"]
    placing.workers({"a": _hb("a", 1), "c": _hb("c", 1)})
    assert placing.held() == {"a": 1, "c": 1}


def test_a_pool_of_one_worker_has_nothing_to_choose() -> None:
    placing = Placement()
    placing.workers({"a": _hb("a", 8), "g": _hb("g", 8, pool="gpu")})
    assert placing.place("cpu", _seqs(5, 5)) == {}  # the pool's stream, which its one worker reads
    assert placing.held() == {"a": 0, "g": 0}


def _turn(history: tuple[int, ...], new: int, rid: str, start: int = 10_000) -> p.SeqJob:
    """A conversation's next turn: its history resent, ``new`` tokens appended."""
    start = history[-1] + 1 if history else start
    return p.SeqJob(rid, history + tuple(range(start, start + new)), p.SamplingParams(4))


def test_block_hashes_agree_exactly_on_the_shared_leading_blocks() -> None:
    a = tuple(range(5 * BLOCK + 3))
    b = a[: 3 * BLOCK] + (-1,) + a[3 * BLOCK + 1:]
    assert len(block_hashes(a)) == 5 and block_hashes(a[: BLOCK - 1]) == []
    assert block_hashes(a)[:3] == block_hashes(b)[:3] and block_hashes(a)[3:] != block_hashes(b)[3:]


def test_a_conversation_s_next_turn_goes_back_to_the_replica_that_holds_its_history() -> None:
    placing = Placement("prefix")
    placing.workers({w: _hb(w, 4, 1e-4, cache=32 * 1024) for w in ("a", "b", "c")})
    first = _turn((), 1000, "t1")
    home = placing.place("cpu", (first,))["t1"]
    for w in ("a", "b", "c"):
        placing.observe(w, 0)
    other = placing.place("cpu", (_turn((), 1000, "x", start=90_000),))["x"]  # another conversation
    assert other != home
    placing.observe(other, 0)
    again = placing.place("cpu", (_turn(first.prompt_ids, 50, "t2"),))
    assert again == {"t2": home}
    placed = placing.placed("t2")
    assert placed is not None and placed.cached_tokens == 1000 // BLOCK * BLOCK  # whole blocks only
    assert placed.first_token_s[home] < min(v for w, v in placed.first_token_s.items() if w != home)


def test_a_hot_conversation_spills_when_its_replica_s_queue_costs_more_than_the_prefill_it_saves() -> None:
    placing = Placement("prefix")
    placing.workers({w: _hb(w, 8, 1e-4, cache=32 * 1024) for w in ("a", "b")})
    first = _turn((), 1000, "t1")
    home = placing.place("cpu", (first,))["t1"]
    away = "b" if home == "a" else "a"
    placing.observe(home, 500)  # less queued than the 1,000 cached tokens save: it stays
    assert placing.place("cpu", (_turn(first.prompt_ids, 50, "t2"),)) == {"t2": home}
    placing.observe(home, 3000)  # more: it spills
    assert placing.place("cpu", (_turn(first.prompt_ids, 50, "t3"),)) == {"t3": away}


def test_without_a_free_slot_on_its_replica_a_turn_spills_and_an_engine_that_caches_nothing_gets_no_credit() -> None:
    placing = Placement("prefix")
    placing.workers({"a": _hb("a", 1, 1e-4, cache=32 * 1024), "b": _hb("b", 1, 1e-4), "c": _hb("c", 1, 1e-4)})
    first = _turn((), 1000, "t1")
    placing.observe("b", 1)
    placing.observe("c", 1)
    assert placing.place("cpu", (first,)) == {"t1": "a"}
    assert placing.place("cpu", (_turn(first.prompt_ids, 50, "t2"),))["t2"] in ("b", "c")  # a is full
    placing.release("t1")
    placing.release("t2")
    nocache = Placement("prefix")
    nocache.workers({"a": _hb("a", 4, 1e-4), "b": _hb("b", 4, 1e-4)})
    nocache.place("cpu", (first,))
    second = nocache.place("cpu", (_turn(first.prompt_ids, 50, "t2"),))
    assert nocache.placed("t2") is not None and nocache.placed("t2").cached_tokens == 0  # type: ignore[union-attr]
    assert second["t2"] != nocache.placed("t1").worker  # type: ignore[union-attr]  # by load alone


def test_the_cache_estimate_forgets_the_least_recently_sent_prompts_beyond_the_engine_s_cache() -> None:
    placing = Placement("prefix")
    placing.workers({w: _hb(w, 8, 1e-4, cache=2048) for w in ("a", "b")})
    first = _turn((), 1024, "t1")
    home = placing.place("cpu", (first,))["t1"]
    for n in range(3):  # 3,072 more tokens sent to the same replica push the first out
        placing.observe("a" if home == "b" else "b", 10**6)  # keep them on home
        placing.place("cpu", (p.SeqJob(f"f{n}", tuple(range(50_000 * (n + 1), 50_000 * (n + 1) + 1024)),
                                       p.SamplingParams(4)),))
    placing.observe(home, 0)
    placing.place("cpu", (_turn(first.prompt_ids, 16, "t2"),))
    assert placing.placed("t2").cached_tokens == 0  # type: ignore[union-attr]


def test_worker_routing_gives_no_cache_credit_and_round_robin_takes_turns() -> None:
    placing = Placement("worker")
    placing.workers({w: _hb(w, 8, 1e-4, cache=32 * 1024) for w in ("a", "b")})
    first = _turn((), 1000, "t1")
    placing.place("cpu", (first,))
    placing.place("cpu", (_turn(first.prompt_ids, 50, "t2"),))
    assert placing.placed("t2").cached_tokens == 0  # type: ignore[union-attr]
    rr = Placement("round-robin")
    rr.workers({w: _hb(w, 2, 1e-4) for w in ("a", "b", "c")})
    placed = [rr.place("cpu", (_turn((), 10, f"r{i}"),))[f"r{i}"] for i in range(6)]
    assert placed == ["a", "b", "c", "a", "b", "c"]
    assert rr.place("cpu", (_turn((), 10, "full"),)) == {"full": ""}  # every slot held
    rr.release("r1")
    assert rr.place("cpu", (_turn((), 10, "r6"),)) == {"r6": "b"}
