"""What a run is worth: latency percentiles, throughput, SLO attainment and goodput, Jain's
fairness index among backlogged tenants, and the accuracy of the latency contracts.

Definitions (docs/scheduling.md §13 states them with the results):

* latencies are measured at the client: TTFT from arrival to the first token, end-to-end
  (e2e) from arrival to the last; a rejected request has neither and misses the SLO;
* throughput is measured while requests arrive, [first arrival, last arrival]: requests
  completed in it per second (``throughput_rps``), tokens prefilled or generated in it per
  second (``tokens_per_s``); under overload these are the service rate, and the drain after
  the last arrival (where one straggler would set the makespan) does not count; and the
  rate at which the whole workload drains, all tokens / (last completion − first arrival)
  (``drain_tokens_per_s``): every policy serves the same requests, so this compares the
  capacity each leaves;
* a request meets the SLO iff TTFT ≤ ``ttft_s`` and its time per output token after the
  first, (e2e − TTFT)/(tokens − 1), is ≤ ``tpot_s``; goodput = such requests completed in
  the window per second;
* fairness: the run, first arrival to last completion (overload backlogs drain long after
  the last arrival), is cut into ``windows`` equal windows; in each,
  a tenant is backlogged if it had a request waiting for its prefill throughout the window;
  its service is ``fair_input_weight``·prompt + ``fair_output_weight``·output tokens served
  in the window, divided by its budget; Jain's index (Σx)²/(n·Σx²) is taken over the
  backlogged tenants of every window with at least two, and averaged;
* contracts, over the requests that finished with one: the share whose TTFT is within the
  contract's ``ttft_p99_s``, whose e2e is within its ``p99_s``, and the mean absolute
  percentage error of the predicted TTFT (``ttft_s``) and total (``total_s``), calibrated
  and the raw model's (``sched_core.contracts``);
* refusals: requests the driver refused at admission for their SLO (``refused_slo``;
  admission is at arrival in the simulator, so a refusal takes no time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.pools import POOLS
from sched_core.simulate.engine import Outcome, Result

CONTRACT_FIGURES = ("within_ttft_bound", "within_p99_bound", "mape_ttft", "mape", "raw_mape_ttft", "raw_mape")


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 1.0
    tpot_s: float = 0.1

    def met(self, o: Outcome) -> bool:
        if o.rejected is not None or math.isnan(o.finished):
            return False
        return self.meets(o.ttft, o.e2e, o.tokens)

    def meets(self, ttft_s: float, e2e_s: float, tokens: int) -> bool:
        """A finished request's first token within the TTFT SLO, each later one within the TPOT SLO."""
        return ttft_s <= self.ttft_s and (tokens <= 1 or (e2e_s - ttft_s) / (tokens - 1) <= self.tpot_s)

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_s * 1000:g} ms and <= {self.tpot_s * 1000:g} ms per later token"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def jain(xs: Sequence[float]) -> float:
    total = sum(xs)
    squares = sum(x * x for x in xs)
    return total * total / (len(xs) * squares) if squares > 0.0 else 1.0


def _intervals(events: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """Spans during which the count of waiting requests is positive."""
    spans = []
    count, start = 0, 0.0
    for t, delta in sorted(events):
        if count == 0 and delta > 0:
            start = t
        count += delta
        if count == 0:
            spans.append((start, t))
    if count > 0:
        spans.append((start, math.inf))
    return spans


def fairness(result: Result, windows: int = 20, input_weight: float = 1.0,
             output_weight: float = 2.0) -> tuple[float | None, int]:
    """(mean Jain index over windows with >= 2 backlogged tenants, number of such windows)."""
    arrivals = [o.arrival.time for o in result.outcomes]
    if len(result.budgets) < 2 or not arrivals:
        return None, 0
    t0 = min(arrivals)
    t1 = max([o.finished for o in result.outcomes if not math.isnan(o.finished)] + arrivals)
    width = (t1 - t0) / windows
    if width <= 0.0:
        return None, 0
    spans = {t: _intervals(ev) for t, ev in result.backlog.items()}
    served = {t: [0.0] * windows for t in result.budgets}
    for tenant, entries in result.service.items():
        bins = served[tenant]
        for t, p, o in entries:
            k = int((t - t0) // width)
            if 0 <= k < windows:
                bins[k] += input_weight * p + output_weight * o
    indices = []
    for k in range(windows):
        lo, hi = t0 + k * width, t0 + (k + 1) * width
        xs = [served[t][k] / budget for t, budget in result.budgets.items()
              if any(s <= lo and hi <= e for s, e in spans[t])]
        if len(xs) >= 2:
            indices.append(jain(xs))
    return (sum(indices) / len(indices) if indices else None), len(indices)


def summarize(result: Result, slo: Slo, windows: int = 20) -> dict[str, Any]:
    """The figures of one run, as JSON data (milliseconds, requests/s, fractions)."""
    outs = result.outcomes
    done = [o for o in outs if o.rejected is None and not math.isnan(o.finished)]
    ttft = [o.ttft for o in done]
    e2e = [o.e2e for o in done]
    start = min((o.arrival.time for o in outs), default=0.0)
    end = max((o.arrival.time for o in outs), default=start)
    if end <= start:  # a single arrival: the window is its lifetime
        end = max((o.finished for o in done), default=start)
    span = end - start
    window = [o for o in done if o.finished <= end]
    makespan = max((o.finished for o in done), default=start) - start
    work = sum(o.arrival.prompt_tokens + o.tokens for o in done)
    served = sum(p + o for entries in result.service.values() for t, p, o in entries
                 if t <= end)
    met = sum(1 for o in outs if slo.met(o))
    index, nwin = fairness(result, windows)
    acc = [o.accuracy for o in done if o.accuracy is not None]
    contracts: dict[str, float | None] = dict.fromkeys(CONTRACT_FIGURES)
    if acc:  # the simulator sees every first token
        n = len(acc)
        contracts = {
            "within_ttft_bound": sum(bool(a.ttft_inside) for a in acc) / n,
            "within_p99_bound": sum(a.total_inside for a in acc) / n,
            "mape_ttft": sum(a.ttft_ape or 0.0 for a in acc) / n,
            "mape": sum(a.total_ape for a in acc) / n,
            "raw_mape_ttft": sum(a.raw_ttft_ape or 0.0 for a in acc) / n,
            "raw_mape": sum(a.raw_total_ape for a in acc) / n,
        }
    paths = {p: sum(1 for o in done if o.path == p) for p in POOLS}
    return {
        "requests": len(outs),
        "completed": len(done),
        "rejected": sum(1 for o in outs if o.rejected is not None),
        "p50_ms": percentile(e2e, 50) * 1000,
        "p99_ms": percentile(e2e, 99) * 1000,
        "ttft_p50_ms": percentile(ttft, 50) * 1000,
        "ttft_p99_ms": percentile(ttft, 99) * 1000,
        "ttft_p999_ms": percentile(ttft, 99.9) * 1000,
        "throughput_rps": len(window) / span if span > 0 else 0.0,
        "tokens_per_s": served / span if span > 0 else 0.0,
        "makespan_s": makespan,
        "span_s": span,  # the arrivals' span, which throughput and goodput are per second of
        "drain_tokens_per_s": work / makespan if makespan > 0 else 0.0,
        "slo_attainment": met / len(outs) if outs else 0.0,
        "goodput_rps": sum(1 for o in window if slo.met(o)) / span if span > 0 else 0.0,
        "jain": index,
        "jain_windows": nwin,
        **contracts,
        "refused_slo": sum(1 for o in outs if o.rejected == "slo"),
        "cpu_share": paths["cpu"] / len(done) if done else 0.0,
        "batches": result.batches,
    }
