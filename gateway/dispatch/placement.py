"""Which worker of a pool runs each dispatched request (``--routing``, docs/scheduling.md §15).

The core decides what leaves and for which pool; this picks, request by request, the worker
of that pool. Only a worker with a free slot is a candidate; which requests each worker holds
is kept here, from dispatch until the scheduler's one ledger of slots (``Driver``) gives the
request's slot back (``Driver.on_free`` calls ``release``). With no worker free (a heartbeat
not yet seen, a previous scheduler's sequences), a request goes to the pool's stream for
whichever worker reads it. With one worker in the pool there is nothing to choose: its jobs go
to the pool's stream. The rules (``ROUTINGS`` in ``gateway.settings``):

- ``prefix`` (the default): the worker whose first token comes earliest, its measured prefill
  (the profile it published at start, ``workers/selfprofile.py``) over the prompt tokens it
  has not prefilled yet (its last telemetry, plus what was sent to it since) and the part of
  this prompt its engine would not find cached. What an engine holds is estimated here: the
  hashes of the leading ``BLOCK``-token blocks of the prompts sent to it, least recently sent
  dropped first beyond the prompt tokens its engine says it can keep (``Heartbeat.prefix_cache``;
  0, an engine that reuses nothing, gets no credit). A conversation's next turn therefore stays
  on the replica that holds its history until that replica's queue costs more than the
  prefill it saves, or it has no free slot: then it spills.
- ``worker``: the same without the cache credit (the earliest first token; ties to the worker
  holding fewer requests).
- ``round-robin``: each request to the next worker in turn that has a free slot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from common import protocol as p
from common import stepmodel

BLOCK = 16  # prompt tokens per block: the grain at which a cached prefix is estimated
TOKEN_S = 1e-4  # seconds per prompt token assumed for a worker that published no profile


def block_hashes(prompt: tuple[int, ...]) -> list[int]:
    """A hash per whole leading block of ``prompt``, each covering every token before it: two
    prompts share their first k hashes exactly when they share their first k blocks."""
    out: list[int] = []
    h = 0
    for end in range(BLOCK, len(prompt) + 1, BLOCK):
        h = hash((h, prompt[end - BLOCK:end]))
        out.append(h)
    return out


@dataclass(slots=True)
class _Worker:
    pool: str
    slots: int
    launch_s: float  # its measured prefill launch
    token_s: float  # its measured seconds per prompt token
    cache_blocks: int = 0  # prompt blocks its engine keeps for reuse (0: none)
    queued: int = 0  # prompt tokens it had not prefilled at its last telemetry
    sent: int = 0  # prompt tokens sent to it since
    held: set[str] = field(default_factory=set)
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)  # blocks sent, least recent first

    def first_token_s(self, prompt: int, cached: int = 0) -> float:
        return self.launch_s + (self.queued + self.sent + prompt - cached) * self.token_s

    def cached(self, hashes: list[int]) -> int:
        """Prompt tokens of a prompt with these block hashes its engine should find cached."""
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n * BLOCK

    def remember(self, hashes: list[int]) -> None:
        if not self.cache_blocks:  # its engine keeps nothing
            return
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a request went and why (``explain``): its worker, the prompt tokens that worker
    was expected to find cached, and each candidate's predicted first token (seconds)."""

    worker: str
    prompt_tokens: int
    cached_tokens: int
    first_token_s: dict[str, float]


class Placement:
    def __init__(self, routing: str = "prefix") -> None:
        self.routing = routing
        self._workers: dict[str, _Worker] = {}
        self._at: dict[str, Placed] = {}  # request -> where it went
        self._turn: dict[str, int] = {}  # per pool: round-robin's next

    def workers(self, heartbeats: dict[str, p.Heartbeat]) -> None:
        """The live workers that take jobs, with their slots, measured speed and cache."""
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
            w.cache_blocks = hb.prefix_cache // BLOCK if self.routing == "prefix" else 0
            live[wid] = w
        self._workers = live

    def observe(self, worker: str, queued_prefill: int) -> None:
        """A worker's telemetry: the prompt tokens it holds unprefilled now."""
        w = self._workers.get(worker)
        if w is not None:
            w.queued, w.sent = queued_prefill, 0

    def place(self, pool: str, seqs: tuple[p.SeqJob, ...]) -> dict[str, str]:
        """Each request's worker ('' for the pool's stream)."""
        out: dict[str, str] = {}
        pool_workers = [(wid, w) for wid, w in self._workers.items() if w.pool == pool]
        if len(pool_workers) < 2:  # no choice to make: the pool's stream, which its one worker reads
            return out
        for s in sorted(seqs, key=lambda s: -len(s.prompt_ids)):  # the longest prompts choose first
            free = [(wid, w) for wid, w in pool_workers if len(w.held) < w.slots]
            if not free:
                out[s.rid] = ""
                continue
            n = len(s.prompt_ids)
            # hashed only where a candidate's engine caches (``cache_blocks`` is 0 but under prefix routing)
            hashes = block_hashes(s.prompt_ids) if any(w.cache_blocks for _, w in free) else []
            cached = {wid: w.cached(hashes) for wid, w in free}
            predicted = {wid: w.first_token_s(n, cached[wid]) for wid, w in free}
            if self.routing == "round-robin":  # the next in the pool's order with a free slot
                turn, ids, has_slot = self._turn.get(pool, 0), [wid for wid, _ in pool_workers], dict(free)
                k = next(k for k in range(len(ids)) if ids[(turn + k) % len(ids)] in has_slot)
                wid = ids[(turn + k) % len(ids)]
                self._turn[pool] = turn + k + 1
            else:
                wid = min(free, key=lambda f: (predicted[f[0]], len(f[1].held), f[0]))[0]
            w = self._workers[wid]
            w.held.add(s.rid)
            w.sent += n - cached[wid]
            w.remember(hashes)
            self._at[s.rid] = Placed(wid, n, cached[wid], {k: round(v, 4) for k, v in predicted.items()})
            out[s.rid] = wid
        return out

    def release(self, rid: str) -> None:
        """The request ended (or its batch did): its slot on its worker is free."""
        placed = self._at.pop(rid, None)
        w = self._workers.get(placed.worker) if placed is not None else None
        if w is not None:
            w.held.discard(rid)

    def placed(self, rid: str) -> Placed | None:
        """Where a running request went, and why."""
        return self._at.get(rid)

    def held(self) -> dict[str, int]:
        """Requests placed per worker, not yet ended."""
        return {wid: len(w.held) for wid, w in self._workers.items()}
