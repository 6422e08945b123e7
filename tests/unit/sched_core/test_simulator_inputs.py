"""The simulator's inputs: traces, synthetic arrivals, tenants, cost profiles."""

from __future__ import annotations

import pytest

from sched_core.simulate import CostProfile, TraceError, on_off, parse_trace, poisson, replay
from sched_core.simulate.workload import (
    LENGTH_MIXES,
    MAX_PROMPT,
    lognormal_lengths,
    mix_lengths,
    pareto_lengths,
    parse_tenants,
    trace_rate,
)

TRACE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.0319600,110,27
"""


def test_a_trace_parses_into_relative_times() -> None:
    rows = parse_trace(TRACE.splitlines(), "t.csv")
    assert [r.prompt_tokens for r in rows] == [4808, 3180, 110]
    assert rows[0].time_s == 0.0
    assert rows[1].time_s == pytest.approx(0.052)
    assert trace_rate(rows) == pytest.approx(2 / 1.052)


def test_columns_in_any_order_numeric_times_and_unsorted_rows() -> None:
    text = "GeneratedTokens,TIMESTAMP,extra,ContextTokens\n5,10.5,x,7\n3,10.0,y,9\n"
    rows = parse_trace(text.splitlines())
    assert [(r.time_s, r.prompt_tokens, r.output_tokens) for r in rows] == [
        (0.0, 9, 3), (0.5, 7, 5)]


@pytest.mark.parametrize(("text", "where"), [
    ("TIMESTAMP,ContextTokens\n1,2\n", "t.csv:1:"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n2,abc,3\n", "t.csv:3:"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n\nnot a time,2,3\n", "t.csv:4:"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3,4\n", "t.csv:2:"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,0,3\n", "t.csv:2:"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
    ("", "empty file"),
])
def test_a_malformed_trace_is_an_error_naming_the_line(text: str, where: str) -> None:
    with pytest.raises(TraceError, match=where):
        parse_trace(text.splitlines(), "t.csv")


def test_replay_scales_time_and_lengths_and_assigns_tenants() -> None:
    rows = parse_trace(TRACE.splitlines())
    w = replay(rows, time_scale=0.5, length_scale=2.0, seed=3)
    assert [a.time for a in w.arrivals] == pytest.approx([0.0, 0.026, 0.526])
    assert [a.prompt_tokens for a in w.arrivals] == [2404, 1590, 55]
    assert [a.output_tokens for a in w.arrivals] == [5, 4, 14]
    assert all(a.max_tokens >= a.output_tokens for a in w.arrivals)
    assert {a.tenant for a in w.arrivals} <= {t.name for t in w.tenants}
    assert replay(rows, seed=3) == replay(rows, seed=3)


def test_poisson_and_on_off_hit_their_mean_rate() -> None:
    lengths = lognormal_lengths()
    for make in (poisson, on_off):
        w = make(20.0, 20_000, lengths, seed=1)  # type: ignore[operator]
        assert w.rate == pytest.approx(20.0, rel=0.05)
        assert all(1 <= a.prompt_tokens <= MAX_PROMPT for a in w.arrivals)
        assert all(a.output_tokens >= 1 for a in w.arrivals)


def test_on_off_is_burstier_than_poisson() -> None:
    def dispersion(w: object) -> float:  # variance/mean of counts per second
        counts: dict[int, int] = {}
        for a in w.arrivals:  # type: ignore[attr-defined]
            counts[int(a.time)] = counts.get(int(a.time), 0) + 1
        xs = list(counts.values())
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs) / mean

    lengths = pareto_lengths()
    assert dispersion(on_off(20.0, 10_000, lengths, seed=2)) > 3 * dispersion(
        poisson(20.0, 10_000, lengths, seed=2))


@pytest.mark.parametrize("name", sorted(LENGTH_MIXES))
def test_a_length_mix_has_the_medians_it_names(name: str) -> None:
    prompt_median, _, output_median, _ = LENGTH_MIXES[name]
    w = poisson(10.0, 4000, mix_lengths(name), seed=4)
    prompts = sorted(a.prompt_tokens for a in w.arrivals)
    outputs = sorted(a.output_tokens for a in w.arrivals)
    assert prompts[len(prompts) // 2] == pytest.approx(prompt_median, rel=0.1)
    assert outputs[len(outputs) // 2] == pytest.approx(output_median, rel=0.1, abs=1)
    with pytest.raises(ValueError, match="unknown length mix"):
        mix_lengths("nope")


def test_tenant_specs_are_normalized() -> None:
    tenants = parse_tenants("a:1000:1,b:3000:3")
    assert [(t.name, t.budget, t.share) for t in tenants] == [("a", 1000.0, 0.25),
                                                               ("b", 3000.0, 0.75)]
    with pytest.raises(ValueError, match="name:budget:share"):
        parse_tenants("a:1000")


def test_a_profile_reads_its_json_and_names_a_missing_field() -> None:
    data = {"name": "gpu-x", "device": "H100", "model": "m", "derived": True,
            "source": "datasheet", "fit": {"prefill": {"a": 0.01, "b": 1e-6},
                                           "decode": {"c": 0.01, "d": 1e-4}}}
    p = CostProfile.from_dict(data)
    assert p.derived and "derived" in p.label and p.prefill_b2 == 0.0
    assert p.prefill_s(2, 100) == pytest.approx(0.01 + 1e-6 * 200)
    assert p.decode_step_s(4, 1000) == pytest.approx(0.01 + 4e-4)
    # a worker's fit may put all of a decode step in its KV term: it loads, and prices by it
    data["fit"]["decode"] = {"c": 0.0, "d": 0.0, "e": 3.5e-4}  # type: ignore[index]
    assert CostProfile.from_dict(data).decode_step_s(4, 1000) == pytest.approx(4 * 3.5e-4 * 1000)
    data["fit"]["decode"] = {"c": 0.0, "d": 0.0}  # type: ignore[index]
    with pytest.raises(ValueError, match="must take time"):
        CostProfile.from_dict(data)
    del data["fit"]["decode"]["c"]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="'c'"):
        CostProfile.from_dict(data)
