"""A re-solve on the traffic a deployment served, and the test a candidate table must pass
before it runs (issue 41; docs/scheduling.md §16.2). Pure: ``tokengate policy tune`` does
the I/O, and the gateway runs that command off its request path
(``gateway/dispatch/tuning.py``).

The recorded window is split in time. The earlier part is tuned on: ``solve``'s coordinate
descent, starting from the table in force, over ``PLAN_LOADS`` without SLOs and
``PLAN_SLO_LOADS`` with them, each a multiple of that part's own FCFS 90 %-SLO load. The
later part is the test: the candidate, the running table and FCFS run the same scenarios on
it (at that part's own FCFS load), and the candidate is swapped in only where its score
(``solve.objective``, relative to the running table's on the same runs) beats the running
table's by at least ``MARGIN`` and it loses in no scenario by more than ``MAX_LOSS`` (``decide``).
A table that wins on the traffic it was tuned on but not on the traffic that came after is not
taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from sched_core.simulate import solve as sv
from sched_core.simulate.workload import TraceError, TraceRow, trace_part
from sched_core.smdp import PolicyTable

#: The later share of the window the candidate is tested on (never tuned on).
TEST_SHARE = 1.0 / 3.0
#: The most recent requests a re-solve reads (the window keeps more; a longer one costs time).
WINDOW = 3000
#: Fewer recorded requests than this: nothing to tune on yet.
MIN_REQUESTS = 300
#: The score a candidate must gain on the later part over the running table to be swapped in:
#: two points of relative attainment or goodput, on average over the scenarios.
MARGIN = 0.02
#: Nor may it lose more than this share of the running table's figure in any test scenario.
MAX_LOSS = 0.02
#: Nor is a loss of fewer requests than this one (a scenario of 150 requests at 12x admits a
#: handful, and one request more or less there is not a table's loss).
MIN_LOSS_REQUESTS = 3.0
#: Simulations the search may run (one core, a few minutes at ``WINDOW`` requests).
BUDGET = 240
#: The scenarios: fewer than an offline solve's (``solve.TUNE_LOADS``), for the time.
PLAN_LOADS = (0.5, 1.0)
PLAN_SLO_LOADS = (1.0, 3.0, 12.0)
#: Dispatch knobs are searched only where a queue forms (below capacity, with one SLO for all,
#: dispatching at once in arrival order is earliest-deadline-first: a knob could only delay).
DISPATCH_LEVELS = ("queue", "backlog")
#: The two parts' arrivals, as ``solve.Scenario.arrivals`` names them.
EARLIER, LATER = "earlier", "later"


def split(rows: Sequence[TraceRow], test_share: float = TEST_SHARE) -> tuple[list[TraceRow], list[TraceRow]]:
    """The window's earlier and later parts, each starting at 0 (``workload.trace_part``)."""
    if len(rows) < MIN_REQUESTS:
        raise TraceError(f"{len(rows)} requests recorded: a re-solve needs at least {MIN_REQUESTS}")
    if not 0.0 < test_share < 1.0:
        raise ValueError(f"the test share must lie in (0, 1), got {test_share}")
    cut = round(len(rows) * (1.0 - test_share))
    return trace_part(rows, f":{cut}"), trace_part(rows, f"{cut}:")


def plans() -> tuple[tuple[sv.Scenario, ...], tuple[sv.Scenario, ...]]:
    """The scenarios tuned on (earlier part) and tested on (later part)."""
    return (sv.scenarios(PLAN_LOADS, PLAN_SLO_LOADS, (EARLIER,)),
            sv.scenarios(PLAN_LOADS, PLAN_SLO_LOADS, (LATER,)))


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a re-solve found and why the candidate is or is not swapped in."""

    swap: bool
    why: str
    running: str  # the table in force's name
    candidate: str
    score_running: float  # on the later part, relative to the running table (1: its own, less penalties)
    score_candidate: float
    margin: float
    evaluations: int  # simulations run, search and test
    budget_spent: bool  # the search stopped at its budget
    scenarios: tuple[dict[str, Any], ...]  # per test scenario: the running table's and the candidate's figure

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["scenarios"] = list(self.scenarios)
        return out


def retune(runner: sv.Runner, running: PolicyTable, name: str, budget: int = BUDGET, margin: float = MARGIN,
           log: Callable[[str], None] = lambda _: None) -> tuple[PolicyTable, Verdict]:
    """Solve a candidate on the earlier part starting from ``running``, test both on the later
    part; ``runner`` holds both parts' workloads under ``plans()``'s scenarios."""
    tune_plan, test_plan = plans()
    found, how = sv.solve(runner, tune_plan, running, log=log, dispatch_levels=DISPATCH_LEVELS, budget=budget)
    candidate = replace(found, name=name, about={"retuned_from": running.name, "search": how})
    n = len(test_plan)
    rows = runner.map([(p, t, sc) for p, t in (("smdp", running), ("smdp", candidate), ("fcfs", None))
                       for sc in test_plan])
    mine, theirs, fcfs = rows[:n], rows[n:2 * n], rows[2 * n:]
    score_running = sv.objective(mine, mine, fcfs, test_plan)
    score_candidate = sv.objective(theirs, mine, fcfs, test_plan)
    figures = tuple(_figures(sc, a, b) for sc, a, b in zip(test_plan, mine, theirs, strict=True))
    if found.actions == running.actions:
        swap, why = False, "the search found no better table on the earlier traffic"
    else:
        swap, why = decide(score_running, score_candidate, figures, margin)
    return candidate, Verdict(swap, why, running.name, name, score_running, score_candidate, margin,
                              runner.evaluations, bool(how["budget_spent"]), figures)


def decide(score_running: float, score_candidate: float, figures: Sequence[dict[str, Any]],
           margin: float = MARGIN, max_loss: float = MAX_LOSS) -> tuple[bool, str]:
    """Whether a candidate is swapped in, and why: its score on the later traffic beats the
    running table's by ``margin``, and in no test scenario is its figure (attainment or
    goodput) below the running table's by more than ``max_loss`` of it and by at least
    ``MIN_LOSS_REQUESTS`` requests (a figure's ``per_request``: the requests one unit of it is,
    the scenario's requests or span; without it every loss counts). The second rule
    because the mean can hide a loss at the load the deployment runs at, bought with a gain
    at another: the first live test of self-tuning (docs/benchmarks.md, "The table that tunes
    itself") swapped in a table that gained 29 % of goodput at 3x and lost 11 % at 1x in the
    simulator (live it then attained 7 points less than the fixed table, about as much as two
    runs of one table differed there)."""
    gain = score_candidate - score_running
    if gain < margin:
        return False, (f"on the later traffic it scored {score_candidate:.3f} against the running table's "
                       f"{score_running:.3f} ({gain:+.3f}; a swap needs +{margin:g})")
    for f in figures:
        if f["candidate"] >= f["running"] * (1.0 - max_loss):
            continue
        lost = (f["running"] - f["candidate"]) * f.get("per_request", math.inf)  # > 0: it lost
        if lost >= MIN_LOSS_REQUESTS:
            return False, (f"it scored +{gain:.3f} on the later traffic but lost at {f['scenario']}: "
                           f"{f['figure']} {f['candidate']:.3g} against {f['running']:.3g} (more than "
                           f"{max_loss:.0%} below" + (f", {lost:.0f} requests)" if lost < math.inf else ")"))
    return True, (f"it scored {score_candidate:.3f} against the running table's {score_running:.3f} "
                  f"on the later traffic (+{gain:.3f}, margin {margin:g}), losing nowhere by more than {max_loss:.0%}")


def _figures(sc: sv.Scenario, running: dict[str, Any], candidate: dict[str, Any]) -> dict[str, Any]:
    key = "goodput_rps" if sc.shed else "slo_attainment"
    return {"scenario": sc.label(), "figure": key, "running": running[key], "candidate": candidate[key],
            "per_request": running["span_s"] if sc.shed else running["requests"],
            "inside_bounds_running": sv.bound_share(running), "inside_bounds_candidate": sv.bound_share(candidate)}
