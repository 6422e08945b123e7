"""The upstream engine on its own against llama.cpp's C++ server (``make install-llama-server``,
``-np 4``): the steps it infers from an engine that decodes several sequences per step, the
prefill it records for a prompt the engine found cached, and the engine's metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from bench.llamacpp import LlamaCppServer, llama_server_bin
from common import protocol as p
from tests.integration.helpers import run_engine
from workers.upstream import UpstreamEngine

pytestmark = pytest.mark.model

if llama_server_bin() is None:
    pytest.skip("llama-server is not built (make install-llama-server)", allow_module_level=True)

SLOTS = 4
LONG = "Here is a list of rivers: " + ", ".join(f"river number {i}" for i in range(120)) + ". "


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppServer]:
    s = LlamaCppServer(tmp_path_factory.mktemp("llama-server") / "server.log", slots=SLOTS).start()
    yield s  # type: ignore[misc]  # start returns the server itself
    s.stop()


@pytest.fixture
def engine(server: LlamaCppServer) -> Iterator[UpstreamEngine]:
    e = UpstreamEngine(server.url, slots=SLOTS, timeout_s=30)
    yield e
    e.close()


def test_four_sequences_decode_in_the_same_steps_and_the_metrics_reach_the_engine(engine: UpstreamEngine) -> None:
    assert engine.context_tokens == 2048 and engine.prefix_cache_tokens == SLOTS * 2048  # from /props
    for i in range(SLOTS):
        engine.add(p.SeqJob(f"s{i}", (1,) * 12, p.SamplingParams(48, temperature=0.0),
                            messages=(("user", f"Write a poem about the number {i}."),)))
    results = run_engine(engine)
    ends = [ev for r in results for ev in r.events if isinstance(ev, p.Finished)]
    assert len(ends) == SLOTS and all(ev.text for ev in ends)
    decodes = [rec for r in results for rec in r.records() if not rec.prefill_tokens]
    assert max(rec.decode_seqs for rec in decodes) == SLOTS  # several sequences per step, as it batches
    time.sleep(1.5)  # the next probe reads /metrics
    assert engine.metrics["prompt_tokens_prefilled"] > 0 and "running" in engine.metrics and "waiting" in engine.metrics


def test_a_prompt_the_engine_found_cached_is_recorded_as_the_prefill_it_did(engine: UpstreamEngine) -> None:
    def prefills(rid: str, question: str) -> list[p.StepRecord]:
        engine.add(p.SeqJob(rid, (1,) * 400, p.SamplingParams(4, temperature=0.0),
                            messages=(("user", LONG + question),)))
        return [rec for r in run_engine(engine) for rec in r.records() if rec.prefill_tokens]

    (first,) = prefills("a", "Which is the first?")
    (again,) = prefills("b", "Which is the last?")  # the same long start: the engine has it cached
    assert engine.says_cached
    assert first.prefill_tokens > 300 and again.prefill_tokens < 40, (first, again)
