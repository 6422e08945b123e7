"""The ratio windows a calibration keeps (``sched_core.contracts``): the last outcomes of one
component, path, load level and bucket, as ratios of actual to the raw model's prediction,
with the statistics the promises read off them (a 1/x-weighted median, conformal quantiles)."""

from __future__ import annotations

import math

from sched_core.drift import median_of

POINT_WINDOW = 64  # the median is of a window's latest outcomes: the bias drifts with the load
REFRESH = 8  # a window's factors are recomputed after this many new outcomes (and while small)
MIN_CONFORMAL = 99  # outcomes a window needs before it bounds at a level past its resolution
STRETCH = 40.0  # past level 1, the largest ratio is stretched by exp(STRETCH·(level − 1))


class Window:
    """The last ``size`` ratios, sorted on demand (cached while fewer than ``REFRESH`` new)."""

    __slots__ = ("size", "values", "at", "stale", "point", "centre", "sorted", "restored")

    def __init__(self, size: int, values: list[float] | None = None) -> None:
        self.size = size
        self.values: list[float] = list(values or [])[-size:]
        self.restored = 0  # the oldest values came from a saved state (``Contracts.load``), this many
        self.at = 0  # the oldest (values are oldest first); appends until full leave it there
        self.stale = len(self.values)
        self.point = 1.0
        self.centre = 1.0
        self.sorted: list[float] = []

    def add(self, x: float) -> None:
        if len(self.values) < self.size:
            self.values.append(x)
        else:
            self.values[self.at] = x
            self.at = (self.at + 1) % self.size
            self.restored = max(0, self.restored - 1)
        self.stale += 1

    def forget_restored(self) -> None:
        """Drop the values a saved state brought (their time is over: the path has its own)."""
        if self.restored:
            self.values = self.ordered()[self.restored:]
            self.at = self.restored = 0
            self.stale = max(self.stale, REFRESH)

    def __len__(self) -> int:
        return len(self.values)

    def _refresh(self) -> None:
        if self.stale and (self.stale >= REFRESH or len(self.values) < 8 * REFRESH):
            self.sorted = sorted(self.values)
            recent = sorted(self.ordered()[-POINT_WINDOW:])
            self.point = weighted_median(recent)
            self.centre = median_of(recent)
            self.stale = 0

    def median(self) -> float:
        """The 1/x-weighted median: the factor that minimises the mean absolute percentage error."""
        self._refresh()
        return self.point

    def middle(self) -> float:
        """The plain median of the same outcomes: half of them took longer (drift's yardstick;
        the weighted one sits lower the more they scatter)."""
        self._refresh()
        return self.centre

    def quantile(self, q: float) -> float:
        """The split-conformal q quantile, the ⌈(n+1)·q⌉-th smallest; inf while the window is
        too small for one. Past q = 1 (adaptive conformal inference asks for more than the
        window can give), the largest ratio, stretched by how far past."""
        self._refresh()
        xs = self.sorted
        n = len(xs)
        if q >= 1.0:
            return xs[-1] * stretch(q) if n >= MIN_CONFORMAL else math.inf
        k = math.ceil((n + 1) * q)
        if k > n:  # past the window's resolution: its largest ratio, as at q = 1, once it has enough
            return xs[-1] if n >= MIN_CONFORMAL else math.inf
        return xs[k - 1]

    def ordered(self) -> list[float]:
        """Oldest first (for persisting)."""
        return self.values[self.at:] + self.values[: self.at]

    def rescale(self, factor: float, keep: list[bool]) -> None:
        """Multiply every value by ``factor`` (re-anchoring) but those of the newest
        ``len(keep)`` (oldest first) that ``keep`` marks."""
        order = [(self.at + i) % len(self.values) for i in range(len(self.values))]  # oldest first
        kept = {order[len(order) - len(keep) + i] for i, k in enumerate(keep) if k and len(keep) <= len(order)}
        self.values = [v if i in kept else v * factor for i, v in enumerate(self.values)]
        self.stale = max(self.stale, REFRESH)


def stretch(q: float) -> float:
    """How far a bound set at level ``q`` reaches past the largest ratio it rests on (1 up to q = 1)."""
    return math.exp(STRETCH * max(q - 1.0, 0.0))


def weighted_median(xs: list[float]) -> float:
    """The median of sorted positive ``xs`` weighted 1/x: the c minimising Σ|c − x|/x."""
    half = sum(1.0 / x for x in xs) / 2.0
    acc = 0.0
    for x in xs:
        acc += 1.0 / x
        if acc >= half:
            return x
    return xs[-1]
