"""Cancels reach a worker over pub/sub (``wire.CANCEL_CHANNEL``): a thread stays subscribed,
the main loop applies what it heard between steps, and the recent cancels are kept, so a job
read after its cancel was published is cancelled as it is admitted. Cancels published while
the subscription was down are not lost: their keys (``wire.cancel_key``) are checked when a
job is admitted and at every publish (``Fence.publish``'s ``check_cancel``)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import redis
from redis.backoff import AbstractBackoff

from common import wire
from common.retry import Outage, Retrier

log = logging.getLogger("tokengate.worker")

POLL_S = 0.1  # the thread checks for a stop this often (the exit joins it)
RECENT = 10_000  # past this many recent cancels, those older than RECENT_S are forgotten
RECENT_S = 600.0


class Cancels:
    def __init__(self, client: redis.Redis, backoff: AbstractBackoff, outage: Outage,
                 stop: threading.Event) -> None:
        self.client = client
        self._backoff = backoff
        self._outage = outage
        self._stop = stop
        self._heard: deque[str] = deque()  # from the subscription thread
        self._recent: dict[str, float] = {}

    def loop(self) -> None:
        """Subscribed until stopped; a lost connection is subscribed again after a backoff."""
        retry = Retrier(self._backoff, self._outage, self._stop.wait)
        while not self._stop.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(wire.CANCEL_CHANNEL)
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=POLL_S)
                    retry.reset()  # subscribed; whether Redis answers, the other loops tell
                    if msg is not None:
                        self._heard.append(wire.text(msg["data"]))
            except redis.RedisError as exc:
                log.debug("cancel subscription lost (%s): subscribing again after a backoff", exc)
                retry.failed(exc)
            finally:
                pubsub.close()

    def apply(self, cancel: Callable[[str], bool]) -> None:
        """Every cancel heard since the last call goes to ``cancel`` (True: it stopped a
        sequence running here) and is kept as recent."""
        now = time.monotonic()
        while self._heard:
            rid = self._heard.popleft()
            self._recent[rid] = now
            if cancel(rid):
                log.info("cancelled %s", rid)
        if len(self._recent) > RECENT:
            horizon = now - RECENT_S
            self._recent = {r: t for r, t in self._recent.items() if t > horizon}

    def recent(self, rid: str) -> bool:
        return rid in self._recent
