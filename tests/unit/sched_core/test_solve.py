"""The SMDP table's offline search (``sched_core.simulate.solve``) and ``tokengate policy``:
the score, a search that finds a better table where one exists, determinism, the trace parts,
and the command line end to end on a small trace."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.main import main
from sched_core.simulate import experiment as ex
from sched_core.simulate import solve as sv
from sched_core.simulate import workload as wl
from sched_core.simulate.engine import Pool
from sched_core.simulate.profile import CostProfile
from sched_core.smdp import STATE_NAMES, PolicyTable, heuristic_table, packaged_table
from sched_core.types import DEFAULT_PROFILES, packaged_profile


def row(attainment: float, goodput: float, ttft_p99_ms: float, inside: float | None) -> dict[str, Any]:
    return {"slo_attainment": attainment, "goodput_rps": goodput, "ttft_p99_ms": ttft_p99_ms,
            "within_ttft_bound": inside, "within_p99_bound": inside}


def test_the_score_is_relative_attainment_and_goodput_less_the_penalties() -> None:
    plan = (sv.Scenario(1.0, False), sv.Scenario(3.0, True))
    ref = [row(0.9, 8.0, 1000.0, 0.995), row(0.5, 10.0, 500.0, 0.99)]
    fcfs = [row(0.9, 8.0, 2000.0, None), row(0.3, 6.0, 9000.0, None)]
    assert sv.objective(ref, ref, fcfs, plan) == pytest.approx(1.0)
    better = [row(0.99, 8.8, 1000.0, 0.995), row(0.5, 12.0, 500.0, 0.99)]
    assert sv.objective(better, ref, fcfs, plan) == pytest.approx((1.1 + 1.2) / 2)
    # 3 points outside the bounds cost 10 x 0.02; a TTFT p99 of 1.5x FCFS's costs 0.1 x 0.5
    worse = [row(0.9, 8.0, 3000.0, 0.995), row(0.5, 10.0, 500.0, 0.97)]
    assert sv.objective(worse, ref, fcfs, plan) == pytest.approx((1.0 - 0.05 + 1.0 - 0.2) / 2)
    # without SLOs, each point of attainment below the heuristic's (or FCFS's) costs 10 more
    short = [row(0.88, 8.0, 1000.0, 0.995), row(0.5, 10.0, 500.0, 0.99)]
    assert sv.objective(short, ref, fcfs, plan) == pytest.approx((0.88 / 0.9 - 0.2 + 1.0) / 2)


@pytest.fixture(scope="module")
def small() -> tuple[ex.Setup, dict[sv.Scenario, wl.Workload]]:
    """One cpu pool of two 8-slot workers (the packaged measured profile), Poisson arrivals
    of 250 log-normal requests at 3x its rough capacity, SLO at admission."""
    profile = CostProfile.from_dict(packaged_profile(DEFAULT_PROFILES["cpu"]))
    setup = ex.Setup((Pool("cpu", 2, 8, profile, 64),))
    plan = (sv.Scenario(3.0, True),)
    return setup, {plan[0]: wl.poisson(6.0, 250, wl.lognormal_lengths(), seed=3)}


Search = tuple[ex.Setup, dict[sv.Scenario, wl.Workload], tuple[sv.Scenario, ...], PolicyTable]


@pytest.fixture
def search(small: tuple[ex.Setup, dict[sv.Scenario, wl.Workload]], monkeypatch: pytest.MonkeyPatch) -> Search:
    """``small``, its plan and the heuristic's table, with a grid of two knobs of two values."""
    monkeypatch.setattr(sv, "GRID", {"admit_quantile": (0.5, 0.99), "slot_share": (0.5, 1.0)})
    setup, workloads = small
    return setup, workloads, tuple(workloads), heuristic_table(4.0)


def test_the_search_finds_a_better_table_where_the_heuristic_sheds_too_much(search: Search) -> None:
    setup, workloads, plan, start = search
    lines: list[str] = []
    with sv.Runner(setup, workloads) as runner:
        found, how = sv.solve(runner, plan, start, log=lines.append)
        ref, mine = runner.map([("smdp", start, plan[0]), ("smdp", found, plan[0])])
    assert found != start and how["score"] > how["score_heuristic"] + sv.MIN_GAIN
    assert mine["goodput_rps"] > ref["goodput_rps"]  # the score's gain is the simulated goodput's
    assert any(a.admit_quantile == 0.5 for a in found.actions)  # the median admits what p99 refused
    assert lines[0].startswith("heuristic: score") and how["evaluations"] > 2
    unseen = [s for s, name in enumerate(STATE_NAMES) if name not in how["searched_states"]]
    assert unseen and all(found.actions[s] == start.actions[s] for s in unseen)  # no evidence, no change
    with sv.Runner(setup, workloads, jobs=2) as runner:  # processes change the time, not the answer
        again, _ = sv.solve(runner, plan, start)
    assert again == found


def test_a_search_that_keeps_the_clear_states_dispatch_still_tunes_their_admission(search: Search) -> None:
    setup, workloads, plan, start = search
    with sv.Runner(setup, workloads) as runner:
        found, how = sv.solve(runner, plan, start, dispatch_levels=("queue", "backlog"))
    with sv.Runner(setup, workloads) as runner:
        _, anywhere = sv.solve(runner, plan, start)
    clear = [s for s, n in enumerate(STATE_NAMES) if n.startswith("clear")]
    assert how["dispatch_levels"] == ["queue", "backlog"] and how["searched_states"] == ["clear"]  # all it saw
    # the slot share's two tries (every state seen, then clear alone) are the ones left out
    assert how["evaluations"] == anywhere["evaluations"] - 2
    assert all(found.actions[s].slot_share == start.actions[s].slot_share for s in clear)
    assert any(found.actions[s].admit_quantile == 0.5 for s in clear)  # the median admits what p99 refused


def test_a_trace_part_is_shifted_to_start_at_zero() -> None:
    rows = [wl.TraceRow(float(i), 100 + i, 10) for i in range(10)]
    second = wl.trace_part(rows, "second-half")
    assert [r.prompt_tokens for r in second] == [105, 106, 107, 108, 109] and second[0].time_s == 0.0
    assert [r.prompt_tokens for r in wl.trace_part(rows, "2:4")] == [102, 103]
    assert len(wl.trace_part(rows, "first-half")) == 5 and len(wl.trace_part(rows, "all")) == 10
    for bad in ("half", "9:", "x:y"):
        with pytest.raises(wl.TraceError, match="rows"):
            wl.trace_part(rows, bad)


def test_shuffled_gaps_keep_the_gaps_and_the_lengths_in_another_order() -> None:
    rows = [wl.TraceRow(t, 100 + i, 10) for i, t in enumerate((0.0, 0.1, 0.2, 5.0, 5.1, 9.0))]
    mixed = wl.shuffled_gaps(rows, seed=2)
    gaps = sorted(round(b.time_s - a.time_s, 9) for a, b in zip(mixed, mixed[1:], strict=False))
    assert gaps == sorted(round(b.time_s - a.time_s, 9) for a, b in zip(rows, rows[1:], strict=False))
    assert [r.prompt_tokens for r in mixed] == [r.prompt_tokens for r in rows]
    assert mixed[-1].time_s == pytest.approx(9.0) and mixed != rows


def _trace(path: Path, n: int = 240) -> Path:
    rng = random.Random(1)
    t = 0.0
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for _ in range(n):
        t += rng.expovariate(3.0)
        lines.append(f"{t:.4f},{int(rng.lognormvariate(4.5, 0.8)) + 1},{rng.randint(2, 40)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_policy_solve_writes_a_table_that_report_simulate_and_show_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sv, "GRID", {"admit_quantile": (0.5, 0.99), "prefill_queue_steps": (1.0, 4.0)})
    monkeypatch.setattr(sv, "TUNE_LOADS", (1.0,))
    monkeypatch.setattr(sv, "TUNE_SLO_LOADS", (3.0,))
    monkeypatch.setattr(sv, "REPORT_LOADS", (1.0,))
    monkeypatch.setattr(sv, "REPORT_SLO_LOADS", (1.0, 3.0))
    trace, out = _trace(tmp_path / "t.csv"), tmp_path / "table.json"
    common = ["--cpu-workers", "1", "--gpu-workers", "0", "--jobs", "1"]
    assert main(["policy", "solve", "--trace", str(trace), "--out", str(out), "--synthetic", "none",
                 "--name", "tiny", *common]) == 0
    table = PolicyTable.load(out)
    about = table.about
    assert table.name == "tiny" and about["tune_rows"] == "first-half" and about["requests"] == 120
    assert about["scenarios"] == ["1x", "3x SLO", "1x shuffled", "3x SLO shuffled"]
    assert about["search"]["evaluations"] > 8
    report = about["report"]["trace rows second-half"]["targets"]
    assert {"no_slo", "slo", "vs_heuristic"} <= set(report) and isinstance(report["slo"]["met"], bool)
    capsys.readouterr()

    assert main(["policy", "report", "--trace", str(trace), "--table", str(out), "--synthetic", "poisson",
                 "--requests", "100", "--json", *common]) == 0
    figures = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(figures["report"]) == {"trace rows second-half", "poisson"}
    rows = figures["report"]["poisson"]["rows"]
    assert {r["policy"] for r in rows} == {"fcfs", "tokengate", "smdp"} and len(rows) == 3 * 3
    # the table again on each SLO load after a restart on what a run of the next seed learnt
    restarted = {r["load"]: r["after_restart"] for r in rows if r["after_restart"] is not None}
    assert set(restarted) == {1.0, 3.0} and all(r["policy"] == "smdp" and r["slo_at_admission"] for r in rows
                                                if r["after_restart"] is not None)
    assert all(0.0 <= a["inside_bounds"] <= 1.0 and a["goodput_rps"] > 0.0 for a in restarted.values())
    assert figures["report"]["poisson"]["targets"]["slo"]["min_inside_bounds_after_restart"] == min(
        a["inside_bounds"] for a in restarted.values())

    assert main(["simulate", "--trace", str(trace), "--rows", "second-half", "--policies", "fcfs,tokengate,smdp",
                 "--table", str(out), "--rates", "4", "--json", "--no-plots", "--out", str(tmp_path / "sim"),
                 "--cpu-workers", "1", "--gpu-workers", "0"]) == 0
    sims = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["policy"] for s in sims] == ["fcfs", "tokengate", "smdp"]
    assert all(s["requests"] == 120 for s in sims)

    assert main(["policy", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "policy table tiny" in shown and all(name in shown for name in STATE_NAMES)
    assert main(["policy", "show", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_the_packaged_table_says_how_it_was_solved() -> None:
    about = packaged_table().about
    assert about["trace"] == "azure_llm_code_2023.csv" and about["tune_rows"] == "first-half"
    assert about["test_rows"] == "second-half" and math.isfinite(about["search"]["score"])
    assert about["search"]["score"] >= about["search"]["score_heuristic"]
