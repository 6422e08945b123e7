"""A follower's side of a gateway (``election``; docs/scheduling.md §15), the remote
``role.Role``: its requests go to the elected scheduler over ``wire.arrivals_stream`` and
wait for its decision; what the
follower learns of them afterwards (the workers' final events and batch reports, a first
token, an end, a cancel) goes the same way; questions (``explain``) wait for an answer. The
answers come on this gateway's reply stream, which the dispatcher reads and hands here.

It acts through its host, the gateway's dispatcher (``Host``), which it never imports."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any, Protocol

from redis.exceptions import RedisError

from common import protocol as p
from common import wire
from gateway.dispatch import election
from gateway.dispatch.scheduling import Origin
from gateway.redis_batch import AutoPipeline
from gateway.settings import GatewaySettings
from sched_core import Contract, Reject
from sched_core.contracts import Accuracy

log = logging.getLogger("tokengate.dispatch")

ASK_S = 1.0  # a follower waits this long for the scheduler's answer to a question (``explain_anywhere``)
DECIDE_S = 5.0  # a follower waits this long for the scheduler's decision (a failover takes ~1 s)


class Host(Protocol):
    """What the follower's side asks of the gateway's dispatcher."""

    settings: GatewaySettings
    batch: AutoPipeline
    replies: str

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...

    async def xadd_or_warn(self, stream: str, fields: dict[bytes, bytes]) -> None: ...

    def route_event(self, ev: p.Delta | p.Finished | p.Failed) -> None: ...


class Forwarding:
    """The requests this gateway forwarded (until they end here), their decisions awaited,
    and the questions asked."""

    def __init__(self, d: Host) -> None:
        self.d = d
        self.arrivals = wire.arrivals_stream(d.settings.model_name)  # this model's scheduler reads it
        self._decisions: dict[str, asyncio.Future[Contract | Reject | None]] = {}  # forwarded, undecided
        self._remote: set[str] = set()  # requests this gateway forwarded, until they end here
        self._asked: dict[str, asyncio.Future[dict[str, object] | None]] = {}  # questions to the scheduler

    def __contains__(self, rid: str) -> bool:
        return rid in self._remote

    async def submit(self, seq: p.SeqJob, who: Origin, now: float) -> Contract | Reject | None:
        """The scheduler's decision on ``seq``: its contract, its refusal, or None (a baseline
        policy admits without one). TimeoutError when none came within ``DECIDE_S``."""
        decided = self._decisions[seq.rid] = asyncio.get_running_loop().create_future()
        self._remote.add(seq.rid)
        admitted = False
        try:
            await self._arrive(seq, who)
            async with asyncio.timeout(DECIDE_S):
                decision = await decided
            admitted = not isinstance(decision, Reject)
            return decision
        finally:
            self._decisions.pop(seq.rid, None)
            if not admitted:  # nothing to tell the scheduler about it later
                self._remote.discard(seq.rid)

    def first_token(self, rid: str, ttft_s: float, now: float) -> None:
        self._tell(election.Note(election.FIRST, rid, ttft_s=ttft_s))

    def ended(self, rid: str, ttft_s: float | None, total_s: float | None, tokens: int,
              now: float) -> Accuracy | None:
        """The scheduler learns it in a note, and keeps the calibration (None here)."""
        if rid in self._remote:
            self._remote.discard(rid)
            self._tell(election.Note(election.END, rid, ttft_s, total_s, tokens))
        return None

    def cancel(self, rid: str, now: float) -> bool:
        """The scheduler drops it if still queued, and says so with a final event (False:
        not known here to be queued)."""
        self._tell(election.Note(election.CANCEL, rid))
        return False

    async def explain(self, rid: str) -> dict[str, object] | None:
        """The scheduler's ``explain`` of ``rid``, waited for up to ``ASK_S`` (None: it holds
        no such request, or did not answer)."""
        ask = os.urandom(8).hex()
        answer = self._asked[ask] = asyncio.get_running_loop().create_future()
        try:
            await self._send(election.encode_question(election.Question(rid, ask, self.d.replies)))
            async with asyncio.timeout(ASK_S):
                return await answer
        except TimeoutError:
            log.info("the scheduler did not explain %s within %g s", rid, ASK_S)
            return None
        finally:
            self._asked.pop(ask, None)

    def hand_on(self, seq: p.SeqJob, who: Origin) -> None:
        """Forward a request this gateway had admitted as the scheduler, to the next one:
        promised (``election.Arrival``), no decision awaited (a refusal still ends it,
        ``_decided``)."""
        self._remote.add(seq.rid)
        self.d.spawn(self._hand_on(seq, who))

    async def _hand_on(self, seq: p.SeqJob, who: Origin) -> None:
        try:
            await self._arrive(seq, who, promised=True)
        except RedisError as exc:
            self._remote.discard(seq.rid)
            self.d.route_event(p.Failed(seq.rid, "redis", f"The request could not reach the new scheduler: {exc}"))

    async def _arrive(self, seq: p.SeqJob, who: Origin, promised: bool = False) -> None:
        """The arrival on ``wire.arrivals_stream``, answered on this gateway's reply stream."""
        fields = election.encode_arrival(seq, who, self.d.replies, promised)
        await self.d.batch.call("XADD", self.arrivals, "*", *flat(fields))

    def _tell(self, note: election.Note) -> None:
        """Tell the scheduler about a request this gateway forwarded."""
        self.d.spawn(self._send(election.encode_note(note)))

    def pass_on(self, events: list[p.Event]) -> None:
        """What the scheduler must learn of the workers' events here: slots back (the reports
        of batches it sent, not this gateway's own), forwarded requests ended."""
        mine = f"{self.d.settings.gateway_id}:"
        news: list[p.Event] = [
            ev for ev in events
            if (isinstance(ev, p.BatchReport) and not ev.batch_id.startswith(mine))
            or (isinstance(ev, p.Finished | p.Failed) and ev.rid in self._remote)
        ]
        if news:
            self.d.spawn(self._send(election.encode_events(news)))

    def answered(self, fields: dict[bytes, bytes]) -> bool:
        """A reply-stream entry that answers this gateway's forwarded requests or questions is
        taken here (True); the workers' events are not (False)."""
        if election.DECISION in fields:
            self._decided(fields[election.DECISION])
        elif election.EXPLAINED in fields:
            self._explained(fields[election.EXPLAINED])
        else:
            return False
        return True

    def _decided(self, raw: bytes) -> None:
        """The scheduler's answer to a forwarded request. A second answer (a new scheduler
        took the request up again) counts only if it refuses what was promised: the request
        then ends with that refusal."""
        try:
            rid, decision = election.decode_decision(raw)
        except p.ProtocolError as exc:
            log.error("dropping an unreadable decision: %s", exc)
            return
        waiting = self._decisions.pop(rid, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(decision)
        elif isinstance(decision, Reject):
            self.d.route_event(p.Failed(rid, decision.reason, decision.message))

    def _explained(self, raw: bytes) -> None:
        try:
            ask, explain = election.decode_explained(raw)
        except p.ProtocolError as exc:
            log.error("dropping an unreadable answer: %s", exc)
            return
        waiting = self._asked.get(ask)
        if waiting is not None and not waiting.done():
            waiting.set_result(explain)

    async def _send(self, fields: dict[bytes, bytes]) -> None:
        await self.d.xadd_or_warn(self.arrivals, fields)  # if lost: the slot comes back with the report


def flat(fields: dict[bytes, bytes] | dict[str, bytes]) -> list[bytes | str]:
    """A stream entry's fields as XADD's arguments."""
    return [x for item in fields.items() for x in item]
