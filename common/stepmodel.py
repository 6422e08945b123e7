"""The step-time model of an engine, written once: its formulas, their fit to measured steps,
and the scheduler's prior made of it. A prefill step of B prompts of L tokens and a decode
step of n sequences holding K KV tokens each take

    P(B, L) = a + b·B·L + b2·B·L²        D(n, K) = c + d·n + e·n·K

(``b2`` is attention's quadratic term). A fit is ``{"prefill": {a, b, b2}, "decode": {c, d,
e}, "noise_cv": ...}``; ``step_model`` maps it onto the scheduler's ``PathConfig`` fields term
for term, attention as ``prefill_attention``. The worker's self-profile
(``workers/selfprofile.py``) and the simulator's measured profiles (``bench/cost_profile.py``,
``CostProfile.path_config``) both fit and map through here, and what a worker publishes in
its heartbeat is read back through ``published``."""

from __future__ import annotations

import itertools
import statistics
from typing import Any

import numpy as np

TINY = 1e-12  # the scheduler wants positive slopes
#: ``step_model``'s coefficients, as ``PathConfig`` names them (the online fit's five, then attention)
TERMS = ("decode_launch", "decode_seq", "kv_token", "prefill_launch", "prefill_token", "prefill_attention")


def nn_relative_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares on relative error, coefficients >= 0: the best of the fits on every
    subset of the columns whose coefficients all come out non-negative. Returns the
    coefficients and the spread (standard deviation) of the relative residuals."""
    y = np.maximum(y, 1e-9)
    weights = 1.0 / y
    best: tuple[float, np.ndarray] | None = None
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            sub = x[:, cols] * weights[:, None]
            theta, *_ = np.linalg.lstsq(sub, np.ones_like(y), rcond=None)
            if (theta < 0).any():
                continue
            full = np.zeros(x.shape[1])
            full[list(cols)] = theta
            err = float(np.sum((x @ full / y - 1.0) ** 2))
            if best is None or err < best[0]:
                best = (err, full)
    if best is None:  # every subset came out negative (degenerate points): the mean, flat
        best = (0.0, np.zeros(x.shape[1]))
        best[1][0] = float(np.mean(y))
    residual = x @ best[1] / y - 1.0
    return best[1], float(np.std(residual))


def prefill_s(fit_: dict[str, Any], batch: float, length: float) -> float:
    """P(B, L): one step prefilling ``batch`` prompts of ``length`` tokens."""
    p = fit_["prefill"]
    return float(p["a"] + p["b"] * batch * length + p["b2"] * batch * length * length)


def decode_s(fit_: dict[str, Any], running: float, kv_per_seq: float) -> float:
    """D(n, K): one decode step of ``running`` sequences holding ``kv_per_seq`` KV tokens each."""
    d = fit_["decode"]
    return float(d["c"] + d["d"] * running + d["e"] * running * kv_per_seq)


def fit(points: dict[str, Any]) -> dict[str, Any]:
    """``prefill(B, L) = a + b·B·L + b2·B·L²`` and ``decode(n, K) = c + d·n + e·n·K`` by
    relative least squares with non-negative coefficients. Without decode steps (an engine
    that answers whole in one step) decode costs the shortest step measured."""
    pre = points["prefill"]
    if not pre:
        raise ValueError("no prefill step was measured")
    xb = np.array([[1.0, p["batch"] * p["tokens"], p["batch"] * p["tokens"] ** 2] for p in pre])
    (a, b, b2), cv_pre = nn_relative_fit(xb, np.array([p["seconds"] for p in pre]))
    dec = points["decode"]
    if len(dec) >= 2:
        xd = np.array([[1.0, d["running"], d["running"] * d["kv_tokens"]] for d in dec])
        (c, d, e), cv_dec = nn_relative_fit(xd, np.array([d["seconds"] for d in dec]))
    else:
        c, d, e, cv_dec = min(p["seconds"] for p in pre), 0.0, 0.0, 0.0
    return {"prefill": {"a": float(a), "b": float(b), "b2": float(b2)},
            "decode": {"c": float(c), "d": float(d), "e": float(e)},
            "noise_cv": max(cv_pre, cv_dec), "noise_cv_prefill": cv_pre, "noise_cv_decode": cv_dec}


def step_model(fit_: dict[str, Any], max_batch: int, step_tokens: int) -> dict[str, Any]:
    """The scheduler's step-time prior (``PathConfig`` fields), term for term: decode
    ``c, d, e``; prefill ``a, b`` and attention's ``b2`` (``prefill_attention``)."""
    p, d = fit_["prefill"], fit_["decode"]
    return {"decode_launch": float(d["c"]), "decode_seq": max(TINY, float(d["d"])),
            "kv_token": max(TINY, float(d["e"])), "prefill_launch": float(p["a"]),
            "prefill_token": max(TINY, float(p["b"])), "prefill_attention": float(p["b2"]),
            "max_batch": max_batch, "step_tokens": step_tokens}  # 0: whole prompts, as the engine runs


def as_fit(model: dict[str, float]) -> dict[str, Any]:
    """``step_model``'s terms read back as a fit, for the formulas."""
    return {"prefill": {"a": model["prefill_launch"], "b": model["prefill_token"],
                        "b2": model.get("prefill_attention", 0.0)},
            "decode": {"c": model["decode_launch"], "d": model["decode_seq"], "e": model["kv_token"]}}


def serving(profile: dict[str, Any], model: dict[str, float], steps: int) -> dict[str, Any]:
    """A worker's measured ``profile`` with its formulas replaced by ``model``, fitted on
    ``steps`` of the workers' live steps (``sched_core.costmodel.fit_steps``; ``as_fit``; the measured spread kept):
    the workers as they run while serving, beside the gateway and whatever else shares their
    CPUs, where the profile timed the engine alone at start."""
    fit_ = {**as_fit(model), "noise_cv": float(profile.get("fit", {}).get("noise_cv", 0.0))}
    return {**profile, "fit": fit_, "learnt_steps": steps,
            "source": f"refit on {steps} live steps, from {profile.get('name', 'a measured profile')}"}


def published(profile: dict[str, Any]) -> dict[str, float] | None:
    """The step model a worker published (its heartbeat's ``profile["step_model"]``, made by
    ``step_model``): every term of ``TERMS`` as a float, a missing attention term as 0; None
    when it published none, or one this version cannot read."""
    model = profile.get("step_model")
    if not isinstance(model, dict):
        return None
    try:
        return {name: float(model.get(name, 0.0)) for name in TERMS}
    except (TypeError, ValueError):
        return None


def mixed_error(model: dict[str, Any], mixed: list[list[float]]) -> float | None:
    """Median relative error of the step model on the measured mixed steps (None: none ran)."""
    errors = []
    for prefill, seqs, kv, seconds in mixed:
        predicted = (model["decode_launch"] + model["decode_seq"] * seqs + model["kv_token"] * kv
                     + model["prefill_launch"] + model["prefill_token"] * prefill)  # attention: a chunk's is small
        if seconds > 0:
            errors.append(abs(predicted / seconds - 1.0))
    return statistics.median(errors) if errors else None


def summary(fit_: dict[str, Any]) -> dict[str, float]:
    """The two figures an operator reads: prefill tokens/s of a 512-token prompt, and the
    decode step of one sequence holding 256 KV tokens."""
    return {"prefill_tokens_per_s": 512.0 / max(prefill_s(fit_, 1, 512), 1e-9),
            "decode_step_ms": decode_s(fit_, 1, 256) * 1000.0}


def formula_points(fit_: dict[str, Any], prefill_grid: list[tuple[int, int]],
                   decode_grid: list[tuple[int, int]]) -> dict[str, list[dict[str, float]]]:
    """Noiseless points of a fit's formulas on measuring grids (a derived profile's points)."""
    return {"prefill": [{"batch": b, "tokens": n, "seconds": prefill_s(fit_, b, n)} for b, n in prefill_grid],
            "decode": [{"running": n, "kv_tokens": k, "seconds": decode_s(fit_, n, k)} for n, k in decode_grid]}
