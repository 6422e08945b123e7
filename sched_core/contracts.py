"""Calibrated latency contracts: the core's raw prediction, corrected and bounded by what
requests really took (docs/scheduling.md §14). Pure: no clock, no I/O.

Per path, load level and prompt bucket, sliding windows keep the ratios of what finished
requests took to what the raw model predicted for them (the budget wait, known exactly, left
out):

* first token: actual TTFT ÷ raw TTFT;
* per token: actual (e2e − TTFT)/(tokens − 1) ÷ raw TPOT;
* total: actual e2e ÷ the raw bound ``TTFT + (out_hi − 1)·TPOT``, ``out_hi`` the output
  length's upper quantile for the tenant (the exact length when ``ignore_eos`` fixes it).

A promise multiplies the raw terms by the window's weighted median ratio (weights 1/ratio:
the factor that minimises the mean absolute percentage error) and bounds them by the
window's split-conformal quantile (the ⌈(n+1)·q⌉-th smallest of n ratios), which covers a
share q of new requests whatever the model's error, as long as the window resembles them;
the window forgets, so coverage recovers after a shift. The load level (``LEVELS``: the
path's sequences running and queued, as a share of its slots, when the request arrived) makes
the windows conditional on congestion (Mondrian conformal prediction): the model errs most in
bursts, and an unconditional window, mostly calm, bounds a burst too tightly. A cell with too
few outcomes borrows its level's pooled window, then its path's; with too few of those, the
bound is the point times ``PRIOR_BOUND_FACTOR`` or the largest latest ratio, stretched by the level.

The windows follow the machine without double counting: their ratios are taken against the
raw model as the step-time model prices now (it re-anchors on the workers' steps when the
machine's speed moves), the requests in flight while it moved (or while a worker changed its
threads) teach nothing, and the windows a path starts with (restored from a saved state, or
filled while the step-time model was still far off) are checked by its first outcomes and
re-anchored when a dozen of them disagree (docs/scheduling.md §14).

Output lengths are learned per tenant and bucket: the last ``output_window`` lengths, with
exact quantiles over them (a sliding window is small and forgets, which a mergeable sketch
such as DDSketch does not); the estimate is their 1/length-weighted median, the bound their
q quantile, never above ``max_tokens``.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Any

from sched_core.drift import Z_SPAN, log_spread, median_of, shifted
from sched_core.types import Contract, Request
from sched_core.windows import POINT_WINDOW, Window, stretch

#: Before a path has enough outcomes for a conformal bound, bounds are the raw model's times
#: this (the model is the packaged profile's: measured, but not on this deployment's load).
PRIOR_BOUND_FACTOR = 3.0
MIN_POINT = 16  # outcomes a window needs before its median corrects the raw prediction
#: Adaptive conformal inference (Gibbs and Candès, 2021): after each outcome the level a
#: component's bounds are set at moves by GAMMA·(miss − (1 − coverage)), so that misses that
#: come together (a burst, whose outcomes the windows learn only once they finish) raise the
#: level until the long-run share inside the bounds is the coverage asked for. Past level 1
#: the largest ratio is stretched by exp(STRETCH·(level − 1)), at most ``LEVEL_MAX``. The
#: raised level decays back with time constant ``LEVEL_DECAY_S``: a gateway that refuses
#: everything learns from no outcome, and must not stay locked by an old burst.
GAMMA = 0.01
LEVEL_MAX = 1.035  # a stretch of 4x at most
LEVEL_DECAY_S = 60.0
COMPONENTS = ("ttft", "tpot", "total")
#: Upper edges of the load levels: (running + queued) ÷ slots of the request's path.
LEVELS = (0.5, 0.9, 1.5)
#: The windows a saved state brought are checked by the path's first outcomes: while a
#: component and path has learnt fewer than ``CHECK_OUTCOMES`` outcomes in this process and its
#: windows still hold restored values, its latest ``DRIFT_OUTCOMES`` outcomes' errors are
#: compared with what the windows held before them: when their median is past ``DRIFT_MIN`` and past
#: ``DRIFT_SIGMAS`` standard errors of a median (σ the larger of the window's spread and
#: theirs, so a path whose outcomes only scatter more is not re-anchored on noise), and
#: ``DRIFT_AGREE`` of them erred past the same ``DRIFT_TAIL`` tail of the window, the windows
#: are re-anchored. At ``CHECK_OUTCOMES`` the values a saved state brought are dropped: the
#: path has its own by then, and a restored tail (a busy run's, say) would widen its bounds for
#: another window's length. Later, a machine that changes is the step-time model's to follow
#: (it sees steps, many per second, where outcomes come a few at a time): a dozen outcomes of a
#: burst, or of a queue that grows under overload, are late together without the machine
#: having changed, and in the simulator (whose machine never changes) re-anchoring on them cost
#: 1-5 points of coverage, and under overload with shedding a fifth of the goodput.
CHECK_OUTCOMES = 128
DRIFT_OUTCOMES = 12
DRIFT_TAIL = 0.1
DRIFT_AGREE = 8
DRIFT_MIN = 1.2
DRIFT_SIGMAS = 4.0
#: An outcome whose path's step-time model was re-anchored by more than this factor while it
#: ran is the change's, not the path's: it judges its bound but is not learnt.
TRANSITION = 1.1


def load_level(load: float) -> int:
    """The level of a path's load: the number of ``LEVELS`` edges at or below it."""
    return sum(load >= edge for edge in LEVELS)


@dataclass(slots=True)
class _Pending:
    path: str
    level: int
    bucket: int
    tenant: str
    wait: float  # budget wait: part of every figure, known exactly
    raw_ttft: float  # without the wait
    raw_tpot: float
    raw_total: float  # the core's total, wait included (for the raw error)
    basis: float  # raw total bound without the wait: ttft + (out_hi − 1)·tpot
    promise: Contract
    middles: tuple[float, float, float]  # per component, the median ratio when promised (drift's yardstick)
    speed: float  # the step-time model's re-anchoring of the path when promised (``StepModel.scale``)
    at: float  # when it was promised
    first: float | None = None  # its first token, seconds from arrival, once seen
    judged: bool = False  # its first-token bound has moved the adaptive level (kept or missed)
    changed: bool = False  # teaches nothing: its workers changed how they run (``transition``), or it is inherited


@dataclass(frozen=True, slots=True)
class Accuracy:
    """How one promise fared: inside its bounds, and the absolute percentage error of the
    calibrated prediction and of the raw model's, per component (total, first token)."""

    path: str
    total_inside: bool
    total_ape: float
    raw_total_ape: float
    ttft_inside: bool | None  # None: the first token was not seen apart (not streamed)
    ttft_ape: float | None
    raw_ttft_ape: float | None


class Contracts:
    """Output-length estimates and calibration windows, and the promises built from them."""

    def __init__(self, bucket_bounds: tuple[int, ...], default_output: int, coverage: float = 0.99,
                 window: int = 512, output_window: int = 256) -> None:
        if not 0.5 <= coverage < 1.0 or window < 1 or output_window < 1:
            raise ValueError("coverage must lie in [0.5, 1), windows must hold at least one outcome")
        self.bounds = bucket_bounds
        self.default_output = default_output
        self.coverage = coverage
        self.window = window
        self.output_window = output_window
        # (component, path, level or -1, bucket or -1)
        self._ratios: dict[tuple[str, str, int, int], Window] = {}
        self._outputs: dict[tuple[str, int], Window] = {}  # (tenant or "", bucket)
        # (component, path): the adaptive level's excess over the coverage, and when it was set
        self._level: dict[tuple[str, str], tuple[float, float]] = {}
        self._pending: dict[str, _Pending] = {}
        self._due: list[tuple[float, str]] = []  # (when its first-token bound runs out, request id)
        # (component, path): the latest outcomes' errors against their promised point, and the
        # (level, bucket) cell each went to; how many re-anchorings there were
        self._recent: dict[tuple[str, str], deque[tuple[float, int, int]]] = {}
        self.reanchored: dict[tuple[str, str], int] = {}
        self._learnt: dict[tuple[str, str], int] = {}  # outcomes learnt in this process (``CHECK_OUTCOMES``)
        self._now = 0.0  # the time of the latest event (for ``summary``)
        self._speeds: dict[str, float] = {}  # per path, the step-time model's re-anchoring as last told

    def __len__(self) -> int:
        return len(self._pending)

    # -- output lengths -----------------------------------------------------------------------

    def output(self, req: Request) -> tuple[int, int]:
        """(estimate, upper bound) of the request's output length, within [1, max_tokens]."""
        cap = req.max_tokens
        if req.expected_output_tokens > 0:
            n = min(req.expected_output_tokens, cap)
            return n, n
        k = min(bisect_left(self.bounds, req.prompt_tokens), len(self.bounds) - 1)  # the core's bucket
        for key in ((req.tenant, k), ("", k)):
            w = self._outputs.get(key)
            if w is not None and len(w) >= MIN_POINT:
                point = w.median()
                hi = _quantile(w.sorted, self.coverage)
                return max(1, min(cap, round(point))), max(1, min(cap, math.ceil(hi)))
        return min(cap, self.default_output), cap

    # -- promises -----------------------------------------------------------------------------

    def _adaptive(self, component: str, path: str, now: float) -> float:
        """The level a component's bounds are set at now (adaptive conformal inference)."""
        excess, at = self._level.get((component, path), (0.0, now))
        return self.coverage + excess * math.exp(-max(now - at, 0.0) / LEVEL_DECAY_S)

    def _factors(self, component: str, path: str, level: int, bucket: int,
                 now: float) -> tuple[float, float, bool, float]:
        """(point factor, bound factor, whether the bound is a window's conformal quantile,
        the plain median ratio by the point's window) for a component on a path, load level
        and bucket: each from the most specific window that has enough outcomes for it. Before
        any has, the bound is ``PRIOR_BOUND_FACTOR`` times the point, or the largest ratio seen if
        further out, stretched past level 1 as a window's largest is (a first burst's misses widen it)."""
        cells = [self._ratios.get(key) for key in
                 ((component, path, level, bucket), (component, path, level, -1), (component, path, -1, -1))]
        q = self._adaptive(component, path, now)
        point, middle, bound = 1.0, 1.0, math.inf
        for w in cells:
            if w is not None and len(w) >= MIN_POINT:
                point, middle = w.median(), w.middle()
                break
        for w in cells:
            if w is not None and len(w) >= MIN_POINT:
                bound = w.quantile(q)
                if bound < math.inf:
                    break
        if bound < math.inf:
            return point, max(point, bound), True, middle
        seen = max((max(w.ordered()[-POINT_WINDOW:]) for w in cells if w is not None and len(w)), default=0.0)
        return point, max(PRIOR_BOUND_FACTOR * point, seen) * stretch(q), False, middle

    def calibrated(self, component: str, path: str, load: float) -> bool:
        """Whether a component's points on a path at this load rest on its load level's outcomes."""
        w = self._ratios.get((component, path, load_level(load), -1))
        return w is not None and len(w) >= MIN_POINT

    def promise(self, raw: Contract, req: Request, out_hi: int, load: float, now: float,
                speed: float = 1.0, inherited: bool = False) -> Contract:
        """The calibrated contract for a request the core admitted with ``raw``; ``load`` is its path's running
        and queued sequences ÷ its slots; ``speed``: the step-time model's re-anchoring of the path now (see
        ``observe``); ``inherited``: another scheduler promised it, or this one could not see its wait (a failover):
        its times count from what this one never saw, so it teaches nothing (docs/scheduling.md §15). The total's bound
        assumes ``out_hi`` output tokens: before the total's windows can bound it, the first token's bound plus
        ``out_hi − 1`` tokens at the per-token bound (nothing on top of a length already its 99th percentile); after,
        never under the point's first token plus those tokens at the per-token bound it is given beside."""
        self._overdue(now)
        self._now = now
        level = load_level(load)
        wait = raw.budget_wait_s
        out = raw.output_tokens
        raw_ttft = max(raw.ttft_s - wait, 1e-6)
        raw_tpot = max(raw.tpot_s, 1e-6)
        f_ttft, b_ttft, _, m_ttft = self._factors("ttft", raw.path, level, raw.bucket, now)
        f_tpot, b_tpot, _, m_tpot = self._factors("tpot", raw.path, level, raw.bucket, now)
        _, b_total, conformal, m_total = self._factors("total", raw.path, level, raw.bucket, now)
        basis = raw_ttft + max(out_hi - 1, 0) * raw_tpot
        ttft = wait + raw_ttft * f_ttft
        tpot = raw_tpot * f_tpot
        total = ttft + max(out - 1, 0) * tpot
        ttft_hi = wait + raw_ttft * b_ttft
        tpot_hi = raw_tpot * b_tpot
        total_hi = wait + basis * b_total if conformal else ttft_hi + max(out_hi - 1, 0) * tpot_hi
        total_hi = max(total_hi, ttft_hi, total, ttft + max(out_hi - 1, 0) * tpot_hi)
        c = Contract(raw.request_id, raw.bucket, raw.path, ttft, total, total_hi, raw.tokens_ahead, wait, tpot, out,
                     ttft_hi, tpot_hi, out_hi)
        self._pending[raw.request_id] = _Pending(raw.path, level, raw.bucket, req.tenant, wait, raw_ttft,
                                                 raw_tpot, raw.total_s, basis, c, (m_ttft, m_tpot, m_total), speed,
                                                 now, changed=inherited)
        self._speeds[raw.path] = speed
        heapq.heappush(self._due, (now - wait + ttft_hi, raw.request_id))
        return c

    def _overdue(self, now: float) -> None:
        """Promises whose first-token bound ran out with no first token are misses now, not
        when they finish: in a burst the level rises while the burst lasts. Where the path's
        step-time model was re-anchored slower since the promise, the bound is judged as the
        re-anchored model would have set it (the change is followed there, not by the level)."""
        due = self._due
        while due and due[0][0] < now:
            rid = heapq.heappop(due)[1]
            pend = self._pending.get(rid)
            if pend is None or pend.judged:
                continue
            slower = self._speeds.get(pend.path, pend.speed) / pend.speed
            later = pend.at + (pend.promise.ttft_p99_s - pend.wait) * slower
            if later > now:
                heapq.heappush(due, (later, rid))
                continue
            pend.judged = True
            self._judge("ttft", pend, False, 1.0 / slower, now)

    def transition(self, path: str) -> None:
        """A worker of ``path`` changed how it runs (another program took its CPUs and it gave
        up a thread, or the program left): the requests in flight now are the change's, like
        those in flight while the step-time model re-anchored (``_steady``)."""
        for pend in self._pending.values():
            if pend.path == path:
                pend.changed = True

    @staticmethod
    def _steady(pend: _Pending, moved: float) -> bool:
        """Whether a request ran on a steady path: no worker of it changed how it runs, and its
        step-time model moved by less than ``TRANSITION`` while it ran (``moved``). A request
        that did not is the change's: it judges its bound for the metrics, but teaches neither
        the windows nor the adaptive level (the re-anchoring answers the change; a level raised
        for it would widen every bound for minutes after)."""
        return not pend.changed and 1.0 / TRANSITION < moved < TRANSITION

    def _judge(self, component: str, pend: _Pending, inside: bool, moved: float, now: float) -> None:
        """A bound kept or missed moves the adaptive level, on a steady path (``_steady``)."""
        if self._steady(pend, moved):
            self._adapt(component, pend.path, inside, now)

    def _adapt(self, component: str, path: str, inside: bool, now: float) -> None:
        self._now = max(self._now, now)
        q = self._adaptive(component, path, now) + GAMMA * ((not inside) - (1.0 - self.coverage))
        self._level[(component, path)] = (min(max(q, self.coverage), LEVEL_MAX) - self.coverage, now)

    def first_token(self, rid: str, ttft_s: float, now: float, speed: float = 1.0) -> None:
        """A promised request's first token came, ``ttft_s`` after arrival: its first-token
        ratio is learnt now, before its last token (``speed``: see ``observe``)."""
        pend = self._pending.get(rid)
        if pend is None or pend.first is not None or not ttft_s > 0.0:
            return
        pend.first = ttft_s
        self._speeds[pend.path] = speed
        moved = pend.speed / speed
        self._add("ttft", pend, max(ttft_s - pend.wait, 1e-6) / pend.raw_ttft * moved, moved)
        if not pend.judged:
            pend.judged = True
            self._judge("ttft", pend, _within(ttft_s, pend.promise.ttft_p99_s, pend.wait, moved), moved, now)

    def promised(self, rid: str) -> Contract | None:
        """The contract given to ``rid``, while its outcome is awaited."""
        pend = self._pending.get(rid)
        return None if pend is None else pend.promise

    def forget(self, rid: str) -> None:
        """The request ended without an outcome to learn from (refused, failed, cancelled)."""
        self._pending.pop(rid, None)

    def observe(self, rid: str, ttft_s: float | None, total_s: float, tokens: int,
                now: float, speed: float = 1.0) -> Accuracy | None:
        """A request this calibrator promised finished: learn from it; how its promise fared
        (None if it made none). ``ttft_s`` is None where the first token was not seen apart
        (a non-streaming response): the total and the output length still teach.

        The windows keep ratios to the raw model as it prices now: where the step-time model
        was re-anchored since the promise (``speed``, against the promise's; another program
        took the CPU and the model followed its steps), the ratio is taken against the raw
        prediction re-anchored alike, so that the two corrections never count one change
        twice."""
        pend = self._pending.pop(rid, None)
        if pend is not None and pend.first is not None:
            ttft_s = pend.first  # seen and learnt already
        if pend is None or not total_s > 0.0 or tokens < 1 or (ttft_s is not None and not 0.0 < ttft_s <= total_s):
            return None
        c = pend.promise
        k = pend.bucket
        self._speeds[pend.path] = speed
        moved = pend.speed / speed  # the raw model's re-anchoring since the promise, undone
        self._add("total", pend, max(total_s - pend.wait, 1e-6) / pend.basis * moved, moved)
        for key in ((pend.tenant, k), ("", k)):
            window = self._outputs.get(key)
            if window is None:  # not setdefault: that builds a window on every call
                window = self._outputs[key] = Window(self.output_window)
            window.add(float(tokens))
        total_inside = total_s <= c.p99_s
        ttft_inside = None if ttft_s is None else ttft_s <= c.ttft_p99_s
        # the adaptive level counts the misses the re-anchored raw model would have made
        self._judge("total", pend, _within(total_s, c.p99_s, pend.wait, moved), moved, now)
        if ttft_s is not None:
            if pend.first is None:
                self._add("ttft", pend, max(ttft_s - pend.wait, 1e-6) / pend.raw_ttft * moved, moved)
            if not pend.judged:
                self._judge("ttft", pend, _within(ttft_s, c.ttft_p99_s, pend.wait, moved), moved, now)
            if tokens > 1:
                self._add("tpot", pend, max((total_s - ttft_s) / (tokens - 1), 1e-6) / pend.raw_tpot * moved, moved)
        return Accuracy(
            path=pend.path,
            total_inside=total_inside,
            total_ape=abs(c.total_s - total_s) / total_s,
            raw_total_ape=abs(pend.raw_total - total_s) / total_s,
            ttft_inside=ttft_inside,
            ttft_ape=None if ttft_s is None else abs(c.ttft_s - ttft_s) / ttft_s,
            raw_ttft_ape=None if ttft_s is None else abs(pend.raw_ttft + pend.wait - ttft_s) / ttft_s,
        )

    def _add(self, component: str, pend: _Pending, ratio: float, moved: float = 1.0) -> None:
        """Learn a ratio, of a request that ran on a steady path (``_steady``), or provisionally
        one the step-time model re-anchored under while its path's window at its load level
        holds fewer than ``MIN_POINT`` (a fresh start's first burst, which runs while the
        measured profile is first corrected: without it no wait bound comes into force).
        Provisional ratios are held like restored ones: checked, then dropped at
        ``CHECK_OUTCOMES`` (docs/scheduling.md §14)."""
        path = pend.path
        provisional = not self._steady(pend, moved)
        if provisional and (pend.changed or len(self._ratios.get((component, path, pend.level, -1), ())) >= MIN_POINT
                            or self._learnt.get((component, path), 0) >= CHECK_OUTCOMES):
            return
        for key in ((component, path, pend.level, pend.bucket), (component, path, pend.level, -1),
                    (component, path, -1, -1)):
            w = self._ratios.get(key)
            if w is None:
                w = self._ratios[key] = Window(self.window)
            w.add(ratio)
            if provisional:
                w.restored = min(len(w), w.restored + 1)
        recent = self._recent.get((component, path))
        if recent is None:
            recent = self._recent[(component, path)] = deque(maxlen=DRIFT_OUTCOMES)
        recent.append((ratio / pend.middles[COMPONENTS.index(component)], pend.level, pend.bucket))
        self._drift(component, path)

    def _drift(self, component: str, path: str) -> None:
        """While a component and path's windows are being checked (``CHECK_OUTCOMES``):
        re-anchor them when the latest ``DRIFT_OUTCOMES`` outcomes say the calibrated
        prediction is off (see ``DRIFT_TAIL``). Every older ratio is scaled by the median error
        of the new regime's outcomes (those nearer it than 1 stay as they came), the promises
        in flight are judged against the re-anchored windows, and the adaptive level starts
        again."""
        learnt = self._learnt[(component, path)] = self._learnt.get((component, path), 0) + 1
        recent = self._recent[(component, path)]
        if learnt == CHECK_OUTCOMES:  # what a saved state brought has served the start
            for (c, p, _, _), w in self._ratios.items():
                if c == component and p == path:
                    w.forget_restored()
        pooled = self._ratios[(component, path, -1, -1)]
        if learnt > CHECK_OUTCOMES or len(recent) < DRIFT_OUTCOMES or not pooled.restored:
            return
        older = pooled.ordered()[:-DRIFT_OUTCOMES]
        if len(older) < MIN_POINT:
            return  # too few older outcomes to judge against: the windows are still filling
        latest = sorted(older[-POINT_WINDOW:])  # the spread as it is now: the old one may have been tighter
        older.sort()
        centre = median_of(older)
        lo = older[int(DRIFT_TAIL * (len(older) - 1))] / centre
        hi = older[math.ceil((1.0 - DRIFT_TAIL) * (len(older) - 1))] / centre
        errors = sorted(e for e, _, _ in recent)
        m = median_of(errors)
        if not shifted(errors, m, max(math.log(hi / lo) / Z_SPAN, log_spread(latest)), DRIFT_MIN, DRIFT_SIGMAS):
            return
        past = [e for e in errors if e > hi] if m > 1.0 else [e for e in errors if e < lo]
        if len(past) < DRIFT_AGREE:
            return
        m = median_of(past)  # the outcomes of the new regime: the oldest of the dozen may predate it
        midway = math.sqrt(m)  # nearer m than 1 on a log scale: an outcome of the new regime
        newest: dict[tuple[int, int], list[bool]] = {}  # per cell, its latest values: of the new regime?
        for e, level, bucket in recent:
            for cell in ((level, bucket), (level, -1), (-1, -1)):
                newest.setdefault(cell, []).append(e > midway if m > 1.0 else e < midway)
        for (c, p, level, bucket), w in self._ratios.items():
            if c == component and p == path:
                w.rescale(m, newest.get((level, bucket), []))
        # the promises in flight are judged against the re-anchored windows too, or their
        # outcomes would show the same change again and re-anchor it twice
        i = COMPONENTS.index(component)
        for pend in self._pending.values():
            if pend.path == path:
                scaled = [x * m if j == i else x for j, x in enumerate(pend.middles)]
                pend.middles = (scaled[0], scaled[1], scaled[2])
        recent.clear()
        self._level.pop((component, path), None)
        self.reanchored[(component, path)] = self.reanchored.get((component, path), 0) + 1

    def summary(self) -> dict[str, dict[str, dict[str, float | int | None]]]:
        """Per path and component, what the promises rest on as of the last event: the outcomes in the path's
        window, its median ratio of actual to the raw model (the point's correction), its
        bound (the conformal quantile at the adaptive level), that level, and how many times
        the windows were re-anchored (for ``/admin/scheduler``)."""
        out: dict[str, dict[str, dict[str, float | int | None]]] = {}
        for (component, path, level, bucket), w in sorted(self._ratios.items()):
            if level != -1 or bucket != -1:
                continue
            q = self._adaptive(component, path, self._now)
            bound = w.quantile(q) if len(w) >= MIN_POINT else math.inf
            out.setdefault(path, {})[component] = {
                "outcomes": len(w), "median": w.median() if len(w) >= MIN_POINT else 1.0,
                "bound": bound if bound < math.inf else None, "level": q,
                "reanchored": self.reanchored.get((component, path), 0)}
        return out

    # -- persistence --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The windows, as JSON data (``load`` takes it back)."""
        return {
            "ratios": [[c, p, lv, k, w.ordered()] for (c, p, lv, k), w in self._ratios.items()],
            "outputs": [[t, k, w.ordered()] for (t, k), w in self._outputs.items()],
        }

    def load(self, state: dict[str, Any]) -> None:
        """Start from a saved state (another replica's, or this one's before a restart);
        malformed entries are skipped."""
        for entry in state.get("ratios", ()):
            try:
                c, p, lv, k, values = entry
                xs = [float(x) for x in values if float(x) > 0.0 and math.isfinite(float(x))]
                if c in COMPONENTS and isinstance(p, str) and isinstance(lv, int) and isinstance(k, int) and xs:
                    w = self._ratios[(c, p, lv, k)] = Window(self.window, xs)
                    w.restored = len(w.values)
            except (TypeError, ValueError):
                continue
        for entry in state.get("outputs", ()):
            try:
                t, k, values = entry
                xs = [float(x) for x in values if float(x) >= 1.0 and math.isfinite(float(x))]
                if isinstance(t, str) and isinstance(k, int) and xs:
                    self._outputs[(t, k)] = Window(self.output_window, xs)
            except (TypeError, ValueError):
                continue


def _within(actual: float, bound: float, wait: float, moved: float) -> bool:
    """Whether ``actual`` (seconds, a budget ``wait`` included) is inside ``bound`` once its
    model part is scaled by ``moved`` (the raw model's re-anchoring since the promise, undone)."""
    return wait + (actual - wait) * moved <= bound


def _quantile(xs: list[float], q: float) -> float:
    """The q quantile of sorted ``xs`` (nearest rank, rounding up)."""
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]
