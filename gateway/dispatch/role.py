"""The scheduler as a gateway's requests see it (docs/scheduling.md §15).

While a gateway holds the scheduling lease its requests go to its own core (``Leading``);
otherwise to the elected scheduler's, through Redis (``Forwarding``). The election swaps one
for the other (``Dispatcher.role``); a request keeps the one that admitted it until it ends,
or until a scheduler that steps down hands it on (``Dispatcher.hand_over``)."""

from __future__ import annotations

from typing import Protocol

from common import protocol as p
from gateway.dispatch.scheduling import Origin
from sched_core import Contract, Reject
from sched_core.contracts import Accuracy


class Role(Protocol):
    """What a gateway asks of the scheduler about one request, wherever it runs."""

    async def submit(self, seq: p.SeqJob, who: Origin, now: float) -> Contract | Reject | None:
        """Its contract, its refusal, or None (a baseline policy admits without one).
        TimeoutError when no scheduler answered."""
        ...

    def first_token(self, rid: str, ttft_s: float, now: float) -> None:
        """A streamed request's first token came ``ttft_s`` after it arrived."""
        ...

    def ended(self, rid: str, ttft_s: float | None, total_s: float | None, tokens: int,
              now: float) -> Accuracy | None:
        """It is over where it was sent from: what it took (None: not seen) calibrates the
        contracts; how its promise fared (None where another gateway keeps the calibration)."""
        ...

    def cancel(self, rid: str, now: float) -> bool:
        """Its client left: True if it was still queued here, and will never run."""
        ...

    async def explain(self, rid: str) -> dict[str, object] | None:
        """Why it is where it is (None: not held, or no answer)."""
        ...
