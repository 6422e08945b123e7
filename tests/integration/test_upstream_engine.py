"""The upstream engine on its own against llama.cpp's server (``llama-cpp-python[server]``):
several sequences at once, the step records it infers, cancelling, an upstream that is not
there yet, and the context it does not say."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.llamacpp import LlamaServer
from common import protocol as p
from gateway.cli.embedded_redis import free_port
from tests.integration.helpers import run_engine
from workers.upstream import UpstreamEngine

pytest.importorskip("llama_cpp.server", reason="the llamacpp extra (make install-llamacpp)")

pytestmark = pytest.mark.model

GREEDY = p.SamplingParams(24, temperature=0.0)
QUESTIONS = ("Name three colours.", "What is the capital of Italy?", "Count to five.")
#: asked before each question's run: llama.cpp's server reuses the KV cache of the longest prefix
#: shared with the prompt before, and a prompt evaluated from another cached prefix can turn a
#: greedy near-tie the other way. After this one (its first word none of the questions'), every
#: question, through the engine in whatever order the server takes them or direct, is evaluated
#: from the chat template's cached prefix alone.
BEFORE = "Please say yes."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    s = LlamaServer(tmp_path_factory.mktemp("llamacpp") / "server.log").start()
    yield s
    s.stop()


@pytest.fixture
def engine(server: LlamaServer) -> Iterator[UpstreamEngine]:
    e = UpstreamEngine(server.url, slots=3, timeout_s=30)
    yield e
    e.close()


def _ask(server: LlamaServer, question: str) -> str:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": GREEDY.max_tokens, "temperature": 0}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    return str(reply.json()["choices"][0]["message"]["content"])


def _direct(server: LlamaServer, question: str) -> str:
    """The server's own answer, from the cache state the engine's request met (``BEFORE``)."""
    _ask(server, BEFORE)
    return _ask(server, question)


def test_several_sequences_at_once_answer_as_direct_calls_and_their_steps_are_inferred(
    engine: UpstreamEngine, server: LlamaServer
) -> None:
    assert engine.down == "" and engine.model  # probed at start: the server's own model name
    _ask(server, BEFORE)
    for i, q in enumerate(QUESTIONS):
        engine.add(p.SeqJob(f"s{i}", (1,) * (10 + i), GREEDY, stream=i == 0, messages=(("user", q),)))
    assert engine.free_slots == 0 and engine.queued_prefill == 10 + 11 + 12
    results = run_engine(engine)
    texts = {ev.rid: ev.text for r in results for ev in r.events if isinstance(ev, p.Finished)}
    deltas = "".join(ev.text for r in results for ev in r.events if isinstance(ev, p.Delta))
    assert texts["s0"] == "" and deltas == _direct(server, QUESTIONS[0])  # streamed, token by token
    assert texts["s1"] == _direct(server, QUESTIONS[1]) and texts["s2"] == _direct(server, QUESTIONS[2])

    records = [rec for r in results for rec in r.records()]
    prefills = [rec for rec in records if rec.prefill_tokens]
    assert sorted(rec.prefill_tokens for rec in prefills) == [10, 11, 12]  # one per first token
    decodes = [rec for rec in records if not rec.prefill_tokens]
    assert decodes and all(rec.decode_seqs >= 1 and rec.kv_tokens > 0 and rec.ms > 0 for rec in decodes)
    # the server runs one sequence at a time: a first token waits for the sequences before it,
    # and a decode step is one token of one sequence (a few ms here, far below a first token)
    assert max(rec.ms for rec in prefills) > 5 * sorted(rec.ms for rec in decodes)[len(decodes) // 2]


def test_a_cancelled_sequence_ends_cancelled_and_its_slot_comes_back(engine: UpstreamEngine) -> None:
    engine.add(p.SeqJob("c", (1,) * 8, p.SamplingParams(400, temperature=0.0), stream=True,
                        messages=(("user", "Tell me a long story."),)))
    got_tokens = False
    while not got_tokens:
        got_tokens = any(isinstance(ev, p.Delta) for ev in engine.step().events)
    assert engine.cancel("c") and not engine.cancel("c")
    assert engine.free_slots == 3
    ends = [ev for r in run_engine(engine, 10) for ev in r.events if isinstance(ev, p.Finished)]
    assert [(ev.rid, ev.finish_reason) for ev in ends] == [("c", "cancelled")]


def test_an_upstream_that_is_not_there_is_down_until_it_answers(tmp_path: Path) -> None:
    port = free_port()
    engine = UpstreamEngine(f"http://127.0.0.1:{port}/v1", slots=2, timeout_s=30, probe_s=0.2)
    try:
        assert engine.down.startswith(f"upstream http://127.0.0.1:{port} does not answer")
        assert engine.free_slots == 0  # the worker reads no job for it
        late = LlamaServer(tmp_path / "late.log", port=port).start()
        try:
            deadline = time.monotonic() + 5
            while engine.down:
                assert time.monotonic() < deadline, engine.down
                time.sleep(0.05)
            assert engine.free_slots == 2
        finally:
            late.stop()
    finally:
        engine.close()


def test_a_shared_upstreams_running_count_sizes_the_inferred_decode_steps(engine: UpstreamEngine) -> None:
    """vLLM's gauge says how many requests run upstream, other clients' included: a decode
    step is that large, not only as large as this worker's share of it."""
    assert engine.metrics == {}  # llama-cpp-python serves no /metrics
    engine.metrics = {"running": 4.0}  # as a vLLM shared with three other requests would say
    engine.add(p.SeqJob("v", (1,) * 20, GREEDY, messages=(("user", QUESTIONS[0]),)))
    decodes = [rec for r in run_engine(engine) for rec in r.records() if not rec.prefill_tokens]
    assert decodes and all(rec.decode_seqs == 4 for rec in decodes)
    assert all(rec.kv_tokens >= 4 * 21 for rec in decodes)  # four sequences of at least 20 + 1 tokens


def test_llama_cpp_pythons_server_says_no_context_so_the_one_given_is_published(server: LlamaServer) -> None:
    """It answers neither vLLM's ``max_model_len`` nor llama-server's ``/props``: the worker
    publishes its ``--context-tokens`` (the server's ``--n_ctx``), else 0 (the model's own)."""
    for given in (2048, 0):
        e = UpstreamEngine(server.url, slots=1, timeout_s=30, context_tokens=given)
        try:
            assert e.down == "" and e.context_tokens == given
        finally:
            e.close()
