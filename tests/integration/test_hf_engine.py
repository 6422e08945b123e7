"""The continuous-batching engine against the real model: same text as `generate`."""

from __future__ import annotations

import pytest
import torch

from common.protocol import Delta, Finished, SamplingParams, SeqJob
from workers.devices import DeviceChoice
from workers.hf_engine import HFEngine
from workers.model_store import ModelSpec

pytestmark = pytest.mark.model

CPU = DeviceChoice("cpu", "float32", False, "test")
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Count to five.",
    "Why is the sky blue? Explain in detail please, with physics.",
]


@pytest.fixture(scope="module")
def engine(model_spec: ModelSpec) -> HFEngine:
    return HFEngine(model_spec.path, CPU, slots=8)


def _ids(engine: HFEngine, text: str) -> tuple[int, ...]:
    out = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tuple(out["input_ids"] if hasattr(out, "keys") else out)


def _run(engine: HFEngine, joins: dict[int, list[SeqJob]]) -> tuple[dict[str, str], dict[str, Finished]]:
    """Step the engine, adding sequences at the given step numbers; return text per rid."""
    texts: dict[str, str] = {}
    done: dict[str, Finished] = {}
    step = 0
    while step <= max(joins) or engine.busy:
        for job in joins.get(step, []):
            engine.add(job)
        for ev in engine.step().events:
            texts[ev.rid] = texts.get(ev.rid, "") + ev.text
            if isinstance(ev, Finished):
                done[ev.rid] = ev
        step += 1
    return texts, done


def test_sequences_joining_between_steps_match_generate(engine: HFEngine) -> None:
    ids = [_ids(engine, t) for t in PROMPTS]
    greedy = SamplingParams(16, temperature=0.0)
    expected = []
    for x in ids:
        out = engine.model.generate(torch.tensor([x]), max_new_tokens=16, do_sample=False)
        expected.append(engine.tokenizer.decode(out[0][len(x):], skip_special_tokens=True))
    joins = {
        0: [SeqJob("a", ids[0], greedy), SeqJob("b", ids[1], greedy, stream=True)],
        3: [SeqJob("c", ids[2], greedy)],
        4: [SeqJob("d", ids[3], greedy, stream=True)],
    }
    texts, done = _run(engine, joins)
    assert [texts[r] for r in "abcd"] == expected
    assert done["b"].finish_reason == "length" and done["b"].completion_tokens == 16
    assert all(done[r].prompt_tokens == len(ids[i]) for i, r in enumerate("abcd"))


def test_stop_string_and_seeded_sampling(engine: HFEngine) -> None:
    ids = _ids(engine, PROMPTS[1])
    texts, done = _run(engine, {0: [SeqJob("s", ids, SamplingParams(40, 0.0, stop=("sea",)))]})
    assert "sea" not in texts["s"] and done["s"].finish_reason == "stop"
    seeded = SamplingParams(12, temperature=0.9, top_p=0.9, seed=7)
    first, _ = _run(engine, {0: [SeqJob("x", ids, seeded)]})
    again, _ = _run(engine, {0: [SeqJob("y", ids, seeded), SeqJob("z", _ids(engine, PROMPTS[2]), seeded)]})
    assert first["x"] == again["y"]


def test_cancel_frees_the_slot_within_one_step(engine: HFEngine) -> None:
    ids = _ids(engine, PROMPTS[3])
    engine.add(SeqJob("long", ids, SamplingParams(200, 0.0), stream=True))
    engine.add(SeqJob("other", ids, SamplingParams(3, 0.0)))
    engine.step()
    assert engine.cancel("long")
    events = engine.step().events
    cancelled = [e for e in events if isinstance(e, Finished) and e.rid == "long"]
    assert cancelled and cancelled[0].finish_reason == "cancelled"
    assert not any(isinstance(e, Delta) and e.rid == "long" for e in events)
    while engine.busy:
        engine.step()
    assert not engine.cancel("long")  # late cancel is harmless
    assert engine.free_slots == engine.slots


def test_ignore_eos_generates_exactly_max_tokens(engine: HFEngine) -> None:
    ids = _ids(engine, PROMPTS[0])  # greedy, this answer ends well before 24 tokens
    _, natural = _run(engine, {0: [SeqJob("n", ids, SamplingParams(24, 0.0))]})
    _, forced = _run(engine, {0: [SeqJob("f", ids, SamplingParams(24, 0.0, ignore_eos=True))]})
    assert natural["n"].finish_reason == "stop" and natural["n"].completion_tokens < 24
    assert forced["f"].finish_reason == "length" and forced["f"].completion_tokens == 24


def _alone(engine: HFEngine, job: SeqJob, step_tokens: int) -> tuple[str, int]:
    """The text of one sequence run alone with this budget, and its prefill passes. Alone,
    nothing decodes while it is prefilled: ``max_prefill_tokens`` is what chunks it."""
    most = engine.max_prefill_tokens
    engine.step_tokens, engine.max_prefill_tokens = step_tokens, step_tokens or most
    try:
        engine.add(job)
        text, passes = "", 0
        while engine.busy:
            result = engine.step()
            passes += len(result.prefills)
            text += "".join(e.text for e in result.events if e.rid == job.rid)
        return text, passes
    finally:
        engine.step_tokens, engine.max_prefill_tokens = 0, most


def test_chunked_prefill_gives_the_same_greedy_output(engine: HFEngine) -> None:
    greedy = SamplingParams(16, temperature=0.0)
    for i, prompt in enumerate(PROMPTS):
        ids = _ids(engine, prompt)
        for job in (SeqJob(f"p{i}", ids, greedy), SeqJob(f"s{i}", ids, greedy, stream=True, resume_ids=ids[-5:])):
            whole, one = _alone(engine, job, 0)
            chunked, passes = _alone(engine, job, 8)  # chunks of 8 tokens: several per prompt
            assert one == 1 and passes == -(-len(job.prompt_ids + job.resume_ids) // 8)
            assert chunked == whole, prompt


def test_a_long_prompt_joining_running_sequences_keeps_each_step_within_budget(engine: HFEngine) -> None:
    budget = 32
    engine.step_tokens = budget
    try:
        forever = SamplingParams(400, temperature=0.0, ignore_eos=True)
        for i in range(4):
            engine.add(SeqJob(f"r{i}", _ids(engine, PROMPTS[i]), forever))
        first = engine.step()  # nothing decodes yet: the budget does not apply
        assert first.prefill_tokens == sum(len(_ids(engine, p)) for p in PROMPTS) and engine.running == 4
        long_ids = _ids(engine, " ".join(PROMPTS * 4))
        assert len(long_ids) > 4 * budget
        engine.add(SeqJob("long", long_ids, SamplingParams(4, temperature=0.0)))
        assert engine.queued_prefill == len(long_ids) and engine.free_slots == engine.slots - 5
        steps = []
        while engine.running < 5:
            steps.append(engine.step())
        prefilled = sum(s.prefill_tokens for s in steps)
        assert prefilled == len(long_ids) and engine.queued_prefill == 0
        assert engine.prefill_budget(4) == budget - 4 and engine.prefill_budget(0) == engine.max_prefill_tokens
        for s in steps:
            assert s.decode_seqs == 4  # no running sequence waits for the long prompt
            assert s.prefill_tokens == budget - 4 or (s is steps[-1] and s.prefill_tokens < budget - 4)
        for before, after in zip(steps, steps[1:], strict=False):
            assert after.kv_tokens == before.kv_tokens + 4  # each running row grew by one token
        joined = engine.step()
        assert joined.decode_seqs == 5 and joined.kv_tokens == steps[-1].kv_tokens + 4 + len(long_ids)
    finally:
        engine.reset()
        engine.step_tokens = 0


def test_the_engine_uses_the_cache_keyword_of_its_transformers_without_a_deprecation(
        engine: HFEngine, caplog: pytest.LogCaptureFixture) -> None:
    """transformers 5.2x renamed ``past_key_values`` to ``cache`` and warns (once a process) on
    the old name: a worker printed that warning at every start."""
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()  # a warning given earlier in this process would not show again
    hf_logging.enable_propagation()
    caplog.set_level("WARNING")
    params = SamplingParams(max_tokens=4, temperature=0.0)
    try:
        _run(engine, {0: [SeqJob("kw-0", _ids(engine, PROMPTS[0]), params)],
                      1: [SeqJob("kw-1", _ids(engine, PROMPTS[1]), params)]})
    finally:
        hf_logging.disable_propagation()
    deprecated = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert not deprecated, deprecated
