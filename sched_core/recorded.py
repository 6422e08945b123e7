"""The traffic a scheduler served, kept as a trace to tune on (issue 41): per request when it
arrived, its prompt tokens, the tokens it generated and its tenant; no content.

``Traffic`` opens a row at each arrival and closes it when the request ends: with the tokens
generated when it finished, or unfinished (refused, cancelled, failed: it generated nothing
that counts, and the tokens it asked for, ``max_tokens``, are what it would have cost). Closed
rows wait in ``closed`` (the last ``TRAFFIC_WINDOW``) for whoever keeps them: the gateway
appends them to the model's traffic stream (``gateway/dispatch/traffic_log.py``). Rows left
open past ``TRAFFIC_WINDOW`` (requests whose end this scheduler never saw: it stepped down)
are dropped, oldest first. Pure: no I/O, no clock of its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: The requests kept: the traffic a re-solve tunes on (about an hour at 5 requests/s).
TRAFFIC_WINDOW = 20_000


@dataclass(slots=True)
class Seen:
    arrival: float  # the driver's clock
    prompt_tokens: int
    max_tokens: int
    tenant: str
    output_tokens: int = -1  # generated, once it finished; -1: it did not finish

    @property
    def finished(self) -> bool:
        return self.output_tokens >= 0


class Traffic:
    __slots__ = ("_open", "closed", "capacity")

    def __init__(self, capacity: int = TRAFFIC_WINDOW) -> None:
        self.capacity = capacity
        self._open: dict[str, Seen] = {}
        self.closed: deque[Seen] = deque(maxlen=capacity)

    def arrived(self, rid: str, tenant: str, prompt_tokens: int, max_tokens: int, now: float) -> None:
        if len(self._open) >= self.capacity:
            del self._open[next(iter(self._open))]
        self._open[rid] = Seen(now, prompt_tokens, max_tokens, tenant)

    def finished(self, rid: str, output_tokens: int) -> None:
        """It generated ``output_tokens`` (< 0: unknown, e.g. it failed): the row is closed."""
        row = self._open.pop(rid, None)
        if row is not None:
            row.output_tokens = output_tokens
            self.closed.append(row)

    def ended(self, rid: str) -> None:
        """It ended without finishing here (refused, cancelled, failed): the row is closed."""
        row = self._open.pop(rid, None)
        if row is not None:
            self.closed.append(row)

    def take(self) -> list[Seen]:
        """The rows closed since the last take."""
        rows = list(self.closed)
        self.closed.clear()
        return rows
