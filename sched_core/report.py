"""Derived thresholds and the JSON shapes of ``snapshot()`` and ``explain()``.

Both implementations gather the raw facts (their own state) and hand them to these
functions, so the two report in exactly the same words and shapes. Nothing here decides:
the decisions use the same inequalities in multiplied-out form (see docs/scheduling.md).
"""

from __future__ import annotations

import math
from typing import Any

from common.pools import POOLS


def finite(x: float) -> float | None:
    """JSON has no infinity: an unbounded threshold is reported as null."""
    return x if math.isfinite(x) else None


def thresholds(cpu: tuple[float, float], gpu: tuple[float, float], b2: float) -> dict[str, Any]:
    """B1 and B2 of one bucket.

    B1: the crossover of the paths' batch lines ``S(B) = F + m·B`` (running sequences
    counted); below it the CPU finishes a batch sooner. B2: the most sequences of the bucket
    one GPU worker decodes within the TPOT SLO; past it, each added sequence pushes the
    running ones over the SLO, which is when the release rule may hold a batch.
    """
    f_cpu, m_cpu = cpu
    f_gpu, m_gpu = gpu
    d_f, d_m = f_gpu - f_cpu, m_cpu - m_gpu
    if d_m > 0.0:
        b1 = max(0.0, d_f / d_m)
    else:
        b1 = math.inf if d_f > 0.0 else 0.0
    return {"b1": finite(b1), "b2": finite(b2)}


def route_reason(
    *,
    target: int,
    free: tuple[int, int],
    capacity: tuple[int, int],
    eligible: bool,
    overdue: bool,
    holds: bool,
    tpot_slo: float,
) -> tuple[str, str]:
    """Which path a queued request is headed for, and why it is still waiting."""
    if overdue and capacity[0] > 0:
        return "cpu", "waited past T_cut: the tail cut sends it to cpu at the next free slot"
    name = POOLS[target]
    if not eligible:
        return name, "its tenant is ahead of its fair share and waits for the others"
    if capacity[target] <= 0:
        return name, "no worker offers capacity on any path"
    if free[target] <= 0:
        return name, f"{name} is busy: it leaves when slots come back"
    if holds:
        return name, (
            f"held: starting it now would push {name}'s running sequences past the "
            f"{tpot_slo * 1000:.0f} ms per-token SLO; it leaves when they finish or its own "
            f"time-to-first-token slack runs out"
        )
    return name, f"it leaves for {name} at the next tick"


def snapshot_dict(
    *,
    now: float,
    queued: int,
    buckets: list[dict[str, Any]],
    paths: list[dict[str, Any]],
    t_cut: float,
    mu_cpu: float,
    lambda_cpu: float,
    slo: float,
    tenants: dict[str, dict[str, Any]],
    min_counter: float,
    policy: dict[str, Any],
) -> dict[str, Any]:
    """The JSON-serializable state: queues, fits, thresholds, tenants, capacity, and the
    policy in force (``sched_core.smdp.describe``)."""
    return {
        "now": now,
        "queued": queued,
        "buckets": buckets,
        "paths": dict(zip(POOLS, paths, strict=True)),
        "tail_cut": {
            "t_cut_s": finite(t_cut),
            "mu_cpu": mu_cpu,
            "lambda_cpu": lambda_cpu,
            "ttft_p99_slo_s": slo,
        },
        "fairness": {"min_counter": finite(min_counter), "tenants": tenants},
        "policy": policy,
    }


def queued_explanation(
    *,
    request_id: str,
    tenant: str,
    bucket: int,
    max_prompt: int,
    requests_ahead: int,
    tokens_ahead: int,
    queued_in_bucket: int,
    waited_s: float,
    path: str,
    reason: str,
    counter: float,
    min_counter: float,
    t_cut: float,
    limits: dict[str, Any],
    ttft_s: float,
    total_s: float,
    p99_s: float,
) -> dict[str, Any]:
    """``explain()`` of a queued request; the estimate is re-made now, from arrival."""
    return {
        "request_id": request_id,
        "state": "queued",
        "tenant": tenant,
        "bucket": bucket,
        "max_prompt": max_prompt,
        "requests_ahead": requests_ahead,
        "tokens_ahead": tokens_ahead,
        "queued_in_bucket": queued_in_bucket,
        "waited_s": waited_s,
        "path": path,
        "reason": reason,
        "tenant_counter": counter,
        "min_counter": finite(min_counter),
        "t_cut_s": finite(t_cut),
        "thresholds": limits,
        "estimate": {"ttft_s": ttft_s, "total_s": total_s, "p99_s": p99_s},
    }
