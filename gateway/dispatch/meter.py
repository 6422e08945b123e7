"""What one admitted request has consumed, as its events report it, and what it is charged."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Literal

from common import protocol as p
from sched_core import Contract

Outcome = Literal["done", "cancelled", "failed"]


@dataclass(slots=True)
class Meter:
    """``outcome`` stays ``cancelled`` unless the request finished or failed: a client that
    went away, a server shutting down. ``settling`` is the one settlement task."""

    prompt_tokens: int
    received: float = field(default_factory=time.monotonic)  # when the request arrived
    started: bool = False  # handed to the workers (not only waiting for its budget)
    completion_tokens: int = 0
    outcome: Outcome = "cancelled"
    settling: asyncio.Future[bool] | None = None
    contract: Contract | None = None
    first_token_s: float | None = None  # seen by a streaming client, from ``received``
    total_s: float | None = None

    def age(self) -> float:
        """Seconds since the request arrived."""
        return time.monotonic() - self.received

    def observe(self, ev: p.Event) -> None:
        if isinstance(ev, p.Delta):
            self.completion_tokens = ev.tokens
            if self.first_token_s is None:
                self.first_token_s = time.monotonic() - self.received
        elif isinstance(ev, p.Finished):
            self.prompt_tokens, self.completion_tokens = ev.prompt_tokens, ev.completion_tokens
            self.outcome = "done"
            self.total_s = time.monotonic() - self.received
            if self.first_token_s is None and ev.decode_s is not None and ev.completion_tokens > 0:
                # not streamed: its first token came when the worker sampled it, decode_s before the end
                self.first_token_s = max(self.total_s - ev.decode_s, 1e-6)
        elif isinstance(ev, p.Failed):
            self.outcome = "failed"

    def fail(self) -> None:
        if self.outcome == "cancelled":
            self.outcome = "failed"

    def record(self) -> dict[str, float]:
        """The contract and what happened, for the request's record (seconds)."""
        out: dict[str, float] = {}
        if self.contract is not None:
            c = self.contract
            out |= {"contract_ttft_s": c.ttft_s, "contract_total_s": c.total_s, "contract_p99_s": c.p99_s,
                    "contract_ttft_p99_s": c.ttft_p99_s}
        if self.first_token_s is not None:
            out["ttft_s"] = self.first_token_s
        if self.total_s is not None:
            out["total_s"] = self.total_s
        return out

    def charge(self) -> tuple[int, int]:
        """(prompt, completion) tokens to charge: what the model processed, except that a
        request that never reached a worker or failed on our side costs nothing. A stream
        cut by its client pays its prompt and the tokens generated until then."""
        if not self.started or self.outcome == "failed":
            return 0, 0
        return self.prompt_tokens, self.completion_tokens
