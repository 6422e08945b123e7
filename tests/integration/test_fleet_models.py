"""`tokengate simulate --fleet redis://…` on a deployment that serves two models: each model's
profiles and live workers per pool, read from the workers' heartbeats on a real Redis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from common import protocol as p
from common import wire
from sched_core.simulate.cli import read_fleet

pytestmark = pytest.mark.redis

PACKAGED = Path(__file__).parents[2] / "sched_core" / "profiles" / "cpu-smollm2-135m.json"


def test_the_fleet_in_redis_is_read_per_model_with_its_live_workers(redis_client: redis.Redis, redis_url: str) -> None:
    profile = json.loads(PACKAGED.read_text())
    workers = [("w1", "small", "cpu"), ("w2", "small", "cpu"), ("w3", "large", "cpu"), ("w4", "large", "gpu")]
    for i, (wid, model, pool) in enumerate(workers):
        prof = {**profile, "name": f"{model}-{pool}", "model": model, "pool": pool, "measured_at": float(i)}
        hb = p.Heartbeat(wid, pool, pool, "float32", "echo", model, 8, 8, 1.0, 1.0, profile=prof)
        redis_client.set(wire.worker_key(wid), p.encode_heartbeat(hb), ex=60)
        redis_client.zadd(wire.WORKERS_ZSET, {wid: 1.0})
    fleet = read_fleet(redis_url)
    assert {m: {pool: prof.name for pool, prof in pools.items()} for m, pools in fleet.profiles.items()} == {
        "small": {"cpu": "small-cpu"}, "large": {"cpu": "large-cpu", "gpu": "large-gpu"}}
    assert fleet.workers == {("small", "cpu"): 2, ("large", "cpu"): 1, ("large", "gpu"): 1}
    assert fleet.models("all") == ["large", "small"] and fleet.models("small") == ["small"]
    with pytest.raises(ValueError, match="pick one with --fleet-model"):
        fleet.models(None)
