"""Who is over its fair share: each tenant's admitted work rate against its budget's share
(``Shares``, what SLO shedding asks), and the work each tenant holds now, queued and running
(``Backlogs``, what the wait bound asks). Both are the driver's (``sched_core.driver``)."""

from __future__ import annotations

import math

from sched_core.reference import RateMeter


class Shares:
    """Each tenant's admitted work (prompt + expected output tokens per second, decayed with
    time constant ``tau``) against its budget's share of all tenants' admitted work: who is
    over its share. The weights of the tenants seen lately are summed at most once a second."""

    def __init__(self, tau: float = 10.0) -> None:
        self.tau = tau
        self._meters: dict[str, tuple[RateMeter, float]] = {}
        self._total = RateMeter(tau)
        self._weights = 0.0
        self._summed = -math.inf

    def add(self, tenant: str, weight: float, tokens: float, now: float) -> None:
        entry = self._meters.get(tenant)
        if entry is None or entry[1] != weight:
            meter = entry[0] if entry is not None else RateMeter(self.tau)
            self._weights += weight - (entry[1] if entry is not None else 0.0)  # counted at once, not at the next sum
            entry = self._meters[tenant] = (meter, weight)
        entry[0].add(now, tokens)
        self._total.add(now, tokens)

    def use(self, tenant: str, now: float) -> float:
        """How much of its fair share of all admitted work ``tenant`` uses (1: all of it, more:
        over it; 0: none admitted lately)."""
        entry = self._meters.get(tenant)
        if entry is None:
            return 0.0
        total = self._total.rate(now)
        if now - self._summed >= 1.0:
            floor = 1e-3 * total
            self._meters = {t: e for t, e in self._meters.items() if e[0].rate(now) > floor or t == tenant}
            self._weights = sum(w for _, w in self._meters.values())
            self._summed = now
        rate, fair = entry[0].rate(now), total * entry[1] / max(self._weights, entry[1])
        return rate / fair if fair > 0.0 else (math.inf if rate > 0.0 else 0.0)

    def over(self, tenant: str, now: float) -> bool:
        return self.use(tenant, now) > 1.0


class Backlogs:
    """The work each tenant has outstanding now: the prompt and expected output tokens of its
    requests admitted and not yet dispatched (queued), and of those dispatched and not yet
    finished (running). Its share of all of it, against its weight's share among the tenants
    with work outstanding, says whether it is under its fair share now, with no rate window:
    a flood whose requests are refused still holds the workers, and a quiet tenant's few
    requests are few whatever the rates."""

    def __init__(self) -> None:
        self._queued: dict[str, tuple[str, int, int]] = {}
        self._running: dict[str, tuple[str, int]] = {}
        self._work: dict[str, tuple[int, int]] = {}  # tenant -> queued prompt and output tokens
        self._held: dict[str, list[float]] = {}  # tenant -> [outstanding tokens, weight]
        self._total = 0
        self._weights = 0.0  # of the tenants holding work

    def add(self, request_id: str, tenant: str, weight: float, prompt: int, output: int) -> None:
        self._queued[request_id] = (tenant, prompt, output)
        had = self._work.get(tenant, (0, 0))
        self._work[tenant] = (had[0] + prompt, had[1] + output)
        self._hold(tenant, prompt + output, weight)

    def _hold(self, tenant: str, tokens: int, weight: float = 0.0) -> None:
        held = self._held.get(tenant)
        if held is None:
            held = self._held[tenant] = [0.0, 0.0]
        held[0] += tokens
        if weight and weight != held[1]:
            self._weights += weight - held[1]
            held[1] = weight
        if held[0] <= 0:
            self._weights -= held[1]
            del self._held[tenant]
        self._total += tokens

    def remove(self, request_id: str, running: bool = False) -> None:
        """It left the queue: dispatched (``running``), cancelled or refused."""
        entry = self._queued.pop(request_id, None)
        if entry is None:
            return
        tenant, prompt, output = entry
        had = self._work[tenant]
        if had == (prompt, output):
            del self._work[tenant]
        else:
            self._work[tenant] = (had[0] - prompt, had[1] - output)
        if running:
            self._running[request_id] = (tenant, prompt + output)
        else:
            self._hold(tenant, -(prompt + output))

    def done(self, request_id: str) -> None:
        """A running request finished."""
        entry = self._running.pop(request_id, None)
        if entry is not None:
            self._hold(entry[0], -entry[1])

    def work(self, tenant: str) -> tuple[int, int]:
        """The prompt and expected output tokens ``tenant`` has queued."""
        return self._work.get(tenant, (0, 0))

    def use(self, tenant: str) -> float:
        """How much of its fair share of the outstanding work ``tenant`` holds (its weight over
        the weights of the tenants holding any; 1: just its share, a tenant alone; 0: none)."""
        held = self._held.get(tenant)
        if held is None or self._total <= 0:
            return 0.0
        return (held[0] / self._total) / (held[1] / self._weights)
