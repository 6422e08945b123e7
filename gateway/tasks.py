"""Background tasks a gateway must see to their end, or cancel at shutdown (``Tasks``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("tokengate.gateway")


class Tasks:
    """Tasks that must run to their end even if what started them is cancelled (settlements,
    a cancelled request's drain, a dispatcher's cancels); awaited at shutdown, up to a time."""

    def __init__(self, what: str) -> None:
        self.what = what  # what they are, for the log
        self._running: set[asyncio.Future[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for them; any still running then is cancelled and awaited, so
        that none of them writes to Redis after the gateway closed its connections."""
        if self._running:
            _done, late = await asyncio.wait(set(self._running), timeout=timeout_s)
            if late:
                log.warning("%d %s still running at shutdown: cancelled", len(late), self.what)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
