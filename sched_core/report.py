"""Derived thresholds and the JSON shapes of ``snapshot()`` and ``explain()``.

Both implementations gather the raw facts (their own state) and hand them to these
functions, so the two report in exactly the same words and shapes. Nothing here decides:
the decisions use the same inequalities in multiplied-out form (see docs/scheduling.md).
"""

from __future__ import annotations

import math
from typing import Any

from sched_core.types import PATHS


def finite(x: float) -> float | None:
    """JSON has no infinity: an unbounded threshold is reported as null."""
    return x if math.isfinite(x) else None


def thresholds(cpu: tuple[float, float], gpu: tuple[float, float], lam: float) -> dict[str, Any]:
    """B1, B2 and B*(λ) of one bucket, from each path's batch-time line ``S(B) = F + m·B``.

    B1: the crossover ``S_cpu(B1) = S_gpu(B1)``; below it the CPU finishes a batch sooner.
    B2 = F/m of the GPU: the batch size whose marginal work equals the launch cost; waiting
    for more requests never pays beyond it, whatever the arrival rate.
    B*(λ) = (λF − 1)/(1 + λm): the GPU waits for the next arrival while fewer are queued.
    """
    f_cpu, m_cpu = cpu
    f_gpu, m_gpu = gpu
    d_f, d_m = f_gpu - f_cpu, m_cpu - m_gpu
    if d_m > 0.0:
        b1 = max(0.0, d_f / d_m)
    else:
        b1 = math.inf if d_f > 0.0 else 0.0
    b2 = f_gpu / m_gpu if m_gpu > 0.0 else math.inf
    b_star = max(0.0, (lam * f_gpu - 1.0) / (1.0 + lam * m_gpu))
    return {"b1": finite(b1), "b2": finite(b2), "b_star": finite(b_star)}


def route_reason(
    *,
    target: int,
    free: tuple[int, int],
    capacity: tuple[int, int],
    eligible: bool,
    overdue: bool,
    holds: bool,
    queued: int,
    b_star: float,
) -> tuple[str, str]:
    """Which path a queued request is headed for, and why it is still waiting."""
    if overdue and capacity[0] > 0:
        return "cpu", "waited past T_cut: the tail cut sends it to cpu at the next free slot"
    name = PATHS[target]
    if not eligible:
        return name, "its tenant is ahead of its fair share and waits for the others"
    if capacity[target] <= 0:
        return name, "no worker offers capacity on any path"
    if free[target] <= 0:
        return name, f"{name} is busy: it leaves when slots come back"
    if holds:
        return name, (
            f"waiting for a larger {name} batch: {queued} queued, waiting pays below "
            f"B* = {b_star:.2f}"
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
) -> dict[str, Any]:
    """The JSON-serializable state: queues, fits, thresholds, tenants, capacity."""
    return {
        "now": now,
        "queued": queued,
        "buckets": buckets,
        "paths": dict(zip(PATHS, paths, strict=True)),
        "tail_cut": {
            "t_cut_s": finite(t_cut),
            "mu_cpu": mu_cpu,
            "lambda_cpu": lambda_cpu,
            "ttft_p99_slo_s": slo,
        },
        "fairness": {"min_counter": finite(min_counter), "tenants": tenants},
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
        "estimate": {"ttft_s": ttft_s, "total_s": total_s, "p99_s": p99_s},
    }
