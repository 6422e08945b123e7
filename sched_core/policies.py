"""Baseline policies with the scheduler's driving interface (arrive, tick, finished,
completed, worker_capacity, observe_steps), so the one driver (``sched_core.driver``) runs them
live in the gateway and in the simulator exactly as it runs ``sched_core.Scheduler``; and
``make_policy``, which builds any of them from a ``--policy`` spec.

All keep one FIFO queue and free a slot as each request finishes. They give no latency
contract (``arrive`` answers None). ``paths`` is the order in which paths are tried: the
default ``("gpu", "cpu")`` fills the GPU first and overflows to the CPU, as a load balancer that
knows no costs would.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from common.pools import POOLS
from sched_core import IMPLEMENTATIONS
from sched_core.driver import TICK_S, Policy
from sched_core.reference import RateMeter
from sched_core.smdp import PolicyTable, packaged_table
from sched_core.types import BatchTimings, Dispatch, Reject, Request, SchedulerConfig

if TYPE_CHECKING:  # the simulator's package imports this module
    from sched_core.simulate.profile import CostProfile

BOTH = ("gpu", "cpu")
#: The gateway's policy unless ``--policy`` says another: the scheduler with the packaged SMDP
#: table, which dispatches below capacity as the heuristic does and admits and dispatches
#: under overload as the table found best (docs/scheduling.md §16, issue 41).
DEFAULT_POLICY = "smdp"


class FifoPolicy:
    """FCFS continuous batching: whatever is queued leaves at once for free slots."""

    def __init__(self, max_batch: Mapping[str, int], paths: Sequence[str] = BOTH) -> None:
        self.paths = tuple(paths)
        self.max_batch = dict(max_batch)
        self._queue: deque[Request] = deque()
        self._cap = dict.fromkeys(POOLS, 0)
        self._used = dict.fromkeys(POOLS, 0)
        self._path_of: dict[str, str] = {}
        self._batches: dict[int, tuple[str, ...]] = {}
        self._next_batch = 1

    @property
    def queued(self) -> int:
        return len(self._queue)

    def backlog(self) -> tuple[int, int]:
        """Queued requests and their tokens (prompt, and expected output or else max_tokens)."""
        return len(self._queue), sum(r.prompt_tokens + (r.expected_output_tokens or r.max_tokens)
                                     for r in self._queue)

    def arrive(self, req: Request, now: float) -> None:
        self._queue.append(req)

    def cancel(self, request_id: str, now: float) -> bool:
        """Remove a queued request; False if it is not queued."""
        for r in self._queue:
            if r.id == request_id:
                self._queue.remove(r)
                return True
        return False

    def completed(self, timings: BatchTimings, now: float) -> None:
        """A batch ended: its requests not yet ``finished`` free their slots."""
        for rid in self._batches.pop(timings.batch_id, ()):
            self.finished(rid, 0, now)

    def finished(self, request_id: str, output_tokens: int, now: float) -> bool:
        path = self._path_of.pop(request_id, None)
        if path is None:
            return False
        self._used[path] -= 1
        return True

    def worker_capacity(self, path: str, slots: int, now: float, workers: int = 1,
                        step_tokens: int = 0) -> None:
        self._cap[path] = slots

    def observe_steps(self, path: str, records: list[tuple[int, int, int, float]],
                      now: float) -> None:
        pass  # baselines use no cost model

    def next_wake(self, now: float) -> float:
        return math.inf  # only arrivals and completions change what it does

    def free(self, path: str) -> int:
        return self._cap[path] - self._used[path] if path in self.paths else 0

    def release(self, path: str, size: int, out: list[Dispatch | Reject]) -> None:
        batch = tuple(self._queue.popleft() for _ in range(size))
        bid = self._next_batch
        self._next_batch += 1
        ids = tuple(r.id for r in batch)
        for rid in ids:
            self._path_of[rid] = path
        self._batches[bid] = ids
        self._used[path] += size
        out.append(Dispatch(bid, path, 0, ids, 0.0))

    def tick(self, now: float) -> list[Dispatch | Reject]:
        out: list[Dispatch | Reject] = []
        for path in self.paths:
            while self._queue and self.free(path) > 0:
                self.release(path, min(len(self._queue), self.free(path),
                                       self.max_batch[path]), out)
        return out


class FixedBatch(FifoPolicy):
    """Batches of exactly ``size`` requests (the remainder leaves once arrivals end)."""

    def __init__(self, size: int, max_batch: Mapping[str, int],
                 paths: Sequence[str] = BOTH) -> None:
        super().__init__(max_batch, paths)
        self.size = size
        self._draining = False

    def end_of_arrivals(self, now: float) -> None:
        self._draining = True

    def tick(self, now: float) -> list[Dispatch | Reject]:
        out: list[Dispatch | Reject] = []
        while len(self._queue) >= self.size or (self._draining and self._queue):
            n = min(self.size, len(self._queue))
            path = next((p for p in self.paths
                         if self.free(p) >= n and self.max_batch[p] >= n), None)
            if path is None:
                break
            self.release(path, n, out)
        return out


class TimeWindow(FifoPolicy):
    """Triton's dynamic batcher: a batch leaves when it reaches the preferred size (the
    path's max batch, or its free slots) or when its oldest request waited ``delay_s``."""

    def __init__(self, delay_s: float, max_batch: Mapping[str, int],
                 paths: Sequence[str] = BOTH) -> None:
        super().__init__(max_batch, paths)
        self.delay_s = delay_s

    def next_wake(self, now: float) -> float:
        """When the oldest request's window closes; past that, only a freed slot (which
        ticks anyway) can release anything."""
        due = self._queue[0].arrival + self.delay_s if self._queue else math.inf
        return due if due > now else math.inf

    def tick(self, now: float) -> list[Dispatch | Reject]:
        out: list[Dispatch | Reject] = []
        while self._queue:
            path = next((p for p in self.paths if self.free(p) > 0), None)
            if path is None:
                break
            full = min(self.max_batch[path], self.free(path))
            if len(self._queue) < full and now - self._queue[0].arrival < self.delay_s:
                break
            self.release(path, min(len(self._queue), full), out)
        return out


class ThreeRegime(FifoPolicy):
    """The source notes' policy, from static cost curves: a batch smaller than the crossover
    B1 goes to the CPU at once; a larger one waits for the GPU while the marginal-cost rule
    says waiting pays (``(n + 1)/λ < F − m·n``), and goes at once beyond that. No buckets, no
    fairness, no tail cut, no refit: one FIFO queue and the profiles' curves."""

    def __init__(self, profiles: Mapping[str, CostProfile], max_batch: Mapping[str, int],
                 rate_window_s: float = 10.0, default_output: int = 64,
                 tick_s: float = TICK_S) -> None:
        super().__init__(max_batch, BOTH)
        self.profiles = dict(profiles)
        self.tick_s = tick_s
        self._rate = RateMeter(rate_window_s)
        self._out = float(default_output)

    def arrive(self, req: Request, now: float) -> None:
        super().arrive(req, now)
        self._rate.add(now, 1.0)

    def finished(self, request_id: str, output_tokens: int, now: float) -> bool:
        if not super().finished(request_id, output_tokens, now):
            return False
        self._out += 0.1 * (output_tokens - self._out)
        return True

    def next_wake(self, now: float) -> float:
        """Polled like the scheduler while a path has a free slot."""
        free = any(self.free(p) > 0 for p in self.paths)
        return now + self.tick_s if self._queue and free else math.inf

    def _fm(self, path: str, length: int) -> tuple[float, float]:
        """Launch cost F and per-request cost m of a batch padded to ``length``."""
        p, nbar = self.profiles[path], self._out
        launch = p.prefill_a + p.decode_c * nbar
        kv = length + nbar / 2.0
        per = (p.prefill_b + p.prefill_b2 * length) * length + (p.decode_d + p.decode_e * kv) * nbar
        return launch, per

    def tick(self, now: float) -> list[Dispatch | Reject]:
        out: list[Dispatch | Reject] = []
        while self._queue:
            n = len(self._queue)
            head = min(n, self.max_batch["gpu"])
            length = max(self._queue[i].prompt_tokens for i in range(head))
            target = "gpu"
            if self._cap["cpu"] > 0 and self._cap["gpu"] > 0 and "cpu" in self.profiles:
                fc, mc = self._fm("cpu", length)
                fg, mg = self._fm("gpu", length)
                target = "cpu" if fc + mc * n < fg + mg * n else "gpu"
            elif self._cap["gpu"] <= 0:
                target = "cpu"
            if target == "cpu" and self.free("cpu") <= 0:
                target = "gpu"  # a small batch takes a free gpu rather than wait
            free = self.free(target)
            if free <= 0:
                break
            size = min(n, free, self.max_batch[target])
            grows = n < min(free, self.max_batch[target])
            if target == "gpu" and grows and self._holds(n, length, now):
                break
            self.release(target, size, out)
        return out

    def _holds(self, n: int, length: int, now: float) -> bool:
        f, m = self._fm("gpu", length)
        gain = f - m * n
        if gain <= 0.0:
            return False
        return n + 1 < self._rate.rate(now) * gain and (n + 1) * (now - self._rate.last) < gain


POLICY_FORMS = ("tokengate", "smdp", "smdp:FILE", "fcfs", "gpu-only", "three-regime",
                "fixed:batch=B", "fixed:window_ms=W", "fixed:batch=B,window_ms=W")


def make_policy(spec: str, config: SchedulerConfig, *, max_batch: Mapping[str, int] | None = None,
                profiles: Mapping[str, CostProfile] | None = None, implementation: str = "cython",
                tick_s: float = TICK_S) -> Policy:
    """The one factory of policies, for the gateway's ``--policy`` and the simulator alike.
    Each name means one thing:

    - ``tokengate``: the scheduler (``implementation``: the compiled core or its twin);
    - ``smdp``: the scheduler with the design notes' SMDP table (``sched_core.smdp``), the
      packaged one, or ``smdp:FILE``, a table ``tokengate policy solve`` wrote (a table the
      config already carries wins over the packaged one);
    - ``fcfs``: FCFS continuous batching; ``gpu-only``: the same on the gpu pool alone;
    - ``fixed:batch=B[,window_ms=W]``: a batcher of B requests. Without a window a batch leaves
      only when B requests wait and B slots are free (a closed simulation drains the rest when
      arrivals end; a gateway, whose arrivals never end, refuses this form). With ``window_ms``
      it is Triton's dynamic batcher: a batch leaves at B (or the free slots) or once its
      oldest request waited W ms; ``fixed:window_ms=W`` takes B from the path's max batch;
    - ``three-regime``: the source notes' static policy, from cost ``profiles`` (the simulator's).

    Options after the colon also take ``paths=gpu`` or ``paths=gpu+cpu`` (the default): the
    pools a baseline uses, in order. ``max_batch`` overrides the config's per-path limit.
    Raises ValueError with the accepted forms."""
    name, _, args = spec.partition(":")
    if name == "smdp":  # its argument is a path, not knobs; a bad table says what is wrong with it
        table = PolicyTable.load(args) if args else config.policy_table or packaged_table()
        return IMPLEMENTATIONS[implementation](replace(config, policy_table=table))
    if max_batch is None:
        max_batch = {p: config.path(i).max_batch for i, p in enumerate(POOLS)}
    try:
        knobs = dict(kv.split("=", 1) for kv in args.split(",")) if args else {}
        paths = tuple(knobs.pop("paths", "+".join(BOTH)).split("+"))
        if not paths or any(p not in POOLS for p in paths):
            raise ValueError(paths)
        if name == "tokengate" and not args:
            return IMPLEMENTATIONS[implementation](config)
        if name in ("fcfs", "gpu-only") and not knobs:
            return FifoPolicy(max_batch, ("gpu",) if name == "gpu-only" else paths)
        if name == "three-regime" and not args and profiles is not None:
            return ThreeRegime(profiles, max_batch, tick_s=tick_s)
        if name == "fixed" and knobs and set(knobs) <= {"batch", "window_ms"}:
            batch = int(knobs["batch"]) if "batch" in knobs else None
            if "window_ms" not in knobs and batch is not None and batch >= 1:
                return FixedBatch(batch, max_batch, paths)
            window_ms = float(knobs["window_ms"])
            if window_ms >= 0.0 and (batch is None or batch >= 1):
                cap = {p: b if batch is None else min(batch, b) for p, b in max_batch.items()}
                return TimeWindow(window_ms / 1000.0, cap, paths)
    except (KeyError, ValueError):
        pass
    why = " (it needs cost profiles: the simulator's)" if name == "three-regime" and profiles is None else ""
    raise ValueError(f"unknown policy {spec!r}{why}: expected one of {', '.join(POLICY_FORMS)} "
                     "(B >= 1, W >= 0; options may add paths=gpu or paths=gpu+cpu)")
