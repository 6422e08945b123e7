"""The gateway's Redis shell around the scheduling core: jobs out, replies in, workers watched.

An admitted request goes to the scheduler (``gateway.scheduling``), which answers with a
latency contract or a rejection. The send loop drives the scheduler with the wall clock:
it wakes on every arrival, and every ``TICK_S`` while requests are queued, and sends the
batches the scheduler releases to the pools' streams in one pipelined round trip. Replies
arrive on this gateway's own stream and are routed to the waiting request by id (events
for ids no longer waited on, late or duplicate deliveries, are dropped); batch timings go
back to the scheduler. Worker heartbeats and the set of live gateways give each pool's
capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.scheduling import Origin, SchedulerShell
from gateway.settings import GatewaySettings
from sched_core import Contract, Reject, SchedulerConfig
from workers import protocol as p
from workers import wire

log = logging.getLogger("tokengate.dispatch")

CANCEL_TTL_S = 600
TICK_S = 0.002  # how often the scheduler is asked while requests wait



@dataclass(slots=True)
class Pending:
    seq: p.SeqJob
    created: float
    contract: Contract
    events: asyncio.Queue[p.Event] = field(default_factory=asyncio.Queue)


class Dispatcher:
    def __init__(
        self,
        settings: GatewaySettings,
        client: aioredis.Redis,
        on_workers: Callable[[dict[str, p.Heartbeat]], None] | None = None,
        config: SchedulerConfig | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.replies = wire.replies_stream(settings.gateway_id)
        self.shell = SchedulerShell(settings.gateway_id, self.replies, config, settings.handoff_min_prompt)
        self.pending: dict[str, Pending] = {}
        self.workers: dict[str, p.Heartbeat] = {}
        self.gateways = 1
        self._on_workers = on_workers
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh_workers()
        self._tasks = [
            asyncio.create_task(self._send_loop(), name="send"),
            asyncio.create_task(self._reply_loop(), name="replies"),
            asyncio.create_task(self._watch_loop(), name="workers"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(RedisError):
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(self.replies, wire.gateway_key(self.settings.gateway_id))
            pipe.zrem(wire.GATEWAYS_ZSET, self.settings.gateway_id)
            await pipe.execute()

    # -- requests -------------------------------------------------------------------------

    def alive_pools(self) -> set[str]:
        return {hb.pool for hb in self.workers.values()}

    def submit(self, seq: p.SeqJob, who: Origin) -> Pending | Reject:
        """Hand a request to the scheduler: its contract (and a place to wait for its
        events), or the rejection to answer at once."""
        now = time.monotonic()
        decision = self.shell.arrive(seq, who, now)
        if isinstance(decision, Reject):
            return decision
        pending = Pending(seq, now, decision)
        self.pending[seq.rid] = pending
        self._wake.set()
        return pending

    def explain(self, rid: str) -> dict[str, object] | None:
        return self.shell.core.explain(rid)

    def snapshot(self) -> dict[str, object]:
        snap = self.shell.core.snapshot()
        snap["gateway"] = self.settings.gateway_id
        snap["gateways_sharing_capacity"] = self.gateways
        return snap

    def forget(self, rid: str) -> None:
        self.pending.pop(rid, None)

    def cancel(self, rid: str) -> bool:
        """The client went away. True if the request was still queued: it will never be
        dispatched. Otherwise its worker is told (a TTL'd key for workers that have not
        read it yet, a pub/sub message for the one running it) and stops it within one
        decode step; its final event still arrives here. Harmless if repeated."""
        if self.shell.cancel(rid, time.monotonic()):
            self.pending.pop(rid, None)
            return True
        task = asyncio.get_running_loop().create_task(self._send_cancel(rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return False

    async def _send_cancel(self, rid: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.set(wire.cancel_key(rid), 1, ex=CANCEL_TTL_S)
        pipe.publish(wire.CANCEL_CHANNEL, rid)
        try:
            await pipe.execute()
        except RedisError as exc:
            log.warning("could not cancel %s: %s", rid, exc)

    async def _send_loop(self) -> None:
        while True:
            if len(self.shell):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(TICK_S):
                        await self._wake.wait()
            else:
                await self._wake.wait()
            self._wake.clear()
            sends, rejects = self.shell.tick(time.monotonic())
            for r in rejects:
                pending = self.pending.get(r.request_id)
                if pending is not None:
                    pending.events.put_nowait(p.Failed(r.request_id, r.reason, r.message))
            if not sends:
                continue
            pipe = self.client.pipeline(transaction=False)
            for send in sends:
                pipe.xadd(wire.jobs_stream(send.pool), p.encode_job(send.job))
            try:
                await pipe.execute()
            except RedisError as exc:
                log.error("sending %d batches failed: %s", len(sends), exc)
                for send in sends:
                    for seq in send.job.seqs:
                        failed = p.Failed(seq.rid, "redis", f"Could not queue the request: {exc}")
                        self._route_event(failed)

    # -- replies --------------------------------------------------------------------------

    async def _reply_loop(self) -> None:
        last = b"0-0"
        failures = 0
        trimmed = time.monotonic()
        while True:
            try:
                reply = await self.client.xread({self.replies: last}, count=1000, block=1000)
                failures = 0
            except RedisError as exc:
                failures += 1
                log.warning("reading replies failed (%d): %s", failures, exc)
                await asyncio.sleep(min(2.0, 0.05 * 2**failures))
                continue
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    self._route(fields)
            if time.monotonic() - trimmed > 1.0:  # entries already routed; drop them once a second
                trimmed = time.monotonic()
                with contextlib.suppress(RedisError):
                    await self.client.xtrim(self.replies, minid=last, approximate=True)

    def _route(self, fields: dict[bytes, bytes]) -> None:
        try:
            events = p.decode_events(fields)
        except p.ProtocolError as exc:
            log.error("dropping unreadable reply: %s", exc)
            return
        for ev in events:
            if isinstance(ev, p.BatchReport):
                self.shell.completed(ev, time.monotonic())
                self._wake.set()  # slots came back
            else:
                self._route_event(ev)

    def _route_event(self, ev: p.Delta | p.Finished | p.Failed) -> None:
        pending = self.pending.get(ev.rid)
        if pending is not None:
            pending.events.put_nowait(ev)

    # -- workers and peers ------------------------------------------------------------------

    async def refresh_workers(self) -> None:
        """Read live workers and gateways (their keys expire on Redis's clock) and give the
        scheduler this gateway's share of each pool."""
        me = self.settings.gateway_id
        pipe = self.client.pipeline(transaction=False)
        pipe.set(wire.gateway_key(me), 1, px=int(self.settings.heartbeat_ttl_s * 1000))
        pipe.zadd(wire.GATEWAYS_ZSET, {me: time.time()})
        pipe.zrange(wire.WORKERS_ZSET, 0, -1)
        pipe.zrange(wire.GATEWAYS_ZSET, 0, -1)
        _, _, worker_ids, gateway_ids = await pipe.execute()
        wids = [i.decode() for i in worker_ids]
        gids = [i.decode() for i in gateway_ids]
        pipe = self.client.pipeline(transaction=False)
        pipe.mget([wire.worker_key(i) for i in wids] or ["tg:none"])
        pipe.mget([wire.gateway_key(i) for i in gids] or ["tg:none"])
        raws, alive_gws = await pipe.execute()
        workers: dict[str, p.Heartbeat] = {}
        gone: list[str] = []
        for wid, raw in zip(wids, raws, strict=False):
            if raw is None:
                gone.append(wid)
                continue
            try:
                workers[wid] = p.decode_heartbeat(raw)
            except p.ProtocolError as exc:
                log.warning("ignoring worker %s: %s", wid, exc)
        dead_gws = [g for g, alive in zip(gids, alive_gws, strict=False) if alive is None]
        pipe = self.client.pipeline(transaction=False)
        if gone:
            pipe.zrem(wire.WORKERS_ZSET, *gone)
        if dead_gws:
            pipe.zrem(wire.GATEWAYS_ZSET, *dead_gws)
        await pipe.execute()
        self.workers = workers
        self.gateways = max(1, len(gids) - len(dead_gws))
        self.shell.capacity(workers, self.gateways, time.monotonic())
        self._wake.set()
        if self._on_workers is not None:
            self._on_workers(workers)

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                await self.refresh_workers()
            except RedisError as exc:
                log.warning("reading worker heartbeats failed: %s", exc)
