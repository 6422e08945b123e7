"""Per-path cost models, fitted online from the timings workers report.

Both scheduler implementations use these classes: a refit happens once per completed batch,
far off the per-request hot path, so one shared implementation keeps the two in lockstep.

Model of one path (seconds):
    prefill of B sequences padded to L tokens   T(B, L) = a + b·B·L
    one decode step with B running sequences    D(B)    = c + d·B
A batch whose sequences produce n_1..n_B tokens (each leaving when done) decodes for
max(n_i) steps with sum(n_i) sequence-steps in all, so its decode time is
c·max(n_i) + d·sum(n_i).
"""

from __future__ import annotations

from sched_core.types import BatchTimings, PathConfig, SchedulerConfig


class LinearFit2:
    """Weighted least squares for ``y ≈ θ1·x1 + θ2·x2`` with ``θ1, θ2 ≥ 0``.

    Observations decay by ``forgetting`` each time a new one arrives (an exponentially
    weighted fit that follows workers whose speed drifts). The prior enters as fixed
    pseudo-observations at the ``design`` points, of total weight ``weight``: it dominates
    until real timings outweigh it and keeps the normal equations regular when every real
    batch had the same shape. Where no batch came near a design point (say no large batch
    ran yet), the prior keeps its say there: the fit does not extrapolate a slope from
    small batches alone.
    """

    __slots__ = ("_prior", "_data", "_forgetting", "theta", "observations")

    def __init__(
        self,
        theta: tuple[float, float],
        design: tuple[tuple[float, float], ...],
        weight: float,
        forgetting: float,
    ) -> None:
        self._prior = [0.0] * 5  # S11, S12, S22, S1y, S2y
        self._data = [0.0] * 5
        self._forgetting = forgetting
        each = weight / len(design)
        for x1, x2 in design:
            self._accumulate(self._prior, each, x1, x2, theta[0] * x1 + theta[1] * x2)
        self.theta = self._solve()
        self.observations = 0

    @staticmethod
    def _accumulate(s: list[float], w: float, x1: float, x2: float, y: float) -> None:
        s[0] += w * x1 * x1
        s[1] += w * x1 * x2
        s[2] += w * x2 * x2
        s[3] += w * x1 * y
        s[4] += w * x2 * y

    def add(self, x1: float, x2: float, y: float) -> None:
        """Add one observation and refit."""
        self._data = [v * self._forgetting for v in self._data]
        self._accumulate(self._data, 1.0, x1, x2, y)
        self.observations += 1
        self.theta = self._solve()

    def _solve(self) -> tuple[float, float]:
        s11, s12, s22, s1y, s2y = (p + d for p, d in zip(self._prior, self._data, strict=True))
        det = s11 * s22 - s12 * s12
        t1 = (s1y * s22 - s12 * s2y) / det
        t2 = (s11 * s2y - s12 * s1y) / det
        # Non-negative least squares in two dimensions: when the free optimum has a
        # negative coefficient, the constrained optimum lies on the other axis.
        if t1 < 0.0:
            return 0.0, max(0.0, s2y / s22)
        if t2 < 0.0:
            return max(0.0, s1y / s11), 0.0
        return t1, t2


class PathModel:
    """The prefill and decode fits of one path."""

    __slots__ = ("prefill", "decode")

    def __init__(self, prior: PathConfig, config: SchedulerConfig) -> None:
        # Prior pseudo-observations at an empty and at a full batch of the longest bucket.
        full_prefill = float(prior.max_batch * config.bucket_bounds[-1])
        self.prefill = LinearFit2(
            (prior.prefill_a, prior.prefill_b),
            ((1.0, 0.0), (1.0, full_prefill)),
            config.prior_weight,
            config.fit_forgetting,
        )
        self.decode = LinearFit2(
            (prior.decode_c, prior.decode_d),
            ((1.0, 0.0), (1.0, float(prior.max_batch))),
            config.prior_weight,
            config.fit_forgetting,
        )

    def observe(self, timings: BatchTimings) -> None:
        """Refit from one finished batch; zero-sized parts are skipped."""
        if timings.batch_size > 0:
            tokens = float(timings.batch_size * timings.prompt_tokens)
            self.prefill.add(1.0, tokens, timings.prefill_s)
        if timings.decode_steps > 0:
            if timings.mean_running > 0.0:
                running = timings.mean_running * timings.decode_steps
            else:
                running = float(sum(timings.output_tokens))
            self.decode.add(float(timings.decode_steps), running, timings.decode_s)

    def coefficients(self) -> tuple[float, float, float, float]:
        """(a, b, c, d) of the current fit."""
        return self.prefill.theta + self.decode.theta
