"""Every Redis name tokengate writes carries the one hash tag (Redis Cluster: one slot)."""

from __future__ import annotations

from common import wire


def test_every_name_carries_the_hash_tag() -> None:
    names = [wire.jobs_stream("m", "cpu"), wire.bell_stream("w"), wire.replies_stream("g"), wire.gone_key("s"),
             wire.worker_key("w"), wire.gateway_requests("g"), wire.cancel_key("r"), wire.suspect_key("1-0"),
             wire.kv_key("r"), wire.progress_key("r"), wire.request("r"), wire.model_key("m"), wire.tenant("t"),
             wire.tenant_keys("t"), wire.api_key("p"), wire.budget("t"), wire.in_flight("t"), wire.usage("t", 1),
             wire.DEAD_LETTER_STREAM, wire.TELEMETRY_STREAM, wire.scheduler_lease("m"), wire.arrivals_stream("m"),
             wire.scheduler_term("m"),
             wire.WORKERS_ZSET, wire.GATEWAYS_ZSET, wire.PROFILES_HASH, wire.BACKLOG_HASH, wire.CANCEL_PREFIX,
             wire.TENANT_IDS, wire.TENANT_NAMES, wire.TENANT_PREFIX, wire.TENANT_KEYS_PREFIX, wire.KEY_PREFIX]
    assert all(name.startswith("{tg}:") for name in names)
