"""Where tokengate's Redis names fall on a Redis Cluster: a model's scheduling state in its
model's slot, what a request's budget scripts touch in its tenant's, the rest in the one slot
of ``{tg}``."""

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


def test_a_models_keys_share_its_slot_and_spread_over_models() -> None:
    for model in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-360M", "m"):
        replies = wire.replies_stream(model, "gw-1/" + model)
        names = [wire.jobs_stream(model, "cpu"), wire.jobs_stream(model, "gpu"), wire.bell_stream(model, "w"), replies,
                 wire.gone_key(replies), wire.arrivals_stream(model), wire.scheduler_lease(model),
                 wire.scheduler_term(model), wire.model_key(model), wire.telemetry_stream(model),
                 wire.dead_letter_stream(model), wire.cancel_key(model, "r"), wire.suspect_key(model, "1-0"),
                 wire.kv_key(model, "r"), wire.progress_key(model, "r")]
        assert all(name.startswith(f"{{tg:m:{model}}}:") for name in names)
        assert {key_slot(name.encode()) for name in names} == {key_slot(wire.model_slot(model).encode())}
    assert len({key_slot(wire.jobs_stream(f"model-{i}", "cpu").encode()) for i in range(50)}) > 40


def test_every_other_name_carries_the_one_hash_tag() -> None:
    names = [wire.worker_key("w"), wire.tenant("t"), wire.api_key("p"), wire.tokenizer_key("d"), wire.console_key("g"),
             wire.WORKERS_ZSET, wire.GATEWAYS_ZSET, wire.GATEWAY_REPLIES, wire.PROFILES_HASH, wire.BACKLOG_HASH,
             wire.CANCEL_CHANNEL, wire.TENANT_IDS, wire.TENANT_NAMES, wire.TENANT_PREFIX, wire.KEY_PREFIX]
    assert all(name.startswith("{tg}:") for name in names)
