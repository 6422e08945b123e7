"""The SMDP table searched in the simulator, and the figures it is judged by (docs/scheduling.md
§16). Pure: the command-line shell (``sched_core/simulate/policy_cli.py``) does the I/O.

The search is coordinate descent over the table, on one part of a trace: every evaluation
runs the whole table through a set of scenarios (loads, with and without SLOs at admission)
in the simulator, through the one driver, and scores it with ``objective``. First one
action for every state the tuning sees (the states it hardly sees keep the heuristic's), then
each of those in turn, most visited first, one knob at a time over its grid; a change is kept
only where it raises the score.
Everything is deterministic for a seed, so a solve is reproducible; the evaluations of one
step run in parallel processes (``jobs``), which changes nothing but the time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from sched_core.simulate import experiment as ex
from sched_core.simulate.engine import simulate
from sched_core.simulate.metrics import summarize
from sched_core.simulate.workload import Workload
from sched_core.smdp import N_STATES, QUEUE_LEVELS, STATE_NAMES, Action, PolicyTable, level_of

#: The values each knob is searched over (the heuristic's are among them).
GRID: dict[str, tuple[float, ...]] = {
    "prefill_queue_steps": (1.0, 2.0, 4.0, 8.0, math.inf),
    "slot_share": (0.25, 0.5, 0.75, 1.0),
    "aging": (0.1, 1.0, 10.0, 100.0),
    "admit_quantile": (0.5, 0.9, 0.99),
    "admit_slack": (0.5, 0.75, 1.0),
}
#: The knobs that decide admission (they act only on requests that carry an SLO); the others
#: decide dispatch, in every run.
ADMISSION_KNOBS = ("admit_quantile", "admit_slack")
#: Loads (multiples of FCFS's 90%-SLO load) tuned on: without SLOs, and with them at admission.
TUNE_LOADS = (0.5, 0.75, 1.0)  # the no-SLO target's loads (at 0.25x every policy meets the SLO)
TUNE_SLO_LOADS = (1.0, 3.0, 6.0, 12.0)
#: The tuning part's arrivals as the trace has them, and with their gaps shuffled (the same
#: gaps in another order): a table must not lean on one trace's particular bursts.
TUNE_ARRIVALS = ("trace", "shuffled")
#: Loads reported on.
REPORT_LOADS = (0.25, 0.5, 0.75, 1.0)
REPORT_SLO_LOADS = (1.0, 1.5, 3.0, 6.0, 12.0)
#: Contracts: the share inside both p99 bounds a table must keep, and the weight of a miss.
BOUND_SHARE = 0.99
BOUND_PENALTY = 10.0
#: The weight of a TTFT p99 above FCFS's, per unit of the ratio's excess.
TAIL_PENALTY = 0.1
#: Without SLOs, the weight of each point of attainment below the heuristic's or FCFS's
#: (whichever is higher): a table must not buy overload goodput with the calm hours.
ATTAIN_PENALTY = 10.0
#: A change must raise the score by this much to be kept.
MIN_GAIN = 1e-3
#: A macro-state seen at fewer than this share of the ticks is left with its action.
MIN_VISITS = 0.005


#: The arrivals a restart's saved state is learnt on (``Scenario.restart``): another draw of the
#: same workload (the trace's gaps shuffled, or the next seed).
WARM = "warm"


@dataclass(frozen=True, slots=True)
class Scenario:
    load: float  # multiple of FCFS's 90%-SLO load
    shed: bool  # every request carries the SLO to admission
    arrivals: str = "trace"  # or "shuffled": the trace's gaps in another order
    #: a restart on saved state: the run starts from what the policy learnt on the ``WARM``
    #: arrivals at the same load (its step-time model and calibration, as a gateway saves them)
    restart: bool = False

    def label(self) -> str:
        return (f"{self.load:g}x{' SLO' if self.shed else ''}{'' if self.arrivals == 'trace' else ' ' + self.arrivals}"
                f"{' after a restart' if self.restart else ''}")

    def warm(self) -> Scenario:
        """The scenario a restart's saved state is learnt on."""
        return Scenario(self.load, self.shed, WARM)


def scenarios(loads: Sequence[float] | None = None, slo_loads: Sequence[float] | None = None,
              arrivals: Sequence[str] | None = None) -> tuple[Scenario, ...]:
    """The scenarios at ``loads`` without SLOs and ``slo_loads`` with them, for each kind of
    ``arrivals`` (default: the tuning's)."""
    free = TUNE_LOADS if loads is None else loads
    slo = TUNE_SLO_LOADS if slo_loads is None else slo_loads
    return tuple(sc for kind in (TUNE_ARRIVALS if arrivals is None else arrivals)
                 for sc in (*(Scenario(x, False, kind) for x in free), *(Scenario(x, True, kind) for x in slo)))


# -- one evaluation: a policy on one scenario (run in worker processes) -----------------------

_SETUP: ex.Setup | None = None
_WORKLOADS: dict[Scenario, Workload] = {}


def _init(setup: ex.Setup, workloads: dict[Scenario, Workload]) -> None:
    global _SETUP, _WORKLOADS
    _SETUP, _WORKLOADS = setup, workloads


def run_one(policy: str, table: PolicyTable | None, scenario: Scenario) -> dict[str, Any]:
    """``policy`` (``smdp`` with ``table``, or another of ``experiment.POLICIES``) on one
    scenario: the run's figures, and for the scheduler how many ticks saw each state."""
    assert _SETUP is not None, "_init first"
    setup = replace(_SETUP, shed=scenario.shed, table=table)
    start = None
    if scenario.restart:
        warm = _WORKLOADS[scenario.warm()]
        start = simulate(ex.policy_for(policy, None, setup, warm), warm, setup.sim_config()).learnt
        scenario = replace(scenario, restart=False)
    workload = _WORKLOADS[scenario]
    chosen = ex.policy_for(policy, None, setup, workload)
    row = summarize(simulate(chosen, workload, setup.sim_config(), start), setup.slo, setup.fair_windows)
    visits = getattr(chosen, "state_visits", None)
    row["visits"] = visits() if visits is not None else None
    return row


def _run_task(task: tuple[str, PolicyTable | None, Scenario]) -> dict[str, Any]:
    return run_one(*task)


class Runner:
    """Runs (policy, table, scenario) tasks, in ``jobs`` processes (1: in this one)."""

    def __init__(self, setup: ex.Setup, workloads: dict[Scenario, Workload], jobs: int = 1) -> None:
        _init(setup, workloads)
        self.evaluations = 0
        self._pool = (ProcessPoolExecutor(jobs, initializer=_init, initargs=(setup, workloads))
                      if jobs > 1 else None)

    def map(self, tasks: Sequence[tuple[str, PolicyTable | None, Scenario]]) -> list[dict[str, Any]]:
        self.evaluations += len(tasks)
        if self._pool is None:
            return [_run_task(t) for t in tasks]
        return list(self._pool.map(_run_task, tasks, chunksize=1))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the score ---------------------------------------------------------------------------------


def bound_share(row: dict[str, Any]) -> float | None:
    """The share of a run's requests inside both their p99 bounds (None: no contracts)."""
    inside = [row[k] for k in ("within_ttft_bound", "within_p99_bound") if row.get(k) is not None]
    return min(inside) if inside else None


def objective(rows: Sequence[dict[str, Any]], ref: Sequence[dict[str, Any]], fcfs: Sequence[dict[str, Any]],
              plan: Sequence[Scenario]) -> float:
    """The score of a table's runs (higher is better): the mean over scenarios of its SLO
    attainment (without SLOs) or goodput (with them) relative to the heuristic's in the same
    scenario, less ``BOUND_PENALTY`` per point of requests outside their p99 bounds beyond
    1 %; without SLOs, less ``ATTAIN_PENALTY`` per point of attainment below the heuristic's
    or FCFS's, and ``TAIL_PENALTY`` per unit of TTFT p99 above FCFS's.
    It is the design notes' reward with the response time in its tail term and its SLO
    penalty in the attainment; energy is not modelled (no worker reports it)."""
    score = 0.0
    for row, base, first, sc in zip(rows, ref, fcfs, plan, strict=True):
        key = "goodput_rps" if sc.shed else "slo_attainment"
        score += row[key] / base[key] if base[key] > 0.0 else (1.0 if row[key] <= 0.0 else 2.0)
        inside = bound_share(row)
        if inside is not None and inside < BOUND_SHARE:
            score -= BOUND_PENALTY * (BOUND_SHARE - inside)
        if sc.shed:
            continue
        short = max(base["slo_attainment"], first["slo_attainment"]) - row["slo_attainment"]
        if short > 0.0:
            score -= ATTAIN_PENALTY * short
        if math.isfinite(first["ttft_p99_ms"]) and first["ttft_p99_ms"] > 0.0:
            excess = row["ttft_p99_ms"] / first["ttft_p99_ms"] - 1.0
            if excess > 0.0:
                score -= TAIL_PENALTY * excess
    return score / len(plan)


# -- the search --------------------------------------------------------------------------------


def _knob(action: Action, name: str, value: float) -> Action:
    return replace(action, **{name: value})


def solve(runner: Runner, plan: Sequence[Scenario], start: PolicyTable, passes: int = 1,
          log: Callable[[str], None] = lambda _: None,
          dispatch_levels: Sequence[str] = QUEUE_LEVELS,
          budget: int | None = None) -> tuple[PolicyTable, dict[str, Any]]:
    """Coordinate descent from ``start`` (the heuristic): the table found and how it was
    found (scores, visits, evaluations). The dispatch knobs are searched only in the states
    of the queue levels ``dispatch_levels`` (the others dispatch as ``start`` does); the
    admission knobs in every state seen. With a ``budget``, the search stops before a step
    that would take the simulations run past it (``budget_spent``: it did)."""
    spent = False

    def score(tables: Sequence[PolicyTable]) -> list[float]:
        tasks = [("smdp", t, sc) for t in tables for sc in plan]
        rows = runner.map(tasks)
        n = len(plan)
        return [objective(rows[i * n:(i + 1) * n], ref, fcfs, plan) for i in range(len(tables))]

    ref = runner.map([("smdp", start, sc) for sc in plan])
    fcfs = runner.map([("fcfs", None, sc) for sc in plan])
    visits = [sum(row["visits"][s] for row in ref) for s in range(N_STATES)]
    total = max(sum(visits), 1)
    best, best_score = start, objective(ref, ref, fcfs, plan)
    first_score = best_score
    log(f"heuristic: score {best_score:.4f}; ticks per state: "
        + ", ".join(f"{STATE_NAMES[s]} {v / total:.1%}" for s, v in enumerate(visits) if v))
    searched = [s for s in sorted(range(N_STATES), key=lambda s: -visits[s]) if visits[s] / total >= MIN_VISITS]

    def free(s: int, name: str) -> bool:
        return name in ADMISSION_KNOBS or level_of(s) in dispatch_levels

    def step(candidates: list[tuple[str, PolicyTable]]) -> None:
        nonlocal best, best_score, spent
        if not candidates or spent:
            return
        if budget is not None and runner.evaluations + len(candidates) * len(plan) > budget:
            spent = True
            log(f"  the budget of {budget} simulations is spent: the search stops here")
            return
        scores = score([t for _, t in candidates])
        i = max(range(len(candidates)), key=lambda j: scores[j])
        if scores[i] > best_score + MIN_GAIN:
            best, best_score = candidates[i][1], scores[i]
            log(f"  {candidates[i][0]}: score {best_score:.4f}")

    def every(name: str, value: float) -> PolicyTable:
        """The knob ``name`` at ``value`` in every searched state where it may change; the
        states the tuning hardly saw keep the heuristic's knobs (no evidence, no change)."""
        table = best
        for s in searched:
            if free(s, name):
                table = table.with_action(s, _knob(table.actions[s], name, value))
        return table

    for p in range(passes):
        log(f"pass {p + 1}: one setting for every state seen")
        for name, values in GRID.items():
            first = next((s for s in searched if free(s, name)), None)
            if first is None:
                continue
            current = getattr(best.actions[first], name)
            step([(f"every state seen {name}={v:g}", every(name, v)) for v in values if v != current])
        log(f"pass {p + 1}: state by state ({', '.join(STATE_NAMES[s] for s in searched)})")
        for s in searched:
            for name, values in GRID.items():
                action = best.actions[s]
                if free(s, name):
                    step([(f"{STATE_NAMES[s]} {name}={v:g}", best.with_action(s, _knob(action, name, v)))
                          for v in values if v != getattr(action, name)])
    how = {"score_heuristic": first_score, "score": best_score, "evaluations": runner.evaluations,
           "ticks_per_state": {STATE_NAMES[s]: v / total for s, v in enumerate(visits)},
           "searched_states": [STATE_NAMES[s] for s in searched], "dispatch_levels": list(dispatch_levels),
           "passes": passes, "budget_spent": spent}
    return best, how


# -- the report --------------------------------------------------------------------------------


def report(runner: Runner, plan: Sequence[Scenario], table: PolicyTable) -> dict[str, Any]:
    """FCFS, the heuristic and the table on every scenario of ``plan``, the table again on
    those with SLOs after a restart on saved state (``Scenario.restart``; its workloads need
    the ``warm`` scenarios too), and the issue's targets for this workload (each with its
    figure and whether it is met)."""
    tasks = [(p, table if p == "smdp" else None, sc) for sc in plan for p in ("fcfs", "tokengate", "smdp")]
    restarts: list[tuple[str, PolicyTable | None, Scenario]] = [
        ("smdp", table, replace(sc, restart=True)) for sc in plan if sc.shed]
    rows = runner.map(tasks + restarts)
    after = {replace(sc, restart=False): row for (_, _, sc), row in zip(restarts, rows[len(tasks):], strict=True)}
    out: list[dict[str, Any]] = []
    for (policy, _, sc), row in zip(tasks, rows[: len(tasks)], strict=True):
        restarted = after.get(sc) if policy == "smdp" else None
        out.append({"policy": policy, "load": sc.load, "slo_at_admission": sc.shed,
                    **{k: row[k] for k in ("slo_attainment", "goodput_rps", "ttft_p99_ms", "ttft_p999_ms",
                                           "p99_ms", "throughput_rps", "refused_slo")},
                    "inside_bounds": bound_share(row),
                    "after_restart": None if restarted is None else {
                        "inside_bounds": bound_share(restarted), "goodput_rps": restarted["goodput_rps"]}})

    def at(policy: str, load: float, shed: bool) -> dict[str, Any]:
        return next(r for r in out if r["policy"] == policy and r["load"] == load and r["slo_at_admission"] == shed)

    free = sorted({sc.load for sc in plan if not sc.shed})
    slo = sorted({sc.load for sc in plan if sc.shed})
    targets: dict[str, Any] = {}
    if free:
        worst = [(x, at("smdp", x, False), at("fcfs", x, False), at("tokengate", x, False)) for x in free]
        targets["no_slo"] = {
            "min_margin_vs_fcfs": min(s["slo_attainment"] - f["slo_attainment"] for _, s, f, _ in worst),
            "min_margin_vs_heuristic": min(s["slo_attainment"] - h["slo_attainment"] for _, s, _, h in worst),
            "max_ttft_p99_vs_fcfs": max(s["ttft_p99_ms"] / f["ttft_p99_ms"] for _, s, f, _ in worst),
            # not a target: what a lower p99 cost the last 0.1 % (FCFS's can rest on them)
            "max_ttft_p999_vs_fcfs": max(s["ttft_p999_ms"] / f["ttft_p999_ms"] for _, s, f, _ in worst),
        }
        t = targets["no_slo"]
        t["met"] = (t["min_margin_vs_fcfs"] >= 0.0 and t["min_margin_vs_heuristic"] >= 0.0
                    and t["max_ttft_p99_vs_fcfs"] <= 1.0)
    if slo and 1.0 in slo:
        one = at("smdp", 1.0, True)["goodput_rps"]
        above = [x for x in slo if x > 1.0]
        lowest = min((at("smdp", x, True)["goodput_rps"] for x in above), default=0.0)
        inside = [at("smdp", x, True)["inside_bounds"] for x in slo]
        again = [at("smdp", x, True)["after_restart"]["inside_bounds"] for x in slo]
        targets["slo"] = {
            "goodput_1x": one,
            "min_goodput_ratio": lowest / one if above and one else None,
            "min_inside_bounds": min((i for i in inside if i is not None), default=None),
            # the same after a restart on saved state (a figure: the target is judged on a fresh start)
            "min_inside_bounds_after_restart": min((i for i in again if i is not None), default=None),
        }
        t = targets["slo"]
        t["met"] = (t["min_goodput_ratio"] is not None and t["min_goodput_ratio"] >= 0.9
                    and t["min_inside_bounds"] is not None and t["min_inside_bounds"] >= BOUND_SHARE)
    margins = [at("smdp", sc.load, sc.shed)["slo_attainment"] - at("tokengate", sc.load, sc.shed)["slo_attainment"]
               for sc in plan]
    targets["vs_heuristic"] = {"min_attainment_margin": min(margins), "met": min(margins) >= -0.02}
    return {"rows": out, "targets": targets}
