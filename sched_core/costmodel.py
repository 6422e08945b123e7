"""The step-time model of a continuously batching worker, fitted online from its step records.

Both scheduler implementations use this code: refits happen per batch of step records, off the
per-request hot path, so one pure-Python implementation keeps the two builds in lockstep.

A worker step runs up to two forwards, a decode forward of the running sequences and a prefill
forward of at most ``step_tokens`` pending prompt tokens (chunked prefill), so its time is
linear in five features (seconds)::

    step_s = decode_launch·[decode_seqs > 0] + decode_seq·decode_seqs + kv_token·kv_tokens
             + prefill_launch·[prefill_tokens > 0] + prefill_token·prefill_tokens

``kv_tokens`` counts the KV-cache tokens held by the decoding sequences (attention reads them).

The fit (see docs/step-model.md for the derivation):

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

Cost: ``observe_many`` of 64 records with its refit takes about 0.2 ms in CPython 3.11 on a
shared 2-core VM (``test_costmodel.py::test_a_refit_of_64_records_is_cheap`` bounds it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

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


def typical_steps(prior: PathConfig) -> tuple[Features, Features]:
    """Features of the typical step of each forward on a full worker: ``max_batch`` sequences
    decoding with ``step_tokens`` of KV cache each, and a prefill chunk of ``step_tokens``."""
    seqs = prior.max_batch
    return step_features(0, seqs, seqs * prior.step_tokens), step_features(prior.step_tokens, 0, 0)


class StepModel:
    """The online fit of one path's step time. ``observations``: records fitted so far."""

    __slots__ = ("_prior", "_typical", "_weight", "_forgetting", "_a", "_b", "_robust", "_theta",
                 "observations")

    def __init__(self, prior: PathConfig, config: SchedulerConfig) -> None:
        self._prior = (prior.decode_launch, prior.decode_seq, prior.kv_token,
                       prior.prefill_launch, prior.prefill_token)
        self._typical = typical_steps(prior)
        self._weight = config.prior_weight
        self._forgetting = config.fit_forgetting
        self._a = [0.0] * len(_PAIRS)  # Σ w·x_i·x_j, upper triangle
        self._b = [0.0] * _N  # Σ w·x_i·y
        self._robust = SCALE_START
        self._theta = self._prior
        self.observations = 0

    def reprior(self, prior: PathConfig) -> None:
        """Pull the fit toward a new prior (a worker measured itself at start): the step
        records fitted so far stay, the penalty now centres on ``prior``."""
        self._prior = (prior.decode_launch, prior.decode_seq, prior.kv_token,
                       prior.prefill_launch, prior.prefill_token)
        self._typical = typical_steps(prior)
        self._theta = self._solve() if self.observations else self._prior

    def coefficients(self) -> Features:
        """The current coefficients, in ``COEFFICIENTS`` order (seconds per unit)."""
        return self._theta

    def predict(self, prefill_tokens: float, decode_seqs: float, kv_tokens: float) -> float:
        """Predicted seconds of one step."""
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
        oldest first, with one refit at the end. An empty step (no prefill, no decode) carries
        no information and is skipped; negative counts or times, and KV tokens without a
        decoding sequence, raise ValueError."""
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
            r = abs(seconds - _dot(self._theta, x)) / ref
            cut = HUBER_K * self._robust
            huber = cut / r if r > cut else 1.0
            self._robust = max(SCALE_FLOOR, self._robust + SCALE_RATE * (min(r, cut) - self._robust))
            rows.append((x, huber / (ref * ref), seconds))
        if not rows:
            return
        # Decay once for the whole batch: record i of n carries lam**(n-1-i).
        decay = lam ** len(rows)
        a = [v * decay for v in self._a]
        b = [v * decay for v in self._b]
        age = 1.0
        for x, w, y in reversed(rows):
            w *= age
            age *= lam
            for k, (i, j) in enumerate(_PAIRS):
                if x[i] and x[j]:
                    a[k] += w * x[i] * x[j]
            for i in range(_N):
                if x[i]:
                    b[i] += w * x[i] * y
        self._a, self._b = a, b
        self.observations += len(rows)
        self._theta = self._solve()

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
                penalty[j] += self._weight * (v / ref) ** 2
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
