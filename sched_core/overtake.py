"""The prompts that will overtake a request while it waits (docs/scheduling.md §14).

The core prices a request's first token from the queue it finds: the prompts ahead of it now.
Shortest prompt first, the prompts of shorter buckets that arrive while it waits go before it
too. In a burst they are most of its wait: in the simulator a fresh scheduler's first second of
``agent`` at 12× missed 20 of its 87 first-token bounds (docs/benchmarks.md, "The first burst's
bounds"). Cobham's formula for a non-preemptive priority queue prices them: a request of
class k waits ``W = W₀ / ((1 − σ_{k−1})(1 − σ_k))``, σ_j the load of classes 1…j; the factor
``1 / (1 − σ_{k−1})`` is the work of the higher classes that arrives during the wait. Here
σ_{k−1} is the prefill load the path's admitted arrivals of shorter buckets bring: the
exponentially decayed sum of their prompts' prefill times on an idle worker, over the decay's
time constant and the path's workers. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math

#: The decay's time constant, in seconds: long enough that a few arrivals close together at a
#: calm rate do not read as a burst, short enough to see one within its first second.
OVERTAKE_TAU_S = 1.0
#: The most of a path's prefill the shorter buckets are taken to hold (a wait priced at most
#: 1 ÷ (1 − this) times the core's): past it the queue does not settle, and the calibration's
#: windows, not this factor, must say how long the wait grows.
OVERTAKE_MAX = 0.9


class Overtaking:
    """Per path and bucket, the decayed prefill seconds of the requests admitted there."""

    def __init__(self, tau_s: float = OVERTAKE_TAU_S) -> None:
        if not tau_s > 0.0:
            raise ValueError("the time constant must be positive")
        self.tau_s = tau_s
        self._sum: dict[tuple[str, int], tuple[float, float]] = {}  # (path, bucket) -> (decayed sum, as of when)

    def admitted(self, path: str, bucket: int, prefill_s: float, now: float) -> None:
        """A request whose prompt takes ``prefill_s`` alone was admitted to ``path`` in ``bucket``."""
        self._sum[(path, bucket)] = (self._decayed(path, bucket, now) + max(prefill_s, 0.0), now)

    def load(self, path: str, bucket: int, workers: int, now: float) -> float:
        """σ: the share of ``path``'s ``workers`` that the recent arrivals of buckets shorter
        than ``bucket`` keep prefilling, at most ``OVERTAKE_MAX``."""
        work = sum(self._decayed(path, k, now) for k in range(bucket))
        return min(work / (self.tau_s * max(workers, 1)), OVERTAKE_MAX)

    def factor(self, path: str, bucket: int, workers: int, now: float) -> float:
        """What the wait before a request's first token is multiplied by: 1 ÷ (1 − σ)."""
        return 1.0 / (1.0 - self.load(path, bucket, workers, now))

    def _decayed(self, path: str, bucket: int, now: float) -> float:
        total, at = self._sum.get((path, bucket), (0.0, now))
        return total * math.exp(-max(now - at, 0.0) / self.tau_s)
