"""The gateway's Redis shell around the scheduling core: jobs out, replies in, workers watched.

An admitted request goes to the scheduling policy (``gateway.dispatch.scheduling``, through the one
driver ``sched_core.driver`` that the simulator uses too), which answers with a latency
contract, a rejection, or (a baseline policy) nothing. The send loop ticks the driver with the
wall clock: on every arrival, on every freed slot, and whenever the driver asks
(``next_tick``: while requests wait and a slot is free); it sends the batches released to the
pools' streams in one pipelined round trip. Replies arrive on this gateway's own stream and
are routed to the waiting request by id (events for ids no longer waited on, late or
duplicate deliveries, are dropped); each finished request gives its slot back at once, batch
reports end their batch. Every worker's step telemetry (``{tg}:steps``) arrives in the same
blocking read and refits the step-time model. Worker heartbeats and the set of live gateways
give each pool's capacity.

No loop dies of one bad item: a job that cannot be encoded or sent fails its own requests
(and gives its slots back), an unreadable reply is dropped, a Redis error is retried. A
loop that stops anyway is a bug: ``failed`` says which (``/readyz`` turns 503) and
``on_fatal`` is called so that the process exits and is restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from common import protocol as p
from common import wire
from common.retry import Outage, Retrier
from gateway import keyspace
from gateway.dispatch import election, saved_model, traffic_log
from gateway.dispatch.forwarding import DECIDE_S, Forwarding, flat
from gateway.dispatch.inbox import Inbox
from gateway.dispatch.leading import BACKOFF, Leading
from gateway.dispatch.liveness import Liveness
from gateway.dispatch.role import Role
from gateway.dispatch.scheduling import Origin, SchedulerShell, Send
from gateway.dispatch.tuning import Tuning
from gateway.redis_batch import AutoPipeline
from gateway.settings import GatewaySettings
from gateway.tasks import Tasks
from sched_core import Contract, Reject, SchedulerConfig
from sched_core.contracts import Accuracy

log = logging.getLogger("tokengate.dispatch")

CANCEL_TTL_S = 600
WATCH_S = 0.5  # how often workers and peers are re-read (and slot leases checked)
MODEL_SAVE_S = 10.0  # how often the fitted model and calibration are saved for the next start, and the traffic kept
BACKGROUND_DRAIN_S = 2.0  # at close, what ``spawn`` started may run this long, then is cancelled


@dataclass(slots=True)
class Pending:
    seq: p.SeqJob
    who: Origin
    created: float
    role: Role  # the scheduler that admitted it (this gateway's core, or the elected one's)
    contract: Contract | None = None  # None under a baseline policy (fcfs, fixed), which promises nothing
    before: float = 0.0  # seconds from its arrival here to the scheduler's decision, its budget wait aside
    events: asyncio.Queue[p.Event] = field(default_factory=asyncio.Queue)

    def scheduled(self, seconds: float) -> float:
        """A time since its arrival here, as the scheduler counts it: from its decision (with
        nothing before the decision, as it came)."""
        return max(seconds - self.before, 1e-6) if self.before else seconds


class Dispatcher:
    def __init__(
        self,
        settings: GatewaySettings,
        client: aioredis.Redis,
        on_workers: Callable[[dict[str, p.Heartbeat]], None] | None = None,
        config: SchedulerConfig | None = None,
        on_fatal: Callable[[str], None] | None = None,
        batch: AutoPipeline | None = None,
        on_accuracy: Callable[[Accuracy | None], None] | None = None,
        leads_elsewhere: Callable[[], int] = lambda: 0,
    ) -> None:
        self.settings = settings
        self.client = client
        self.batch = batch or AutoPipeline(client)
        self.replies = wire.replies_stream(settings.model_name, settings.gateway_id)
        self.telemetry = wire.telemetry_stream(settings.model_name)  # its workers' steps
        self._config = config
        self.shell = self.new_shell()
        # one gateway schedules for all (``election``): this one, or the one it forwards to
        self.leading = Leading(self)
        self.forwarding = Forwarding(self)  # a follower's: what it forwarded to the scheduler
        self.tuning = Tuning(self)  # the scheduler's table re-solved on the traffic it served
        self.inbox = Inbox(self, settings.redis_timeout_s)  # replies and telemetry, on a connection of their own
        self.liveness = Liveness(client, settings)
        self.pending: dict[str, Pending] = {}
        self.workers: dict[str, p.Heartbeat] = {}
        self.gateways = 1
        self.failed: str | None = None  # why a loop stopped; the gateway is then not ready
        self.on_fatal = on_fatal
        self._on_workers = on_workers
        self.on_accuracy = on_accuracy  # how the promise to a forwarded request fared (the scheduler's metrics)
        self.leads_elsewhere = leads_elsewhere  # how many other models this process schedules (``Leading.turn``)
        self.wake = asyncio.Event()
        self.closing = False  # loops end at their next turn (a cancel can be swallowed, see close)
        self.outage = Outage()  # shared by the loops: one warning when Redis fails, one line when it is back
        self._tasks: list[asyncio.Task[None]] = []
        self._background = Tasks("background calls")  # cancels, a follower's notes

    # -- lifecycle ------------------------------------------------------------------------

    def new_shell(self) -> SchedulerShell:
        s = self.settings
        return SchedulerShell(s.gateway_id, self.replies, self._config, s.handoff_min_prompt,
                              lease_s=s.request_timeout_s + 30.0, policy=s.policy, routing=s.routing)

    async def start(self) -> None:
        try:
            await keyspace.migrate(self.client, self.settings.model_name)  # a deployment's names from before
            await saved_model.load(self.client, self.settings.model_name, self.shell)
            await self.refresh_workers()
            await self.leading.elect()
        except RedisError as exc:  # not ready until Redis answers; the watch loop retries
            log.warning("Redis is not reachable at start-up: %s", exc)
        self._tasks = [
            asyncio.create_task(self._supervised("send", self._send_loop), name="send"),
            asyncio.create_task(self._supervised("replies", self.inbox.loop), name="replies"),
            asyncio.create_task(self._supervised("workers", self._watch_loop), name="workers"),
            asyncio.create_task(self._supervised("election", self.leading.election_loop), name="election"),
            asyncio.create_task(self._supervised("arrivals", self.leading.arrivals_loop), name="arrivals"),
            asyncio.create_task(self._supervised("tuning", self.tuning.loop), name="tuning"),
        ]

    async def _supervised(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        try:
            await loop()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.critical("the %s loop stopped: %r", name, exc, exc_info=exc)
            self.failed = f"the {name} loop stopped: {exc!r}"
            self.fail_all("gateway_error", "The gateway lost its dispatch loop; retry on another replica.")
            if self.on_fatal is not None:
                self.on_fatal(self.failed)
            raise

    async def close(self) -> None:
        """Stop the loops. Cancelling alone is not enough: a cancel that lands as a Redis
        call's own timeout fires is reported as that timeout (``asyncio.timeout`` in 3.11),
        which the loop retries; so the loops also check ``closing`` every turn, and the
        wait here is bounded."""
        self.closing = True
        self.wake.set()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            _done, stuck = await asyncio.wait(self._tasks, timeout=5.0)
            for task in stuck:
                log.error("the %s loop did not stop within 5 s", task.get_name())
        self.fail_all("shutdown", "The gateway is shutting down; retry on another replica.")
        await self._background.drain(BACKGROUND_DRAIN_S)
        await self.inbox.close()
        await self.leading.close()
        with contextlib.suppress(RedisError):
            await saved_model.save(self.client, self.settings.model_name, self.shell)
            await traffic_log.flush(self.client, self.settings.model_name, self.shell.driver.traffic)
            await self.liveness.leave(self.replies)

    # -- requests -------------------------------------------------------------------------

    def alive_pools(self) -> set[str]:
        """Pools with a worker that takes jobs (alive, and not down)."""
        return {hb.pool for hb in self.workers.values() if not hb.down}

    def down_reasons(self) -> list[str]:
        """Why the workers that are alive but take no job say they are down."""
        return sorted({hb.down for hb in self.workers.values() if hb.down})

    def role(self) -> Role:
        """The scheduler this gateway's requests go to now: its own core while it holds the
        lease, the elected one's through ``wire.arrivals_stream`` otherwise (``election``)."""
        return self.leading if self.leading.leader else self.forwarding  # (queued here while it renews, ``lead``)

    async def submit(self, seq: p.SeqJob, who: Origin, received: float | None = None) -> Pending | Reject:
        """Hand a request to the scheduler: its contract (and a place to wait for its
        events), or the rejection to answer at once. ``received``: when it arrived here.

        The scheduler predicts from its decision; what came before it (this gateway's own work,
        a forwarded request's wait for a scheduler: a second through a failover), the budget
        wait aside, is not its model's error: it goes off the times the scheduler learns from
        (``first_token``, ``end``). A failover's second, learnt, read as the model 300-2,300x
        off and was saved for the next scheduler (docs/scheduling.md §15)."""
        now = time.monotonic()
        role = self.role()
        pending = self.pending[seq.rid] = Pending(seq, who, now, role)  # a forwarded one's events may come first
        try:
            decision = await role.submit(seq, who, now)
        except TimeoutError:
            self.cancel(seq.rid)  # should a scheduler take it up later, it never runs
            decision = Reject(seq.rid, "no_scheduler", f"no scheduler answered within {DECIDE_S:g} s", 1.0, 0.0)
        except BaseException:
            self.cancel(seq.rid)
            self.pending.pop(seq.rid, None)
            raise
        if isinstance(decision, Reject):
            self.pending.pop(seq.rid, None)
            return decision
        if received is not None:
            pending.before = max(0.0, time.monotonic() - received - who.budget_wait_s)
        pending.contract = decision
        self.wake.set()
        return pending

    async def explain_anywhere(self, rid: str) -> dict[str, object] | None:
        """The scheduler's ``explain`` of ``rid`` from whichever gateway schedules: a follower
        asks it over the arrivals stream and waits up to ``ASK_S``. None when the scheduler
        holds no such request (it has not arrived, or it has ended) or did not answer."""
        return await self.role().explain(rid)

    def snapshot(self) -> dict[str, object]:
        snap = self.shell.snapshot()
        snap["gateway"] = self.settings.gateway_id
        snap["model"] = self.settings.model_name  # the scheduling domain it belongs to
        snap["role"] = "scheduler" if self.leading.lead() else "follower"  # a follower's queue is the scheduler's
        snap["gateways"] = self.gateways
        snap["batches_in_flight"] = self.shell.leases
        snap["backlog"] = self.backlog()
        return snap

    def backlog(self) -> dict[str, dict[str, int]]:
        """This gateway's queued requests and tokens per pool (``SchedulerShell.backlog``)."""
        return {pool: {"requests": n, "tokens": t} for pool, (n, t) in self.shell.backlog().items()}

    def end(self, rid: str, ttft_s: float | None, total_s: float | None, tokens: int) -> Accuracy | None:
        """The request is over here, whichever way it ended (the one call at its end): its
        events stop being routed, its batch's lease learns it, and what it took (seconds from
        arrival; None: not seen) calibrates the contracts (the scheduler's, for a forwarded
        request, told in a note). How its promise fared (None for a forwarded one: the
        scheduler keeps the calibration)."""
        pending = self.pending.pop(rid, None)
        role = pending.role if pending is not None else self.leading  # (refused: only its promise goes)
        if pending is not None:
            ttft_s = None if ttft_s is None else pending.scheduled(ttft_s)
            total_s = None if total_s is None else pending.scheduled(total_s)
        return role.ended(rid, ttft_s, total_s, tokens, time.monotonic())

    def hand_over(self, rids: list[str]) -> None:
        """This gateway's own requests it had queued as the scheduler go to the next one
        (``Leading.step_down``), forwarded as promised (their clients hold contracts); a
        deadline counts from the request's arrival still."""
        now = time.monotonic()
        handed = 0
        for rid in rids:
            pending = self.pending.get(rid)
            if pending is not None and rid not in self.forwarding:  # one forwarded already stays pending there
                self.forwarding.hand_on(pending.seq, pending.who.waited(now - pending.created))
                pending.role = self.forwarding
                handed += 1
        if handed:
            log.info("handed %d queued requests to the next scheduler", handed)

    def first_token(self, rid: str, ttft_s: float) -> None:
        """A streamed request's first token came ``ttft_s`` after it arrived."""
        pending = self.pending.get(rid)
        if pending is not None:
            pending.role.first_token(rid, pending.scheduled(ttft_s), time.monotonic())

    async def xadd_or_warn(self, stream: str, fields: dict[bytes, bytes]) -> None:
        """One entry sent between gateways, in this turn's round trip; a failure is logged (each
        caller says what makes up for it)."""
        try:
            await self.batch.call("XADD", stream, "*", *flat(fields))
        except RedisError as exc:
            log.warning("could not write to %s: %s", stream, exc)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._background.spawn(coro)

    def fail_all(self, code: str, message: str) -> None:
        """End every waiting request with an error event (shutdown, a lost loop)."""
        for rid, pending in list(self.pending.items()):
            pending.events.put_nowait(p.Failed(rid, code, message))

    def cancel(self, rid: str) -> bool:
        """The client went away. True if the request was still queued: it will never be
        dispatched. Otherwise its worker is told (a TTL'd key for workers that have not
        read it yet, a pub/sub message for the one running it) and stops it within one
        decode step; its final event still arrives here. Harmless if repeated."""
        pending = self.pending.get(rid)
        if pending is not None and pending.role.cancel(rid, time.monotonic()):
            self.pending.pop(rid, None)
            return True
        self.spawn(send_cancel(self.client, self.settings.model_name, rid))
        return False

    # -- jobs out ---------------------------------------------------------------------------

    async def _send_loop(self) -> None:
        """Tick on every wake (an arrival, a slot back, capacity) and whenever the driver
        asks for one (``Driver.next_tick``: while requests wait and a slot is free)."""
        while not self.closing:
            due = self.shell.next_tick(time.monotonic())
            if due < math.inf:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, due - time.monotonic())):
                        await self.wake.wait()
            else:
                await self.wake.wait()
            self.wake.clear()
            if self.leading.leader and not self.leading.lead():  # nothing leaves until the lease is settled
                await asyncio.sleep(election.RENEW_S / 5)
                self.wake.set()
                continue
            sends, rejects = self.shell.tick(time.monotonic())
            for r in rejects:
                self.refuse_queued(r.request_id, r.reason, r.message)
            if sends:
                await self._send(sends)

    def refuse_queued(self, rid: str, code: str, message: str) -> None:
        """A queued request will not run: its final event, here or at the gateway that forwarded it."""
        origin = self.shell.take_origin(rid)
        if origin is None:
            self.route_event(p.Failed(rid, code, message))
            return
        reply_to, entry = origin
        events = p.encode_events([p.Failed(rid, code, message)])["m"]
        self.spawn(self.settle_quietly([(reply_to, b"m", events)], [entry]))

    async def _settle_arrivals(self, writes: list[tuple[str, bytes, bytes]], entries: list[str],
                               worker: str = "") -> bool:
        """Write ``(stream, field, payload)`` entries (a job for ``worker``: delivered to it)
        and acknowledge the arrival ``entries`` they answer, in one script (``election.DISPATCH``)
        fenced by the lease when there are entries; False, and this gateway steps down, if it
        no longer schedules."""
        keys, args = election.dispatch_args(self.settings.model_name, self.settings.gateway_id, writes, entries, worker)
        try:
            done = await self.batch.call("EVALSHA", election.DISPATCH_SHA, len(keys), *keys, *args)
        except NoScriptError:  # a fresh (or flushed) Redis: the script's text, which it keeps
            done = await self.batch.call("EVAL", election.DISPATCH, len(keys), *keys, *args)
        if done == -1:
            self.leading.step_down("another gateway schedules now")
            return False
        return True

    async def settle_quietly(self, writes: list[tuple[str, bytes, bytes]], entries: list[str]) -> None:
        try:
            await self._settle_arrivals(writes, entries)
        except RedisError as exc:  # not acknowledged: taken up again after RECLAIM_S, and decided anew
            log.warning("could not answer %d forwarded requests: %s", len(entries), exc)

    async def _send(self, sends: list[Send]) -> None:
        """XADD the batches, in the same round trip as whatever else this loop turn sends
        (``AutoPipeline``). A batch that cannot be encoded or queued fails its requests with
        a clear error and gives its slots back at once."""
        queued: list[Send] = []
        replies: list[Awaitable[object]] = []
        for send in sends:
            try:
                fields = p.encode_job(send.job)
            except Exception as exc:  # noqa: BLE001 - one bad job must not stop the loop
                log.error("batch %s cannot be encoded: %r", send.job.batch_id, exc)
                self._lost(send, "unencodable", f"The request could not be queued: {exc}")
                continue
            stream = wire.jobs_stream(self.settings.model_name, send.pool)
            if send.acks or send.worker:  # to its worker, and forwarded requests' arrivals acknowledged
                replies.append(self._settle_arrivals([(stream, b"m", fields["m"])], list(send.acks), send.worker))
            else:  # to whichever worker of the pool reads it first
                replies.append(self.batch.call("XADD", stream, "*", *flat(fields)))
            queued.append(send)
        if not queued:
            return
        results = await asyncio.gather(*replies, return_exceptions=True)
        for send, result in zip(queued, results, strict=True):
            if isinstance(result, Exception):
                log.warning("queueing batch %s failed: %s", send.job.batch_id, result)
                self._lost(send, "redis", f"Could not queue the request: {result}")
            elif result is False:  # not sent: the next scheduler takes its forwarded requests up, and gets ours
                self.hand_over([seq.rid for seq in send.job.seqs])

    def _lost(self, send: Send, code: str, message: str) -> None:
        self.shell.abort(send.batch, time.monotonic())
        for seq in send.job.seqs:
            self.route_event(p.Failed(seq.rid, code, message))
        self.wake.set()  # slots came back

    # -- replies -------------------------------------------------------------------------

    def handle(self, events: list[p.Event]) -> None:
        for ev in events:
            try:
                if isinstance(ev, p.BatchReport):
                    self.shell.completed(ev, time.monotonic())
                    self.wake.set()  # slots came back
                    continue
                if isinstance(ev, p.Finished | p.Failed):
                    tokens = ev.completion_tokens if isinstance(ev, p.Finished) else -1
                    if self.shell.finished(ev.rid, tokens, time.monotonic()):
                        self.wake.set()  # its slot came back
                self.route_event(ev)
            except Exception:  # noqa: BLE001 - one bad event must not stop the loop
                log.exception("dropping a reply event that could not be handled: %r", ev)

    def route_event(self, ev: p.Delta | p.Finished | p.Failed) -> None:
        pending = self.pending.get(ev.rid)
        if pending is not None:
            pending.events.put_nowait(ev)

    # -- workers, peers and leases ----------------------------------------------------------

    async def refresh_workers(self) -> None:
        """Renew this gateway's liveness, read live workers and gateways (their keys expire
        on Redis's clock), give the scheduler this gateway's share of each pool, and settle
        the requests of gateways that died. If Redis forgot this gateway (it restarted
        without its data, or a peer took this gateway for dead), every dispatched batch is
        lost: its requests fail now, with a clear error, and its slots come back."""
        view = await self.liveness.renew(self.replies)
        if view.forgotten:
            lost = self.shell.abort_all(time.monotonic())
            if lost:
                log.error("Redis no longer knows this gateway: %d requests in flight are lost", len(lost))
            for rid in lost:
                self.route_event(p.Failed(rid, "redis", "The request was lost by Redis; retry it."))
        for gateway_id in view.dead:
            swept = await self.liveness.sweep(gateway_id)
            if swept >= 0:
                log.warning("gateway %s is gone: settled %d of its requests", gateway_id, swept)
            if self.leading.leader:  # its queued requests leave the queue, the jobs sent to it their slots
                origin = wire.replies_stream(self.settings.model_name, gateway_id)  # (none: another model's)
                dropped = self.shell.origin_gone(origin, time.monotonic())
                if dropped:
                    await self.client.xack(self.leading.arrivals, wire.ARRIVALS_GROUP, *dropped)
        # this gateway's queued work per pool, for whatever scales the workers on it (the time
        # lets a reader skip a stale entry)
        backlog = orjson.dumps({"at": time.time(), **self.backlog()})
        await self.batch.call("HSET", wire.BACKLOG_HASH, self.settings.gateway_id, backlog)
        self.gateways = max(1, view.alive)
        self.seen(await self.liveness.workers())
        self.wake.set()

    def seen(self, workers: dict[str, p.Heartbeat]) -> None:
        """The live workers as just read: the view, the scheduler's capacity and the metrics
        change together."""
        self.workers = workers
        for note in self.shell.capacity(workers, time.monotonic()):
            log.info("%s", note)
        if self._on_workers is not None:
            self._on_workers(workers)

    async def _watch_loop(self) -> None:
        retry = Retrier(BACKOFF, self.outage)
        wait = WATCH_S
        saved = time.monotonic()
        while not self.closing:
            await asyncio.sleep(wait)
            expired = self.shell.expire(time.monotonic())
            for rid in expired:
                self.route_event(p.Failed(rid, "lost", "The request's batch was lost; retry it."))
            if expired:
                self.wake.set()
            started = time.monotonic()
            try:
                await self.refresh_workers()
                if started - saved >= MODEL_SAVE_S:
                    saved = started
                    await saved_model.save(self.client, self.settings.model_name, self.shell)
                    await traffic_log.flush(self.client, self.settings.model_name, self.shell.driver.traffic)
            except RedisError as exc:
                wait = retry.count(exc)
                continue
            wait = WATCH_S
            retry.succeeded(started)


async def send_cancel(client: aioredis.Redis, model: str, rid: str) -> None:
    """Tell ``model``'s workers ``rid`` is cancelled: a TTL'd key for those that have not read
    it yet, a message for the one running it."""
    pipe = client.pipeline(transaction=False)
    pipe.set(wire.cancel_key(model, rid), 1, ex=CANCEL_TTL_S)
    pipe.publish(wire.CANCEL_CHANNEL, rid)
    try:
        await pipe.execute()
    except RedisError as exc:
        log.warning("could not cancel %s: %s", rid, exc)
