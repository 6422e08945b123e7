"""The test both online models run to tell a machine that changed from one that is noisy:
the step-time fit (``costmodel``) on its latest steps, the contracts' calibration
(``contracts``) on its latest outcomes. Pure arithmetic on ratios of actual to predicted.

A level moved when the median ratio of the latest ``n`` is at least a given factor from 1 and
``sigmas`` standard errors of a median away from it, σ (on a log scale) the larger of the
spread the caller knows (its window's) and the latest ratios' own: the median of ``n`` draws
has a standard error of about 1.2533·σ/√n, so a noisy stream needs a larger move, and a
stream whose noise only grew (its ratios scatter on both sides) is not taken for a move.
"""

from __future__ import annotations

import math

#: The width of the 10th-90th percentile range of a normal distribution, in standard deviations.
Z_SPAN = 2.5631
MEDIAN_SE = 1.2533  # the standard error of a median, in σ/√n
MAD_SIGMA = 1.4826  # a median absolute deviation of one is this many σ


def median_of(xs: list[float]) -> float:
    """The median of sorted ``xs`` (not empty)."""
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def log_spread(xs: list[float]) -> float:
    """σ of positive sorted ``xs`` on a log scale, from their median absolute deviation (0 for
    fewer than two)."""
    if len(xs) < 2:
        return 0.0
    centre = math.log(median_of(xs))
    return MAD_SIGMA * median_of(sorted(abs(math.log(x) - centre) for x in xs))


def shifted(ratios: list[float], m: float, spread: float, least: float, sigmas: float) -> bool:
    """Whether positive sorted ``ratios`` with median ``m`` say their level moved from 1 (see
    the module's docstring); ``spread``: the log-scale σ the caller knows."""
    need = max(math.log(least), sigmas * MEDIAN_SE * max(spread, log_spread(ratios)) / math.sqrt(len(ratios)))
    return abs(math.log(m)) >= need
