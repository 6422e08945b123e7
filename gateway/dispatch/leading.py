"""The elected scheduler's side of a gateway (``election``; docs/scheduling.md §15): the lease,
held or sought every ``RENEW_S``; while held, this gateway's own requests (``role.Role``,
on its own core) and the arrivals other gateways forward (admitted here and answered on
their reply streams), the notes and worker events about them, the questions; and the
hand-over when the lease moves (``take_over``, ``step_down``).

It acts through its host, the gateway's dispatcher (``Host``: jobs out, replies in, the
workers watched), which it never imports."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from common import protocol as p
from common import wire
from common.retry import Outage, Retrier, backoff_policy
from gateway.dispatch import election
from gateway.dispatch.liveness import Liveness
from gateway.dispatch.scheduling import Origin, SchedulerShell
from gateway.dispatch.tuning import Tuning
from gateway.redis_batch import AutoPipeline
from gateway.settings import GatewaySettings
from sched_core import Contract, Reject
from sched_core.contracts import Accuracy

log = logging.getLogger("tokengate.dispatch")

READ_BLOCK_MS = 1000  # the arrivals' blocking read returns at least this often
BACKOFF = backoff_policy(base_s=0.05, cap_s=2.0)  # after the n-th Redis failure in a row of one loop
RECLAIM_S = 1.0  # the scheduler takes over arrivals left pending this long by another consumer
YIELD_S = 1.0  # a process already scheduling k other models waits k times this on a free lease before taking it


class Host(Protocol):
    """What the scheduler's side asks of the gateway's dispatcher."""

    settings: GatewaySettings
    client: aioredis.Redis
    batch: AutoPipeline
    liveness: Liveness
    shell: SchedulerShell
    workers: dict[str, p.Heartbeat]
    wake: asyncio.Event
    closing: bool
    outage: Outage
    on_accuracy: Callable[[Accuracy | None], None] | None
    leads_elsewhere: Callable[[], int]
    tuning: Tuning

    def new_shell(self) -> SchedulerShell: ...

    def seen(self, workers: dict[str, p.Heartbeat]) -> None: ...

    def handle(self, events: list[p.Event]) -> None: ...

    def refuse_queued(self, rid: str, code: str, message: str) -> None: ...

    def hand_over(self, rids: list[str]) -> None: ...

    def route_event(self, ev: p.Delta | p.Finished | p.Failed) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...

    async def settle_quietly(self, writes: list[tuple[str, bytes, bytes]], entries: list[str]) -> None: ...

    async def xadd_or_warn(self, stream: str, fields: dict[bytes, bytes]) -> None: ...


class Leading:
    """Whether this gateway schedules for all (``leader``), and what it does while it does."""

    def __init__(self, d: Host) -> None:
        self.d = d
        self.leader = False
        self.term = 0  # the lease's term this gateway schedules in (``election.HOLD``)
        self.renewed = 0.0  # when the lease was last renewed (sent), by this gateway's clock
        self.leading = asyncio.Event()
        self.free_since: float | None = None  # when this gateway, deferring, first saw the lease free
        self._hold = d.client.register_script(election.HOLD)
        self._release = d.client.register_script(election.RELEASE)
        # this model's: the gateways serving a model elect their scheduler among themselves
        self.lease = wire.scheduler_lease(d.settings.model_name)
        self.term_key = wire.scheduler_term(d.settings.model_name)
        self.arrivals = wire.arrivals_stream(d.settings.model_name)
        self._arrivals = AutoPipeline(d.client, timeout_s=d.settings.redis_timeout_s + READ_BLOCK_MS / 1000)

    # -- the local role (``role.Role``): this gateway's own requests on its own core ----------

    async def submit(self, seq: p.SeqJob, who: Origin, now: float) -> Contract | Reject | None:
        return self.d.shell.arrive(seq, who, now)

    def first_token(self, rid: str, ttft_s: float, now: float) -> None:
        self.d.shell.driver.first_token(rid, ttft_s, now)

    def ended(self, rid: str, ttft_s: float | None, total_s: float | None, tokens: int,
              now: float) -> Accuracy | None:
        self.d.shell.request_ended(rid, now)
        accuracy = self.d.shell.outcome(rid, ttft_s, total_s, tokens, now)
        self.d.tuning.outcome(ttft_s, total_s, tokens, accuracy)  # the watch of a swapped table
        return accuracy

    def cancel(self, rid: str, now: float) -> bool:
        return self.d.shell.cancel(rid, now)

    async def explain(self, rid: str) -> dict[str, object] | None:
        return self.d.shell.explain(rid)

    # -- the lease ----------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop reading arrivals; a scheduler that exits cleanly hands the lease on at once,
        not a lease later."""
        await self._arrivals.close()
        if self.leader:
            with contextlib.suppress(RedisError):
                await self._release(keys=[self.lease], args=[self.d.settings.gateway_id])

    def lead(self) -> bool:
        """Whether this gateway may act as the scheduler now: dispatch, take up arrivals, say
        it schedules. Not while its lease has gone unrenewed for the lease's time by its own
        clock (the process was paused or starved, or Redis did not answer): another gateway
        may hold it already. The next renewal settles it (``elect``): the lease still its own
        in the same term, it goes on; another's, or taken again after another's term, it
        steps down."""
        return self.leader and time.monotonic() - self.renewed < election.LEASE_MS / 1000

    async def elect(self) -> None:
        """Hold the lease, or seek it: this gateway takes over scheduling when it gets it,
        goes on when it kept it, and steps down when another holds or held it."""
        if not self.leader and not await self.turn():
            return
        sent = time.monotonic()  # Redis counts the lease's time from later: this end lapses first
        term = await self._hold(keys=[self.lease, self.term_key],
                                args=[self.d.settings.gateway_id, election.LEASE_MS])
        if not term:
            self.step_down("another gateway holds the scheduling lease")
            return
        if self.leader and term not in (self.term, self.term + 1):  # (+1: lapsed, and nobody took it between)
            self.step_down(f"another gateway scheduled in between (term {self.term} -> {term})")
        self.term, self.renewed = int(term), sent
        if not self.leader:
            await self.take_over()

    async def turn(self) -> bool:
        """Whether this gateway seeks the lease now. A process that already schedules ``k``
        other models lets a free lease lie ``k * YIELD_S`` first, so that a gateway scheduling
        fewer takes it: a fleet of several models spreads its schedulers over its gateways
        (docs/scheduling.md §15), and a lone gateway still takes them all, a little later."""
        k = self.d.leads_elsewhere()
        if not k:
            return True
        if await self.d.client.exists(self.lease):
            self.free_since = None
            return False
        now = time.monotonic()
        if self.free_since is None:
            self.free_since = now
        return now - self.free_since >= k * YIELD_S

    async def take_over(self) -> None:
        """Schedule for every gateway from now on: the workers' running sequences are the
        previous scheduler's until they end, and the arrivals it left are taken up."""
        await self.arrivals_group()
        workers = await self.d.liveness.workers()
        self.d.shell.take_over(workers)
        await self.d.tuning.restore()  # the table in force, where it was re-solved
        self.d.seen(workers)
        self.leader = True
        self.leading.set()
        log.info("this gateway schedules for all gateways now")
        await self.reclaim(0)
        self.d.wake.set()

    async def arrivals_group(self) -> None:
        """From the stream's start: what followers sent before any scheduler read it (a model's
        first scheduler takes its lease after its followers served, ``turn``) is taken up,
        an admission given up since with the cancel that follows it."""
        with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists
            await self.d.client.xgroup_create(self.arrivals, wire.ARRIVALS_GROUP, id="0", mkstream=True)

    def step_down(self, why: str) -> None:
        """Another gateway schedules now. Nothing queued here fails: this gateway's own
        requests are handed to the next scheduler (forwarded, their contracts kept), the
        forwarded ones stay pending for it to take up; what was dispatched runs on, its
        events still come here."""
        if not self.leader:
            return
        log.warning("this gateway stops scheduling: %s", why)
        self.leader = False
        self.leading.clear()
        state = self.d.shell.model_state()
        own = [rid for rid in self.d.shell.queued_ids() if self.d.shell.take_origin(rid) is None]
        self.d.shell = self.d.new_shell()
        if state is not None:
            self.d.shell.load_model_state(state)
        self.d.hand_over(own)

    async def reclaim(self, idle_ms: int) -> None:
        """Take up the arrivals pending ``idle_ms`` or longer with any consumer (a previous
        scheduler's; this one's own queued ones come back too, and are recognised)."""
        cursor = "0-0"
        while True:
            cursor_raw, entries, *_ = await self.d.client.xautoclaim(
                self.arrivals, wire.ARRIVALS_GROUP, self.d.settings.gateway_id, idle_ms, cursor, count=1000
            )
            self.take_arrivals(entries, reclaimed=True)
            cursor = wire.text(cursor_raw)
            if cursor == "0-0":
                return

    async def trim_arrivals(self) -> None:
        """Drop the arrivals already settled: everything before the oldest entry still
        pending, or before the next one to deliver when none is."""
        groups = await self.d.client.xinfo_groups(self.arrivals)
        group = next((g for g in groups if wire.text(g["name"]) == wire.ARRIVALS_GROUP), None)
        if group is None:
            return
        pending = await self.d.client.xpending(self.arrivals, wire.ARRIVALS_GROUP)
        oldest = pending["min"] if pending["pending"] else None
        if oldest is None:  # MINID keeps the entry given: the last delivered one stays, a few bytes
            oldest = group["last-delivered-id"]
        await self.d.client.xtrim(self.arrivals, minid=wire.text(oldest), approximate=False)

    async def election_loop(self) -> None:
        retry = Retrier(BACKOFF, self.d.outage)
        reclaimed = time.monotonic()
        while not self.d.closing:
            await asyncio.sleep(election.RENEW_S)
            started = time.monotonic()
            try:
                await self.elect()
                if self.leader and started - reclaimed >= RECLAIM_S:
                    reclaimed = started
                    await self.reclaim(int(RECLAIM_S * 1000))
                    await self.trim_arrivals()
            except RedisError as exc:  # past the lease's time ``lead`` stops this gateway acting as the scheduler
                await asyncio.sleep(retry.count(exc))
                continue
            retry.succeeded(started)

    async def arrivals_loop(self) -> None:
        """The scheduler's read of what the other gateways send (``election``)."""
        retry = Retrier(BACKOFF, self.d.outage)
        while not self.d.closing:
            if not self.leader:
                await self.leading.wait()
                continue
            started = time.monotonic()
            try:
                reply = await self._arrivals.call(
                    "XREADGROUP", "GROUP", wire.ARRIVALS_GROUP, self.d.settings.gateway_id, "COUNT", 1000,
                    "BLOCK", READ_BLOCK_MS, "STREAMS", self.arrivals, ">",
                )
            except RedisError as exc:
                if "NOGROUP" in str(exc) and self.leader:  # the stream was deleted (Redis restarted)
                    with contextlib.suppress(RedisError):
                        await self.arrivals_group()
                await asyncio.sleep(retry.count(exc))
                continue
            retry.succeeded(started)
            for _stream, entries in reply or []:
                self.take_arrivals(entries)

    def take_arrivals(self, entries: list[tuple[bytes, dict[bytes, bytes] | list[bytes] | None]],
                      reclaimed: bool = False) -> None:
        """Admissions go to the scheduler (answered on their gateway's reply stream); the
        rest (workers' events, notes) are applied and acknowledged at once. ``reclaimed``:
        taken up from another scheduler, which may have promised them already: admitted
        without a refusal (``Driver.arrive``), never failed after their 200."""
        if not self.lead():  # read just before a pause, or a lost lease: they stay pending for the scheduler
            return
        done: list[bytes] = []
        now = time.monotonic()
        for entry_id, raw in entries:
            if raw is None:  # deleted while pending
                done.append(entry_id)
                continue
            fields = raw if isinstance(raw, dict) else dict(zip(raw[::2], raw[1::2], strict=True))
            try:
                msg = election.decode_entry(fields)
                if isinstance(msg, election.Arrival):
                    self._admit(wire.text(entry_id), msg, now, reclaimed or msg.promised)
                    continue
                done.append(entry_id)
                if isinstance(msg, election.Events):
                    self.d.handle(list(msg.events))
                elif isinstance(msg, election.Note):
                    self._apply_note(msg, now)
                elif isinstance(msg, election.Question):
                    answer = {b"v": election.VERSION,
                              election.EXPLAINED: election.encode_explained(msg.ask, self.d.shell.explain(msg.rid))}
                    self.d.spawn(self.d.xadd_or_warn(msg.reply_to, answer))
            except p.ProtocolError as exc:
                log.error("dropping an unreadable arrival: %s", exc)
                done.append(entry_id)
        if done:
            self.d.spawn(self._ack(done))
        self.d.wake.set()

    async def _ack(self, entries: list[bytes]) -> None:
        with contextlib.suppress(RedisError):  # taken up again later, and recognised
            await self.d.batch.call("XACK", self.arrivals, wire.ARRIVALS_GROUP, *entries)

    def _admit(self, entry: str, arrival: election.Arrival, now: float, promised: bool) -> None:
        seq = arrival.seq
        if self.d.shell.knows(seq.rid):  # taken up again while still queued or running here
            return
        decision = self.d.shell.arrive(seq, arrival.who, now, forwarded=(arrival.reply_to, entry), promised=promised)
        answer = election.encode_decision(seq.rid, decision)
        if isinstance(decision, Reject):  # answered and acknowledged together
            self.d.spawn(self.d.settle_quietly([(arrival.reply_to, election.DECISION, answer)], [entry]))
        else:  # the arrival stays pending until its job leaves; if lost, the follower gives up after DECIDE_S
            self.d.spawn(self.d.xadd_or_warn(arrival.reply_to, {b"v": election.VERSION, election.DECISION: answer}))

    def _apply_note(self, note: election.Note, now: float) -> None:
        rid = note.rid
        if note.kind == election.FIRST and note.ttft_s is not None:
            self.first_token(rid, note.ttft_s, now)
        elif note.kind == election.END:
            accuracy = self.ended(rid, note.ttft_s, note.total_s, note.tokens, now)
            if self.d.on_accuracy is not None:
                self.d.on_accuracy(accuracy)
        elif note.kind == election.CANCEL and self.cancel(rid, now):
            self.d.refuse_queued(rid, "cancelled", "The client went away.")
