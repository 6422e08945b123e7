"""How far behind the gateway's event loop runs: the signal that the process itself is
saturated (more requests than its core can parse, route and answer).

The scheduler prices the queue in front of the workers; it cannot see requests piling up in
front of the gateway's own event loop, where each await of a request waits one more turn of
an ever longer loop. So the loop is sampled: a timer that should fire every ``interval_s``
records how late it fired. A single slow callback (a long prompt's tokenization handed back,
a burst of connections) shows as one late sample among many on time; a saturated loop is
late on every sample. ``behind_s`` is therefore the least lag of the samples of the last
``window_s`` and of the one sample before them: it stays near zero through one slow callback
and follows a sustained delay within a turn. The sample before counts because a process that
was paused (SIGSTOP, a VM's stolen time) wakes with one late sample alone in the window: the
pause is over, and the requests that waited through it are not to be refused for it; a loop
that stays behind is late on that earlier sample too. Pure: ``now`` is an argument;
``LoopLag.run`` is the only part that sleeps.
"""

from __future__ import annotations

import asyncio
from collections import deque

SAMPLE_S = 0.01  # the timer's period
WINDOW_S = 0.25  # behind_s is the least lag over this much time
SATURATED_S = 0.03  # a loop this far behind on every recent sample is saturated: shed new work


class LoopLag:
    def __init__(self, interval_s: float = SAMPLE_S, window_s: float = WINDOW_S) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()  # (when, lag)

    def record(self, lag_s: float, now: float) -> None:
        self._samples.append((now, max(0.0, lag_s)))
        while len(self._samples) > 2 and self._samples[1][0] < now - self.window_s:
            self._samples.popleft()  # (the last one before the window stays)

    def behind_s(self, now: float) -> float:
        """The least lag of the samples of the last ``window_s`` and the one before them (the
        latest sample if none is that recent)."""
        since = now - self.window_s
        recent = [lag for at, lag in self._samples if at >= since]
        before = [lag for at, lag in self._samples if at < since]
        return min(recent + before[-1:]) if self._samples else 0.0

    async def run(self) -> None:
        """Samples the running loop until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            self.record(now - due, now)
