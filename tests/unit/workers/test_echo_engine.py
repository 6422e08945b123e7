from common.protocol import Delta, Finished, SamplingParams, SeqJob
from workers.engine import EchoEngine


def test_echo_answers_a_fixed_number_of_tokens() -> None:
    engine = EchoEngine(tokens=4)
    engine.add(SeqJob("a", (1, 2), SamplingParams(10)))
    engine.add(SeqJob("b", (1,), SamplingParams(2), stream=True))
    result = engine.step()
    done = {e.rid: e for e in result.events if isinstance(e, Finished)}
    assert done["a"].text == " echo" * 4 and done["a"].completion_tokens == 4
    assert done["a"].finish_reason == "stop"
    assert done["b"].completion_tokens == 2 and done["b"].finish_reason == "length"
    assert [e.tokens for e in result.events if isinstance(e, Delta)] == [1, 2]
    assert not engine.busy


def test_echo_cancel_ends_the_sequence_with_a_cancelled_event() -> None:
    engine = EchoEngine()
    engine.add(SeqJob("a", (1,), SamplingParams(3)))
    assert engine.cancel("a") and not engine.cancel("a")
    events = engine.step().events
    assert events == [Finished("a", "", "cancelled", 1, 0)]
    assert not engine.busy


def test_stepping_echo_emits_one_token_per_step_and_resumes() -> None:
    engine = EchoEngine(tokens=3, step_s=1e-6)
    engine.add(SeqJob("s", (1,), SamplingParams(10), stream=True))
    first = engine.step()
    assert [e.tokens for e in first.events if isinstance(e, Delta)] == [1]
    assert first.progress["s"] == ((0,), len(" echo"))
    resumed = EchoEngine(tokens=3, step_s=1e-6)
    resumed.add(SeqJob("s", (1,), SamplingParams(10), stream=True, resume_ids=(0,), resume_chars=5))
    events = resumed.step().events + resumed.step().events
    assert [e.tokens for e in events if isinstance(e, Delta)] == [2, 3]
    assert [e.completion_tokens for e in events if isinstance(e, Finished)] == [3]


def test_echo_step_totals() -> None:
    engine = EchoEngine(tokens=3, step_s=1e-6)
    engine.add(SeqJob("a", (1, 2, 3), SamplingParams(10)))
    engine.add(SeqJob("b", (1, 2), SamplingParams(10)))
    assert (engine.queued_prefill, engine.running) == (5, 0)
    first = engine.step()
    assert (first.prefill_tokens, first.decode_seqs, first.kv_tokens) == (5, 0, 0)
    assert first.step_s > 0 and first.record().ms == first.step_s * 1000
    assert (engine.queued_prefill, engine.running) == (0, 2)
    engine.add(SeqJob("c", (1,), SamplingParams(10)))
    second = engine.step()  # a and b held 3+1 and 2+1 tokens; c is prefilled
    assert (second.prefill_tokens, second.decode_seqs, second.kv_tokens) == (1, 2, 7)


def test_a_step_that_prefills_takes_its_prompt_tokens_time_too() -> None:
    engine = EchoEngine(tokens=3, step_s=0.001, prefill_s=2e-5)
    engine.add(SeqJob("long", tuple(range(1, 1001)), SamplingParams(10)))
    prefill = engine.step()  # 1 ms + 1,000 tokens x 20 us
    assert prefill.prefill_tokens == 1000 and prefill.step_s >= 0.021
    decode = engine.step()  # nothing left to prefill: the step alone
    assert decode.prefill_tokens == 0 and decode.step_s < 0.021
