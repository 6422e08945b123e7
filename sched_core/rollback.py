"""After a policy table is swapped in, does the live service hold up? (issue 41,
docs/scheduling.md §16.2)

The gateway feeds the outcome of every promised request: whether it met the SLO (its first
token within the TTFT SLO, each later token within the TPOT SLO) and whether it ended inside
its contract's p99 bounds. The last ``BASELINE`` outcomes are the baseline; a swap freezes it,
and once ``AFTER`` outcomes have come in under the new table each share is compared with the
baseline's by a one-sided two-proportion z-test. A drop of more than ``Z`` standard errors in
either (SLO attainment or contract accuracy) rolls the swap back; otherwise the swap is
settled and the outcomes under it become the next baseline. A change of load in the same
minutes moves the shares too: the test cannot tell it from the table's doing, and errs on the
side of the table that served before. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

#: Outcomes the baseline holds (the most recent before a swap).
BASELINE = 400
#: Outcomes under a new table before it is judged.
AFTER = 200
#: One-sided 1 %: a table that serves as well as the one before is rolled back about once in a
#: hundred swaps.
Z = 2.33


@dataclass(frozen=True, slots=True)
class Shares:
    n: int
    met: int  # met the SLO
    inside: int  # ended inside both p99 bounds

    @property
    def attainment(self) -> float:
        return self.met / self.n if self.n else math.nan

    @property
    def accuracy(self) -> float:
        return self.inside / self.n if self.n else math.nan

    def to_json(self) -> dict[str, float | int]:
        return {"requests": self.n, "slo_attainment": self.attainment, "inside_bounds": self.accuracy}


def drop_z(before_hits: int, before_n: int, after_hits: int, after_n: int) -> float:
    """The after share's change against the before share's, in standard errors of their
    difference (pooled): negative where it fell. 0 where neither varies."""
    pooled = (before_hits + after_hits) / (before_n + after_n)
    se = math.sqrt(pooled * (1.0 - pooled) * (1.0 / before_n + 1.0 / after_n))
    diff = after_hits / after_n - before_hits / before_n
    return diff / se if se > 0.0 else 0.0


@dataclass(frozen=True, slots=True)
class Judgement:
    rollback: bool
    why: str
    before: Shares
    after: Shares


class SwapWatch:
    """The outcomes before and after the last swap, and the judgement of it."""

    def __init__(self, baseline: int = BASELINE, after: int = AFTER, z: float = Z) -> None:
        self.after_n = after
        self.z = z
        self._recent: deque[tuple[bool, bool]] = deque(maxlen=baseline)
        self._before: Shares | None = None  # frozen at a swap; None: no swap being watched
        self._after: list[tuple[bool, bool]] = []

    @property
    def watching(self) -> bool:
        return self._before is not None

    def swapped(self) -> None:
        """A table was swapped in: the outcomes so far are the baseline it is judged against."""
        self._before = _shares(self._recent)
        self._after = []

    def cancel(self) -> None:
        """The swap is undone by other means (another table swapped in, this scheduler stepped
        down): nothing to judge."""
        self._before = None
        self._after = []

    def observe(self, met: bool, inside: bool) -> Judgement | None:
        """One promised request's outcome; the judgement of the swap once enough are in."""
        self._recent.append((met, inside))
        if self._before is None:
            return None
        self._after.append((met, inside))
        if len(self._after) < self.after_n:
            return None
        before, after = self._before, _shares(self._after)
        self._before = None
        self._after = []
        if before.n < self.after_n:
            return Judgement(False, f"kept: only {before.n} outcomes before the swap to compare with", before, after)
        z_met = drop_z(before.met, before.n, after.met, after.n)
        z_inside = drop_z(before.inside, before.n, after.inside, after.n)
        figures = (f"SLO attainment {before.attainment:.1%} -> {after.attainment:.1%} (z {z_met:+.2f}), "
                   f"inside the p99 bounds {before.accuracy:.1%} -> {after.accuracy:.1%} (z {z_inside:+.2f})")
        if min(z_met, z_inside) < -self.z:
            return Judgement(True, f"rolled back: {figures} over {after.n} requests", before, after)
        return Judgement(False, f"kept: {figures} over {after.n} requests", before, after)

    def state(self) -> dict[str, object]:
        """For ``/admin/scheduler``: whether a swap is being watched and how far."""
        return {"watching": self.watching, "outcomes_after_swap": len(self._after), "needed": self.after_n,
                "baseline": self._before.to_json() if self._before is not None else None}


def _shares(outcomes: deque[tuple[bool, bool]] | list[tuple[bool, bool]]) -> Shares:
    return Shares(len(outcomes), sum(m for m, _ in outcomes), sum(i for _, i in outcomes))
