"""Where tokengate's Redis names fall on a Redis Cluster: what a request's budget scripts touch
in its tenant's slot, everything else in the one slot of ``{tg}``."""

from __future__ import annotations

from redis.crc import key_slot

from common import wire


def test_a_tenants_keys_share_its_slot_and_spread_over_tenants() -> None:
    for tid in ("tn_0123456789abcdef", "tn_fedcba9876543210", "t"):
        names = [wire.budget(tid), wire.in_flight(tid), wire.open_requests(tid), wire.request(tid, "r1"),
                 wire.tenant_keys(tid), wire.usage(tid, 29000000)]
        assert all(name.startswith(f"{{tg:t:{tid}}}:") for name in names)
        assert {key_slot(name.encode()) for name in names} == {key_slot(wire.tenant_slot(tid).encode())}
    slots = {key_slot(wire.budget(f"tn_{i:016x}").encode()) for i in range(200)}
    assert len(slots) > 150  # 200 tenants over 16,384 slots: spread, not one shard


def test_every_other_name_carries_the_one_hash_tag() -> None:
    names = [wire.jobs_stream("m", "cpu"), wire.bell_stream("w"), wire.replies_stream("g"), wire.gone_key("s"),
             wire.worker_key("w"), wire.cancel_key("r"), wire.suspect_key("1-0"),
             wire.kv_key("r"), wire.progress_key("r"), wire.model_key("m"), wire.tenant("t"),
             wire.api_key("p"),
             wire.DEAD_LETTER_STREAM, wire.TELEMETRY_STREAM, wire.scheduler_lease("m"), wire.arrivals_stream("m"),
             wire.scheduler_term("m"),
             wire.WORKERS_ZSET, wire.GATEWAYS_ZSET, wire.PROFILES_HASH, wire.BACKLOG_HASH, wire.CANCEL_PREFIX,
             wire.TENANT_IDS, wire.TENANT_NAMES, wire.TENANT_PREFIX, wire.KEY_PREFIX]
    assert all(name.startswith("{tg}:") for name in names)
