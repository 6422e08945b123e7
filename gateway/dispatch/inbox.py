"""What comes back to a gateway, in one blocking read: its reply stream (the workers' events
for its requests, and the elected scheduler's decisions and answers when it forwards) and
its model's workers' step telemetry (``wire.telemetry_stream``), which refits the step-time model.

It acts through its host, the gateway's dispatcher (``Host``), which it never imports."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common import protocol as p
from common import wire
from common.retry import Outage, Retrier
from gateway.dispatch.forwarding import Forwarding
from gateway.dispatch.leading import BACKOFF, READ_BLOCK_MS, Leading
from gateway.dispatch.scheduling import SchedulerShell
from gateway.redis_batch import AutoPipeline

log = logging.getLogger("tokengate.dispatch")

TELEMETRY_BACKLOG = 16  # telemetry entries a starting gateway observes (the workers' warm-ups)


class Host(Protocol):
    """What the read of replies asks of the gateway's dispatcher."""

    client: aioredis.Redis
    replies: str
    telemetry: str  # its model's workers' telemetry stream
    shell: SchedulerShell
    closing: bool
    outage: Outage
    leading: Leading
    forwarding: Forwarding

    def handle(self, events: list[p.Event]) -> None: ...


class Inbox:
    """The reply stream and the telemetry, read on a connection of their own."""

    def __init__(self, d: Host, timeout_s: float) -> None:
        self.d = d
        self._reads = AutoPipeline(d.client, timeout_s=timeout_s + READ_BLOCK_MS / 1000)

    async def close(self) -> None:
        await self._reads.close()

    async def loop(self) -> None:
        """This gateway's replies and its model's workers' telemetry, in one blocking read (one slot).
        Telemetry is read from the stream's last entry at start: a concrete id, since ``$``
        re-read every turn would miss whatever arrived while the replies kept the read from
        blocking."""
        telemetry_stream = self.d.telemetry
        last = {self.d.replies: b"0-0", telemetry_stream: await self._telemetry_start()}
        retry = Retrier(BACKOFF, self.d.outage)
        trimmed = time.monotonic()
        while not self.d.closing:
            started = time.monotonic()
            try:
                reply: list[tuple[bytes, list[tuple[bytes, list[bytes]]]]] | None = await self._reads.call(
                    "XREAD", "COUNT", 1000, "BLOCK", READ_BLOCK_MS, "STREAMS", *last, *last.values()
                )
            except RedisError as exc:
                await asyncio.sleep(retry.count(exc))
                continue
            retry.succeeded(started)
            for stream, entries in reply or []:
                telemetry = wire.text(stream) == telemetry_stream
                for entry_id, items in entries:
                    fields = dict(zip(items[::2], items[1::2], strict=True))
                    if telemetry:
                        last[telemetry_stream] = entry_id
                        self._observe(fields)
                    else:
                        last[self.d.replies] = entry_id
                        self._route(fields)
            if time.monotonic() - trimmed > 1.0:  # entries already routed; drop them once a second
                trimmed = time.monotonic()
                with contextlib.suppress(RedisError):
                    await self.d.client.xtrim(self.d.replies, minid=last[self.d.replies], approximate=True)

    async def _telemetry_start(self) -> bytes:
        """Where the telemetry read starts: after the newest entry, once the latest
        ``TELEMETRY_BACKLOG`` entries are observed (oldest first), so that a worker's warm-up
        steps, published before this gateway started, shape its first contracts."""
        try:
            recent: list[tuple[bytes, dict[bytes, bytes]]] = await self.d.client.xrevrange(  # type: ignore[assignment]
                self.d.telemetry, count=TELEMETRY_BACKLOG
            )
        except RedisError:
            return b"0-0"  # Redis is not there yet: read what the stream holds (at most its cap)
        for _entry_id, fields in reversed(recent):
            self._observe(fields)
        entry_id = recent[0][0] if recent else None
        return entry_id if isinstance(entry_id, bytes) else b"0-0"

    def _observe(self, fields: dict[bytes, bytes]) -> None:
        """One of the model's workers' telemetry (each model's workers have a stream of their
        own: a model's step-time model never learns another model's steps)."""
        try:
            telemetry = p.decode_telemetry(fields)
        except p.ProtocolError as exc:
            log.warning("dropping unreadable worker telemetry: %s", exc)
            return
        self.d.shell.telemetry(telemetry, time.monotonic())

    def _route(self, fields: dict[bytes, bytes]) -> None:
        if self.d.forwarding.answered(fields):
            return
        try:
            events = p.decode_events(fields)
        except p.ProtocolError as exc:
            log.error("dropping unreadable reply: %s", exc)
            return
        if not self.d.leading.leader:  # what the scheduler must learn: slots back, batches ended
            self.d.forwarding.pass_on(events)
        self.d.handle(events)
