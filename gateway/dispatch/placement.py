"""Which worker of a pool runs each dispatched request (``--routing worker``, docs/scheduling.md §15).

The core decides what leaves and for which pool; this picks, request by request, the worker
of that pool whose first token comes earliest: its measured prefill (the profile it
published at start, ``workers/selfprofile.py``) over the prompt tokens it has not prefilled
yet (its last telemetry, plus what was sent to it since) and this prompt. Only a worker with
a free slot is a candidate; which requests each worker holds is kept here, from dispatch
until the scheduler's one ledger of slots (``Driver``) gives the request's slot back
(``Driver.on_free`` calls ``release``). With no worker free (a heartbeat not yet seen, a previous
scheduler's sequences), a request goes to the pool's stream for whichever worker reads it.
A tie goes to the worker holding fewer requests, then to the one that ran the same tenant's
prompt with the same first tokens last (``PREFIX_TOKENS``): an engine that caches prefixes
reuses it. With one worker in the pool there is nothing to choose: its jobs go to the pool's
stream, as without placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common import protocol as p
from common import stepmodel

PREFIX_TOKENS = 32  # the prompt tokens a prefix hint compares
TOKEN_S = 1e-4  # seconds per prompt token assumed for a worker that published no profile
HINTS = 4096  # prefix hints kept (the oldest go first)


@dataclass(slots=True)
class _Worker:
    pool: str
    slots: int
    launch_s: float  # its measured prefill launch
    token_s: float  # its measured seconds per prompt token
    queued: int = 0  # prompt tokens it had not prefilled at its last telemetry
    sent: int = 0  # prompt tokens sent to it since
    held: set[str] = field(default_factory=set)

    def first_token_s(self, prompt: int) -> float:
        return self.launch_s + (self.queued + self.sent + prompt) * self.token_s


class Placement:
    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._at: dict[str, str] = {}  # request -> its worker
        self._hints: dict[tuple[str, tuple[int, ...]], str] = {}  # (tenant, first tokens) -> the worker that ran it

    def workers(self, heartbeats: dict[str, p.Heartbeat]) -> None:
        """The live workers that take jobs, with their slots and measured speed."""
        live: dict[str, _Worker] = {}
        for wid, hb in heartbeats.items():
            if hb.down:
                continue
            model = stepmodel.published(hb.profile)
            launch, token = (model["prefill_launch"], model["prefill_token"]) if model is not None else (0.0, TOKEN_S)
            w = self._workers.get(wid)
            if w is None:
                w = _Worker(hb.pool, hb.slots, launch, token)
            w.pool, w.slots, w.launch_s, w.token_s = hb.pool, hb.slots, launch, max(token, 0.0)
            live[wid] = w
        self._workers = live

    def observe(self, worker: str, queued_prefill: int) -> None:
        """A worker's telemetry: the prompt tokens it holds unprefilled now."""
        w = self._workers.get(worker)
        if w is not None:
            w.queued, w.sent = queued_prefill, 0

    def place(self, pool: str, seqs: tuple[p.SeqJob, ...], tenants: dict[str, str]) -> dict[str, str]:
        """Each request's worker ('' for the pool's stream); ``tenants`` names each request's tenant."""
        out: dict[str, str] = {}
        pool_workers = [(wid, w) for wid, w in self._workers.items() if w.pool == pool]
        if len(pool_workers) < 2:  # no choice to make: the pool's stream, which its one worker reads
            return out
        for s in sorted(seqs, key=lambda s: -len(s.prompt_ids)):  # the longest prompts choose first
            n = len(s.prompt_ids)
            hint = (tenants.get(s.rid, ""), s.prompt_ids[:PREFIX_TOKENS])
            preferred = self._hints.get(hint) if n >= PREFIX_TOKENS else None
            free = [(w.first_token_s(n), len(w.held), wid != preferred, wid) for wid, w in pool_workers
                    if len(w.held) < w.slots]
            if not free:
                out[s.rid] = ""
                continue
            wid = min(free)[3]
            w = self._workers[wid]
            w.held.add(s.rid)
            w.sent += n
            self._at[s.rid] = out[s.rid] = wid
            if n >= PREFIX_TOKENS:
                self._hints.pop(hint, None)
                self._hints[hint] = wid
                if len(self._hints) > HINTS:
                    del self._hints[next(iter(self._hints))]
        return out

    def release(self, rid: str) -> None:
        """The request ended (or its batch did): its slot on its worker is free."""
        wid = self._at.pop(rid, None)
        w = self._workers.get(wid) if wid is not None else None
        if w is not None:
            w.held.discard(rid)

    def held(self) -> dict[str, int]:
        """Requests placed per worker, not yet ended."""
        return {wid: len(w.held) for wid, w in self._workers.items()}
