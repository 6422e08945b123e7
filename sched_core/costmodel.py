"""The step-time model of a continuously batching worker, fitted online from its step records.

Both scheduler implementations use this code: refits happen per batch of step records, off the
per-request hot path, so one pure-Python implementation keeps the two builds in lockstep.

A worker step runs up to two forwards, a decode forward of the running sequences and a prefill
forward of at most ``step_tokens`` pending prompt tokens (chunked prefill), so its time is
linear in five features (seconds)::

    step_s = decode_launch·[decode_seqs > 0] + decode_seq·decode_seqs + kv_token·kv_tokens
             + prefill_launch·[prefill_tokens > 0] + prefill_token·prefill_tokens

``kv_tokens`` counts the KV-cache tokens held by the decoding sequences (attention reads them).

The fit (docs/scheduling.md §4 has the derivation):

* **Relative error.** Step times span 1 ms to seconds, so each record is weighted by
  ``1/ŷ²``, ŷ the current prediction for it: the fit minimizes relative, not absolute, error.
* **Forgetting.** The sufficient statistics decay by ``fit_forgetting`` per record, so the fit
  remembers about ``1/(1 − fit_forgetting)`` steps (1000 by default: 10–100 s of one worker).
* **Ridge toward the prior.** Each coefficient pays ``λ_j·(θ_j − prior_j)²`` with
  ``λ_j = prior_weight·Σ (x̄_j/ŷ(x̄))²`` over the typical step x̄ of each forward on a full
  worker (``typical_steps``): the information about θ_j that ``prior_weight`` such steps
  carry, in the same relative units as the data. The penalty does not decay, so data only
  moves the combinations of coefficients they identify: a run of same-shaped steps pins the
  prediction at that shape and leaves the rest at the prior (no intercept drifts to swallow a
  slope).
* **Robust.** A record's weight is multiplied by the Huber weight ``min(1, k·s/|r|)`` of its
  relative residual ``r = (y − ŷ)/ŷ``, ``s`` a running, clipped mean of ``|r|``: a step 20×
  slower than predicted (a GC pause, a busy machine) pulls like one ordinary step at most.
  A persistent bias still moves the fit: each step grows ``s`` by at most ``SCALE_RATE``.
* **Non-negative.** The penalized quadratic is minimized over θ ≥ 0 by a warm-started
  primal active-set method (exact in at most a few 5×5 solves).
* **Re-anchored when the machine changes.** Forgetting and the outlier guard make the fit
  slow to follow a worker whose speed moves as a whole (another program takes the CPU, or
  leaves it): a 3× change took thousands of steps. So the model watches its own running error:
  when the median ratio of actual to predicted time over the last ``DRIFT_RECORDS`` steps is
  past ``DRIFT_FACTOR`` (or under its inverse), with ``DRIFT_AGREE`` of them on that side, the
  whole model is re-anchored by that median: the prior is scaled by it (``scale``: how much
  slower the worker runs than the profile it was seeded with) and the fitted history is
  rescaled as if it had run at the new speed (``A/m², b/m``: the fit is scale-equivariant, so
  its shape is kept and its level moves). One slow step never does this; sixteen in a row do.
* **Attention.** A prompt's quadratic share (``prefill_attention·L²``, measured by the worker at
  start) is priced apart from the five linear terms: a step that only prefilled (one whole
  prompt on an idle worker) is fitted without it, and it scales with the rest.

Cost: ``observe_many`` of 64 records with its refit takes about 0.2 ms in CPython 3.11 on a
shared 2-core VM (``test_costmodel.py::test_a_refit_of_64_records_is_cheap`` bounds it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

from sched_core.drift import median_of, shifted
from sched_core.types import PathConfig, SchedulerConfig

#: Names of the coefficients, in the order of ``step_features`` and ``coefficients()``.
COEFFICIENTS = ("decode_launch", "decode_seq", "kv_token", "prefill_launch", "prefill_token")

#: Huber threshold in units of the running mean |relative residual| (≈ 1.6 σ for normal noise).
HUBER_K = 2.0
#: Starting value and floor of the robust scale (relative): a 10% spread until data say more;
#: the floor keeps noiseless data from turning every later record into an outlier.
SCALE_START = 0.1
SCALE_FLOOR = 0.01
#: Per-record update rate of the robust scale.
SCALE_RATE = 0.05
#: Relative errors are measured against the current prediction, floored at this fraction of
#: the prior's.
REFERENCE_FLOOR = 1e-3
#: Drift: the steps a change of the machine's speed is judged on, the median ratio of actual to
#: predicted past which it is one (a structural misfit of the five terms stays under it: the
#: mixed steps' error is 3-21 %), the share of those steps that must agree, how far from 1 the
#: median must be in its standard errors, and the range the scale is held in.
DRIFT_RECORDS = 16
DRIFT_FACTOR = 1.3
DRIFT_AGREE = 0.75
DRIFT_SIGMAS = 4.0  # and the median that many standard errors from 1 (sched_core.drift)
DRIFT_SETTLE = 1.02  # once re-anchoring, until the latest steps' median is this close to 1
#: Re-anchoring rescales the history but the latest this many steps, which may already have
#: run at the new speed (all of them, when the history is a worker's warm-up alone).
DRIFT_KEPT = 2 * DRIFT_RECORDS
SCALE_LIMITS = (1e-2, 1e2)

_N = len(COEFFICIENTS)
#: Upper-triangle index pairs of the 5×5 normal matrix, stored as a flat list of 15.
_PAIRS = tuple((i, j) for i in range(_N) for j in range(i, _N))


Features = tuple[float, float, float, float, float]


def step_features(prefill_tokens: float, decode_seqs: float, kv_tokens: float) -> Features:
    """The feature vector of one step, in ``COEFFICIENTS`` order."""
    return (
        1.0 if decode_seqs > 0 else 0.0,
        float(decode_seqs),
        float(kv_tokens),
        1.0 if prefill_tokens > 0 else 0.0,
        float(prefill_tokens),
    )


#: the fewest timed live steps ``fit_steps`` fits (a few runs' worth; fewer leave a term unidentified)
MIN_LIVE_STEPS = 200


def fit_steps(records: Sequence[tuple[int, int, int, float]]) -> dict[str, float] | None:
    """The five terms of ``COEFFICIENTS`` (and attention, left out: 0) fitted at once on a
    worker's step records ``(prefill tokens, decoding sequences, KV tokens, seconds)``, as
    ``observe_many`` takes them: ``common.stepmodel.nn_relative_fit`` on ``step_features``,
    every record alike. None under ``MIN_LIVE_STEPS`` timed records. Unlike ``StepModel``
    (forgetting, ridge toward its prior, re-anchored on drift: made to price the next steps), it
    weighs the whole window: in two ``bench.policies_live`` runs it simulated the runs within
    0.24 and 0.59 of live at worst, the scheduler's fit as each run ended within 0.75 and 1.45."""
    import numpy as np  # (here: the scheduler that imports this module needs no numpy)

    from common.stepmodel import nn_relative_fit

    timed = [r for r in records if r[3] > 0]
    if len(timed) < MIN_LIVE_STEPS:
        return None
    x = np.array([step_features(prefill, seqs, kv) for prefill, seqs, kv, _ in timed])
    coef, _spread = nn_relative_fit(x, np.array([r[3] for r in timed]))
    return {**dict(zip(COEFFICIENTS, (float(c) for c in coef), strict=True)), "prefill_attention": 0.0}


def typical_steps(prior: PathConfig) -> tuple[Features, Features]:
    """Features of the typical step of each forward on a full worker: ``max_batch`` sequences
    decoding with ``step_tokens`` of KV cache each, and a prefill chunk of ``step_tokens``."""
    seqs = prior.max_batch
    return step_features(0, seqs, seqs * prior.step_tokens), step_features(prior.step_tokens, 0, 0)


class StepModel:
    """The online fit of one path's step time. ``observations``: records fitted so far;
    ``scale``: how much slower than its prior the worker runs now (drift re-anchoring)."""

    __slots__ = ("_base", "_prior", "_attention", "_typical", "_weight", "_forgetting", "_a", "_b", "_robust",
                 "_theta", "_recent", "observations", "scale", "_trust")

    def __init__(self, prior: PathConfig, config: SchedulerConfig) -> None:
        self._weight = config.prior_weight
        self._forgetting = config.fit_forgetting
        self._a = [0.0] * len(_PAIRS)  # Σ w·x_i·x_j, upper triangle
        self._b = [0.0] * _N  # Σ w·x_i·y
        self._robust = SCALE_START
        # the latest records, for the drift check: features, a whole prompt's tokens (or 0), the
        # seconds it took, and as fitted: its weight, its linear part, its index among the records
        self._recent: deque[tuple[Features, float, float, float, float, int]] = deque(maxlen=DRIFT_KEPT)
        self.observations = 0
        self._set_prior(prior, 1.0)
        self._theta = self._prior

    def _set_prior(self, prior: PathConfig, trust: float) -> None:
        self._base = (prior.decode_launch, prior.decode_seq, prior.kv_token, prior.prefill_launch,
                      prior.prefill_token, prior.prefill_attention)
        self._trust = trust
        self.scale = 1.0
        self._prior = self._base[:5]
        self._attention = prior.prefill_attention
        self._typical = typical_steps(prior)

    def reprior(self, prior: PathConfig, trust: float = 1.0) -> None:
        """Pull the fit toward a new prior (a worker measured itself at start): the step
        records fitted so far stay, the penalty now centres on ``prior``, held as firmly as
        ``trust`` (0-1] of the usual ``prior_weight`` (a profile measured while its worker was
        starved of CPU is held loosely); the latest records re-anchor it if they disagree."""
        if not 0.0 < trust <= 1.0:
            raise ValueError(f"trust must lie in (0, 1], got {trust}")
        self._set_prior(prior, trust)
        self._theta = self._solve() if self.observations else self._prior
        self._drift(self._prior)

    def coefficients(self) -> Features:
        """The current coefficients, in ``COEFFICIENTS`` order (seconds per unit)."""
        return self._theta

    @property
    def attention(self) -> float:
        """Attention's quadratic share of one prompt's prefill (s per squared token), at the
        worker's current speed."""
        return self._attention

    def predict(self, prefill_tokens: float, decode_seqs: float, kv_tokens: float) -> float:
        """Predicted seconds of one step (a chunk's attention aside)."""
        return _dot(self._theta, step_features(prefill_tokens, decode_seqs, kv_tokens))

    def _reference(self, x: Features) -> float:
        """The step time that relative errors at ``x`` are measured against: the current
        prediction, but never below 1e-3 of the prior's (a coefficient clamped at zero must
        not give a record infinite weight). Zero only for an empty step."""
        return max(_dot(self._theta, x), REFERENCE_FLOOR * _dot(self._prior, x))

    def observe(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int, seconds: float) -> None:
        """Fit one step record and refit."""
        self.observe_many(((prefill_tokens, decode_seqs, kv_tokens, seconds),))

    def observe_many(self, records: Iterable[tuple[int, int, int, float]]) -> None:
        """Fit several step records ``(prefill_tokens, decode_seqs, kv_tokens, seconds)``,
        oldest first, with one refit at the end, then re-anchor the model if the latest
        records say the worker's speed moved. An empty step (no prefill, no decode) carries
        no information and is skipped; negative counts or times, and KV tokens without a
        decoding sequence, raise ValueError.

        A step that only prefilled is taken for one whole prompt: its attention share
        (``attention·tokens²``, never more than half the step) is left out of what the five
        linear terms are fitted to. A chunk beside decoding sequences keeps its share (its
        prompt's length is not in the record; the share is small)."""
        lam = self._forgetting
        rows: list[tuple[Features, float, float]] = []
        for prefill_tokens, decode_seqs, kv_tokens, seconds in records:
            if (min(prefill_tokens, decode_seqs, kv_tokens) < 0 or (kv_tokens and not decode_seqs)
                    or not 0.0 <= seconds < math.inf):
                raise ValueError(f"bad step record {(prefill_tokens, decode_seqs, kv_tokens, seconds)}")
            x = step_features(prefill_tokens, decode_seqs, kv_tokens)
            ref = self._reference(x)
            if ref <= 0.0:
                continue  # an empty step
            whole = float(prefill_tokens) if not decode_seqs else 0.0
            linear = max(0.5 * seconds, seconds - self._attention * whole * whole) if whole else seconds
            r = abs(linear - _dot(self._theta, x)) / ref
            cut = HUBER_K * self._robust
            huber = cut / r if r > cut else 1.0
            self._robust = max(SCALE_FLOOR, self._robust + SCALE_RATE * (min(r, cut) - self._robust))
            w = huber / (ref * ref)
            self._recent.append((x, whole, seconds, w, linear, self.observations + len(rows)))
            rows.append((x, w, linear))
        if not rows:
            return
        # Decay once for the whole batch: record i of n carries lam**(n-1-i).
        decay = lam ** len(rows)
        a = [v * decay for v in self._a]
        b = [v * decay for v in self._b]
        age = 1.0
        for x, w, y in reversed(rows):
            _accumulate(a, b, x, w * age, y)
            age *= lam
        self._a, self._b = a, b
        self.observations += len(rows)
        self._theta = self._solve()
        self._drift()

    def _drift(self, judge: Features | None = None) -> None:
        """Re-anchor the whole model when the latest ``DRIFT_RECORDS`` steps agree that the
        worker runs at another speed than predicted (see the module's docstring): the prior
        and the history are scaled by their median ratio ``m``, except the latest steps that
        already ran at the new speed (of the last ``DRIFT_KEPT``, those whose ratio is nearer
        ``m`` than 1), which stay as they ran. The fit had partly followed them, so the ratio
        is taken again on the refit, until their median is within ``DRIFT_SETTLE`` of 1 (a
        few rounds at most). ``judge``: the coefficients the steps are judged against first
        (a new prior: does it describe the machine as it runs now?), else the fit's."""
        theta = judge or self._theta
        m = self._drift_ratio(DRIFT_FACTOR, DRIFT_AGREE, theta)
        if m is None:
            return
        mine = []  # nearer m than 1 (in ratio, on a log scale): past its square root
        midway = math.sqrt(m)
        for x, whole, seconds, w, y, at in self._recent:
            predicted = _dot(theta, x) + self._attention * whole * whole
            if predicted > 0.0 and (seconds > midway * predicted if m > 1.0 else seconds < midway * predicted):
                mine.append((x, w * self._forgetting ** (self.observations - 1 - at), y))
        lo, hi = SCALE_LIMITS
        for _ in range(4):
            m = min(max(self.scale * m, lo), hi) / self.scale
            if m == 1.0:
                return
            a, b = self._a[:], self._b[:]
            for x, w, y in mine:
                _accumulate(a, b, x, -w, y)
            a = [v / (m * m) for v in a]
            b = [v / m for v in b]
            for x, w, y in mine:
                _accumulate(a, b, x, w, y)
            self._a, self._b = a, b
            self.scale *= m
            self._prior = tuple(p * self.scale for p in self._base[:5])  # type: ignore[assignment]
            self._attention = self._base[5] * self.scale
            self._theta = self._solve()
            settle = self._drift_ratio(DRIFT_SETTLE, 0.0, self._theta)
            if settle is None:
                return
            m = settle

    def _drift_ratio(self, band: float, agree: float, theta: Features) -> float | None:
        """The median ratio of actual to predicted time (by ``theta``) of the latest steps
        where it lies outside ``[1/band, band]`` (and, with ``agree`` > 0, as many standard
        errors from 1 as ``DRIFT_SIGMAS``, with a share ``agree`` of them on its side: a noisy
        worker is not re-anchored on noise); None if not, or if too few took measurable time."""
        if len(self._recent) < DRIFT_RECORDS:
            return None
        ratios = []
        for x, whole, seconds, _, _, _ in list(self._recent)[-DRIFT_RECORDS:]:
            # a step the model or the worker takes next to no time for says nothing of speed
            floor = REFERENCE_FLOOR * _dot(self._prior, x)
            predicted = _dot(theta, x) + self._attention * whole * whole
            if predicted > floor and seconds > floor:
                ratios.append(seconds / predicted)
        if len(ratios) < DRIFT_RECORDS:
            return None
        ratios.sort()
        m = median_of(ratios)
        if 1.0 / band <= m <= band:
            return None
        if agree <= 0.0:
            return m
        side = sum(r > 1.0 for r in ratios) if m > 1.0 else sum(r < 1.0 for r in ratios)
        return m if side >= agree * len(ratios) and shifted(ratios, m, 0.0, band, DRIFT_SIGMAS) else None

    def _solve(self) -> Features:
        """Minimize Σ w(y − x·θ)² + Σ λ_j(θ_j − prior_j)² over θ ≥ 0.

        ``λ_j = prior_weight·Σ_typical (x_j/ŷ)²``, ŷ the reference time of each typical step
        (the larger of the current fit's and the prior's prediction): the prior counts as
        ``prior_weight`` typical steps of each forward,
        in the same relative-error units as the data (a fixed absolute penalty would count for
        more and more observations as the worker turned out slower than its prior).
        In scaled variables u_j = θ_j/s_j (s_j = 1/√λ_j) the problem is min ½uᵀQu − cᵀu with
        Q = S·A·S + I and c = S·b + prior/s, over u ≥ 0: a strictly convex quadratic with a
        well-conditioned matrix whatever the coefficients' magnitudes, solved by a primal
        active-set method started from the previous solution."""
        penalty = [0.0] * _N
        for x in self._typical:
            # against the current fit where it predicts more than the prior, else the prior's:
            # a forward the fit drove to ~0 must not make the prior's pull (and the next
            # solve) jump, or successive solves oscillate between two fits
            ref = max(_dot(self._theta, x), _dot(self._prior, x))
            for j, v in enumerate(x):
                penalty[j] += self._trust * self._weight * (v / ref) ** 2
        s = [1.0 / math.sqrt(p) for p in penalty]
        q = [[0.0] * _N for _ in range(_N)]
        for k, (i, j) in enumerate(_PAIRS):
            q[i][j] = q[j][i] = self._a[k] * s[i] * s[j]
        for i in range(_N):
            q[i][i] += 1.0
        c = [self._b[i] * s[i] + self._prior[i] / s[i] for i in range(_N)]
        u = [t / si for t, si in zip(self._theta, s, strict=True)]
        free = [i for i in range(_N) if u[i] > 0.0]
        for _ in range(4 * _N):  # each pass frees or fixes a variable; this bound is never reached
            z = _solve_subset(q, c, free)
            blocked = [i for i in free if z[i] < 0.0]
            if not blocked:
                u = z
                # Optimal unless freeing a variable held at zero lowers the objective.
                grad = [sum(q[i][j] * u[j] for j in free) - c[i] for i in range(_N)]
                held = [i for i in range(_N) if i not in free and grad[i] < -1e-12 * (1.0 + abs(c[i]))]
                if not held:
                    break
                free = sorted([*free, min(held, key=lambda i: grad[i])])
                continue
            # Step from the feasible u toward z until the first free variable reaches zero,
            # then hold that one at zero.
            ratio = {i: u[i] / (u[i] - z[i]) if u[i] > z[i] else 0.0 for i in blocked}
            hit = min(blocked, key=lambda i: ratio[i])
            u = [ui + ratio[hit] * (zi - ui) for ui, zi in zip(u, z, strict=True)]
            free = [i for i in free if i != hit and u[i] > 0.0]
            u = [u[i] if i in free else 0.0 for i in range(_N)]
        t = [max(0.0, ui * si) for ui, si in zip(u, s, strict=True)]
        return t[0], t[1], t[2], t[3], t[4]


def _accumulate(a: list[float], b: list[float], x: Features, w: float, y: float) -> None:
    """Add one record ``x → y`` of weight ``w`` to the normal equations (a negative weight
    takes it out)."""
    for k, (i, j) in enumerate(_PAIRS):
        if x[i] and x[j]:
            a[k] += w * x[i] * x[j]
    for i in range(_N):
        if x[i]:
            b[i] += w * x[i] * y


def _dot(theta: Features, x: Features) -> float:
    return theta[0] * x[0] + theta[1] * x[1] + theta[2] * x[2] + theta[3] * x[3] + theta[4] * x[4]


def _solve_subset(q: list[list[float]], c: list[float], free: list[int]) -> list[float]:
    """Solve ``Q[F,F]·z[F] = c[F]``, zeros elsewhere (Gaussian elimination; Q[F,F] is
    symmetric positive definite, so no pivoting is needed)."""
    n = len(free)
    m = [[q[i][j] for j in free] + [c[i]] for i in free]
    for col in range(n):
        pivot = m[col][col]
        for row in range(col + 1, n):
            f = m[row][col] / pivot
            if f:
                r, p = m[row], m[col]
                for k in range(col, n + 1):
                    r[k] -= f * p[k]
    sol = [0.0] * n
    for row in range(n - 1, -1, -1):
        acc = m[row][n] - sum(m[row][k] * sol[k] for k in range(row + 1, n))
        sol[row] = acc / m[row][row]
    z = [0.0] * _N
    for i, v in zip(free, sol, strict=True):
        z[i] = v
    return z
