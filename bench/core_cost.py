"""Scheduling-core benchmark: arrive + dispatch cost per request, both implementations.

Run from the repository root (after ``python setup.py build_ext --inplace``)::

    python -m bench.core_cost                 # table
    python -m bench.core_cost --json          # one JSON object per line
    python -m bench.core_cost --policy smdp   # with the packaged SMDP table (or smdp:FILE)

For each queue depth Q the scheduler is first filled with Q requests (8 buckets, 100
tenants, arriving over one second, no capacity offered, untimed). Then capacity is offered
(cpu 8 slots, gpu 64) and the steady state is timed: each 1 ms round admits as many new
requests as the previous round dispatched (so the depth stays at Q; they arrive evenly
spread over the round and ``arrive`` is called at each one's arrival time), ticks once, and
reports every dispatched batch completed (timed as the default priors would predict, so the
fitted curves stay put). The stream is the same for both implementations, so their decisions,
hence the mean batch size over all repeats, must agree.

``ns_per_request`` is arrive + dispatch: the time inside ``arrive`` per admitted request plus
the time inside ``tick`` per dispatched request. The time inside ``completed`` (once per
batch: the refit, output lengths, slots) is reported beside it as ``completed_ns`` per
request. Building request and timing objects is the caller's work and is not timed. Each
figure is the best of ``--repeat`` runs of ``--requests`` dispatched requests. With
``--policy smdp`` the scheduler carries the SMDP table, whose actions differ by macro-state
(the decisions, hence the batches, then differ from the heuristic's); the heuristic classifies
the state and looks up its action too, so the lookup's own cost is measured against a build
from before it (docs/benchmarks.md, "The SMDP policy").
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from time import perf_counter_ns

if __package__ in (None, ""):
    # Run as a file, bench/ would be sys.path[0] and this module would shadow the package.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from common.pools import POOLS  # noqa: E402
from sched_core import (  # noqa: E402
    IMPLEMENTATIONS,
    BatchTimings,
    Dispatch,
    Request,
    SchedulerConfig,
)
from sched_core.policies import make_policy  # noqa: E402

BUCKETS = SchedulerConfig().bucket_bounds
TENANTS = 100
ROUND_S = 0.001


class Workload:
    """A reproducible stream of requests spread over all buckets and tenants."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.weights = [self.rng.choice((500.0, 1000.0, 2000.0, 4000.0, 8000.0))
                        for _ in range(TENANTS)]
        self.count = 0

    def take(self, n: int, start: float, span: float) -> list[Request]:
        """``n`` requests arriving evenly over ``[start, start + span)``."""
        rng = self.rng
        out = []
        for j in range(n):
            i = self.count
            self.count += 1
            k = i % len(BUCKETS)
            low = BUCKETS[k - 1] if k else 0
            tenant = rng.randrange(TENANTS)
            out.append(Request(
                id=f"r{i}", tenant=f"t{tenant}", weight=self.weights[tenant],
                prompt_tokens=rng.randint(low + 1, BUCKETS[k]), max_tokens=256,
                arrival=start + span * j / n,
                expected_output_tokens=rng.choice((0, rng.randint(8, 256))),
                priority=1 if rng.random() < 0.1 else 0))
        return out


def _timings(d: Dispatch, rng: random.Random) -> BatchTimings:
    """What a worker would report: the batch timed by the default priors (the fit stays put)."""
    cost = SchedulerConfig().path(POOLS.index(d.path))
    size = len(d.request_ids)
    length = BUCKETS[d.bucket]
    outputs = tuple(rng.randint(1, 256) for _ in range(size))
    return BatchTimings(
        batch_id=d.batch_id, path=d.path, batch_size=size, prompt_tokens=length,
        prefill_s=cost.prefill_launch + cost.prefill_token * size * length, decode_steps=max(outputs),
        decode_s=cost.decode_launch * max(outputs) + cost.decode_seq * sum(outputs),
        output_tokens=outputs)


def measure(impl: str, queued: int, requests: int, repeat: int, seed: int,
            policy: str = "tokengate") -> dict[str, object]:
    """Steady-state cost per request at a queue depth of ``queued``."""
    config = SchedulerConfig(max_queued=2 * queued)
    if policy != "tokengate":  # the smdp forms: the table, from the one factory
        config = make_policy(policy, config).config  # type: ignore[attr-defined]
    sched = IMPLEMENTATIONS[impl](config)
    work = Workload(seed)
    rng = random.Random(seed + 1)
    for req in work.take(queued, 0.0, 1.0):
        sched.arrive(req, req.arrival)
    now = 1.0
    sched.worker_capacity("cpu", 8, now)
    sched.worker_capacity("gpu", 64, now)
    arrive, tick, completed = sched.arrive, sched.tick, sched.completed
    best: dict[str, object] = {}
    want = 72
    all_batches = all_dispatched = 0
    for _ in range(repeat):
        t_arrive = t_tick = t_done = 0
        admitted = dispatched = batches = 0
        while dispatched < requests:
            batch = work.take(want, now, ROUND_S)
            now += ROUND_S
            t0 = perf_counter_ns()
            for req in batch:
                arrive(req, req.arrival)
            t1 = perf_counter_ns()
            decisions = tick(now)
            t2 = perf_counter_ns()
            done = [_timings(d, rng) for d in decisions if isinstance(d, Dispatch)]
            t3 = perf_counter_ns()
            for timings in done:
                completed(timings, now)
            t4 = perf_counter_ns()
            t_arrive += t1 - t0
            t_tick += t2 - t1
            t_done += t4 - t3
            admitted += len(batch)
            batches += len(done)
            want = sum(t.batch_size for t in done)
            dispatched += want
        all_batches += batches
        all_dispatched += dispatched
        total = t_arrive / admitted + t_tick / dispatched
        if not best or total < best["ns_per_request"]:  # type: ignore[operator]
            best = {
                "impl": impl, "policy": policy, "queued": queued, "ns_per_request": total,
                "arrive_ns": t_arrive / admitted, "dispatch_ns": t_tick / dispatched,
                "completed_ns": t_done / dispatched, "requests": dispatched,
            }
    # Same stream, same decisions: both implementations report the same batching.
    best["mean_batch"] = all_dispatched / all_batches
    best["queued_at_end"] = sched.queued
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON lines, no table")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--requests", type=int, default=20_000,
                        help="requests dispatched per timed run")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--policy", default="tokengate", help="tokengate, smdp or smdp:FILE")
    args = parser.parse_args(argv)

    rows = []
    for queued in args.sizes:
        ref = measure("reference", queued, args.requests, args.repeat, args.seed, args.policy)
        fast = measure("cython", queued, args.requests, args.repeat, args.seed, args.policy)
        speedup = ref["ns_per_request"] / fast["ns_per_request"]  # type: ignore[operator]
        fast["speedup_vs_reference"] = speedup
        rows += [ref, fast]
    base = {r["impl"]: r["ns_per_request"] for r in rows if r["queued"] == min(args.sizes)}
    for r in rows:
        r["vs_smallest_queue"] = r["ns_per_request"] / base[r["impl"]]  # type: ignore[operator]

    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    table = Table(title=f"sched_core: arrive + dispatch per request (steady state), policy {args.policy}")
    for col in ("impl", "queued", "arrive ns", "dispatch ns", "ns/request", "completed ns",
                "mean batch", f"× at Q={min(args.sizes):,}", "speedup"):
        table.add_column(col, justify="left" if col == "impl" else "right")
    for r in rows:
        table.add_row(
            str(r["impl"]), f"{r['queued']:,}", f"{r['arrive_ns']:,.0f}",
            f"{r['dispatch_ns']:,.0f}", f"{r['ns_per_request']:,.0f}",
            f"{r['completed_ns']:,.0f}", f"{r['mean_batch']:.1f}",
            f"{r['vs_smallest_queue']:.2f}",
            f"{r['speedup_vs_reference']:.1f}×" if "speedup_vs_reference" in r else "")
    Console(width=120).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
