"""What the scheduling shell reads off the workers' heartbeats, and off a priors file: each
pool's capacity, what the step times belong to (the identities a saved state must match), and
the step-time priors (a file's, or the profiles the workers measured). Pure: no I/O but the
priors file."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

import orjson

from common import protocol as p
from common import stepmodel
from common.pools import POOLS
from sched_core import PathConfig, SchedulerConfig


def scheduler_config(priors_path: str | None, **fields: Any) -> SchedulerConfig:
    """The scheduler's config: the given fields (the SLO it schedules for, its aging rate;
    left out, the defaults), with per-path step-time priors from a JSON file if one is given.

    The file is either a profile written by ``bench/cost_profile.py`` (its ``step_model`` object
    seeds the path named by its ``pool``), or ``{"cpu": {...}, "gpu": {...}}`` with any subset
    of the PathConfig fields (``decode_launch`` s, ``decode_seq`` s/sequence, ``kv_token``
    s/KV token, ``prefill_launch`` s, ``prefill_token`` s/prompt token, ``max_batch``,
    ``step_tokens``), at top level or under ``"priors"``; fields left out keep the packaged
    defaults. Raises ValueError naming the file and the field."""
    config = SchedulerConfig(**fields)
    if priors_path is None:
        return config
    try:
        with open(priors_path, "rb") as f:
            doc = orjson.loads(f.read())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"cost priors {priors_path}: {exc}") from None
    priors: object = doc.get("priors", doc) if isinstance(doc, dict) else None
    if isinstance(doc, dict) and "step_model" in doc:
        if doc.get("pool") not in POOLS:
            raise ValueError(f"cost priors {priors_path}: a profile needs a pool among {', '.join(POOLS)}")
        priors = {doc["pool"]: doc["step_model"]}
    if not isinstance(priors, dict) or not set(priors) <= set(POOLS):
        raise ValueError(f"cost priors {priors_path}: expected an object with keys among {', '.join(POOLS)}")
    paths = {}
    for pool, fields in priors.items():
        known = {f.name for f in dataclasses.fields(PathConfig)}
        unknown = set(fields) - known if isinstance(fields, dict) else {"(not an object)"}
        if unknown:
            raise ValueError(f"cost priors {priors_path}: {pool}: unknown {', '.join(sorted(unknown))}")
        try:
            paths[pool] = replace(getattr(config, pool), **fields)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cost priors {priors_path}: {pool}: {exc}") from None
    return replace(config, **paths)


def capacity_share(workers: dict[str, p.Heartbeat]) -> dict[str, tuple[int, int]]:
    """Live slots and workers per pool. A worker that says it is down counts for nothing."""
    slots: dict[str, int] = {pool: 0 for pool in POOLS}
    count: dict[str, int] = {pool: 0 for pool in POOLS}
    for hb in workers.values():
        if hb.down:  # alive, but its upstream does not answer: it takes no job
            continue
        slots[hb.pool] = slots.get(hb.pool, 0) + hb.slots
        count[hb.pool] = count.get(hb.pool, 0) + 1
    return {pool: (slots[pool], max(1, count[pool])) for pool in slots}


def running_by_pool(workers: dict[str, p.Heartbeat]) -> dict[str, int]:
    """Sequences the workers of each pool said they hold, at their last heartbeat."""
    out = dict.fromkeys(POOLS, 0)
    for hb in workers.values():
        if hb.pool in out and not hb.down:
            out[hb.pool] += hb.running
    return out


def worker_identity(hb: p.Heartbeat) -> str:
    """What a worker's step times belong to: the measured profile it publishes (its id: the
    machine's fingerprint and the fit, so a profile measured again is another), else its
    engine, model, device and dtype (an upstream engine, a worker that measured nothing)."""
    pid = hb.profile.get("id")
    if isinstance(pid, str) and pid:
        return pid
    fingerprint = hb.profile.get("fingerprint")
    if isinstance(fingerprint, str) and fingerprint:
        return f"{fingerprint}@{hb.profile.get('measured_at', '?')}"
    return f"{hb.engine}:{hb.model}:{hb.device}:{hb.dtype}"


def path_identity(workers: dict[str, p.Heartbeat], pool: str) -> str | None:
    """The identities of a pool's live workers (None: it has none): what a saved step-time
    model and calibration of that path must have been made with to be restored."""
    ids = sorted({worker_identity(hb) for hb in workers.values() if hb.pool == pool and not hb.down})
    return " ".join(ids) if ids else None


def engines_identity(workers: dict[str, p.Heartbeat]) -> str:
    """The engines and models the live workers run: what saved output lengths belong to."""
    return " ".join(sorted({f"{hb.engine}:{hb.model}" for hb in workers.values() if not hb.down}))


def measured_trust(workers: dict[str, p.Heartbeat], pool: str) -> float:
    """How firmly a pool's step model holds its measured prior: a profile measured while its
    worker was starved of CPU (``starved``: the share of its threads' time spent waiting for
    one) timed its neighbours as much as its engine, so it counts for (1 − starved)² of one
    measured quietly, slot-weighted over the pool's workers, and live steps overrule it sooner."""
    weights: list[tuple[int, float]] = []
    for hb in workers.values():
        if hb.pool == pool and not hb.down and stepmodel.published(hb.profile) is not None:
            starved = hb.profile.get("starved", 0.0)
            share = min(max(float(starved), 0.0), 0.9) if isinstance(starved, int | float) else 0.0
            weights.append((max(1, hb.slots), (1.0 - share) ** 2))
    if not weights:
        return 1.0
    return sum(slots * trust for slots, trust in weights) / sum(slots for slots, _ in weights)


def measured_prior(workers: dict[str, p.Heartbeat], pool: str, base: PathConfig) -> tuple[str, PathConfig] | None:
    """The prior of ``pool``'s step-time model from its live workers' measured profiles
    (``workers/selfprofile.py``): each coefficient the slot-weighted mean over the workers (a
    batch goes to whichever of them reads it first), with ``base``'s batch limit and step
    budget. Returns a key naming the profiles it came from, or None if no worker of the pool
    published one."""
    found: list[tuple[str, int, dict[str, float]]] = []
    for wid, hb in sorted(workers.items()):
        model = stepmodel.published(hb.profile) if hb.pool == pool and not hb.down else None
        if model is not None:  # (one this gateway cannot read: it keeps the prior it has)
            found.append((f"{wid}={hb.profile.get('fingerprint', '?')}", max(1, hb.slots), model))
    if not found:
        return None
    total = sum(slots for _, slots, _ in found)
    mean = {name: sum(slots * model[name] for _, slots, model in found) / total for name in stepmodel.TERMS}
    return " ".join(key for key, _, _ in found), replace(base, **mean)  # type: ignore[arg-type]


def served_context(workers: dict[str, p.Heartbeat], own: int) -> int:
    """The longest request (prompt plus completion tokens) every worker can run: the smallest
    context among the workers with a heartbeat, each its engine's where it publishes one (an
    upstream's: ``Heartbeat.context``) else ``own``, the model's; ``own`` with no worker.

    The smallest, not the largest: a job goes to the pool's stream (any of its workers reads
    it) unless placement picks a worker, and a re-delivered one goes to whichever worker claims
    it, in either pool the scheduler chooses, so a request can only be kept to the workers whose
    context fits by refusing it where one does not. A worker that says it is down counts too:
    it takes jobs again once its upstream answers."""
    return min((hb.context or own for hb in workers.values()), default=own)
