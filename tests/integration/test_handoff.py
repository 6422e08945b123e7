"""Disaggregated prefill: a cpu worker prefills, a gpu-pool worker decodes from its KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from common import protocol as p
from common import wire
from tests.integration.test_faults import REPLIES, Workers, _read_all
from workers.model_store import ModelSpec

pytestmark = [pytest.mark.redis, pytest.mark.model, pytest.mark.slow]

PROMPTS = ["Explain why the sky is blue.", "Write a haiku about the sea."]


def _prompt_ids(model_spec: ModelSpec, text: str) -> tuple[int, ...]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_spec.path)
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True)
    return tuple(out["input_ids"])


def _texts(events: list[p.Event]) -> dict[str, str]:
    out: dict[str, str] = {}
    for ev in events:
        if isinstance(ev, p.Delta | p.Finished):
            out[ev.rid] = out.get(ev.rid, "") + ev.text
    return out


def test_handoff_output_equals_one_worker_doing_both(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path, model_spec: ModelSpec
) -> None:
    ids = [_prompt_ids(model_spec, t) for t in PROMPTS]
    greedy = p.SamplingParams(16, temperature=0.0)
    ws = Workers(redis_url, tmp_path, "--model", str(model_spec.path))
    try:
        ws.start("--pool", "cpu")
        ws.start("--pool", "gpu")  # no CUDA here: the gpu pool runs on the CPU, same fp32 math
        # one sequence at a time: greedy decoding is deterministic for a given batch, but a
        # batch of other sequences (with their padding) changes the float rounding, which may
        # flip a near-tie late in the output; equal conditions on both paths make it exact
        for i, x in enumerate(ids):
            for mode, handoff in (("single", None), ("handoff", "gpu")):
                for stream in (False, True):
                    rid = f"{mode}-{i}-{int(stream)}"
                    seq = p.SeqJob(rid, x, greedy, stream=stream, handoff=handoff)
                    job = p.BatchJob(f"b-{rid}", REPLIES, 0, (seq,))
                    redis_client.xadd(wire.jobs_stream(model_spec.name, "cpu"), p.encode_job(job))
                    _read_all(redis_client, {rid}, timeout_s=120)
        rids = {f"{m}-{i}-{s}" for m in ("single", "handoff") for i in range(len(ids)) for s in (0, 1)}
        events = _read_all(redis_client, rids, timeout_s=30)
    finally:
        ws.stop_all()
    texts = _texts(events)
    finals = {e.rid: e for e in events if isinstance(e, p.Finished)}
    for i in range(len(ids)):
        for s in (0, 1):
            single, handed = f"single-{i}-{s}", f"handoff-{i}-{s}"
            assert texts[handed] == texts[single] and texts[single]
            assert finals[handed].completion_tokens == finals[single].completion_tokens
            assert finals[handed].prompt_tokens == len(ids[i])
    # the decode half really ran on the gpu pool, from the KV cache the cpu worker sent
    reports = [e for e in events if isinstance(e, p.BatchReport)]
    assert {r.pool for r in reports if "/handoff-" in r.batch_id} == {"gpu"}
    assert all(r.prefill_s == 0 for r in reports if "/handoff-" in r.batch_id)
    assert not redis_client.keys(wire.kv_key("*", "*"))  # cleaned up when each sequence finished
