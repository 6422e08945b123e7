"""The continuous-batching engine against the real model: same text as `generate`."""

from __future__ import annotations

import pytest
import torch

from workers.devices import DeviceChoice
from workers.hf_engine import HFEngine
from workers.model_store import ModelSpec
from workers.protocol import Delta, Finished, SamplingParams, SeqJob

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
