"""Surviving Redis faults: a backoff policy per loop, one outage log per outage.

A worker never exits on a ``redis.RedisError``: each of its loops (the main loop, the
heartbeat thread, the cancel subscription) waits as its backoff policy says and tries
again. The policy is one of redis-py's own strategy objects (``compute(failures)`` ->
seconds). The worker's threads share one :class:`Outage`, so an outage logs one warning
when its first call fails and one info line when a call succeeds again, however many
attempts failed in between.

Time is a parameter: the clock and the sleep are injected, so tests never sleep.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis
from redis.backoff import AbstractBackoff, ExponentialBackoff

log = logging.getLogger("tokengate.worker")


def backoff_policy(base_s: float, cap_s: float) -> AbstractBackoff:
    """Waits base·2^failures seconds, at most ``cap_s``: 2·base after the first failure."""
    return ExponentialBackoff(cap=cap_s, base=base_s)


def is_nogroup(exc: BaseException) -> bool:
    """The consumer group (or its stream) is gone: Redis restarted without its data."""
    return isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc)


class Outage:
    """From the first failed Redis call to the next successful one, across threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: float | None = None
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, exc: BaseException) -> bool:
        """Record a failed call; True (and one warning) when it starts an outage."""
        with self._lock:
            if self._since is not None:
                return False
            self._since = self._clock()
        log.warning("Redis unreachable (%s: %s): retrying with backoff", type(exc).__name__, exc)
        return True

    def recovered(self, started: float) -> float | None:
        """Record a call, begun at ``started``, that succeeded; the outage's length (and one
        info line) if it ends one. A call begun before the outage proves nothing: another
        thread may have seen the failure while this call was still on its way back."""
        with self._lock:
            if self._since is None or started < self._since:
                return None
            lasted = self._clock() - self._since
            self._since = None
        log.info("Redis reachable again after %.1f s", lasted)
        return lasted


class Retrier:
    """One loop's consecutive failures, and the wait its policy gives each. A thread's loop
    calls ``failed`` (which sleeps); an asyncio loop calls ``count`` and awaits the delay."""

    def __init__(self, policy: AbstractBackoff, outage: Outage,
                 sleep: Callable[[float], object] | None = None) -> None:
        self.policy = policy
        self.outage = outage
        self.sleep = sleep
        self.failures = 0

    def count(self, exc: BaseException) -> float:
        """Count the failure (one warning per outage); the policy's delay for it."""
        self.failures += 1
        if not self.outage.failed(exc):
            log.debug("Redis call failed again (%d in a row): %s", self.failures, exc)
        return self.policy.compute(self.failures)

    def failed(self, exc: BaseException) -> float:
        """Count the failure, wait the policy's delay for it, return that delay."""
        delay = self.count(exc)
        assert self.sleep is not None, "a Retrier without sleep: count() and wait yourself"
        self.sleep(delay)
        return delay

    def reset(self) -> None:
        """This loop is through (without proving Redis answers: see ``succeeded``)."""
        self.failures = 0

    def succeeded(self, started: float) -> None:
        """A Redis round trip of this loop, begun at ``started`` (the outage's clock), answered."""
        self.failures = 0
        self.outage.recovered(started)
