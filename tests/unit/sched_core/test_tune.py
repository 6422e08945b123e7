"""The re-solve on recorded traffic (``sched_core.simulate.tune``, ``tokengate policy tune``): the
window's parts, and a candidate swapped in only where it wins on the later part by the margin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli.main import main
from sched_core.simulate import solve as sv
from sched_core.simulate import tune as tn
from sched_core.simulate import workload as wl
from sched_core.smdp import Action, PolicyTable

from .test_solve import _trace


def test_the_window_splits_in_time_and_each_part_starts_at_zero() -> None:
    rows = [wl.TraceRow(10.0 + i, 100 + i, 10) for i in range(600)]
    earlier, later = tn.split(rows)
    assert len(earlier) == 400 and len(later) == 200
    assert earlier[0].time_s == later[0].time_s == 0.0 and later[0].prompt_tokens == 500  # the most recent
    with pytest.raises(wl.TraceError, match="at least 300"):
        tn.split(rows[:299])
    earlier_plan, later_plan = tn.plans()
    assert {sc.arrivals for sc in earlier_plan} == {tn.EARLIER} and {sc.arrivals for sc in later_plan} == {tn.LATER}
    assert [sc.label() for sc in later_plan][0] == "0.5x later"


def _tune(tmp_path: Path, capsys: pytest.CaptureFixture[str], running: Path, margin: float) -> dict:
    trace = _trace(tmp_path / "traffic.csv", n=450)
    out = tmp_path / "candidate.json"
    assert main(["policy", "tune", "--trace", str(trace), "--table", str(running), "--out", str(out),
                 "--name", "tuned-1", "--budget", "40", "--margin", str(margin), "--json",
                 "--cpu-workers", "1", "--gpu-workers", "0", "--jobs", "1"]) == 0
    doc = json.loads(capsys.readouterr().out.splitlines()[-1])
    doc["table"] = PolicyTable.load(out)
    return doc


@pytest.fixture
def small_search(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sv, "GRID", {"slot_share": (0.25, 1.0), "admit_quantile": (0.5, 0.99)})
    monkeypatch.setattr(tn, "PLAN_LOADS", (1.0,))
    monkeypatch.setattr(tn, "PLAN_SLO_LOADS", (3.0,))


def test_a_table_that_starves_its_slots_is_replaced_by_one_that_wins_on_the_later_traffic(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], small_search: None) -> None:
    starving = tmp_path / "running.json"
    PolicyTable.uniform(Action(slot_share=0.25), name="starving").dump(starving)
    doc = _tune(tmp_path, capsys, starving, margin=0.02)
    verdict, table = doc["verdict"], doc["table"]
    assert doc["requests"] == 450 and verdict["running"] == "starving" and table.name == "tuned-1"
    assert table.about["retuned_from"] == "starving"
    assert verdict["evaluations"] <= 40 + 3 * 2  # the search's budget, then three tables on the two test runs
    assert verdict["swap"] and verdict["score_candidate"] >= verdict["score_running"] + 0.02
    assert table.actions != PolicyTable.load(starving).actions
    # the later part's figures, the candidate's beside the running table's, are the swap's grounds
    later = {s["scenario"]: s for s in verdict["scenarios"]}
    assert set(later) == {"1x later", "3x SLO later"}
    assert later["3x SLO later"]["candidate"] > later["3x SLO later"]["running"]


def test_a_candidate_that_does_not_win_by_the_margin_is_not_swapped_in(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], small_search: None) -> None:
    starving = tmp_path / "running.json"
    PolicyTable.uniform(Action(slot_share=0.25), name="starving").dump(starving)
    doc = _tune(tmp_path, capsys, starving, margin=100.0)  # the same search; no gain is that large
    verdict = doc["verdict"]
    assert not verdict["swap"] and "a swap needs +100" in verdict["why"]
    assert verdict["score_candidate"] > verdict["score_running"]


def test_a_candidate_that_wins_on_average_but_loses_at_one_load_is_not_swapped_in() -> None:
    def fig(scenario: str, running: float, candidate: float) -> dict[str, object]:
        return {"scenario": scenario, "figure": "goodput_rps", "running": running, "candidate": candidate}

    even = [fig("1x SLO later", 3.6, 3.6), fig("3x SLO later", 3.0, 3.9)]
    swap, why = tn.decide(0.92, 0.96, even)
    assert swap and "losing nowhere by more than 2%" in why
    lost = [fig("1x SLO later", 3.634, 3.247), fig("3x SLO later", 3.053, 3.925)]  # the first live run's
    swap, why = tn.decide(0.920, 0.956, lost)
    assert not swap and "lost at 1x SLO later" in why
    assert tn.decide(0.92, 0.93, even)[0] is False  # +0.01: under the margin


def test_a_loss_of_a_request_or_two_is_not_a_loss() -> None:
    """A scenario at 12x of a 150-request part admits a handful: one request fewer there is
    12 % of its goodput and no evidence against the table. The figures carry the requests one
    unit is (the span, for goodput), and a loss must be ``MIN_LOSS_REQUESTS`` of them."""
    def fig(running: float, candidate: float, span: float) -> dict[str, object]:
        return {"scenario": "12x SLO later", "figure": "goodput_rps", "running": running, "candidate": candidate,
                "per_request": span}

    assert tn.decide(0.2, 0.6, [fig(0.796, 0.696, 10.0)])[0]  # one request over 10 s
    swap, why = tn.decide(0.2, 0.6, [fig(0.796, 0.496, 10.0)])  # three
    assert not swap and "3 requests" in why
    # the first live run's loss, over its 40 s: 15 requests
    assert not tn.decide(0.920, 0.956, [fig(3.634, 3.247, 40.0)])[0]
