"""tokengate in front of llama.cpp's own C++ server (``make install-llama-server``), the engine
teams run: ``llama-server -np 4`` (four sequences at once, continuous batching, a prompt cache
per slot, ``--metrics``) on the default model's GGUF file, fronted by ``tokengate serve
--upstream-url … --slots 4``. Greedy answers through tokengate are the engine's own; four
requests run at once in the engine; a cancelled stream stops its generation there; the
engine's metrics and context reach the heartbeat; the engine killed and restarted under load
loses nothing: every request ends in its answer or a clear error."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from bench.llamacpp import LlamaCppServer, llama_server_bin
from tests.e2e.conftest import (
    ADMIN_TOKEN,
    Served,
    admin_workers,
    banner_key,
    same_greedy_answers,
    start,
    upstream_clients,
)

pytestmark = [pytest.mark.e2e, pytest.mark.model]

if llama_server_bin() is None:
    pytest.skip("llama-server is not built (make install-llama-server)", allow_module_level=True)

SLOTS = 4
CONTEXT = 2048  # each slot's
STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]
HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]
TOPICS = ("the sea", "a mountain", "the moon", "a city at night")


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppServer]:
    server = LlamaCppServer(tmp_path_factory.mktemp("llama-server") / "server.log", slots=SLOTS, context=CONTEXT)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fronted(upstream: LlamaCppServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # no --context-tokens: llama-server says its slots' context in /props
    s = start(["serve", "--upstream-url", upstream.url, "--slots", str(SLOTS), "--admin-token", ADMIN_TOKEN,
               "--upstream-timeout", "20"], tmp_path_factory.mktemp("serve-llama-server"))
    s.key = banner_key(s)
    yield s
    s.stop()


def test_greedy_answers_through_tokengate_are_the_engines_own(fronted: Served, upstream: LlamaCppServer) -> None:
    tg, direct = upstream_clients(fronted, upstream.url)
    same_greedy_answers(tg, direct, fronted.model)
    # llama-server takes token ids too (llama-cpp-python's server does not)
    ids = tg.completions.create(model=fronted.model, prompt=[504, 3575, 282], max_tokens=8, temperature=0)
    assert ids.choices[0].text == direct.completions.create(model="any", prompt=[504, 3575, 282], max_tokens=8,
                                                            temperature=0).choices[0].text


def test_four_requests_run_at_once_in_the_engine_and_the_heartbeat_carries_its_metrics_and_context(
    fronted: Served, upstream: LlamaCppServer
) -> None:
    tg, _direct = upstream_clients(fronted, upstream.url)
    answers: dict[str, str] = {}
    busy: list[int] = []
    done = threading.Event()

    def ask(topic: str) -> None:
        reply = tg.chat.completions.create(model=fronted.model, max_tokens=64, temperature=0,
                                           messages=[{"role": "user", "content": f"Write a poem about {topic}."}])
        answers[topic] = reply.choices[0].message.content or ""

    def watch() -> None:  # the engine's own view: how many of its slots work at once
        while not done.is_set():
            slots = httpx.get(upstream.url + "/slots", timeout=5).json()
            busy.append(sum(1 for s in slots if s.get("is_processing")))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    askers = [threading.Thread(target=ask, args=(t,)) for t in TOPICS]
    for t in askers:
        t.start()
    for t in askers:
        t.join(timeout=120)
    done.set()
    watcher.join()
    assert len(answers) == len(TOPICS) and all(answers.values()), answers
    assert max(busy) >= 2, busy  # batched in the engine, not one after another

    deadline = time.monotonic() + 10
    while True:  # the next heartbeats carry the engine's counters, with these prompts in them
        (w,) = admin_workers(fronted)
        figures = w["upstream"]
        assert isinstance(figures, dict)
        if figures.get("prompt_tokens_prefilled", 0) > 0:
            break
        assert time.monotonic() < deadline, w
        time.sleep(0.3)
    assert {"running", "waiting", "prompt_tokens_prefilled", "prompt_tokens_cached"} <= set(figures), figures
    assert w["context"] == CONTEXT and w["slots"] == SLOTS and w["prefix_cache"] == SLOTS * CONTEXT, w


def test_a_cancelled_stream_stops_its_generation_in_the_engine(fronted: Served, upstream: LlamaCppServer) -> None:
    tg, _direct = upstream_clients(fronted, upstream.url)
    stream = tg.chat.completions.create(model=fronted.model, messages=STORY, max_tokens=1000, temperature=0,
                                        stream=True)
    for n, _chunk in enumerate(stream):
        if n == 3:
            break
    stream.close()  # the client goes away after a few tokens; 1,000 tokens would take many seconds
    deadline = time.monotonic() + 3
    while upstream.metrics().get("llamacpp:requests_processing", 0) > 0:
        assert time.monotonic() < deadline, "the engine went on generating for a cancelled stream"
        time.sleep(0.1)


def test_the_engine_killed_and_restarted_under_load_loses_nothing(fronted: Served, upstream: LlamaCppServer) -> None:
    tg, _direct = upstream_clients(fronted, upstream.url)
    outcomes: dict[int, str] = {}

    def one(i: int) -> None:
        try:
            stream = tg.chat.completions.create(model=fronted.model, messages=STORY, max_tokens=120,
                                                temperature=0, stream=True, seed=i)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            outcomes[i] = "ok" if text else "empty"
        except openai.APIError as exc:  # a clear error is an outcome; a hang is not
            outcomes[i] = f"error: {exc}"

    clients = [threading.Thread(target=one, args=(i,)) for i in range(2 * SLOTS)]
    for t in clients:
        t.start()
    time.sleep(1.0)  # four streaming, four queued
    upstream.kill()
    deadline = time.monotonic() + 10
    while not any(w["down"] for w in admin_workers(fronted)):
        assert time.monotonic() < deadline, "the worker never said its upstream is down"
        time.sleep(0.2)
    time.sleep(1.0)
    upstream.start()
    back = time.monotonic()
    while any(w["down"] for w in admin_workers(fronted)):
        assert time.monotonic() - back < 5.0, "the worker did not take jobs again within 5 s"
        time.sleep(0.1)
    for t in clients:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in clients), "a request hung"
    # each ends in its answer or a clear error; those the kill interrupted mid-stream were
    # re-delivered and finished once the engine was back
    assert len(outcomes) == 2 * SLOTS and list(outcomes.values()).count("ok") >= SLOTS, outcomes
    for o in outcomes.values():
        assert o == "ok" or "retry" in o.lower() or "deadline" in o.lower(), o
    assert "reclaimed" in fronted.log.read_text()
    reply = httpx.post(fronted.base_url + "/v1/chat/completions", headers=fronted.auth(), timeout=60,
                       json={"model": fronted.model, "messages": HAIKU, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
