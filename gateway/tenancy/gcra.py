"""The token budget, as pure Python: the specification the Lua script in ``gateway.tenancy.budget``
implements, the model the property tests compare it with, and the header arithmetic.

GCRA (the generic cell rate algorithm) over tokens. A tenant with rate ``r`` tokens/s and
burst ``b`` tokens has one state value, the theoretical arrival time ``tat`` (seconds; absent
or in the past means a full bucket). A reservation of ``c`` tokens at time ``now``::

    start   = max(tat, now)
    new_tat = start + c / r
    wait    = max(0, new_tat - b / r - now)      # until the reservation conforms

It is admitted when ``c <= b`` and ``wait <= max_wait`` (then ``tat := new_tat``; the request
starts after ``wait``) and refused otherwise, leaving ``tat`` as it was. Settling adds
``delta = used - reserved`` tokens (negative: a refund)::

    tat := max(tat, now) + delta / r             # dropped when it is not after now

Over any interval the tokens admitted by its end are at most ``r * interval + b``: every
admission keeps ``new_tat - b / r <= start time``, and ``tat`` grows by exactly the tokens
charged. The arithmetic here and in the script is the same IEEE-754 double arithmetic, in
the same order, so the two agree exactly.

Every admitted request is open until it settles (the gateway's list of its requests, which a
survivor settles when the gateway dies); settling is idempotent: only the settle that ends
an open request changes the budget. Under a concurrency limit a request also holds a lease
that expires at ``now + lease_s`` (a crash leaves no slot taken for longer) and ends when it
settles; such admissions drop the expired leases and count the live ones (``in_flight``). A
tenant without the limit takes no lease: nothing would count it, and the scripts save four
commands per request (issue 39).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["ok", "budget", "concurrency", "too_large", "revoked"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What an admission decided. ``tat`` is the state after it (unchanged when refused),
    ``wait`` the budget wait (for ``budget``: the wait the request would have needed),
    ``in_flight`` the tenant's live leases after it (0 without a concurrency limit)."""

    status: Status
    now: float
    tat: float
    wait: float
    in_flight: int


def reserve(
    tat: float | None, now: float, rate: float, burst: int, cost: int
) -> tuple[float, float]:
    """``(new_tat, wait)`` of a reservation, before deciding whether it is admitted."""
    start = tat if tat is not None and tat > now else now
    new_tat = start + cost / rate
    wait = new_tat - burst / rate - now
    if wait < 0.0:
        wait = 0.0
    return new_tat, wait


def settle(tat: float | None, now: float, rate: float, delta: int) -> float | None:
    """The state after charging ``delta`` more tokens (a refund when negative)."""
    start = tat if tat is not None and tat > now else now
    new_tat = start + delta / rate
    return new_tat if new_tat > now else None


@dataclass(slots=True)
class BucketModel:
    """One tenant's budget, open requests and leases, as the Lua scripts keep them in Redis."""

    tat: float | None = None
    leases: dict[str, float] = field(default_factory=dict)  # request id -> lease expiry (under a limit)
    open: set[str] = field(default_factory=set)  # the requests admitted and not settled

    def admit(
        self,
        now: float,
        rate: float,
        burst: int,
        cost: int,
        max_wait: float,
        max_concurrent: int,
        rid: str,
        lease_s: float,
    ) -> Verdict:
        in_flight = 0  # counted (and expired leases dropped) only under a concurrency limit
        if max_concurrent > 0:
            self.leases = {r: exp for r, exp in self.leases.items() if exp > now}
            in_flight = len(self.leases)
        current = self.tat if self.tat is not None and self.tat > now else now
        if cost > burst:
            return Verdict("too_large", now, current, 0.0, in_flight)
        if max_concurrent > 0 and in_flight >= max_concurrent:
            return Verdict("concurrency", now, current, 0.0, in_flight)
        new_tat, wait = reserve(self.tat, now, rate, burst, cost)
        if wait > max_wait:
            return Verdict("budget", now, current, wait, in_flight)
        self.tat = new_tat
        self.open.add(rid)
        if max_concurrent == 0:
            return Verdict("ok", now, new_tat, wait, 0)
        self.leases[rid] = now + lease_s
        return Verdict("ok", now, new_tat, wait, in_flight + 1)

    def settle(self, now: float, rate: float, rid: str, delta: int, leased: bool = True) -> bool:
        """Ends ``rid`` (and its lease, when it was admitted under a concurrency limit:
        ``leased``) and charges ``delta``; False (and no change) when it had ended already."""
        if rid not in self.open:
            return False
        self.open.discard(rid)
        if leased:
            self.leases.pop(rid, None)
        self.tat = settle(self.tat, now, rate, delta)
        return True


# -- what a client is told -----------------------------------------------------------------


def remaining_tokens(tat: float, now: float, rate: float, burst: int) -> int:
    """Tokens a reservation could take at once right now."""
    return max(0, min(burst, math.floor(burst - (tat - now) * rate)))


def reset_s(tat: float, now: float) -> float:
    """Seconds until the bucket is full again."""
    return max(0.0, tat - now)


def retry_after_s(wait: float, max_wait: float) -> int:
    """Whole seconds (at least 1) after which the same request would be admitted."""
    return max(1, math.ceil(wait - max_wait))


def duration(seconds: float) -> str:
    """OpenAI's reset format: ``0s``, ``250ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds <= 0.0:
        return "0s"
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    ms = math.ceil(seconds * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:g}s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    if minutes:
        return f"{minutes}m{secs}"
    return secs
